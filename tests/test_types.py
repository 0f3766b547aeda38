"""mypy over the runtime package (mypy.ini at the repo root: files, Python version, and what is
not checked yet), so that annotations stay true to the code."""
import importlib.util
import subprocess
import sys

import pytest

from conftest import ROOT, missing


@pytest.mark.slow  # about 90 s on 2 cores without mypy's cache (.mypy_cache), a few seconds with it
def test_runtime_passes_mypy():
    if sys.version_info < (3, 10):
        pytest.skip("mypy 2.x (setup.py's test extras) runs on Python 3.10 and later")
    if importlib.util.find_spec("mypy") is None:
        missing("mypy", "pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
