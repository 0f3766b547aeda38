"""Serving sees the starter's engine through its face alone (mdi.starter.engine_face), the
pipeline is built complete from one frozen value made from the plan, and a recovery reaches
serving as one typed event."""
import ast
import dataclasses
import os
import random

import pytest

from mdi.model.sampling import SamplingParams
from mdi.model.source import ModelSource
from mdi.old_paths import MOVED
from mdi.starter.engine import Engine
from mdi.starter.engine_face import EngineFace, RecoveryEvent
from mdi.starter.pipeline_settings import PipelineSettings
from mdi.starter.planning.run_plan import plan_run
from mdi.starter.planning.run_shape import RunShape
from ringconfigs import parse_run_config

SERVING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mdi", "serving")

# What serving may import from mdi.starter, by module, and why: the face, and values or plain
# functions that hold no part of an open engine.
ALLOWED_IMPORTS = {
    "mdi.starter.engine_face": {"EngineFace", "RecoveryEvent", "StarterReading"},  # the face
    "mdi.starter.sample": {"Sample", "FinishReason"},  # a request's sample and why it ended (values)
    "mdi.starter.adapter_set": {"MixTableFull", "StarterTooLarge"},  # exceptions the face raises
    "mdi.starter.planning.run_shape": {"serving_max_len"},  # a function of the config
    "mdi.starter.planning.serving_plan": {"open_serving_ring"},  # opens an engine; serving keeps its face
    "mdi.starter.control": {"ControlClient", "NodeError"},  # the workers' /status (metrics), not the engine
    "mdi.starter.train.train_data": {"Windows", "load_windows", "step_index"},  # training data (values)
    "mdi.starter.train.train_options": {"StepRecord", "TrainOptions"},  # values
    "mdi.starter.generation_options": {"GenerationOptions"},  # a request's options, shared with its sample (a value)
}

# What the engine hides from serving: reaching for any of these off an engine fails the test
# (so does any other name the face does not list, and any private one).
HIDDEN = {"pipeline", "pipe", "chunk", "ring", "recoveries", "adapters", "registry", "backend_choice", "t0"}


def _face_names():
    names = set(getattr(EngineFace, "__annotations__", {}))
    names |= {n for n in vars(EngineFace) if not n.startswith("_")}
    return names


def _serving_modules():
    for folder, _, files in os.walk(SERVING):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, SERVING), ast.parse(f.read(), path)


def _is_engine(node):
    """An expression naming an engine: `engine`, `self.engine`, `ring.engine`, `self.sched.engine`..."""
    if isinstance(node, ast.Name):
        return node.id == "engine" or node.id.endswith("_engine")
    return isinstance(node, ast.Attribute) and (node.attr == "engine" or node.attr.endswith("_engine"))


def test_the_face_hides_the_engine_internals():
    assert not HIDDEN & _face_names()
    assert {"free_slots", "choose_slot", "busy_seconds", "speculation_metrics", "prefix_metrics",
            "set_training_hook", "on_recovery", "in_flight"} <= _face_names()


def test_serving_imports_nothing_of_the_engine_but_its_face():
    wrong = []
    for path, tree in _serving_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mdi.starter"):
                allowed = ALLOWED_IMPORTS.get(node.module or "", set())
                wrong += ["%s:%d from %s import %s" % (path, node.lineno, node.module, a.name)
                          for a in node.names if a.name not in allowed]
            elif isinstance(node, ast.Import):
                wrong += ["%s:%d import %s" % (path, node.lineno, a.name) for a in node.names
                          if a.name.startswith("mdi.starter")]
    assert not wrong, "serving imports from mdi.starter beyond the face (tests/test_engine_face.py):\n" + \
        "\n".join(wrong)


def test_the_allowed_imports_name_modules_where_they_are():
    # An old name (mdi.old_paths) still imports, but the list must name each module's file,
    # so a move cannot leave the walk above checking a name serving no longer writes.
    root = os.path.dirname(os.path.dirname(SERVING))
    stale = [m for m in ALLOWED_IMPORTS if m in MOVED or not os.path.isfile(os.path.join(root, *m.split(".")) + ".py")]
    assert not stale, stale


def test_serving_reads_only_the_face_off_an_engine():
    face = _face_names()
    wrong, reads = [], 0
    for path, tree in _serving_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_engine(node.value):
                reads += 1
                if node.attr in HIDDEN or node.attr.startswith("_") or node.attr not in face:
                    wrong.append("%s:%d .%s" % (path, node.lineno, node.attr))
    assert reads > 30  # the walk sees serving's use of the engine
    assert not wrong, "serving reaches past the engine's face (mdi.starter.engine_face.EngineFace):\n" + \
        "\n".join(wrong)


def test_the_pipeline_is_built_complete_from_the_plan(tiny_models):
    model = tiny_models["gpt2"]
    source = ModelSource(model)
    plan = plan_run(parse_run_config(model, runtime={"max_batch": 2}), source, RunShape(3, 24))
    engine = Engine(plan, source, SamplingParams(0.0))
    engine.open()
    try:
        settings = PipelineSettings.from_plan(plan, tag_epochs=engine.speculating, ggml_cuts=bool(engine.ggml_nodes()))
        assert engine.pipeline.settings == settings and settings.max_batch == 2 and settings.n_stages == 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.max_batch = 3  # type: ignore[misc]
        face: EngineFace = engine  # the engine is its face (mypy checks it too, where serving holds one)
        assert face.free_slots() == [0, 1, 2] and face.in_flight == 0 and face.busy_seconds >= 0
        frames = []
        face.set_training_hook(frames.append)
        engine.pipeline.on_train("frame")  # the pipeline's hook, given at construction, reaches the job's
        assert frames == ["frame"]
    finally:
        engine.close()


def test_a_recovery_is_one_typed_event(tiny_models, monkeypatch):
    from conftest import worker_pool
    from test_recovery import N_TOKENS, PROMPTS, ring_config, run_killing

    events, engines = [], []
    opened = Engine.__init__

    def listening(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        engines.append(self)
        self.on_recovery(events.append)

    monkeypatch.setattr(Engine, "__init__", listening)
    pool = worker_pool(3)
    board1, board2, spare = next(pool)
    try:
        cfg = ring_config(tiny_models["llama"], [board1, board2], [spare])
        at = random.Random().randint(10, N_TOKENS * len(PROMPTS) - 20)
        result, _ = run_killing(cfg, [(at, board1)])
    finally:
        pool.close()
    (event,) = events
    assert isinstance(event, RecoveryEvent) and event.recovered
    assert event.node == "board1" and [n.name for n in event.nodes] == ["starter", "spare1", "board2"]
    assert [event.to_json()] == result.extra["recoveries"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.cause = "x"  # type: ignore[misc]
    late = []  # a listener that comes later gets the earlier events at once, each once
    engines[0].on_recovery(late.append)
    assert late == events
