"""The module names from before mdi.starter and mdi.model got their sub-packages still work
(mdi.old_paths): each imports as the very module at its new name, in every import form, and a
patch through an old name reaches the code that lives at the new one."""
import importlib
import os
import subprocess
import sys
from unittest import mock

import pytest

from conftest import ROOT
from mdi.old_paths import MOVED, OldPathFinder


def _file_of(name: str) -> str:
    return os.path.join(ROOT, *name.split(".")) + ".py"


def test_every_old_name_is_the_new_module():
    for old, new in sorted(MOVED.items()):
        module = importlib.import_module(old)
        assert module is importlib.import_module(new) is sys.modules[old] is sys.modules[new], old
        # the module keeps its own identity: name, spec and file are the new ones
        assert module.__name__ == new and module.__spec__.name == new and module.__file__ == _file_of(new)
        parent, _, child = old.rpartition(".")
        assert getattr(sys.modules[parent], child) is module  # `mdi.model.gguf.x` as an attribute chain


def test_the_import_forms_all_work():
    import mdi.model.gguf
    import mdi.model.files.gguf as gguf
    from mdi.model import gguf as old_gguf, quant
    from mdi.model.gguf import read_gguf
    from mdi.model.quantization import quant as new_quant
    from mdi.starter import training
    from mdi.starter.run_plan import plan_run
    from mdi.starter.planning.run_plan import plan_run as new_plan_run
    from mdi.starter.train import training as new_training
    assert mdi.model.gguf is gguf is old_gguf and read_gguf is gguf.read_gguf
    assert quant is new_quant and plan_run is new_plan_run and training is new_training


def test_a_patch_through_an_old_name_reaches_the_new_module():
    from mdi.model.constraints import grammar_cost
    from mdi.starter.planning import run_plan
    with mock.patch("mdi.starter.run_plan.plan_run", "patched"):
        assert run_plan.plan_run == "patched"
    assert run_plan.plan_run != "patched"
    with mock.patch("mdi.model.grammar_cost.repeat_cost", return_value=7) as seen:
        assert grammar_cost.spec_repeat("regex", "a{2}") == 7  # the new module's code calls the patch
    seen.assert_called_once_with("a{2}")
    assert grammar_cost.spec_repeat("regex", "a{2}") == grammar_cost.RepeatCost(largest=2, added=1)


def test_the_old_names_are_no_files():
    # an old file left beside the new one would be a second copy: the finder's name wins (it
    # is first on sys.meta_path), but the copy would rot unseen
    assert not [old for old in MOVED if os.path.exists(_file_of(old))]
    assert all(os.path.isfile(_file_of(new)) for new in MOVED.values())
    assert len(set(MOVED.values())) == len(MOVED)  # no two old names share a module


def test_unknown_names_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mdi.model.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mdi.starter.planning.no_such_module")
    assert OldPathFinder().find_spec("mdi.model.layout", None) is None  # not moved: the files decide


def test_import_mdi_stays_cheap():
    # mdi/__init__.py installs the finder: it must import nothing of mdi's, nor torch or numpy
    code = ("import sys, mdi; from mdi.old_paths import OldPathFinder; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mdi', 'torch', 'numpy'))); "
            "print(sum(isinstance(f, OldPathFinder) for f in sys.meta_path))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["['mdi', 'mdi.old_paths']", "1"]
