"""Failures with real processes: a node killed mid-run, a dead starter, wrong tokens, and
lingering ports. Nothing hangs, every failure names the node, nothing generated is lost."""
import json
import os
import signal
import socket
import subprocess
import time

import pytest
import requests

from conftest import BIN, WorkerProcess, free_ports, worker_pool
from ringconfigs import parse_run_config, write_run_config
from mdi.starter import batch


def write_ring(tmp_path, model, workers, data_ports, n_tokens=100, n_samples=5, **runtime):
    """tmp_path/ring.yaml: the starter and board1... on `data_ports`; runtime over threads: 1."""
    return write_run_config(tmp_path / "ring.yaml", model, workers, data_ports=data_ports, worker_name="board%d",
                            n_tokens=n_tokens, generation={"n_samples": n_samples},
                            runtime=dict({"threads": 1}, **runtime))


def start_run(config, metrics, env=None):
    return subprocess.Popen([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "Once upon",
                             "--metrics-out", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


# A busy machine may keep a worker's answer waiting for seconds: these bound a hang, not a speed.
STATUS_TIMEOUT = 30


def wait_for_frames(worker, at_least=10, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counters = requests.get(worker.url + "/status", timeout=STATUS_TIMEOUT).json().get("counters") or {}
        if counters.get("frames_done", 0) >= at_least:
            return
        time.sleep(0.01)
    raise AssertionError("no frames flowed through the worker on port %d" % worker.port)


def wait_idle(worker, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if requests.get(worker.url + "/status", timeout=STATUS_TIMEOUT).json()["state"] == "idle":
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError("worker on port %d did not return to idle within %.0f s" % (worker.port, timeout))


def reference_ids(model, prompt, n_tokens):
    cfg = parse_run_config(model, label="ref", n_tokens=n_tokens)
    return batch.run(cfg, [prompt]).samples[0].token_ids


def fresh_run_matches(model, workers, data_ports):
    cfg = parse_run_config(model, workers, "fresh", data_ports=data_ports, n_tokens=20)
    got = batch.run(cfg, ["Once upon"]).samples[0].token_ids
    assert got == reference_ids(model, "Once upon", 20)


@pytest.fixture
def two_workers():
    yield from worker_pool(2)


def test_killed_worker_is_named_partial_output_kept_and_survivor_reusable(tmp_path, tiny_models, two_workers):
    model = tiny_models["llama"]
    ports = free_ports(3)
    metrics = tmp_path / "m.json"
    # No ring timeout could end this run before the hang guard below: it ends because the
    # starter saw board2's connection drop (an event, not a speed).
    run = start_run(write_ring(tmp_path, model, two_workers, ports, ring_timeout=3600), metrics)
    victim, survivor = two_workers[1], two_workers[0]
    wait_for_frames(victim)
    victim.proc.send_signal(signal.SIGKILL)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "board2" in lines[-1] and "127.0.0.1:%d" % victim.port in lines[-1], err
    record = json.loads(metrics.read_text())
    generated = [len(s["token_ids"]) for s in record["samples"]]
    assert 0 < sum(generated) < 5 * 100 and "error" in record
    assert "board2" in record["error"]
    assert "mdi:" in out  # the summary of what was generated is printed
    wait_idle(survivor, 120)
    fresh_run_matches(model, [survivor], free_ports(2))


def test_workers_survive_a_killed_starter(tmp_path, tiny_models, two_workers):
    model = tiny_models["gpt2"]
    ports = free_ports(3)
    run = start_run(write_ring(tmp_path, model, two_workers, ports, heartbeat_timeout=4),
                    tmp_path / "m.json")
    wait_for_frames(two_workers[0])
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=60)
    for w in two_workers:  # a bound on a hang: how fast they notice is the heartbeat's, not this test's
        wait_idle(w, 120)
    fresh_run_matches(model, two_workers, free_ports(3))


def test_wrong_token_is_refused_quickly_and_right_token_works(tmp_path, tiny_models):
    secret = tmp_path / "secret"
    secret.write_text("s3cret-token\n")
    env = dict(os.environ, MDI_TOKEN_FILE=str(secret))
    worker = WorkerProcess(free_ports(1)[0], env=env, token="s3cret-token")
    try:
        worker.wait_ready()
        assert requests.get(worker.url + "/health", timeout=STATUS_TIMEOUT).status_code == 401
        assert requests.get(worker.url + "/status", headers={"Authorization": "Bearer nope"},
                            timeout=STATUS_TIMEOUT).status_code == 401
        # Refused at the first signed call: no timeout could end it before the hang guard.
        config = write_ring(tmp_path, tiny_models["gpt2"], [worker], free_ports(2), n_tokens=8, n_samples=2,
                            init_timeout=3600, connect_timeout=3600)
        wrong = dict(os.environ, MDI_TOKEN="not-it")
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "x"],
                              capture_output=True, text=True, env=wrong, timeout=300)
        assert proc.returncode == 1 and "board1" in proc.stderr and "token" in proc.stderr, proc.stderr
        # The right token works end to end, data-plane handshake included.
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "x"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "16 tokens" in proc.stdout
    finally:
        worker.stop()


def test_a_worker_without_the_ring_s_secret_is_named_at_start_not_found_as_a_broken_ring(tmp_path, tiny_models):
    """A starter with a secret signs its requests; a worker started without one had accepted
    them unchecked, and the ring failed 30 s later with "no probe came back round the ring"
    (CURVE on one side of its links only), as a spare after 65 s of recovery."""
    worker = WorkerProcess(free_ports(1)[0])  # no secret
    try:
        worker.wait_ready()
        config = write_ring(tmp_path, tiny_models["gpt2"], [worker], free_ports(2), n_tokens=4, n_samples=1,
                            init_timeout=3600, connect_timeout=3600)
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "x"],
                              capture_output=True, text=True, env=dict(os.environ, MDI_TOKEN="the-ring-s"), timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 1 and "board1" in lines[-1], proc.stderr
        assert "this worker has no shared secret" in lines[-1] and "--token-file" in lines[-1], proc.stderr
    finally:
        worker.stop()


def test_a_node_failing_at_start_up_ends_it_at_once_while_another_never_answers(tmp_path, tiny_models):
    """The first node to fail while the others still configure ends the start-up, named: board1
    here never answers (a port that listens and never accepts, under a connect timeout that
    outlasts the test), board2 refuses the run's token at once. The run used to wait for every
    node in order and name board1 when its wait ran out; it names board2, whatever the speed."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    secret = tmp_path / "secret"
    secret.write_text("the-boards-token\n")
    worker = WorkerProcess(free_ports(1)[0], env=dict(os.environ, MDI_TOKEN_FILE=str(secret)), token="the-boards-token")
    try:
        worker.wait_ready()
        config = write_ring(tmp_path, tiny_models["gpt2"], [hung.getsockname()[1], worker], free_ports(3),
                            n_tokens=4, n_samples=1, connect_timeout=3600)
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "x"],
                              capture_output=True, text=True, env=dict(os.environ, MDI_TOKEN="not-it"), timeout=600)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 1 and lines, proc.stderr
        assert "board2" in lines[-1] and "token" in lines[-1] and "board1" not in lines[-1], proc.stderr
    finally:
        worker.stop()
        hung.close()


def test_worker_refuses_public_address_without_token():
    proc = subprocess.run([os.path.join(BIN, "mdi-worker"), "--host", "0.0.0.0", "--port", str(free_ports(1)[0])],
                          capture_output=True, text=True, timeout=30,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MDI_TOKEN")})
    assert proc.returncode == 2 and "shared secret" in proc.stderr and "--insecure" in proc.stderr


def test_port_is_free_again_right_after_a_killed_worker(tiny_models, tmp_path):
    port, data = free_ports(2)
    first = WorkerProcess(port).wait_ready()
    config = write_ring(tmp_path, tiny_models["gpt2"], [first], [free_ports(1)[0], data], n_tokens=4, n_samples=1)
    assert subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "x"],
                          capture_output=True, timeout=60).returncode == 0
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    second = WorkerProcess(port)
    try:
        second.wait_ready()
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "x"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    finally:
        second.stop()
        first.log.close()


def test_control_client_says_what_happened_by_type():
    """A refused connection is NodeUnreachable; a node that takes the connection and then
    hangs (mid-request or while we push weights) is NodeTimeout saying it timed out."""
    import socket
    from mdi.runconfig import NodeSpec
    from mdi.starter.control import ControlClient, NodeTimeout, NodeUnreachable
    hung = socket.socket()  # listens, never accepts: a frozen worker
    hung.bind(("127.0.0.1", 0))
    hung.listen(1)
    dead = free_ports(1)[0]
    try:
        client = ControlClient(NodeSpec("frozen", port=hung.getsockname()[1]), connect_timeout=0.5, init_timeout=0.5)
        with pytest.raises(NodeTimeout, match="frozen.*GET /status timed out") as err:
            client.status()
        assert err.value.node == "frozen"
        with pytest.raises(NodeTimeout, match="POST /weights timed out"):
            client.push_weights(b"x" * (64 << 20))  # more than the socket buffers take
        with pytest.raises(NodeUnreachable, match="gone.*cannot connect"):
            ControlClient(NodeSpec("gone", port=dead), connect_timeout=0.5).health()
        # an adapter's matrices wait ADAPTER_TIMEOUT_S, not init_timeout (600 s, for weight loads)
        import mdi.starter.control as control
        frozen = socket.socket()  # (the first one's backlog is full by now)
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)
        slow_load = ControlClient(NodeSpec("frozen", port=frozen.getsockname()[1]), connect_timeout=5,
                                  init_timeout=600)
        old, control.ADAPTER_TIMEOUT_S = control.ADAPTER_TIMEOUT_S, 0.5
        try:
            with pytest.raises(NodeTimeout, match="POST /adapters/3 timed out"):
                slow_load.post_adapter(3, b"x" * 1024)
        finally:
            control.ADAPTER_TIMEOUT_S = old
            frozen.close()
    finally:
        hung.close()


class _StubStatus:
    """A worker's /status as a silent ring's naming reads it: dropped frames doubling at each
    poll (from `bad`), a pass in hand for `pass_seconds`."""
    def __init__(self, node, bad=0, pass_seconds=0.0):
        self.node, self.bad, self.pass_seconds = node, bad, pass_seconds

    def status(self, timeout=None, run_id=None):
        from mdi.ring.status import NodeCounters, StatusReply
        self.bad = self.bad * 2 if self.bad else 0
        return StatusReply("running", "0", 1, "cpu", run_id=1,
                           counters=NodeCounters(bad_frames=self.bad, last_bad_frame="not msgpack",
                                                 pass_seconds=self.pass_seconds))

    def close(self):
        pass


def _silent_ring_named(stubs):
    """What the starter's session says of a ring silent past its 30 s timeout, its workers
    answering as `stubs` (node name -> _StubStatus) at the watchdog's last poll and again."""
    import threading
    from types import SimpleNamespace
    from mdi.ring.transport import RingTimeout
    from mdi.starter.session import RingSession
    session = RingSession.__new__(RingSession)  # only what naming a failure uses
    session.cfg = SimpleNamespace(runtime=SimpleNamespace(heartbeat_interval=1.0, heartbeat_timeout=8.0,
                                                          ring_timeout=30.0))
    session.run_id, session.failure, session._stopping = 1, None, False
    session._answered, session._counters = {}, {}
    session._watching = threading.Event()
    session._watching.set()
    session.workers = [stub.node for stub in stubs.values()]
    session.registry = SimpleNamespace(fresh=lambda node: stubs[node.name])
    for stub in stubs.values():  # the watchdog's last polls
        session._probe(stub)
    named = session.named_failure(RingTimeout("no activations came back round the ring for 30 s"))
    assert isinstance(named, RingTimeout), named
    return str(named)


def test_a_node_address_where_another_web_server_answers_says_it_is_not_an_mdi_worker():
    """A wrong port in the config that reaches some other HTTP server: the error was that
    server's HTML page on one line, with no word of the likely cause."""
    import http.server
    import threading
    from mdi.runconfig import NodeSpec
    from mdi.starter.control import ControlClient, NodeError

    class EveryPathAPage(http.server.BaseHTTPRequestHandler):  # a web app's catch-all route
        def do_GET(self):
            page = b"<!DOCTYPE html>\n<html><body>\n<h1>Welcome</h1>\n</body></html>\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass
    for handler, status in ((http.server.SimpleHTTPRequestHandler, 404), (EveryPathAPage, 200)):
        other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=other.serve_forever, daemon=True).start()
        try:
            client = ControlClient(NodeSpec("board2", port=other.server_address[1]), connect_timeout=5)
            for ask in (client.health, client.status):
                with pytest.raises(NodeError) as err:
                    ask()
                line = str(err.value)
                assert line.startswith("node board2 (127.0.0.1:%d): GET /%s failed with HTTP %d: the server there is "
                                       "not an mdi-worker (wrong port?): <!DOCTYPE" % (other.server_address[1],
                                                                                      ask.__name__, status)), line
                assert "\n" not in line and len(line) < 260, line
        finally:
            other.shutdown()
            other.server_close()


def test_a_worker_ending_mid_answer_is_a_node_error_naming_it():
    """A worker killed while it wrote a /status answer raised requests' ChunkedEncodingError out of
    the client: the watchdog thread died, no worker was polled again, and 8 s later the healthy
    ones ended their run and were blamed for it."""
    import threading
    from mdi.runconfig import NodeSpec
    from mdi.starter.control import ControlClient, NodeError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def answer_half():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1269\r\n\r\n{\"st")
            conn.close()
    threading.Thread(target=answer_half, daemon=True).start()
    try:
        client = ControlClient(NodeSpec("board3", port=listener.getsockname()[1]), connect_timeout=5)
        for ask in (client.health, lambda: client.status(timeout=5, run_id=3)):
            with pytest.raises(NodeError) as err:
                ask()
            assert err.value.node == "board3" and "its answer broke off" in str(err.value), err.value
            assert str(err.value).startswith("node board3 (127.0.0.1:%d): GET /" % listener.getsockname()[1])
    finally:
        listener.close()


def test_a_silent_ring_names_the_node_that_reads_garbage_between_its_frames():
    """A ring slowed past ring_timeout by garbage sent to a worker's data port named no node,
    though every poll of it showed its dropped frames growing."""
    from mdi.runconfig import NodeSpec
    named = _silent_ring_named({"board1": _StubStatus(NodeSpec("board1", port=1)),
                                "board2": _StubStatus(NodeSpec("board2", port=2), bad=1000)})
    assert "board1" not in named, named
    assert "node board2 (127.0.0.1:2) dropped 2000 frames it could not read since its last poll (the last: " \
           "not msgpack)" in named, named


def test_a_silent_ring_names_the_node_stuck_in_a_pass():
    """A board short of memory thrashed in one pass until the ring timed out, and the failure
    named no node (h45): the node whose /status shows a pass in hand for most of the timeout is named."""
    from mdi.runconfig import NodeSpec
    named = _silent_ring_named({"board1": _StubStatus(NodeSpec("board1", port=1), pass_seconds=0.2),
                                "board2": _StubStatus(NodeSpec("board2", port=2), pass_seconds=29.4)})
    assert "board1" not in named, named
    assert named == ("no activations came back round the ring for 30 s; node board2 (127.0.0.1:2) is still "
                     "computing a pass it began 29 s ago (short of memory or CPU?)"), named
    quiet = _silent_ring_named({"board1": _StubStatus(NodeSpec("board1", port=1), pass_seconds=1.0)})
    assert quiet == "no activations came back round the ring for 30 s", quiet


def _watched(clients):
    """A ring session over stub `clients` (their status() as ControlClient's), once its watchdog
    has named a failure."""
    import threading
    from types import SimpleNamespace
    from mdi.starter.session import RingSession
    session = RingSession.__new__(RingSession)  # only what the watchdog uses
    session.cfg = SimpleNamespace(runtime=SimpleNamespace(heartbeat_interval=0.01))
    session.run_id, session.failure, session._stopping = 1, None, False
    session._answered, session._counters, session._unanswered = {}, {}, {}
    session.clients = clients
    session._watching = threading.Event()
    session._watching.set()
    session._watch()
    return session


def _two_frozen_and_a_healthy(state):
    """Stub clients: board1 and board2 frozen (a poll waits, up to a poll's whole timeout, until
    board3 was polled thrice, then times out), board3 answering `state` at once."""
    import threading
    from mdi.runconfig import NodeSpec
    from mdi.ring.status import StatusReply
    from mdi.starter.control import NodeTimeout
    polled = threading.Event()

    class Healthy:
        node, calls = NodeSpec("board3"), 0

        def status(self, timeout=None, run_id=None):
            Healthy.calls += 1
            if Healthy.calls >= 3:
                polled.set()
            return StatusReply(state, "0", 1, "cpu", run_id=1 if state == "running" else None)

        def close(self):
            pass

    class Frozen(Healthy):
        def __init__(self, name):
            self.node, self.others_polled_meanwhile = NodeSpec(name), []

        def status(self, timeout=None, run_id=None):
            self.others_polled_meanwhile.append(polled.wait(10))
            raise NodeTimeout("node %s: GET /status timed out" % self.node.name, self.node.name)
    return [Frozen("board1"), Frozen("board2"), Healthy()]


def test_the_watchdog_polls_every_node_while_another_takes_a_poll_s_whole_timeout():
    """Polled in turn, two frozen boards (5 s a poll each) held the healthy ones' heartbeat past
    their timeout, and the healthy ones ended the run."""
    stubs = _two_frozen_and_a_healthy("running")
    session = _watched(stubs)
    assert session.failure.node in ("board1", "board2") and session.failure.silent
    polled = [f.others_polled_meanwhile for f in stubs[:2] if f.others_polled_meanwhile]  # (one may not have begun)
    assert polled and all(p[0] for p in polled), polled


def test_watchdog_fails_at_once_on_unreachable_and_gives_a_timeout_a_second_chance():
    from types import SimpleNamespace
    from mdi.runconfig import NodeSpec
    from mdi.starter.control import NodeError, NodeTimeout, NodeUnreachable
    from mdi.starter.session import STATUS_TIMEOUT_MIN_S
    from mdi.ring.status import StatusReply

    class Stub:
        def __init__(self, name, errors):
            self.node, self.errors, self.calls, self.timeouts = NodeSpec(name), list(errors), 0, set()

        def status(self, timeout=None, run_id=None):
            self.calls += 1
            self.timeouts.add(timeout)
            if self.errors:
                error = self.errors.pop(0)
                if error is not None:
                    raise error
            return StatusReply("running", "0", 1, "cpu", run_id=1)

    def watch(errors):
        session = _watched([Stub("a", errors)])  # returns once it has named a failure
        # A poll waits seconds however short the interval: a loaded board answers late.
        assert session.clients[0].timeouts == {STATUS_TIMEOUT_MIN_S}
        return session.failure, session.clients[0].calls

    # A message mentioning "cannot connect" is no longer taken for an unreachable node.
    slow = NodeTimeout("node a: timed out, cannot connect", "a")
    failure, calls = watch([slow, None, slow, slow])
    assert failure is slow and calls == 4
    gone = NodeUnreachable("node a: cannot connect", "a")
    failure, calls = watch([gone])
    assert failure is gone and calls == 1
    failure, _ = watch([NodeError("node a: HTTP 500", "a")] * 2)
    assert isinstance(failure, NodeError) and failure.node == "a"
    # a node that did not answer is lost for certain: recovery asks it nothing more (a hung
    # node had cost a stop and a health check of 5 s each after it was named); one that
    # answered with an error is asked whether it lives
    assert slow.silent and gone.silent and not failure.silent
    from mdi.starter.planning.recovery import named_worker_lost

    class Registry:
        asked = []

        def client(self, node):
            Registry.asked.append(node.name)
            raise AssertionError("a silent node was asked again")
    plan = SimpleNamespace(specs=[NodeSpec("s"), NodeSpec("a")])
    assert named_worker_lost(plan, Registry(), slow) and Registry.asked == []


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.1", True), ("127.0.1", True),
                                            ("localhost", True), ("::1", True), ("0.0.0.0", False),
                                            ("192.168.1.10", False), ("10.1", False), ("example.com", False)])
def test_loopback_addresses_in_every_form(host, loopback):
    # `--host 127.1` (the OS binds it as 127.0.0.1) was refused as non-loopback.
    from mdi.system.loopback import is_loopback
    assert is_loopback(host) is loopback


def test_the_start_up_s_keepalive_polls_every_node_while_another_takes_a_poll_s_whole_timeout():
    """As the watchdog (test above): two boards frozen in their /init held the healthy ones'
    heartbeat past its timeout, and a healthy one's /init ended, named as the failure."""
    import threading
    from types import SimpleNamespace
    from mdi.starter.control import NodeTimeout
    from mdi.starter.session import RingSession
    stubs = {stub.node.name: stub for stub in _two_frozen_and_a_healthy("loading")}
    session = RingSession.__new__(RingSession)  # only what the keepalive uses
    session.cfg = SimpleNamespace(runtime=SimpleNamespace(heartbeat_interval=0.01))
    session.run_id, session.failure = 1, None
    session.workers = [stub.node for stub in stubs.values()]
    session.registry = SimpleNamespace(fresh=lambda node: stubs[node.name])
    configured = threading.Event()
    try:
        with pytest.raises(NodeTimeout) as raised:
            session._keepalive(configured)
    finally:
        configured.set()
    assert raised.value.node in ("board1", "board2") and session.failure is raised.value
    polled = [stubs[n].others_polled_meanwhile for n in ("board1", "board2") if stubs[n].others_polled_meanwhile]
    assert polled and all(p[0] for p in polled), polled


def test_a_worker_silent_while_it_is_configured_is_named_at_once():
    """The start-up's keepalive polls apply the running ring's rule: a node that leaves two
    polls unanswered (a board stalled in its /init) or cannot be reached is named and ends the
    start-up (run_all raises it), where it had been left to runtime.init_timeout (600 s)."""
    import threading
    from types import SimpleNamespace
    from mdi.runconfig import NodeSpec
    from mdi.ring.status import StatusReply
    from mdi.starter.control import NodeTimeout, NodeUnreachable
    from mdi.starter.session import RingSession

    class Stub:
        def __init__(self, name, errors):
            self.node, self.errors, self.calls = NodeSpec(name), list(errors), 0

        def status(self, timeout=None, run_id=None):
            self.calls += 1
            error = self.errors.pop(0) if self.errors else None
            if error is not None:
                raise error
            return StatusReply("loading", "0", 1, "cpu")

        def close(self):
            pass

    def keepalive(errors, answered_for=None):
        stubs = {"a": Stub("a", []), "b": Stub("b", errors)}
        session = RingSession.__new__(RingSession)  # only what the keepalive uses
        session.cfg = SimpleNamespace(runtime=SimpleNamespace(heartbeat_interval=0.01))
        session.run_id, session.failure = 1, None
        session.workers = [stubs["a"].node, stubs["b"].node]
        session.registry = SimpleNamespace(fresh=lambda node: stubs[node.name])
        configured = threading.Event()  # the workers configured: after answered_for, else (a hang) 30 s
        timer = threading.Timer(30 if answered_for is None else answered_for, configured.set)
        timer.daemon = True
        timer.start()
        try:
            session._keepalive(configured)
        except NodeTimeout as e:
            return e, session.failure
        except NodeUnreachable as e:
            return e, session.failure
        return None, session.failure

    late = NodeTimeout("node b: GET /status timed out", "b")
    raised, failure = keepalive([late, None, late, late])
    assert raised is late and failure is late and late.silent  # one late answer forgiven, two in a row not
    gone = NodeUnreachable("node b: cannot connect", "b")
    raised, failure = keepalive([gone])
    assert raised is gone and failure is gone and gone.silent
    assert keepalive([], answered_for=0.1) == (None, None)


def test_a_host_name_that_does_not_resolve_is_named_as_such(monkeypatch):
    """A typo in a node's host (127.0.0.l) was said as a worker not running on its port (h79).
    (getaddrinfo fails here without asking any resolver: no query leaves this machine.)"""
    from mdi.runconfig import NodeSpec
    from mdi.starter.control import ControlClient, NodeUnreachable

    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    with pytest.raises(NodeUnreachable, match=r"board1 .*cannot resolve the host name 'boardl' \(a typo"):
        ControlClient(NodeSpec("board1", host="boardl", port=8081), connect_timeout=0.5).health()


def test_a_large_weight_push_is_said_before_and_after_and_a_small_one_is_not(monkeypatch, caplog):
    """A board's GB over its link had been minutes of silence (h79); a small model's start-up
    stays quiet (its failure is one line)."""
    import logging
    from mdi.runconfig import NodeSpec
    from mdi.starter import control
    client = control.ControlClient(NodeSpec("board1", port=1))
    monkeypatch.setattr(client, "_call", lambda *args, **kwargs: {})
    monkeypatch.setattr(control, "SAY_PUSH_BYTES", 1000)
    with caplog.at_level(logging.INFO, logger="mdi"):
        client.push_weights(b"x" * 999)
        assert not caplog.records
        client.push_weights(b"x" * 2000)
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "mdi: board1: sending its weights, 0.0 MB" and said[1].startswith("mdi: board1: weights sent in")
