"""Writing files so that a crash never leaves half of one behind."""
import hashlib
import json
import os
from typing import Any, Optional


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (model files do not fit in memory twice)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def current_umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it, which would
    race with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def use_umask(path: str) -> None:
    """Give a file written by a library that creates it 0600 (safetensors does) the mode any
    new file would get: 0666 less the umask."""
    os.chmod(path, 0o666 & ~current_umask())


def write_json(path: str, obj: Any) -> None:
    """Write `obj` as UTF-8 JSON, whole or not at all (write_text)."""
    write_text(path, json.dumps(obj, ensure_ascii=False, indent=1) + "\n")


def _special(path: str) -> bool:
    """Whether `path` is written through, never renamed over: one there that is neither a file
    nor a folder (its link followed), or one under /dev or /proc (/dev/stdout of a run whose
    output goes to a log file leads to that file: renamed over, the log was lost)."""
    if not os.path.exists(path) or os.path.isdir(path):
        return False
    return not os.path.isfile(path) or os.path.abspath(path).startswith(("/dev/", "/proc/"))


def write_text(path: str, text: str) -> None:
    """Write `text` as UTF-8, its folders made: to a temporary file first, then renamed into
    place (none left where that fails). A link is followed (its target written); what is not a
    file (/dev/null, /dev/stdout, a FIFO) is written to as it is: a rename had replaced the
    system's /dev/null with a plain file when run as root."""
    if _special(path):  # appended: a log file behind /dev/stdout keeps what it holds
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return
    path = os.path.realpath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.isfile(tmp):
            os.unlink(tmp)
        raise


# Linux's limits: a path past them is refused when written, after the run whose result it holds
NAME_MAX, PATH_MAX = 255, 4096


def output_problem(path: str, folder: bool = False) -> Optional[str]:
    """Why `path` cannot be written (a file; with `folder`, a folder to create or fill), asked
    before a run whose result goes there: None where it can."""
    if _special(path):  # /dev/null, /dev/stdout, a FIFO: written as it is
        if folder:
            return "is not a file or folder"
        return None if os.access(path, os.W_OK) else "is not writable"
    real = os.path.realpath(path)  # a link's target is what is written
    if len(os.fsencode(real)) >= PATH_MAX or any(len(os.fsencode(part)) > NAME_MAX for part in real.split(os.sep)):
        return "is too long a path (at most %d bytes a name, %d a path)" % (NAME_MAX, PATH_MAX - 1)
    if os.path.isdir(real) and not folder:
        return "is a directory"
    if os.path.exists(real) and not os.path.isdir(real) and folder:
        return "exists and is not a directory"
    up = os.path.dirname(real) if not os.path.isdir(real) else real
    while not os.path.exists(up):  # the nearest existing folder: makedirs creates the rest
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        return "%s is a file, not a directory" % up
    if not os.access(up, os.W_OK | os.X_OK):
        return "%s is not writable" % up
    return None


def read_json(path: str, error: type = ValueError) -> Any:
    """A JSON file's value, or `error` with one line naming the file: not JSON, not UTF-8, or
    nested past the parser's stack (a model file is input from outside, never a traceback)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error("%s: not valid JSON (%s)" % (path, str(e).splitlines()[0][:300])) from None
    except RecursionError:
        raise error("%s: JSON nested too deeply" % path) from None
