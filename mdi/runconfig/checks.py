"""The run YAML's one error type and its mapping check (key names and value types), shared by
every section's parser and by mdi-bench's experiment files."""
import math
from typing import Any, Dict, Literal, Mapping, Union

# A setting that is a number or "auto" (a node, the planner or the ring works it out): the parsed
# value keeps the string "auto" itself, as the YAML, the CLI and /init have always carried it.
IntOrAuto = Union[int, Literal["auto"]]


class ConfigError(ValueError):
    """A bad setting: the message names the file or flag, the key and what was expected."""


class FileRoot(str):
    """A file's name as the `where` of its top-level mapping: its keys are said "file.yaml: key",
    as a section's are "file.yaml: model.path" (not "file.yaml.key")."""


def key_path(where: str, key: str) -> str:
    """How an error names `key` of the mapping at `where`."""
    return "%s: %s" % (where, key) if isinstance(where, FileRoot) else "%s.%s" % (where, key)


def check_keys(where: str, data: Any, allowed: Mapping[str, Any], required=(),
               error: type = ConfigError) -> Dict[str, Any]:
    """A YAML mapping's keys and value types checked against `allowed` (key -> accepted types);
    every error names `where` and the key. mdi-bench's experiment files use it too (`error`)."""
    if not isinstance(data, dict):
        raise error("%s: expected a mapping, got %s" % (where, type(data).__name__))
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise error("%s: unknown key %r (expected one of: %s)" % (where, unknown[0], ", ".join(sorted(allowed))))
    for key in required:
        if key not in data or data[key] is None:
            raise error("%s: required key is missing" % key_path(where, key))
    out = {}
    for key, value in data.items():
        kinds = allowed[key]
        if value is None:
            continue
        if isinstance(value, bool) and bool not in kinds:
            raise error("%s: expected %s, got a boolean" % (key_path(where, key), _names(kinds)))
        if not isinstance(value, kinds):
            raise error("%s: expected %s, got %r" % (key_path(where, key), _names(kinds), value))
        if isinstance(value, float) and not math.isfinite(value):  # YAML's .nan / .inf pass any comparison's test
            raise error("%s: expected a finite number, got %r" % (key_path(where, key), value))
        out[key] = value
    return out


def _names(kinds) -> str:
    return " or ".join({int: "an integer", float: "a number", str: "a string", list: "a list",
                        bool: "true/false", dict: "a mapping"}[k] for k in kinds)
