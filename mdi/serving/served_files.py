"""The files `--serve` reads its model and adapters from, and where clients may point it.

Clients name paths (POST /v1/mdi/adapters' `path`, POST /v1/mdi/train's `data` and `out`)
only under the models folders: the parents of the model and of the configured adapters. A
training job writes `out` at its end, so `out` must never be, lie inside or contain a folder
the server serves from (the model's, a configured or loaded adapter's): a job would overwrite
weights that requests are using. Paths go back to clients relative to the models folder that
holds them: an API error never shows the server's own layout.
"""
import os
import re
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence


@dataclass(frozen=True)
class ServedPath:
    """A file or folder the server serves from."""
    what: str  # "the model", "adapter 'mine'"
    real: str  # its real path (links followed)


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


class ServedFiles:
    """The models folders and the served paths under them (thread-safe: HTTP threads add)."""

    def __init__(self, model_path: str, adapters: Dict[str, str]) -> None:
        model = os.path.realpath(model_path)
        paths = {name: os.path.realpath(p) for name, p in adapters.items()}
        self.roots = sorted({os.path.dirname(p) for p in [model] + list(paths.values())})
        # The folders as the config spells them too (a link followed above): a loader's message
        # may name a file either way.
        spelled = [os.path.abspath(p) for p in [model_path] + list(adapters.values())]
        self._spellings = sorted(set(self.roots) | {os.path.dirname(p) for p in spelled}, key=len, reverse=True)
        self._served = [ServedPath("the model", model)] + [ServedPath("adapter %r" % n, p) for n, p in paths.items()]
        self._lock = threading.Lock()

    def add(self, name: str, path: str) -> None:
        """An adapter loaded at run time (POST /v1/mdi/adapters, a finished training job). It stays
        protected once unloaded: its files are still someone's."""
        with self._lock:
            self._served.append(ServedPath("adapter %r" % name, os.path.realpath(path)))

    def served(self) -> List[ServedPath]:
        with self._lock:
            return list(self._served)

    def under(self, path: str) -> Optional[str]:
        """`path`'s real path, or None when it lies outside every models folder. No NUL in `path`."""
        real = os.path.realpath(path)
        return real if any(_inside(real, root) for root in self.roots) else None

    def shown(self, real: str) -> str:
        """`real` as a client may see it: relative to the models folder holding it ('.' for the
        folder itself); a path outside them all is shown by its name only."""
        for root in sorted(self.roots, key=len, reverse=True):
            if _inside(real, root):
                return os.path.relpath(real, root)
        return os.path.basename(real) or "."

    def scrub(self, text: str) -> str:
        """`text` (an error message for a client) with each models folder's path taken out of
        the paths under it, and the folder itself shown as '.': loaders name the files they read
        by their full paths, and those would show the server's own layout."""
        for root in self._spellings:
            if root == os.sep:
                continue
            start = r"(?<![\w.\-/])" + re.escape(root)
            text = re.sub(start + re.escape(os.sep) + r"(?=[^\s/])", "", text)
            text = re.sub(start + r"(?![\w\-/]|\.[\w\-/])", ".", text)  # "in /models." ends a sentence
        return text

    def clash(self, real: str) -> Optional[str]:
        """Why writing into folder `real` would overwrite served files (one phrase), or None."""
        for served in self.served():
            if real == served.real:
                return "is %s's own path" % served.what
            if _inside(real, served.real):
                return "lies inside %s's folder (%s)" % (served.what, self.shown(served.real))
            if _inside(served.real, real):
                return "holds %s (%s)" % (served.what, self.shown(served.real))
        return None


def where(roots: Sequence[str]) -> str:
    """What a client is told about where its paths may lie, without the server's own paths."""
    return ("the models folder (beside the model and its configured adapters)" if len(roots) == 1
            else "the models folders (beside the model and its configured adapters)")
