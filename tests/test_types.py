"""mypy over the runtime package (mypy.ini at the repo root: files, Python version, and what is
not checked yet), so that annotations stay true to the code; and the ratchet on what is not
checked yet: mypy.ini's list of modules exempt from the Optional check only gets shorter."""
import configparser
import importlib.util
import os
import re
import subprocess
import sys
from typing import Set

import pytest

from conftest import ROOT, missing

# The modules mypy.ini may still exempt from the Optional check (strict_optional = False). A
# module may leave (then it leaves this set too), none may join: fix its errors instead.
MAY_BE_EXEMPT: Set[str] = set()  # none left: it may only stay empty
CONFIG = os.path.join(ROOT, "mypy.ini")
ERROR_LINE = re.compile(r"^(mdi/[\w/]+)\.py:\d+(?::\d+)?: error:", re.M)


def _config() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(CONFIG, encoding="utf-8")
    return parser


def exempt_modules(parser: configparser.ConfigParser) -> Set[str]:
    """The modules of mypy.ini's [mypy-...] sections with strict_optional off."""
    out: Set[str] = set()
    for section in parser.sections():
        if section.startswith("mypy-") and not parser.getboolean(section, "strict_optional", fallback=True):
            out.update(m.strip() for m in section[len("mypy-"):].split(",") if m.strip())
    return out


def _need_mypy() -> None:
    if sys.version_info < (3, 10):
        pytest.skip("mypy 2.x (setup.py's test extras) runs on Python 3.10 and later")
    if importlib.util.find_spec("mypy") is None:
        missing("mypy", "pip install -e '.[test]'")


@pytest.mark.slow  # about 90 s on 2 cores without mypy's cache (.mypy_cache), a few seconds with it
def test_runtime_passes_mypy():
    _need_mypy()
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_optional_exemptions_only_shrink():
    listed = exempt_modules(_config())
    joined = sorted(listed - MAY_BE_EXEMPT)
    assert not joined, "modules newly exempt from mypy's Optional check: fix their errors instead: %s" % joined
    left = sorted(MAY_BE_EXEMPT - listed)
    assert not left, "no longer exempt in mypy.ini: drop these from MAY_BE_EXEMPT too: %s" % left


@pytest.mark.slow  # one mypy run with the Optional check everywhere (its own cache: a few seconds warm)
def test_every_exempt_module_still_fails_the_optional_check(tmp_path):
    parser = _config()
    listed = exempt_modules(parser)
    if not listed:  # a second whole mypy run (a minute in CI) would have nothing to look for
        pytest.skip("no module is exempt from the Optional check: test_runtime_passes_mypy checks them all")
    _need_mypy()
    for section in parser.sections():
        if section.startswith("mypy-") and parser.has_option(section, "strict_optional"):
            parser.remove_option(section, "strict_optional")
    strict = tmp_path / "mypy-strict.ini"
    with open(str(strict), "w", encoding="utf-8") as f:
        parser.write(f)
    # A cache of its own: sharing .mypy_cache with the run above would recheck both ways each time.
    cache = os.path.join(ROOT, ".mypy_cache", "strict-optional")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(strict), "--cache-dir", cache],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), "mypy did not run: " + proc.stdout + proc.stderr
    failing = {path.replace("/", ".") for path in ERROR_LINE.findall(proc.stdout)}
    failing |= {m[:-len(".__init__")] for m in failing if m.endswith(".__init__")}
    passing = sorted(listed - failing)
    assert not passing, ("these modules pass mypy's Optional check now: drop them from mypy.ini's list "
                         "(and from MAY_BE_EXEMPT in tests/test_types.py): %s" % passing)
