"""The runtime package stays importable on Jetson (Python 3.8, torch 2.0) and never runs
untrusted bytes as code."""
import os
import re
import subprocess
import sys

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "mdi")


def test_runtime_passes_vermin_for_python_3_8():
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "vermin"), "--target=3.8-", "--no-tips", "--violations", "--eval-annotations",
                           "--backport", "typing", "-q", PACKAGE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_unsafe_deserialisation_or_code_execution():
    bad = re.compile(r"\bpickle\b|(?<![.\w])eval\(|(?<![.\w])exec\(|torch\.load\((?![^)]*weights_only=True)|"
                     r"nn\.RMSNorm|enable_gqa")
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    code = line.split("#", 1)[0]
                    if bad.search(code):
                        offenders.append("%s:%d: %s" % (os.path.relpath(path, ROOT), n, line.strip()))
    assert not offenders, "\n".join(offenders)
