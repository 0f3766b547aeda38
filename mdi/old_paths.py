"""Module names from before mdi.starter and mdi.model got their sub-packages (issue 60), kept
working: scripts and tests written against the old layout import `mdi.model.gguf` or patch
`"mdi.starter.run_plan.X"`, and get the module that now lives at `mdi.model.files.gguf`.

An old name is an alias, not a copy: importing it imports the new module and binds that very
module object under the old name too (sys.modules and the parent package's attribute), so a
patch through either name is seen by every caller. mdi/__init__.py installs the finder; it
imports nothing of mdi's own until an old name is asked for, so `import mdi` stays cheap. New
code imports the new names (the table only ever shrinks, once nothing outside uses a name).
"""
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Dict, Optional, Sequence

# old dotted name -> where that module is now
MOVED: Dict[str, str] = {
    # mdi.starter.planning: what a run is planned on, its plan, the checks, the plan after a death
    "mdi.starter.autoplan": "mdi.starter.planning.autoplan",
    "mdi.starter.capacity": "mdi.starter.planning.capacity",
    "mdi.starter.loop_timing": "mdi.starter.planning.loop_timing",
    "mdi.starter.node_budget": "mdi.starter.planning.node_budget",
    "mdi.starter.node_speeds": "mdi.starter.planning.node_speeds",
    "mdi.starter.planner": "mdi.starter.planning.planner",
    "mdi.starter.preflight": "mdi.starter.planning.preflight",
    "mdi.starter.recovery": "mdi.starter.planning.recovery",
    "mdi.starter.run_plan": "mdi.starter.planning.run_plan",
    "mdi.starter.run_shape": "mdi.starter.planning.run_shape",
    "mdi.starter.serving_plan": "mdi.starter.planning.serving_plan",
    # mdi.starter.train: mdi-train on the starter's side
    "mdi.starter.ring_trainer": "mdi.starter.train.ring_trainer",
    "mdi.starter.train_checkpoint": "mdi.starter.train.train_checkpoint",
    "mdi.starter.train_data": "mdi.starter.train.train_data",
    "mdi.starter.train_options": "mdi.starter.train.train_options",
    "mdi.starter.train_recovery": "mdi.starter.train.train_recovery",
    "mdi.starter.training": "mdi.starter.train.training",
    # mdi.model.quantization: quantized weights and their kernels
    "mdi.model.kernel_choice": "mdi.model.quantization.kernel_choice",
    "mdi.model.kernel_memory": "mdi.model.quantization.kernel_memory",
    "mdi.model.kernel_timing": "mdi.model.quantization.kernel_timing",
    "mdi.model.qkernels": "mdi.model.quantization.qkernels",
    "mdi.model.quant": "mdi.model.quantization.quant",
    # mdi.model.files: checkpoints read, model directories written and read
    "mdi.model.checkpoints": "mdi.model.files.checkpoints",
    "mdi.model.convert": "mdi.model.files.convert",
    "mdi.model.gguf": "mdi.model.files.gguf",
    "mdi.model.gguf_config": "mdi.model.files.gguf_config",
    "mdi.model.gguf_encode": "mdi.model.files.gguf_encode",
    "mdi.model.gguf_export": "mdi.model.files.gguf_export",
    "mdi.model.gguf_layout": "mdi.model.files.gguf_layout",
    "mdi.model.gguf_write": "mdi.model.files.gguf_write",
    "mdi.model.model_dir": "mdi.model.files.model_dir",
    "mdi.model.prepare": "mdi.model.files.prepare",
    "mdi.model.store": "mdi.model.files.store",
    "mdi.model.tokenizer_import": "mdi.model.files.tokenizer_import",
    # mdi.model.adapters: LoRA and soft prompts, read and trained
    "mdi.model.adapter_files": "mdi.model.adapters.adapter_files",
    "mdi.model.lora": "mdi.model.adapters.lora",
    "mdi.model.lora_train": "mdi.model.adapters.lora_train",
    "mdi.model.peft_targets": "mdi.model.adapters.peft_targets",
    "mdi.model.prompt_train": "mdi.model.adapters.prompt_train",
    "mdi.model.stage_train": "mdi.model.adapters.stage_train",
    # mdi.model.constraints: constrained decoding
    "mdi.model.constraint": "mdi.model.constraints.constraint",
    "mdi.model.grammar_cost": "mdi.model.constraints.grammar_cost",
    "mdi.model.grammar_empty": "mdi.model.constraints.grammar_empty",
    "mdi.model.grammar_spec": "mdi.model.constraints.grammar_spec",
    "mdi.model.schema_bounds": "mdi.model.constraints.schema_bounds",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module already at its new name."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.own_spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # Between the two calls the import system set module.__spec__ to the old name's spec (its
        # other attributes it leaves as they are): give the module its own back, which reload and
        # pickling read.
        module.__spec__ = self.own_spec


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of MOVED (first on sys.meta_path, so no stray file can shadow one)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on sys.meta_path, once (mdi/__init__.py calls it)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())
