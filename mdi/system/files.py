"""Writing files so that a crash never leaves half of one behind."""
import json
import os
from typing import Any


def write_json(path: str, obj: Any) -> None:
    """Write `obj` as UTF-8 JSON: to a temporary file first, then renamed into place."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    os.replace(tmp, path)
