"""Calls run at once, where the first failure ends the wait.

Start-up asks every node for something slow at the same time (its kernels timed, its weights
loaded): a node that dies meanwhile must end the start-up at once, named, not when the slowest
of the others has answered. The calls run in daemon threads, so those still waiting when one
fails never hold the process (each bounds its own wait: its requests carry timeouts).
"""
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple



def run_all(calls: Sequence[Callable[[], Any]], name: str = "mdi-parallel") -> List[Any]:
    """Each call's result, in order; the first exception any call raises, as soon as it is
    raised (the others are left to end on their own)."""
    results: List[Any] = [None] * len(calls)
    failure: List[Tuple[int, BaseException]] = []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def one(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:
            with lock:
                failure.append((i, e))
        finally:
            done.release()

    threads = [threading.Thread(target=one, args=(i,), name="%s-%d" % (name, i), daemon=True)
               for i in range(len(calls))]
    for t in threads:
        t.start()
    for _ in threads:
        done.acquire()  # one call ended (no timeout: each call bounds its own wait)
        first = _first(failure, lock)
        if first is not None:
            raise first
    return results


def _first(failure: List[Tuple[int, BaseException]], lock: threading.Lock) -> Optional[BaseException]:
    with lock:
        return failure[0][1] if failure else None
