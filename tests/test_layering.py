"""The package's layering rule, checked on every import statement (top-level and inside
functions), so it cannot erode silently.

    system                      memory, tegrastats, devices, files: the bottom
    model                       may use system
    ring, runconfig             may use model, system
    timing                      may use ring, model, system (how fast a node runs: /profile's measuring)
    worker                      may use timing, ring, model, system
    starter                     may use timing, ring, runconfig, model, system
    serving                     may use starter and everything below it
    cli                         may use everything but lab
    lab                         may use anything; nothing imports it

A layer is a module's second name (mdi.model.files.gguf is in model): a package's sub-packages
(mdi.starter.planning, mdi.model.quantization, ...) share its layer. The root (mdi/__init__.py)
may import only old_paths, which imports nothing of mdi's (it names moved modules as strings).
"""
import ast
import importlib.util
import os
from typing import Dict, List, Set

from conftest import ROOT

BELOW: Dict[str, Set[str]] = {
    "system": set(),
    "model": {"system"},
    "ring": {"model", "system"},
    "runconfig": {"model", "system"},
    "timing": {"ring", "model", "system"},
    "worker": {"timing", "ring", "model", "system"},
    "starter": {"timing", "ring", "runconfig", "model", "system"},
    "serving": {"starter", "timing", "ring", "runconfig", "model", "system"},
    "cli": {"serving", "worker", "starter", "timing", "ring", "runconfig", "model", "system"},
    "old_paths": set(),  # the old module names' finder: imported by the root, imports nothing of mdi's
    "": {"old_paths"},  # the root package (mdi/__init__.py): installs that finder, nothing else
}
TOP = "lab"  # may import anything; nothing may import it


def _part(module: str) -> str:
    """mdi.model.layout -> model; mdi.cli -> cli; mdi -> '' (the root: version only)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: str, module: str) -> List[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from mdi import x` / `from mdi.ring import x` may name a submodule: check it
            # (the root's own attributes, like __version__, belong to no layer)
            found += [name + "." + a.name if name.count(".") <= 1 and not a.name.startswith("__") else name
                      for a in node.names]
    return [n for n in found if n == "mdi" or n.startswith("mdi.")]


def _modules(package_dir: str):
    """(path, module name) of every file of the package."""
    root = os.path.dirname(package_dir)
    for folder, _, files in os.walk(package_dir):
        for fn in sorted(files):
            if fn.endswith(".py"):
                path = os.path.join(folder, fn)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                yield path, module[:-len(".__init__")] if module.endswith(".__init__") else module


def import_graph(package_dir: str = os.path.join(ROOT, "mdi")) -> Dict[str, Set[str]]:
    """Each module of the package -> the package's modules it imports (top-level or in a
    function; `from mdi.x import name` counts as mdi.x where name is not a module)."""
    modules = dict((module, path) for path, module in _modules(package_dir))
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for imported in _imports(path, module):
            target = imported if imported in modules else imported.rsplit(".", 1)[0]
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every import cycle found by a depth-first walk, as the modules around it."""
    found: List[List[str]] = []
    state: Dict[str, str] = {}

    def walk(module: str, path: List[str]) -> None:
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                found.append(path[path.index(other):] + [other])
            elif other not in state:
                walk(other, path + [other])
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return found


def test_mdi_has_no_import_cycle():
    """No module imports, directly or through others, one that imports it back (a package's
    __init__ re-exporting its modules' names counts as importing them)."""
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # the check sees one


def layering_violations(package_dir: str) -> List[str]:
    """'file: importer imports imported' for every import that breaks the rule."""
    root = os.path.dirname(package_dir)
    out = []
    for folder, _, files in os.walk(package_dir):
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(folder, fn)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            module = module[:-len(".__init__")] if module.endswith(".__init__") else module
            here = _part(module)
            for imported in _imports(path, module):
                there = _part(imported)
                if not there or there == here or here == TOP:
                    continue
                if there == TOP or there not in BELOW.get(here, set()):
                    out.append("%s: %s imports %s" % (os.path.relpath(path, root), here or "mdi", imported))
    return out


def test_mdi_follows_the_layering_rule():
    assert layering_violations(os.path.join(ROOT, "mdi")) == []


def test_every_package_has_a_place_in_the_rule():
    parts = {n[:-3] if n.endswith(".py") else n for n in os.listdir(os.path.join(ROOT, "mdi"))
             if not n.startswith("__") and (n.endswith(".py") or os.path.isdir(os.path.join(ROOT, "mdi", n)))}
    assert parts <= set(BELOW) | {TOP}, sorted(parts - set(BELOW) - {TOP})


def _fake_package(tmp_path, files: Dict[str, str]) -> str:
    pkg = tmp_path / "mdi"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(pkg)


def test_the_checker_catches_upward_and_lab_imports(tmp_path):
    pkg = _fake_package(tmp_path, {
        "__init__.py": "",
        "model/__init__.py": "",
        "model/layout.py": "from mdi.system.files import write_json\n",  # fine: down
        "model/bad.py": "def f():\n    from mdi.starter.engine import Engine\n",  # lazy, still up
        "ring/wire.py": "from ..worker import node\n",  # relative, up
        "worker/node.py": "from mdi.starter import pipeline\n",  # sideways between roles
        "serving/api.py": "import mdi.lab.nodes\n",  # nothing imports the lab
        "lab/sweep.py": "from mdi.serving import api\nfrom mdi import cli\n",  # the lab may
        "cli.py": "from mdi import starter\nfrom . import lab\n",
    })
    found = layering_violations(pkg)
    text = "\n".join(found)
    assert "model/bad.py: model imports mdi.starter.engine" in text
    assert "ring/wire.py: ring imports mdi.worker" in text
    assert "worker/node.py: worker imports mdi.starter" in text
    assert "serving/api.py: serving imports mdi.lab.nodes" in text
    assert "cli.py: cli imports mdi.lab" in text
    assert "layout.py" not in text and "lab/sweep.py" not in text and "cli imports mdi.starter" not in text
    assert len(found) == 5, found


def test_a_package_s_modules_share_its_layer(tmp_path):
    # mdi/cli/ is a package: its modules import each other (relatively too) and sit in one layer.
    pkg = _fake_package(tmp_path, {
        "__init__.py": "",
        "cli/__init__.py": "from mdi.cli.start import start_main\n",
        "cli/start.py": "from . import output\nfrom .process import fail\nfrom mdi.serving import api\n",
        "cli/plan.py": "def f():\n    from mdi.lab import nodes\n",
    })
    assert layering_violations(pkg) == ["mdi/cli/plan.py: cli imports mdi.lab.nodes"]


def test_sub_packages_share_their_package_s_layer(tmp_path):
    # mdi.starter.planning, mdi.model.files, ...: one more level, the same layer as their package.
    pkg = _fake_package(tmp_path, {
        "__init__.py": "from mdi import old_paths\n",
        "old_paths.py": "",
        "model/files/gguf.py": "from mdi.model.quantization import quant\nfrom mdi.model.layout import x\n",
        "model/quantization/quant.py": "from mdi.system.files import write_json\n",
        "starter/planning/run_plan.py": "from mdi.model.files.gguf import read\nfrom mdi.starter import engine\n",
        "model/adapters/lora.py": "from mdi.starter.planning.run_plan import RunPlan\n",  # up, from a sub-package
        "starter/train/training.py": "from mdi.serving import api\n",  # up, into a package's top level
    })
    assert sorted(layering_violations(pkg)) == ["mdi/model/adapters/lora.py: model imports mdi.starter.planning.run_plan",
                                        "mdi/starter/train/training.py: starter imports mdi.serving.api"]


def test_the_bench_starter_service_module_exists():
    # mdi-bench starts its warm starter with `python -m` this module and --cleanup matches it
    # in /proc/PID/cmdline: a stale name would silently stop both.
    from mdi.lab.nodes import STARTER_SERVICE_MODULE
    assert importlib.util.find_spec(STARTER_SERVICE_MODULE) is not None
