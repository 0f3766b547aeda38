"""runtime.threads: auto: a node times its own chunk at a few thread counts and keeps the
fastest (mdi.model.threads); the config and both wire requests accept it, nothing else new."""
import pytest
import torch

from conftest import tiny_model
from mdi.model.threads import candidates, choose_threads
from mdi.ring.init_request import RequestError, threads_field
from mdi.runconfig import ConfigError, parse_config


def test_candidates_double_up_to_the_cpus():
    assert candidates(1) == [1]
    assert candidates(2) == [1, 2]
    assert candidates(4) == [1, 2, 4]
    assert candidates(6) == [1, 2, 4, 6]


def test_choose_threads_times_every_candidate_and_leaves_torch_set_to_the_choice():
    before = torch.get_num_threads()
    chunk = tiny_model("llama")
    chunk.allocate_cache(3, 16)
    try:
        with torch.no_grad():
            expected = chunk.head(chunk.forward_rows(chunk.embed_rows(torch.tensor([5]), torch.tensor([0])),
                                                     _batch()))
        choice = choose_threads(chunk, max_batch=3, cpus=2)
        assert set(choice.pass_ms) == {1, 2} and all(ms > 0 for ms in choice.pass_ms.values())
        assert choice.threads in (1, 2) and torch.get_num_threads() == choice.threads
        # the fastest, or fewer threads within 3% of it
        assert choice.pass_ms[choice.threads] <= min(choice.pass_ms.values()) * 1.03
        assert choice.describe().startswith("%d thread" % choice.threads)
        # timing wrote into cache slots only; a sample run afterwards is unchanged
        with torch.no_grad():
            again = chunk.head(chunk.forward_rows(chunk.embed_rows(torch.tensor([5]), torch.tensor([0])), _batch()))
        assert torch.equal(again, expected)
        one = choose_threads(chunk, cpus=1)
        assert one.threads == 1 and one.pass_ms == {} and "only choice" in one.describe()  # nothing timed
    finally:
        torch.set_num_threads(before)


def _batch():
    from mdi.model.row_batch import RowBatch
    return RowBatch.of([0], [0], [1])


def runtime(threads):
    return parse_config({"model": {"path": "models/none"}, "runtime": {"threads": threads}}, "t.yaml").runtime


def test_config_takes_an_integer_or_auto():
    assert runtime("auto").threads == "auto" and runtime(3).threads == 3
    for bad in ("fast", 0, -1, True):
        with pytest.raises(ConfigError) as e:
            runtime(bad)
        assert "runtime.threads" in str(e.value)


def test_wire_requests_take_an_integer_or_auto():
    for good in (None, "auto", 1, 64):
        assert threads_field(good) == good
    for bad in ("AUTO", 0, True, 1.5, 10 ** 6, [2]):
        with pytest.raises(RequestError) as e:
            threads_field(bad)
        assert str(e.value).startswith("threads must be an integer in [1, ")


@pytest.mark.usefixtures("on_torch")  # torch's own thread count
def test_an_engine_built_in_python_runs_the_threads_its_config_names(tiny_models):
    # mdi-start sets torch's threads from runtime.threads; an Engine built by a script (the
    # benchmarks, the Python API) did not, and ran torch's default: on a 2-core box a second
    # thread that spun through the board's CPU quota.
    from ringconfigs import parse_run_config
    from mdi.model.sampling import SamplingParams
    from mdi.model.source import ModelSource
    from mdi.starter.engine import Engine
    from mdi.starter.planning.run_plan import plan_run
    from mdi.starter.planning.run_shape import RunShape
    before = torch.get_num_threads()
    model = tiny_models["llama"]
    source = ModelSource(model)
    try:
        for asked, other in ((1, 2), (2, 1)):
            torch.set_num_threads(other)
            engine = Engine(plan_run(parse_run_config(model, runtime={"threads": asked}), source, RunShape(1, 16)),
                            source, SamplingParams(0.0))
            engine.open()
            engine.close()
            assert torch.get_num_threads() == asked
    finally:
        torch.set_num_threads(before)
