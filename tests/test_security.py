"""The shared secret never crosses the network, and idle connections cannot starve a worker.

- Control plane: requests are signed (MDI-HMAC), accepted once, within a time window; the
  worker refuses the secret sent as a bearer token.
- Data plane: zmq CURVE with keys derived from the secret and the run: a relay on loopback
  that records every byte of a worker's control and data connections sees neither the
  secret nor anything it follows from, and no frame in clear.
- HTTP server (waitress, mdi/system/http_server.py): 1100 idle connections against a worker
  limited to 1024 open files neither end a run nor block a new one.
"""
import hashlib
import hmac
import os
import re
import resource
import socket
import subprocess
import threading
import time
from typing import List, Tuple

import pytest
import requests
import torch
import zmq
from zmq.utils import z85

from conftest import BIN, free_ports
from ringconfigs import write_run_config
from mdi.lab import processes
from mdi.ring.auth import (CONTENT_HEADER, INSTANCE, INSTANCE_HEADER, UNKNOWN_INSTANCE, UNSIGNED_PAYLOAD, AuthError,
                           RequestVerifier, body_sha256, ring_keys, ring_password, sign_request)
from mdi.ring.transport import RingEndpoint, RingTimeout
from mdi.ring.wire import Frame, decode
from mdi.runconfig import NodeSpec
from mdi.starter.control import ControlClient, HmacAuth, NodeError
from mdi.system.http_server import HttpServer

SECRET = "correct horse battery staple 42"
T0 = 1700000000.0


# --- signed control requests ---------------------------------------------------------------

def signed(method="GET", path="/status", body=b"", now=T0, nonce=None, token=SECRET, instance=UNKNOWN_INSTANCE):
    content = body_sha256(body)
    return sign_request(token, method, path, content, now=now, nonce=nonce, instance=instance), content


def test_a_signed_request_is_accepted_once():
    v = RequestVerifier(SECRET)
    header, content = signed(nonce="ab" * 16)
    v.verify("GET", "/status", header, content, now=T0 + 5)
    with pytest.raises(AuthError, match="replayed"):
        v.verify("GET", "/status", header, content, now=T0 + 6)
    assert SECRET not in header and "Bearer" not in header


@pytest.mark.parametrize("change", ["token", "method", "path", "query", "body", "signature"])
def test_anything_changed_breaks_the_signature(change):
    v = RequestVerifier(SECRET)
    header, content = signed("POST", "/init?x=1", b'{"run_id": 1}', token="guess" if change == "token" else SECRET)
    method, path = "POST", "/init?x=1"
    if change == "method":
        method = "PUT"
    elif change == "path":
        path = "/shutdown?x=1"
    elif change == "query":
        path = "/init?x=2"
    elif change == "body":
        content = body_sha256(b'{"run_id": 2}')
    elif change == "signature":
        header = header[:-1] + ("0" if header[-1] != "0" else "1")
    with pytest.raises(AuthError, match="bad signature"):
        v.verify(method, path, header, content, now=T0)


def test_time_window_and_bounded_nonce_memory():
    v = RequestVerifier(SECRET, window=60, max_nonces=3)
    header, content = signed(now=T0)
    with pytest.raises(AuthError) as err:
        v.verify("GET", "/status", header, content, now=T0 + 61)
    assert err.value.stale
    for i in range(3):
        h, c = signed(now=T0 + i)
        v.verify("GET", "/status", h, c, now=T0 + i)
    h, c = signed(now=T0 + 3)
    with pytest.raises(AuthError, match="too many"):  # full: refused, never forgotten early
        v.verify("GET", "/status", h, c, now=T0 + 3)
    v.verify("GET", "/status", h, c, now=T0 + 61.5)  # the first nonce's window has passed: room again
    assert len(v._seen) <= 3
    for bad in (None, "", "Bearer " + SECRET, "MDI-HMAC t=1, n=zz, s=00"):
        with pytest.raises(AuthError, match="no MDI-HMAC"):
            v.verify("GET", "/status", bad, content, now=T0)


def test_ring_keys_follow_from_secret_and_run_only():
    a, b = ring_keys(ring_password(SECRET, 7)), ring_keys(ring_password(SECRET, 7))
    assert a == b and len(set(a)) == 4 and all(len(k) == 40 for k in a)
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert ring_keys(ring_password(SECRET, 8)) != a and ring_keys(ring_password("other", 7)) != a


# --- a worker's control plane --------------------------------------------------------------

@pytest.fixture
def secret_worker(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    port = free_ports(1)[0]
    w = processes.WorkerProcess(port, str(tmp_path / "worker.log"), env=dict(os.environ, MDI_TOKEN_FILE=str(path)),
                                token=SECRET, new_session=False)
    try:
        yield w.wait_ready()
    finally:
        w.stop(5)


def test_worker_takes_signed_requests_only(secret_worker):
    url = secret_worker.url
    r = requests.get(url + "/status", headers={"Authorization": "Bearer " + SECRET}, timeout=10)
    assert r.status_code == 401 and "token" in r.json()["error"]  # the secret in clear is refused
    auth = HmacAuth(SECRET)
    assert requests.get(url + "/status", auth=auth, timeout=10).status_code == 200
    instance = auth.instance  # the worker's id, learnt from its 401 to a request signed for none
    assert INSTANCE.match(instance) and instance != UNKNOWN_INSTANCE
    assert requests.get(url + "/status", auth=HmacAuth("not it"), timeout=10).status_code == 401
    # A captured request cannot be played again.
    sent = requests.get(url + "/status?run=1", auth=HmacAuth(SECRET), timeout=10).request
    again = requests.get(url + "/status?run=1", headers=dict(sent.headers), timeout=10)
    assert again.status_code == 401 and "replayed" in again.json()["error"]
    # A signed body cannot be swapped, nor left unsigned outside /weights.
    h, _ = signed("PUT", "/stop", b"", now=time.time(), instance=instance)
    r = requests.put(url + "/stop", data=b"x", headers={"Authorization": h, CONTENT_HEADER: body_sha256(b"")},
                     timeout=10)
    assert r.status_code == 401 and "body" in r.json()["error"]
    h = sign_request(SECRET, "PUT", "/stop", UNSIGNED_PAYLOAD, now=time.time(), instance=instance)
    r = requests.put(url + "/stop", headers={"Authorization": h, CONTENT_HEADER: UNSIGNED_PAYLOAD}, timeout=10)
    assert r.status_code == 401 and "unsigned" in r.json()["error"]


def test_a_request_signed_for_one_worker_process_is_refused_by_any_other(secret_worker, tmp_path):
    """A signed request names the worker process it is for (its random instance id): captured
    on its way to one worker, it is refused by any other process with the same secret (another
    board, or the same board restarted: a 401 naming why, before it acts). A starter learns each worker's id
    from that 401 and signs again, so its own requests go through."""
    auth = HmacAuth(SECRET)
    assert requests.get(secret_worker.url + "/status", auth=auth, timeout=10).status_code == 200
    captured = requests.put(secret_worker.url + "/stop", auth=auth, timeout=10).request
    path = tmp_path / "secret2"
    path.write_text(SECRET + "\n")
    other = processes.WorkerProcess(free_ports(1)[0], str(tmp_path / "other.log"),
                                    env=dict(os.environ, MDI_TOKEN_FILE=str(path)), token=SECRET,
                                    new_session=False).wait_ready()
    try:
        r = requests.put(other.url + "/stop", headers=dict(captured.headers), timeout=10)
        assert r.status_code == 401 and "another worker process" in r.json()["error"]
        assert INSTANCE.match(r.headers[INSTANCE_HEADER]) and r.headers[INSTANCE_HEADER] != auth.instance
        client = ControlClient(NodeSpec("other", port=other.port), token=SECRET)
        assert client.health()["ok"] and client.auth.instance == r.headers[INSTANCE_HEADER]
    finally:
        other.stop(5)


def test_a_worker_refuses_web_pages_and_foreign_hosts_with_or_without_a_secret(secret_worker, tmp_path):
    """Without a secret, a page in a browser on the same machine stopped a worker with a no-cors
    POST, and through DNS rebinding read its /status (h38). A browser marks a page's requests
    (Origin, Sec-Fetch-Site) and names the page's host in Host: a worker refuses both, before
    any body is read; a path no starter sends is refused before its body too."""
    plain = processes.WorkerProcess(free_ports(1)[0], str(tmp_path / "plain.log"), new_session=False).wait_ready()
    try:
        for url, auth in ((plain.url, None), (secret_worker.url, HmacAuth(SECRET))):
            for headers in ({"Origin": "http://evil.test"}, {"Sec-Fetch-Site": "cross-site"}):
                r = requests.post(url + "/shutdown", headers=headers, auth=auth, timeout=10)
                assert r.status_code == 403 and "web pages" in r.json()["error"], r.text
            assert requests.get(url + "/status", auth=auth, headers={"Host": "localhost"}, timeout=10).ok
        rebound = {"Host": "rebind.evil.test:%d" % plain.port}
        r = requests.post(plain.url + "/shutdown", headers=rebound, timeout=10)
        assert r.status_code == 403 and "rebinding" in r.json()["error"] and "MDI_TOKEN" in r.json()["error"]
        # with a secret a page cannot sign, a proxy's own Host is served
        assert requests.get(secret_worker.url + "/status", auth=HmacAuth(SECRET), headers=rebound, timeout=10).ok
        assert requests.get(plain.url + "/health", timeout=10).ok  # it stayed up
        big = b"x" * (8 << 20)
        r = requests.post(secret_worker.url + "/%C3%A9", data=big, timeout=30)
        assert r.status_code == 401 and "path" in r.json()["error"]
    finally:
        plain.stop(5)


@pytest.mark.parametrize("host, refused", [("127.0.0.1:80", False), ("[::1]:8080", False), ("localhost", False),
                                           ("LOCALHOST.", False), ("app.localhost:3000", False), ("127.1", False),
                                           ("evil.test", True), ("evil.test:8080", True), ("10.0.0.5", True),
                                           ("", False)])
def test_a_loopback_server_names_which_hosts_are_its_own(host, refused):
    from mdi.system.loopback import foreign_host, from_page
    assert (foreign_host(host) is not None) is refused
    assert from_page({"ORIGIN": "null"}) and from_page({"SEC_FETCH_SITE": "same-site"})
    assert from_page({"SEC_FETCH_SITE": "none"}) is None and from_page({}) is None


def test_names_etc_hosts_gives_loopback_are_this_machine_s(tmp_path):
    """A ring config may name a worker by an /etc/hosts alias of 127.0.0.1 (Debian's 127.0.1.1
    line, ip6-localhost, localhost.localdomain): a name no web page can point here (h39)."""
    from mdi.system.loopback import local_names
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost localhost.localdomain\n127.0.1.1 board.example.org board  # here\n"
                     "::1 ip6-localhost ip6-loopback\n10.0.0.9 other\n# 127.0.0.1 commented\n")
    names = local_names(str(hosts))
    assert {"localhost.localdomain", "board.example.org", "board", "ip6-localhost", "ip6-loopback"} <= names
    assert "other" not in names and "commented" not in names
    hosts.write_text("127.0.0.1 renamed\n")
    os.utime(str(hosts), ns=(1, 1))  # another stamp: read again
    assert "renamed" in local_names(str(hosts)) and "board" not in local_names(str(hosts))


def test_a_starter_whose_clock_is_off_corrects_it_from_the_worker(secret_worker):
    client = ControlClient(NodeSpec("w", port=secret_worker.port), token=SECRET)
    client.auth.offset = -3600.0  # our clock is an hour behind the worker's
    assert client.health()["ok"]
    assert abs(client.auth.offset) < 60
    with pytest.raises(NodeError, match="HTTP 401.*token"):
        ControlClient(NodeSpec("w", port=secret_worker.port), token="wrong").health()


# --- what crosses the network ---------------------------------------------------------------

class Relay:
    """A TCP relay: 127.0.0.1:port -> (target_host, target_port), recording every byte both ways."""

    def __init__(self, port: int, target: Tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(64)
        self.chunks = []  # type: List[bytes]
        self.lock = threading.Lock()
        self.socks = []  # type: List[socket.socket]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            with self.lock:
                self.socks += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self.lock:
                    self.chunks.append(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def captured(self) -> bytes:
        with self.lock:
            return b"".join(self.chunks)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        with self.lock:
            for s in self.socks:
                s.close()


PATTERN = torch.full((1, 64), 1234.5678)  # float32 0x449a522b, 64 times: unmistakable in a capture


def _frames_through_relay(password):
    """Two endpoints, a -> relay -> b; one frame of PATTERN. What b got, and the capture."""
    a_port, b_port, relay_port = free_ports(3)
    validate = lambda parts: decode(parts, run=5, hidden=64, n_slots=1)  # noqa: E731
    relay = Relay(relay_port, ("127.0.0.1", b_port))
    a = RingEndpoint("a", "127.0.0.1", a_port, validate, password)
    b = RingEndpoint("b", "127.0.0.1", b_port, validate, password)
    try:
        a.connect("127.0.0.1", relay_port)
        a.send(Frame("decode", 5, [0], [3], [1], PATTERN))
        got = b.recv(10)
        return got, relay.captured()
    finally:
        for e in (a, b):
            e.close()
        relay.close()


def test_frames_on_the_wire_are_encrypted_with_a_secret_and_plain_without():
    pattern = PATTERN.numpy().tobytes()[:16]
    got, wire = _frames_through_relay(None)
    assert torch.equal(got.tensor, PATTERN) and pattern in wire and b"decode" in wire  # what a capture sees
    password = ring_password(SECRET, 5)
    got, wire = _frames_through_relay(password)
    assert torch.equal(got.tensor, PATTERN)
    assert len(wire) > PATTERN.numel() * 4 and pattern not in wire and b"decode" not in wire
    assert b"CURVE" in wire and b"PLAIN" not in wire
    for key in ring_keys(password):
        assert key not in wire and z85.decode(key) not in wire
    assert password.encode() not in wire and SECRET.encode() not in wire


def test_a_node_without_the_run_keys_cannot_send_frames():
    a_port, b_port = free_ports(2)
    validate = lambda parts: decode(parts, run=5, hidden=64, n_slots=1)  # noqa: E731
    b = RingEndpoint("b", "127.0.0.1", b_port, validate, ring_password(SECRET, 5))
    intruders = [RingEndpoint("stale", "127.0.0.1", a_port, validate, ring_password(SECRET, 4)),
                 RingEndpoint("plain", "127.0.0.1", free_ports(1)[0], validate, None)]
    try:
        for e in intruders:
            e.connect("127.0.0.1", b_port)
            e.send(Frame("decode", 5, [0], [3], [1], PATTERN))
        with pytest.raises(RingTimeout):
            b.recv(2)
    finally:
        for e in [b] + intruders:
            e.close()


def _loopback_alias_works() -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_a_captured_authenticated_run_holds_no_secret_and_no_frame_in_clear(tmp_path, tiny_models):
    """Two workers listen on 127.0.0.2; relays on 127.0.0.1 carry their control and data
    ports (the starter and worker 1 reach them only that way), recording every byte."""
    if not _loopback_alias_works():
        pytest.skip("cannot bind 127.0.0.2 on this machine")
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    env = dict(os.environ, MDI_TOKEN_FILE=str(path))
    ports = free_ports(5)  # control, data for two workers; the starter's data port
    workers, relays = [], []
    try:
        for i in range(2):
            control, data = ports[2 * i], ports[2 * i + 1]
            w = processes.WorkerProcess(control, str(tmp_path / ("w%d.log" % i)), name="board%d" % (i + 1),
                                        host="127.0.0.2", env=env, token=SECRET, new_session=False)
            workers.append(w)
            relays += [Relay(control, ("127.0.0.2", control)), Relay(data, ("127.0.0.2", data))]
        for w in workers:
            w.wait_ready()
        relayed = {"host": "127.0.0.1"}  # the boards through their relays, not at 127.0.0.2
        config = write_run_config(tmp_path / "ring.yaml", tiny_models["gpt2"], workers,
                                  data_ports=[ports[4], ports[1], ports[3]], worker_name="board%d",
                                  node_options={1: relayed, 2: relayed}, n_tokens=12, generation={"n_samples": 2},
                                  runtime={"threads": 1})
        proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "Once upon"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0 and "24 tokens" in proc.stdout, proc.stderr
    finally:
        for w in workers:
            w.stop(5)
        for r in relays:
            r.close()
    control = b"".join(r.captured() for r in relays[0::2])
    data = b"".join(r.captured() for r in relays[1::2])
    assert b"MDI-HMAC" in control and b"POST /init" in control and b"POST /weights" in control
    run_ids = set(re.findall(rb'"run_id": ?(\d+)', control))
    assert len(run_ids) == 1, run_ids
    password = ring_password(SECRET, int(run_ids.pop()))
    control_key = hmac.new(SECRET.encode(), b"mdi-control-v1", hashlib.sha256).digest()
    forbidden = [SECRET.encode(), password.encode(), control_key, control_key.hex().encode(), b"Bearer"]
    for key in ring_keys(password):
        forbidden += [key, z85.decode(key)]
    wire = control + data
    for needle in forbidden:
        assert needle not in wire, needle
    # Frames went through the data relays (the ring ran), none of them readable there.
    assert len(data) > 10000 and b"CURVE" in data
    for word in (b"prefill", b"decode", b"reset", b"NULL" + bytes(16), b"PLAIN"):
        assert word not in data, word


# --- idle connections -----------------------------------------------------------------------

def _hello_app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "5")])
    return [b"hello"]


def _idle_connections(port: int, n: int, first_bytes: bytes = b"") -> List[socket.socket]:
    conns = []
    try:
        for _ in range(n):
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            if first_bytes:
                c.sendall(first_bytes)
            conns.append(c)
    except BaseException:
        for c in conns:
            c.close()
        raise
    return conns


@pytest.mark.parametrize("first_bytes", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n"])  # silent; headers never ending
def test_connections_over_the_limit_close_the_idlest(first_bytes):
    server = HttpServer(_hello_app, "127.0.0.1", 0, threads=2, max_connections=16, idle_timeout=3600).start()
    served = requests.Session()
    try:
        assert served.get("http://127.0.0.1:%d/" % server.port, timeout=10).text == "hello"
        conns = _idle_connections(server.port, 60, first_bytes)
        try:
            for _ in range(3):  # fresh connections get through at once, again and again
                assert requests.get("http://127.0.0.1:%d/" % server.port, timeout=10).text == "hello"
            # the connection that had completed a request outlived 60 idle ones that never did
            assert served.get("http://127.0.0.1:%d/" % server.port, timeout=10).text == "hello"
            closed = 0
            for c in conns:
                c.settimeout(10)
                try:
                    closed += c.recv(1) == b""
                except socket.timeout:
                    pass
                if closed >= 60 - 16:
                    break
            assert closed >= 60 - 16  # at most the limit stayed open
        finally:
            for c in conns:
                c.close()
    finally:
        served.close()
        server.close()


def _reply(sock):
    """Everything the server sends until it closes the connection."""
    reply = b""
    while len(reply) < 1 << 16:
        try:
            part = sock.recv(4096)
        except ConnectionResetError:  # closed with bytes it never read
            break
        if not part:
            break
        reply += part
    return reply


def test_a_chunk_size_line_that_never_ends_is_refused():
    # waitress kept such a line (and joined it again with every read) until its end came:
    # memory without bound, CPU growing with it. Past MAX_CHUNK_LINE it is a 400 and a close,
    # and a proper chunked body still reaches the application.
    from mdi.system.http_server import MAX_CHUNK_LINE
    server = HttpServer(_hello_app, "127.0.0.1", 0, threads=2).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")
            s.sendall(b"1" * (MAX_CHUNK_LINE + 1))  # all read by the server: it closes, not resets
            reply = _reply(s)
        assert reply.startswith(b"HTTP/1.1 400") and b"chunk-size line" in reply, reply[:200]
        r = requests.post("http://127.0.0.1:%d/" % server.port, data=iter([b"ab", b"cd"]), timeout=10)  # chunked
        assert r.status_code == 200 and r.text == "hello"
    finally:
        server.close()


def test_streamed_writes_leave_at_once():
    """Each chunk an app yields is sent when yielded (server-sent events): the app waits for
    the client to have read its first chunk before it yields the second."""
    seen_first = threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        yield b"data: 1\n\n"
        if not seen_first.wait(30):
            yield b"data: never flushed\n\n"
            return
        yield b"data: 2\n\n"

    server = HttpServer(app, "127.0.0.1", 0, threads=2).start()
    try:
        with requests.get("http://127.0.0.1:%d/" % server.port, stream=True, timeout=60) as r:
            chunks = r.iter_content(chunk_size=None)
            first = next(chunks)
            seen_first.set()
            rest = b"".join(chunks)
        assert first == b"data: 1\n\n" and rest == b"data: 2\n\n"
    finally:
        server.close()


def _status(worker):
    return requests.get(worker.url + "/status", auth=worker.auth, timeout=10).json()


def test_idle_connections_starve_neither_a_running_run_nor_a_new_one(tmp_path, tiny_models):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip("this process may open only %d files" % hard)
    mine = 1400 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    env = dict(os.environ, MDI_TOKEN_FILE=str(path))
    port, data, starter = free_ports(3)

    def limit_files():  # the worker's soft and hard limit: it cannot raise its own
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    worker = processes.WorkerProcess(port, str(tmp_path / "worker.log"), name="board1", env=env, token=SECRET,
                                     preexec=limit_files, new_session=False)
    config = write_run_config(tmp_path / "ring.yaml", tiny_models["gpt2"], [worker],
                              data_ports=[starter, data], worker_name="board%d", n_tokens=100,
                              generation={"n_samples": 4}, runtime={"threads": 1})
    command = [os.path.join(BIN, "mdi-start"), "--config", str(config), "--prompt", "Once upon"]
    conns = []  # type: List[socket.socket]
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, mine), hard))
    try:
        worker.wait_ready()
        limits = open("/proc/%d/limits" % worker.pid).read()
        assert re.search(r"Max open files\s+1024\s+1024", limits), limits
        running = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 60
        while _status(worker).get("counters", {}).get("frames_done", 0) < 10:
            assert running.poll() is None and time.monotonic() < deadline, running.communicate()
            time.sleep(0.02)
        conns = _idle_connections(port, 1100)  # more than the worker may have files open
        out, err = running.communicate(timeout=120)
        assert running.returncode == 0 and "400 tokens" in out, err
        # With all 1100 still open, a new run (a new starter process) completes too.
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0 and "400 tokens" in proc.stdout, proc.stderr
        assert worker.alive()
    finally:
        for c in conns:
            c.close()
        worker.stop(5)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _announce(port, path, authorization, content, length):
    """A POST's headers announcing `length` body bytes, and the worker's answer to them alone."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\nAuthorization: %s\r\n"
                   "%s: %s\r\n\r\n" % (path, length, authorization, CONTENT_HEADER, content)).encode())
        return _reply(s)


def test_a_captured_signed_header_cannot_make_a_worker_store_a_big_body(secret_worker):
    """A signed header does not sign the body's length: one captured (the secret authenticates,
    it does not encrypt) and sent again with Content-Length 800 MB had that body spooled to
    $TMPDIR before its 401, and a stale one (a day old, another worker process) forever."""
    auth = HmacAuth(SECRET)
    assert requests.get(secret_worker.url + "/status", auth=auth, timeout=10).status_code == 200  # its instance id
    body = b"x" * 100
    content = body_sha256(body)
    fresh = sign_request(SECRET, "POST", "/probe", content, instance=auth.instance)
    stale = sign_request(SECRET, "POST", "/probe", content, now=time.time() - 86400, instance=auth.instance)
    reply = _announce(secret_worker.port, "/probe", fresh, content, 800 << 20)
    assert reply.startswith(b"HTTP/1.1 401") and b"at most 1048576 bytes" in reply, reply[:300]
    r = requests.post(secret_worker.url + "/probe", data=body, timeout=10,  # the header, used as signed
                      headers={"Authorization": fresh, CONTENT_HEADER: content})
    assert r.status_code == 200, r.text
    reply = _announce(secret_worker.port, "/probe", fresh, content, 100)  # and replayed
    assert reply.startswith(b"HTTP/1.1 401") and b"replayed request" in reply, reply[:300]
    # A stale one is answered with this node's clock and instance (a starter signs again) once a
    # window: sent again, with any body, it is refused from its headers.
    stale_small = requests.post(secret_worker.url + "/probe", data=body, timeout=10,
                                headers={"Authorization": stale, CONTENT_HEADER: content})
    assert stale_small.status_code == 401 and stale_small.headers.get(INSTANCE_HEADER) == auth.instance
    for length in (100, 800 << 20):
        reply = _announce(secret_worker.port, "/probe", stale, content, length)
        assert reply.startswith(b"HTTP/1.1 401") and b"replayed request" in reply, reply[:300]
    other = sign_request(SECRET, "POST", "/probe", content, now=time.time() - 86400, instance=auth.instance)
    reply = _announce(secret_worker.port, "/probe", other, content, 800 << 20)  # a first stale one, big
    assert reply.startswith(b"HTTP/1.1 401") and b"at most 1048576 bytes" in reply, reply[:300]
    assert requests.post(secret_worker.url + "/probe", data=body, auth=auth, timeout=10).status_code == 200


def test_the_http_server_s_own_refusals_are_json_too(workers):
    """waitress answered a body past its limit (and a malformed request) in its own plain text,
    where every other failure of a worker is {"ok": false, "error": ...}."""
    import json
    port = workers[0].port
    for head in (b"POST /probe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999999\r\n\r\n",
                 b"POST /probe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 12x\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head)
            reply = _reply(s)
        status, _, body = reply.partition(b"\r\n\r\n")
        assert status.split()[1] in (b"400", b"413") and b"application/json" in status, reply[:300]
        answer = json.loads(body)
        assert answer["ok"] is False and answer["error"], answer


def test_an_unsigned_upload_is_refused_before_its_body_is_read(secret_worker):
    # A peer without the secret announces a 1 GiB body: the worker answers 401 from the headers
    # and closes, instead of storing the body (in $TMPDIR, past 1 MB) before checking them.
    with socket.create_connection(("127.0.0.1", secret_worker.port), timeout=10) as s:
        s.sendall(b"POST /weights HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1073741824\r\n"
                  b"Authorization: MDI-HMAC t=1, n=0123456789abcdef, s=" + b"0" * 64 + b"\r\n"
                  b"X-MDI-Content-SHA256: UNSIGNED-PAYLOAD\r\n\r\n")  # the answer comes before any body
        reply = _reply(s)
    assert reply.startswith(b"HTTP/1.1 401") and b"missing or wrong token" in reply, reply[:200]
    # the worker serves the next signed request as ever
    assert requests.get(secret_worker.url + "/status", auth=HmacAuth(SECRET), timeout=10).status_code == 200
