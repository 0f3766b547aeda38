"""The dashboard in a real headless browser: Debian's chromium driven by selenium through
/usr/bin/chromedriver (both given explicitly: nothing is downloaded at run time), against a real
3-node SmolLM2 ring on loopback with a spare worker and a shared secret, and against a batch
run's `--dashboard`.

One served ring and one browser session serve the whole module; the tests run in file order and
the last ring test SIGKILLs a worker. Every browser test ends by checking the browser's console
for errors. Without chromium the browser tests skip, except in CI (CI=true), where they fail.
Screenshots go to $MDI_SCREENSHOTS when it is set (`MDI_SCREENSHOTS=results` refreshes the
committed ones), else to a temporary folder.
"""
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import requests

from conftest import BIN, ROOT, WorkerProcess, free_ports
from ringconfigs import write_run_config
from conftest import ServeProcess as Server

MODEL = os.path.join(ROOT, "models", "smollm2-135m")
SECRET = "dashboard-test-secret-7f3a"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
DESKTOP, PHONE = (1440, 900), (375, 812)
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--disable-extensions", "--disable-default-apps",
                  "--no-default-browser-check", "--password-store=basic", "--window-size=1440,900"]


def _unavailable(reason):
    if IN_CI:
        pytest.fail("%s; CI=true, so the browser tests must run (scripts/setup_env.sh test installs "
                    "chromium and chromium-driver)" % reason, pytrace=False)
    pytest.skip(reason)


def find_browser():
    """(chromium, chromedriver) paths, or None where either is missing."""
    chromium = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                     if p and os.access(p, os.X_OK)), None)
    driver = next((p for p in (shutil.which("chromedriver"), "/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
                   if p and os.access(p, os.X_OK)), None)
    return (chromium, driver) if chromium and driver else None


def _env(token=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDI_TOKEN")}
    if token:
        env["MDI_TOKEN"] = token
    return env


# --------------------------------------------------------------------------- the browser

@pytest.fixture(scope="module")
def chrome():
    found = find_browser()
    if found is None:
        _unavailable("chromium and chromedriver not found (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("the selenium package is not installed (pip install -e '.[test]')")
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager must never download anything
    profile = tempfile.mkdtemp(prefix="mdi-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in CHROMIUM_FLAGS + ["--user-data-dir=" + profile]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=found[1]), options=options)
    driver.set_page_load_timeout(30)
    viewport(driver, *DESKTOP)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def browser(chrome):
    chrome.get_log("browser")  # what earlier tests left
    return chrome


def viewport(driver, width, height):
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})


def assert_no_console_errors(driver):
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors


def screenshot(driver, name, size=DESKTOP, whole=True):
    """The page (`whole`: all of its height) at `size` as PNG into $MDI_SCREENSHOTS (or a
    temporary folder); returns the path."""
    folder = os.environ.get("MDI_SCREENSHOTS") or os.path.join(tempfile.gettempdir(), "mdi-screenshots")
    os.makedirs(folder, exist_ok=True)
    if whole:  # a viewport as tall as the page: no scroll bar, nothing cut
        viewport(driver, size[0], max(size[1], driver.execute_script("return document.documentElement.scrollHeight")))
        time.sleep(0.3)
    try:
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
    finally:
        viewport(driver, *size)
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    return path


def wait_for(what, check, timeout=120.0, every=0.2):
    """Call `check` until it returns something truthy; fail naming `what` and the last value.
    The timeouts bound a hang, not a speed: a busy machine delays the page's polls and the ring."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("%s: not within %.0f s (last: %r)" % (what, timeout, value))


NODE_CARDS = """return Array.from(document.querySelectorAll('#nodes .node')).map(function (c) {
  var dd = {};
  c.querySelectorAll('dt').forEach(function (dt) { dd[dt.textContent] = dt.nextElementSibling.textContent; });
  return {name: c.dataset.node, state: c.dataset.state, badge: c.querySelector('.badge').textContent,
          index: c.querySelector('.idx').textContent, fields: dd,
          shown: c.getBoundingClientRect().width > 0};
});"""


def node_cards(driver):
    return driver.execute_script(NODE_CARDS)


def text(driver, element_id):
    return driver.execute_script("var e = document.getElementById(arguments[0]); return e ? e.textContent : null;",
                                 element_id)


def shown(driver, element_id):
    return driver.execute_script(
        "var e = document.getElementById(arguments[0]); return !!e && e.getClientRects().length > 0;", element_id)


def click(driver, element_id):
    driver.find_element("id", element_id).click()


def set_field(driver, element_id, value):
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(str(value))


def last_answer(driver):
    return driver.execute_script("""var m = document.querySelectorAll('#messages .msg.assistant');
      if (!m.length) return null; var a = m[m.length - 1];
      return {text: a.querySelector('.text').textContent, finish: a.dataset.finish || null,
              meta: (a.querySelector('.meta') || {}).textContent || ''};""")


def ask(driver, question, max_tokens):
    click(driver, "tab-chat")
    set_field(driver, "set-temperature", 0)
    set_field(driver, "set-max-tokens", max_tokens)
    driver.find_element("id", "chat-input").send_keys(question)
    click(driver, "send")


# --------------------------------------------------------------------------- the ring

class Ring:
    def __init__(self, server, workers):
        self.server, self.workers = server, workers
        self.url = server.url


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """starter + board1 + board2 (SmolLM2's 30 layers, 10 each) and the spare board3, all on
    loopback with a shared secret, serving 4 slots."""
    if not os.path.isfile(os.path.join(MODEL, "mdi_config.json")):
        _unavailable("SmolLM2 is not prepared at %s (scripts/setup_env.sh prepares it)" % MODEL)
    env = _env(SECRET)
    http, data, port = free_ports(3), free_ports(4), free_ports(1)[0]
    workers = [WorkerProcess(p, env=env, token=SECRET) for p in http]
    server = None
    try:
        for w in workers:
            w.wait_ready()
        path = write_run_config(tmp_path_factory.mktemp("dashboard") / "ring.yaml", MODEL, workers[:2],
                                data_ports=data, starter_port=port, worker_name="board%d", spares=workers[2:],
                                spare_name="board%d", serve={"max_in_flight": 4, "max_len": 512},
                                runtime={"threads": 1, "ring_timeout": 30, "recovery_attempts": 2})
        server = Server(path, env, SECRET, port).wait_ready()
        yield Ring(server, workers)
    finally:
        code = server.stop() if server is not None else 0
        for w in workers:
            w.stop()
        log = server.output() if server is not None else ""
        assert SECRET not in log, "the secret appears in the server's log"
        assert code == 0, log


class Streams:
    """Streaming chat completions on background threads, hung up on `close()` (which cancels
    them)."""

    def __init__(self, server, prompts, max_tokens):
        self.server, self.closing = server, threading.Event()
        self.tokens = [0] * len(prompts)
        self.finish = [None] * len(prompts)
        self.errors = []
        self.threads = [threading.Thread(target=self._run, args=(i, p, max_tokens), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, i, prompt, max_tokens):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        try:
            with requests.post(self.server.url + "/v1/chat/completions", json=body, headers=self.server.headers,
                               stream=True, timeout=(5, 120)) as r:
                assert r.status_code == 200, r.text
                for line in r.iter_lines():
                    if self.closing.is_set():
                        return
                    if line.startswith(b"data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        self.tokens[i] += 1 if choice["delta"].get("content") else 0
                        self.finish[i] = choice["finish_reason"] or self.finish[i]
        except Exception as e:  # reported by the test
            self.errors.append(e)

    def started(self):
        return all(self.tokens)

    def close(self):
        self.closing.set()
        for t in self.threads:
            t.join(60)


# --------------------------------------------------------------------------- tests

def test_page_routes_and_one_source_of_numbers(ring):
    srv = ring.server
    page = srv.get("/", auth=False)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    csp = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        r = srv.get("/ui/" + name, auth=False)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith(kind), name
        assert SECRET not in r.text and "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")
    assert SECRET not in page.text
    for bad in ("/ui/index.html", "/ui/nothing.js", "/ui/..%2fapi.py", "/ui/%2e%2e/api.py"):
        r = srv.get(bad, auth=False)
        assert r.status_code in (401, 404) and "import" not in r.text, bad  # no route: the token is asked for
    assert srv.get("/v1/mdi/info", auth=False).json() == {"auth": True, "mode": "serve"}
    assert srv.get("/v1/mdi/state", auth=False).status_code == 401
    assert requests.get(srv.url + "/v1/mdi/state", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401

    # One source: at rest, /metrics and /v1/mdi/state show the same numbers.
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                          "temperature": 0}, headers=srv.headers, timeout=60)
    assert r.status_code == 200, r.text
    wait_for("its slot back", lambda: srv.metrics()["mdi_samples_in_flight"] == 0)  # when its last pass returns

    def both_at_rest():  # a worker counts a frame just after sending it on: the two reads may straddle that
        state, m = srv.get("/v1/mdi/state").json(), srv.metrics()
        return all(m['mdi_node_frames_total{node="%s"}' % n["name"]] == n["frames"] and
                   m['mdi_node_sent_bytes_total{node="%s"}' % n["name"]] == n["bytes_sent"]
                   for n in state["nodes"] if n["role"] in ("starter", "worker")) and (state, m)
    state, m = wait_for("/metrics and /v1/mdi/state alike", both_at_rest, 30)
    assert m["mdi_generated_tokens_total"] == state["tokens_total"] >= 4
    assert m["mdi_slots"] == state["slots"] == 4 and m["mdi_samples_in_flight"] == state["in_flight"] == 0
    assert all(m['mdi_requests_total{finish_reason="%s"}' % k] == v for k, v in state["requests"].items())
    assert m["mdi_time_to_first_token_seconds_count"] == state["ttft_count"] >= 1
    ring_nodes = [n for n in state["nodes"] if n["role"] in ("starter", "worker")]
    assert [(n["name"], n["layers"]) for n in ring_nodes] == [("starter", [0, 10]), ("board1", [10, 20]),
                                                              ("board2", [20, 30])]
    for n in ring_nodes:
        assert m['mdi_node_frames_total{node="%s"}' % n["name"]] == n["frames"] > 0
        assert m['mdi_node_sent_bytes_total{node="%s"}' % n["name"]] == n["bytes_sent"] > 0
        assert n["memory_used_bytes"] > 0 and n["memory_limit_bytes"] >= n["memory_used_bytes"]
        assert n["device"] == "cpu" and n["dtype"] == "float32" and n["state"] == "up"
    # a spare's backend is the one it is asked for (its status names its last run's, if any)
    assert [(n["name"], n["state"], n["reachable"], n["backend"]) for n in state["nodes"] if n["role"] == "spare"] == [
        ("board3", "spare", True, os.environ["MDI_BACKEND"])]


def test_without_the_token_the_page_shows_no_data(ring, browser):
    browser.get(ring.url + "/")
    browser.execute_script("sessionStorage.clear();")
    browser.get(ring.url + "/")
    wait_for("the token form", lambda: shown(browser, "login"))
    time.sleep(2.5)  # two polling periods: nothing may arrive meanwhile
    assert not shown(browser, "main") and shown(browser, "login")
    assert browser.execute_script("return document.querySelectorAll('#nodes *, #ring-svg *').length") == 0
    body = browser.find_element("tag name", "body").get_attribute("textContent")
    assert "board1" not in body and "board2" not in body and "smollm2" not in body
    assert text(browser, "s-tokens") == "\u2013"
    assert_no_console_errors(browser)


def test_the_page_shows_the_ring(ring, browser):
    browser.find_element("id", "token-input").send_keys(SECRET)
    click(browser, "token-submit")
    cards = wait_for("three ring nodes and the spare", lambda: len(node_cards(browser)) == 4 and node_cards(browser))
    assert [(c["name"], c["index"], c["state"], c["fields"]["layers"]) for c in cards] == [
        ("starter", "#0", "up", "[0, 10) (10)"), ("board1", "#1", "up", "[10, 20) (10)"),
        ("board2", "#2", "up", "[20, 30) (10)"), ("board3", "\u00b7", "spare", "\u2013")]
    assert all(c["shown"] for c in cards)
    for c in cards[:3]:
        assert c["fields"]["device"] == "cpu" and c["fields"]["dtype"] == "float32"
        assert c["fields"]["backend"] in ("ggml", "torch"), c  # what its layers compute with
        assert {"host", "busy", "compute", "frames/s", "memory", "sent"} <= set(c["fields"]), c
    glyphs = browser.execute_script("return Array.from(document.querySelectorAll('#ring-svg g.ring-node'))"
                                    ".map(function (g) { return g.dataset.node; })")
    assert glyphs == ["starter", "board1", "board2"]
    assert text(browser, "s-slots") == "4" and text(browser, "ring-state") == "up"
    # The secret lives in this tab's sessionStorage only: never in the URL or the page.
    assert browser.execute_script("return sessionStorage.getItem('mdi-token')") == SECRET
    assert SECRET not in browser.current_url and SECRET not in browser.page_source
    assert_no_console_errors(browser)


def test_the_page_shows_speculation_counters(ring, browser):
    """Drafted, accepted, acceptance rate and accepted per pass: the snapshot's and /metrics'
    numbers on the page once a request speculated (dashes before)."""
    srv = ring.server
    before = srv.get("/v1/mdi/state").json().get("speculation") or {}
    if not before.get("drafted"):
        assert text(browser, "s-spec-drafted") == "\u2013" and text(browser, "s-spec-rate") == "\u2013"
    r = requests.post(srv.url + "/v1/completions", headers=srv.headers, timeout=120, json={
        "prompt": "a b c d a b c d a b c d a b c d a b c d", "max_tokens": 24, "temperature": 0,
        "speculation": {"method": "ngram", "ngram_min": 1}})
    assert r.status_code == 200, r.text
    wait_for("its slot back", lambda: srv.metrics()["mdi_samples_in_flight"] == 0)
    spec = srv.get("/v1/mdi/state").json()["speculation"]
    m = srv.metrics()
    assert spec["drafted"] > 0 and m["mdi_speculation_drafted_total"] == spec["drafted"]
    assert m["mdi_speculation_accepted_total"] == spec["accepted"]
    assert m["mdi_speculation_acceptance_ratio"] == pytest.approx(spec["acceptance_rate"])
    # Every counter at once, against the state as it is then: a page snapshot taken while the
    # last verifying pass was still out already shows the final drafted count (counted when
    # sent) beside an older accepted one.
    ids = ("s-spec-drafted", "s-spec-accepted", "s-spec-rate", "s-spec-per-pass", "s-spec-stale", "s-spec-wasted")

    def page_matches_state():
        now = srv.get("/v1/mdi/state").json()["speculation"]
        want = (str(now["drafted"]), str(now["accepted"]), "%.0f%%" % (now["acceptance_rate"] * 100),
                "%.2f" % now["accepted_per_pass"], str(now["passes_stale"]), str(now["rows_wasted"]))
        return tuple(text(browser, i) for i in ids) == want

    wait_for("the counters on the page", page_matches_state, 120)
    assert_no_console_errors(browser)


def test_chat_streams_an_answer(ring, browser):
    # Worded so that the greedy answer keeps a clear lead under every kernel policy: with the
    # system prompt, "What is the capital of France?" opens with "The" 0.09 logits ahead of
    # "L" even with the exact kernels, and `fast` rounding flips it.
    ask(browser, "Name the capital city of France.", 32)
    answer = wait_for("the answer", lambda: (last_answer(browser) or {}).get("finish") and last_answer(browser), 120)
    assert "Paris" in answer["text"] and answer["finish"] == "stop", answer
    assert "tokens/s" in answer["meta"] and "first token" in answer["meta"], answer
    assert_no_console_errors(browser)


def test_stop_cancels_a_long_answer_and_frees_its_slot(ring, browser):
    before = ring.server.metrics()['mdi_requests_total{finish_reason="cancelled"}']
    # A fresh chat (42 prompt tokens) and as long an answer as a 512-position slot takes: the
    # stream must still run after the page's next poll and a screenshot, however fast the box.
    click(browser, "tab-chat")
    click(browser, "clear")
    ask(browser, "Write a long story about a dragon who learns to fly.", 460)
    wait_for("a streamed beginning", lambda: len((last_answer(browser) or {}).get("text", "")) > 150, 120)
    wait_for("the slot in use on the page", lambda: text(browser, "s-inflight") == "1")
    assert last_answer(browser)["finish"] is None  # still streaming
    screenshot(browser, "dashboard-chat.png")
    click(browser, "stop")
    answer = wait_for("the stopped answer", lambda: (last_answer(browser) or {}).get("finish") and last_answer(browser))
    assert answer["finish"] == "stopped" and "stopped" in answer["meta"]
    click(browser, "tab-ring")
    wait_for("the slot free again on the page", lambda: text(browser, "s-inflight") == "0" and browser.execute_script(
        "return document.querySelectorAll('#slots .slot.busy').length === 0"), 30)
    assert shown(browser, "s-inflight")
    m = ring.server.metrics()
    assert m['mdi_requests_total{finish_reason="cancelled"}'] == before + 1 and m["mdi_samples_in_flight"] == 0
    assert_no_console_errors(browser)


# The page's fetch, replaced for one chat request: it records the body and answers with a
# stream that calls a tool (the small model does not call one by itself, and until the
# constrained sampler lands the server refuses response_format json_schema).
MOCK_TOOL_ANSWER = """var original = window.fetch;
window.__sent = null;
window.fetch = function (url, init) {
  if (String(url).indexOf("v1/chat/completions") < 0) return original.apply(this, arguments);
  window.fetch = original;
  window.__sent = JSON.parse(init.body);
  var events = [
    {choices: [{index: 0, delta: {role: "assistant", content: ""}, finish_reason: null}]},
    {choices: [{index: 0, delta: {tool_calls: [{index: 0, id: "call_1", type: "function",
      function: {name: "get_weather", arguments: ""}}]}, finish_reason: null}]},
    {choices: [{index: 0, delta: {tool_calls: [{index: 0, function: {arguments: '{"city": '}}]}, finish_reason: null}]},
    {choices: [{index: 0, delta: {tool_calls: [{index: 0, function: {arguments: '"Paris"}'}}]}, finish_reason: null}]},
    {choices: [{index: 0, delta: {}, finish_reason: "tool_calls"}],
     usage: {prompt_tokens: 5, completion_tokens: 12, total_tokens: 17}}];
  var text = events.map(function (e) { return "data: " + JSON.stringify(e) + "\\n\\n"; }).join("")
    + "data: [DONE]\\n\\n";
  return Promise.resolve(new Response(text, {status: 200, headers: {"Content-Type": "text/event-stream"}}));
};"""


def test_chat_sends_a_json_schema_and_shows_tool_calls(ring, browser):
    click(browser, "tab-chat")
    click(browser, "set-schema-on")
    set_field(browser, "set-schema", "{not json")
    before = browser.execute_script("return document.querySelectorAll('#messages .msg').length")
    browser.find_element("id", "chat-input").send_keys("Weather in Paris?")
    click(browser, "send")
    assert shown(browser, "schema-error") and "not a JSON object" in text(browser, "schema-error")
    assert browser.execute_script("return document.querySelectorAll('#messages .msg').length") == before  # nothing sent
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    set_field(browser, "set-schema", json.dumps(schema))
    browser.execute_script(MOCK_TOOL_ANSWER)
    click(browser, "send")
    answer = wait_for("the mocked answer", lambda: (last_answer(browser) or {}).get("finish") and last_answer(browser))
    assert answer["finish"] == "tool_calls" and not shown(browser, "schema-error")
    sent = browser.execute_script("return window.__sent")
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {"name": "dashboard", "schema": schema,
                                                                                 "strict": False}}
    assert sent["messages"][-1] == {"role": "user", "content": "Weather in Paris?"}
    calls = browser.execute_script("""return Array.from(document.querySelectorAll('#messages .msg.assistant')).pop()
      .querySelectorAll('.tool-call').length ? Array.from(document.querySelectorAll('#messages .msg.assistant')).pop()
      .querySelectorAll('.tool-call')[0].textContent : null""")
    assert calls == 'get_weather{"city": "Paris"}', calls
    click(browser, "set-schema-on")  # off again for the tests after this one
    assert_no_console_errors(browser)


def _no_overflow(driver):
    return driver.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")


def test_dashboard_during_a_run_at_desktop_and_phone_widths(ring, browser):
    streams = Streams(ring.server, ["Write a long story about a lighthouse keeper.",
                                    "Write a long essay on the history of Paris."], 460)
    try:
        wait_for("two streams under way", streams.started, 120)
        click(browser, "tab-ring")
        wait_for("two samples in flight on the page", lambda: text(browser, "s-inflight") == "2", 120)
        wait_for("busy shares on every ring node", lambda: all(
            c["fields"].get("busy", "\u2013") not in ("\u2013", "0%") for c in node_cards(browser)[:3]), 30)
        time.sleep(4)  # a few points on the charts
        screenshot(browser, "dashboard.png")

        viewport(browser, *PHONE)
        time.sleep(1.2)
        width, inner = _no_overflow(browser)
        assert inner == PHONE[0] and width <= inner, (width, inner)
        cards = node_cards(browser)
        assert all(c["shown"] for c in cards) and len(cards) == 4
        for element in ("tab-ring", "tab-chat", "ring-svg", "s-tps", "chart-tps", "recoveries"):
            assert browser.execute_script(
                "var r = document.getElementById(arguments[0]).getBoundingClientRect();"
                "return r.width > 0 && r.left >= 0 && r.right <= window.innerWidth + 0.5;", element), element
        screenshot(browser, "dashboard-phone.png", PHONE, whole=False)
        click(browser, "tab-chat")
        assert shown(browser, "chat-input") and shown(browser, "send") and shown(browser, "set-temperature")
        width, inner = _no_overflow(browser)
        assert width <= inner, (width, inner)
        click(browser, "tab-ring")
    finally:
        viewport(browser, *DESKTOP)
        streams.close()
    assert not streams.errors, streams.errors
    wait_for("no sample in flight", lambda: ring.server.metrics()["mdi_samples_in_flight"] == 0, 120)
    width, inner = _no_overflow(browser)
    assert inner == DESKTOP[0] and width <= inner
    assert_no_console_errors(browser)


def test_a_killed_worker_shows_down_and_the_recovery(ring, browser):
    """SIGKILL board1 while a sample streams: the page shows it down, then the
    spare in its place and the recovery (cause, action, seconds) in the log."""
    click(browser, "tab-ring")
    streams = Streams(ring.server, ["Write a long story about a brave knight."], 460)
    try:
        wait_for("a stream under way", streams.started, 120)
        board1 = ring.workers[0]
        os.kill(board1.proc.pid, signal.SIGKILL)

        def board1_down():
            card = next((c for c in node_cards(browser) if c["name"] == "board1"), None)
            return card is not None and "down" in card["badge"] and card
        wait_for("board1 shown down", board1_down, 120)

        def recovered():
            rows = browser.execute_script("return Array.from(document.querySelectorAll('#recoveries-body tr.recovery'))"
                                          ".map(function (r) { return r.textContent; })")
            cards = {c["name"]: c for c in node_cards(browser)}
            ok = rows and "board1" in rows[0] and "board3" in rows[0] and cards["board3"]["state"] == "up" \
                and cards["board3"]["index"] == "#1" and cards["board3"]["fields"]["layers"] == "[10, 20) (10)"
            return ok and (rows, cards)
        rows, cards = wait_for("the recovery on the page", recovered, 120)
        assert cards["board1"]["state"] == "replaced" and "down" in cards["board1"]["badge"]
        assert "board1" in text(browser, "last-error")
        wait_for("tokens again", lambda: float(text(browser, "s-tps") or 0) > 0, 120)
        screenshot(browser, "dashboard-recovery.png")
    finally:
        streams.close()
    assert not streams.errors, streams.errors
    state = ring.server.get("/v1/mdi/state").json()
    assert len(state["recoveries"]) == 1 and state["recoveries"][0]["seconds"] > 0
    assert ring.server.metrics()["mdi_recoveries_total"] == 1
    assert_no_console_errors(browser)


def test_a_batch_run_shows_the_dashboard(browser, tmp_path):
    if not os.path.isfile(os.path.join(MODEL, "mdi_config.json")):
        _unavailable("SmolLM2 is not prepared at %s" % MODEL)
    port = free_ports(1)[0]
    url = "http://127.0.0.1:%d" % port
    log = open(str(tmp_path / "batch.log"), "w+")
    proc = subprocess.Popen([os.path.join(BIN, "mdi-start"), "--model", MODEL, "--prompt", "Once upon a time",
                             "--n-samples", "2", "--n-tokens", "1500", "--temperature", "0", "--threads", "1",
                             "--dashboard", str(port)], stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        def ready():
            assert proc.poll() is None, open(log.name).read()
            try:
                return requests.get(url + "/health", timeout=2).ok
            except requests.RequestException:
                return False
        wait_for("the batch dashboard", ready, 120)
        assert requests.get(url + "/v1/mdi/info", timeout=10).json() == {"auth": False, "mode": "batch"}
        browser.get(url + "/")
        cards = wait_for("the one node", lambda: node_cards(browser))
        assert [(c["name"], c["state"], c["fields"]["layers"]) for c in cards] == [("starter", "up", "[0, 30) (30)")]
        wait_for("the run generating", lambda: text(browser, "ring-state") == "running" and
                 int(text(browser, "s-tokens") or 0) > 0, 60)
        assert shown(browser, "progress") and text(browser, "s-extra-label") == "samples done"
        assert text(browser, "s-slots") == "2"
        time.sleep(2)
        screenshot(browser, "dashboard-batch.png")
        click(browser, "tab-chat")
        assert shown(browser, "chat-unavailable") and not browser.find_element("id", "send").is_enabled()
        click(browser, "tab-ring")
        assert_no_console_errors(browser)
        browser.get("about:blank")  # before the run ends: its page would lose the connection
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    assert proc.returncode in (0, 128 + signal.SIGTERM), open(log.name).read()


def test_dashboard_flag_errors():
    def start(*args):
        return subprocess.run([os.path.join(BIN, "mdi-start"), "--model", MODEL] + list(args), capture_output=True,
                              text=True, timeout=120, env=_env())
    r = start("--serve", "--dashboard")
    assert r.returncode == 2 and "--dashboard is for batch runs" in r.stderr
    r = start("--prompt", "x", "--port", "9999")
    assert r.returncode == 2 and "--port goes with --serve" in r.stderr
    r = start("--prompt", "x", "--dashboard", "9999", "--host", "0.0.0.0")
    assert r.returncode == 2 and "without a shared secret" in r.stderr


def test_the_page_is_package_data(tmp_path):
    """An installed mdi serves the page: setup.py ships mdi/serving/web/* with the package."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    web = tmp_path / "mdi" / "serving" / "web"
    assert sorted(p.name for p in web.iterdir()) == ["app.js", "favicon.svg", "index.html", "style.css"]


def test_board_memory_comes_from_tegrastats_where_it_runs(tmp_path, monkeypatch):
    """On a Jetson the node's RAM figure is tegrastats' (CPU and GPU share it), read by a
    background reader; elsewhere /proc/meminfo's."""
    from mdi.system import memory, tegra
    line = ("RAM 2040/7854MB (lfb 1027x4MB) SWAP 0/3927MB (cached 0MB) CPU [2%@345,off,off,1%@345] "
            "EMC_FREQ 0%@1866 GR3D_FREQ 0%@114 VDD_IN 2058/2058")
    fake = tmp_path / "tegrastats"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --interval ] || exit 3\nfor i in 1 2 3; do echo '%s'; sleep 0.05; done\n"
                    % line)
    fake.chmod(0o755)
    reader = tegra.TegraStatsReader(interval_ms=50, command=str(fake))
    latest = wait_for("a tegrastats line", reader.latest, 120)
    assert (latest["ram_used_mb"], latest["ram_total_mb"]) == (2040, 7854)
    monkeypatch.setattr(tegra, "shared_reader", lambda: reader)
    assert memory.board_memory() == {"used_bytes": 2040 << 20, "total_bytes": 7854 << 20, "source": "tegrastats"}
    wait_for("the stand-in to exit", lambda: reader.failed, 120)
    monkeypatch.setattr(tegra, "shared_reader", lambda: None)
    off = memory.board_memory()
    assert off["source"] == "meminfo" and 0 < off["used_bytes"] < off["total_bytes"]
    missing = tegra.TegraStatsReader(command=str(tmp_path / "nope"))
    assert wait_for("a failure", lambda: missing.failed, 120).startswith("cannot run") and missing.latest() is None
