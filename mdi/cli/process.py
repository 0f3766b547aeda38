"""What the entry points share about the process they run in: its set-up and how it exits
(exit codes, the one "mdi: error:" line)."""
import signal
import sys
from typing import Any, Callable

EXIT_CONFIG = 2
EXIT_RUN = 1


def setup_process(log_level: str = "INFO", log_format: str = "%(message)s", threads: Any = None) -> None:
    """What only an entry point may decide for the whole process: where log messages go,
    which warnings are noise, how many threads torch uses, and malloc's thresholds."""
    import logging
    import warnings

    from mdi.system.memory import fix_malloc_thresholds
    fix_malloc_thresholds()  # before the first large block (mdi.system.memory says why)
    logging.basicConfig(level=log_level.upper(), format=log_format, stream=sys.stderr)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # Received frames wrap zmq's read-only buffers (mdi/ring/wire.py says why): nothing writes
    # to them, so torch's warning about non-writable tensors does not apply.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    if isinstance(threads, int):  # "auto" is decided once the model is loaded
        from mdi.model.threads import use_fixed
        use_fixed(threads)


def fail(message: str, code: int) -> int:
    """The one "mdi: error:" line on stderr; returns `code` for the entry point to exit with."""
    print("mdi: error: %s" % message, file=sys.stderr)
    return code


def stopped(e: BaseException) -> int:
    """The "mdi: error:" line and exit code of a run stopped by Ctrl-C (KeyboardInterrupt) or by
    a signal (the exception interrupt_on_sigterm raises, which carries its `signum`)."""
    signum = getattr(e, "signum", None)
    if isinstance(e, KeyboardInterrupt) or not signum:
        return fail("interrupted", 128 + signal.SIGINT)
    return fail("interrupted by %s" % signal.Signals(signum).name, 128 + signum)


def interrupt_on_sigterm(interrupted: Callable[[int], BaseException], also_sighup: bool = False) -> Any:
    """Make SIGTERM (systemd, kill, timeout; with `also_sighup` SIGHUP too) raise
    `interrupted(signum)` in the main thread, as Ctrl-C raises KeyboardInterrupt, so a run
    stops its ring at once; returns the SIGTERM handler it replaced (for
    signal.signal(signal.SIGTERM, it) when the run is over). SIGHUP is left alone where it is
    ignored (`nohup mdi-start ...`: a closed terminal must not end that run)."""
    def terminate(signum: int, frame: Any) -> None:
        raise interrupted(signum)

    if also_sighup and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, terminate)
    return signal.signal(signal.SIGTERM, terminate)
