"""The dashboard's and /metrics' scrape of the workers' /status (mdi.serving.metrics.NodeScraper)."""
import os
import signal
import time

from conftest import WorkerProcess, free_ports
from mdi.runconfig import NodeSpec
from mdi.serving.metrics import NodeScraper


def stopped(pid, timeout=30.0):
    """Once every thread of `pid` has stopped: SIGSTOP reaches a busy process's threads one by one
    (a scrape sent at once had been answered, in one CI run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError("process %d did not stop in %.0f s" % (pid, timeout))


def test_a_worker_that_stalled_one_scrape_is_shown_up_at_the_next():
    """A failed scrape was kept as long as an answer: a spare that loaded its layers through one
    scrape on a busy board stayed "down" after the ring it joined was reported recovered."""
    worker = WorkerProcess(free_ports(1)[0]).wait_ready()
    node = NodeSpec("board1", port=worker.port)
    scraper = NodeScraper(None, timeout=3.0)  # (a busy machine: the live answers take their time)
    try:
        assert scraper.scrape([node])[node.address][0] is not None
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            stopped(worker.proc.pid)
            scraper._cache.clear()  # (an answer is reused for SCRAPE_TTL: ask now)
            status, problem = scraper.scrape([node])[node.address]
            assert status is None and "no answer within 3 s" in problem
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        status, problem = scraper.scrape([node])[node.address]  # at once, well inside SCRAPE_TTL
        assert status is not None and problem is None and status.state == "idle"
    finally:
        worker.stop()
