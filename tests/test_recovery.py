"""Recovery with real processes: a worker SIGKILLed mid-run is replaced by a spare or its layers
move to its neighbours, and every sample ends with exactly the tokens of an uninterrupted run."""
import logging
import os
import random
import signal

import pytest

from conftest import worker_pool
from ringconfigs import parse_run_config
from mdi.starter import batch

N_TOKENS = 64
PROMPTS = ["Once upon", "The cat", "Hello"]


@pytest.fixture
def four_workers():
    yield from worker_pool(4)


def ring_config(model, workers, spares=(), sampling=None, attempts=None):
    runtime = {"threads": 1, "heartbeat_interval": 0.2, "ring_timeout": 10}
    if attempts is not None:
        runtime["recovery_attempts"] = attempts
    return parse_run_config(model, workers, "recovery-test", worker_name="board%d", spares=spares, n_tokens=N_TOKENS,
                            generation=sampling, runtime=runtime)


def reference(model, sampling=None):
    """The same prompts, standalone and uninterrupted."""
    cfg = parse_run_config(model, label="ref", n_tokens=N_TOKENS, generation=sampling)
    return [s.token_ids for s in batch.run(cfg, PROMPTS).samples]


def run_killing(cfg, kills, prompts=PROMPTS):
    """Run, SIGKILLing kills[i][1] once kills[i][0] tokens in total have been generated."""
    pending = sorted(kills, key=lambda k: k[0])
    count = [0]

    def on_token(sample, token):
        count[0] += 1
        while pending and count[0] >= pending[0][0]:
            os.kill(pending.pop(0)[1].proc.pid, signal.SIGKILL)

    logs = _Collect()
    logger = logging.getLogger("mdi")
    logger.addHandler(logs)
    level, logger.level = logger.level, logging.INFO
    try:
        result = batch.run(cfg, prompts, on_token=on_token)
    finally:
        logger.removeHandler(logs)
        logger.setLevel(level)
    assert not pending, "the run ended before every kill happened"
    return result, logs.lines


class _Collect(logging.Handler):
    """The run's log messages (recovery lines among them), as the CLI would print them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


SAMPLINGS = [None, {"temperature": 0.9, "top_k": 20, "seed": 7}]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_spare_replaces_killed_worker(tiny_models, four_workers, sampling):
    model = tiny_models["llama"]
    board1, board2, spare, _ = four_workers
    at = random.Random().randint(10, N_TOKENS * len(PROMPTS) - 20)
    cfg = ring_config(model, [board1, board2], [spare], sampling)
    result, logs = run_killing(cfg, [(at, board1)])
    assert [s.token_ids for s in result.samples] == reference(model, sampling), "killed at token %d" % at
    (rec,) = result.extra["recoveries"]
    assert "board1" in rec["cause"] and "spare1" in rec["action"]
    assert [n["name"] for n in result.metrics()["nodes"]] == ["starter", "spare1", "board2"]
    assert any("recovered" in line for line in logs)


def test_a_worker_down_when_the_ring_starts_is_replaced_by_a_spare(tiny_models, four_workers):
    """Spares cover the start too: a worker that is down (or dies during its /init) is
    replaced as one lost mid-run is, where the run had ended at once naming it."""
    model = tiny_models["llama"]
    board1, board2, spare, _ = four_workers
    board1.proc.kill()
    board1.proc.wait(30)
    result = batch.run(ring_config(model, [board1, board2], [spare]), PROMPTS)
    assert [s.token_ids for s in result.samples] == reference(model)
    (rec,) = result.extra["recoveries"]
    assert "board1" in rec["cause"] and "spare1" in rec["action"]
    assert [n["name"] for n in result.metrics()["nodes"]] == ["starter", "spare1", "board2"]


def test_a_worker_lost_after_the_last_token_leaves_a_complete_run(tiny_models, four_workers):
    """Every sample was complete: the stop frame that could not go round costs only the
    workers' counters, not the run (h63: it was a RunFailed, exit 1)."""
    model = tiny_models["llama"]
    board1, board2, spare, _ = four_workers
    expected = reference(model)
    result, logs = run_killing(ring_config(model, [board1, board2], [spare]),
                               [(sum(len(ids) for ids in expected), board1)])
    assert [s.token_ids for s in result.samples] == expected
    assert "board1" in result.extra["ring_end_error"] and "recoveries" not in result.extra
    assert any("every sample is complete" in line for line in logs)


def test_a_spare_that_does_not_answer_is_said_when_the_ring_starts(tiny_models, four_workers, caplog):
    """Not found only when a node is lost (h20): the run goes on without it, said in one line."""
    model = tiny_models["llama"]
    board1, board2, spare, _ = four_workers
    spare.proc.kill()
    spare.proc.wait(30)
    with caplog.at_level(logging.WARNING, logger="mdi.starter.planning.recovery"):
        result = batch.run(ring_config(model, [board1, board2], [spare]), PROMPTS)
    assert [s.token_ids for s in result.samples] == reference(model)
    said = [r.getMessage() for r in caplog.records if "spare" in r.getMessage()]
    assert len(said) == 1 and "spare1" in said[0] and "cannot stand in" in said[0] and "\n" not in said[0], said


def test_a_replay_of_more_than_64_generated_tokens_is_exact_on_ggml(smollm2_dir, four_workers):
    """SmolLM2 on ggml, killed once each sample holds about 120 tokens: the replay re-prefills
    them, and a pass of 64 rows or more takes another attention kernel than the one-row steps
    that computed them first (sample 2 parted from the uninterrupted run at token 131); they
    now go in passes below 64 rows, the prompt cut as when it came."""
    prompts = ["The capital of France is", "Once upon a time in a small village"]
    board1, board2, spare, _ = four_workers
    runtime = {"threads": 1, "heartbeat_interval": 0.2, "ring_timeout": 30, "backend": "ggml"}
    cfg = parse_run_config(smollm2_dir, [board1, board2], "replay-test", worker_name="board%d", spares=[spare],
                           n_tokens=160, runtime=runtime)
    result, _ = run_killing(cfg, [(120 * len(prompts), board1)], prompts)
    ref = parse_run_config(smollm2_dir, label="ref", n_tokens=160, runtime={"threads": 1, "backend": "ggml"})
    assert [s.token_ids for s in result.samples] == [s.token_ids for s in batch.run(ref, prompts).samples]
    assert len(result.extra["recoveries"]) == 1 and [n.backend for n in result.nodes] == ["ggml"] * 3


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_neighbours_take_the_layers_without_a_spare(tiny_models, four_workers, family):
    model = tiny_models[family]
    board1, board2 = four_workers[:2]
    at = random.Random().randint(10, N_TOKENS * len(PROMPTS) - 20)
    victim = random.Random().choice([board1, board2])
    cfg = ring_config(model, [board1, board2], attempts=1)
    result, _ = run_killing(cfg, [(at, victim)])
    assert [s.token_ids for s in result.samples] == reference(model), "killed at token %d" % at
    assert len(result.metrics()["nodes"]) == 2 and len(result.extra["recoveries"]) == 1
    assert sum(n["layers"][1] - n["layers"][0] for n in result.metrics()["nodes"]) == 4  # every layer still served


def test_two_failures_one_spare(tiny_models, four_workers):
    model = tiny_models["llama"]
    board1, board2, board3, spare = four_workers
    sampling = {"temperature": 0.8, "seed": 3}
    cfg = ring_config(model, [board1, board2, board3], [spare], sampling)
    result, _ = run_killing(cfg, [(30, board2), (110, board1)])
    assert [s.token_ids for s in result.samples] == reference(model, sampling)
    assert len(result.extra["recoveries"]) == 2


def test_two_nodes_lost_at_once_each_recovery_names_its_own(tiny_models, four_workers):
    """A second node lost while the ring re-planned for the first was connected: the record said
    only the second re-plan's action, under the first node's cause."""
    import re
    model = tiny_models["llama"]
    board1, board2, board3, spare = four_workers
    cfg = ring_config(model, [board1, board2, board3], [spare], attempts=3)
    result, _ = run_killing(cfg, [(30, board2), (30, board3)])
    assert [s.token_ids for s in result.samples] == reference(model)
    first, second = result.extra["recoveries"]
    lost = re.match(r"node (board[23]) ", first["cause"]).group(1)
    then = re.match(r"spare spare1 \(127.0.0.1:\d+\) takes layers \[\d, \d\) of %s, then failed: node (board[23]) "
                    % lost, first["action"])
    assert then and then.group(1) != lost, first
    assert second["cause"].startswith("node %s " % then.group(1)) and "failed" not in second["action"], second


def test_without_recovery_the_run_fails_naming_the_node(tiny_models, four_workers):
    model = tiny_models["gpt2"]
    board1, board2 = four_workers[:2]
    cfg = ring_config(model, [board1, board2])  # no spares: recovery is off by default
    with pytest.raises(batch.RunFailed, match="board2"):
        run_killing(cfg, [(20, board2)])


def test_an_idle_server_replaces_a_dead_worker_before_the_next_request(tmp_path, tiny_models, four_workers):
    """The watchdog named the dead node within a second, but an idle server recovered only at
    the next request's first step (which then waited for it) and said "up" meanwhile."""
    import time
    import requests
    from conftest import ServeProcess
    from ringconfigs import write_run_config
    board1, board2, spare = four_workers[:3]
    path = write_run_config(tmp_path / "ring.yaml", tiny_models["llama"], [board1, board2], layers=[1, 1, 2],
                            worker_name="board%d", spares=[spare],
                            runtime={"threads": 1, "heartbeat_interval": 0.2, "ring_timeout": 30},
                            serve={"max_in_flight": 2, "model_name": "tiny"})
    server = ServeProcess(path).wait_ready()
    try:
        body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0}
        before = requests.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        lookups = server.metrics()["mdi_prefix_cache_lookups_total"]
        board1.proc.kill()
        deadline = time.monotonic() + 90
        while server.metrics().get("mdi_recoveries_total", 0) < 1:  # no request meanwhile
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.3)
        assert server.get("/health").status_code == 200
        metrics = server.metrics()
        assert metrics['mdi_node_up{node="board1"}'] == 0 and metrics['mdi_node_up{node="spare1"}'] == 1, metrics
        assert metrics["mdi_prefix_cache_lookups_total"] == lookups >= 1  # a counter never goes back
        after = requests.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert after == before
    finally:
        assert server.stop() == 0, server.output()


def test_a_server_whose_worker_is_down_at_start_serves_on_its_spare(tmp_path, tiny_models, four_workers):
    """A batch run of that config recovered with the spare; `--serve` had read every configured
    worker's memory first and exited naming the dead one (h78)."""
    import requests
    from conftest import ServeProcess
    from ringconfigs import write_run_config
    board1, board2, spare = four_workers[:3]
    board1.proc.kill()
    board1.proc.wait(30)
    path = write_run_config(tmp_path / "ring.yaml", tiny_models["llama"], [board1, board2], layers=[1, 1, 2],
                            worker_name="board%d", spares=[spare], runtime={"threads": 1, "ring_timeout": 30},
                            serve={"max_in_flight": 2, "model_name": "tiny"})
    server = ServeProcess(path).wait_ready()
    try:
        body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0}
        got = requests.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        alone = batch.run(parse_run_config(tiny_models["llama"], label="alone", n_tokens=8), ["Once upon"])
        assert got == alone.texts[0]  # (the generated text alone, as the completion's)
        assert server.metrics()['mdi_node_up{node="spare1"}'] == 1
    finally:
        assert server.stop() == 0, server.output()
