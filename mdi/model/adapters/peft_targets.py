"""Which modules a PEFT adapter_config.json targets, and their rank / alpha patterns, with the
config's regexes run where a hostile one cannot freeze the caller.

PEFT's config holds regexes (`target_modules` or `exclude_modules` as a string, the keys of
`rank_pattern` / `alpha_pattern`, `layers_pattern`) that Python's `re` matches by backtracking,
holding the GIL: a 9 s match froze a serving starter until its workers dropped the run, and a
longer pattern freezes it for ever. So when a config has any, they are matched against every
module name at once in a child Python process (this module, run with -m: it imports nothing
heavy) that is killed after `MATCH_TIMEOUT_S`, and patterns are bounded in length. A config of
plain module names is matched here. The rules are PEFT's (peft.tuners.tuners_utils
check_target_module_exists, peft.utils.other.get_pattern_key).
"""
import json
import re
import subprocess
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

MATCH_TIMEOUT_S = 10.0
MAX_PATTERN_CHARS = 1000
Match = Tuple[bool, str, str]  # (targeted, rank_pattern key, alpha_pattern key)


class PatternError(ValueError):
    """adapter_config.json's patterns are too long, not regexes, or took too long to match."""


def get_pattern_key(pattern_keys: Sequence[str], key: str) -> str:
    """PEFT's rule for rank_pattern / alpha_pattern (peft.utils.other.get_pattern_key): the
    first pattern that, as a regex, matches the end of the module name at a dot boundary."""
    for pattern in pattern_keys:
        if re.match(r"(.*\.)?(%s)$" % pattern, key):
            return pattern
    return key


def _layer_of(key: str, layers_pattern: Any) -> Optional[int]:
    """PEFT's layer index of a module name (first numbered segment, or after layers_pattern)."""
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            m = re.match(r"(?:^|.*?\.)%s\.(?P<idx>\d+)\." % pattern, key)
            if m is not None:
                break
    return int(m.group("idx")) if m is not None else None


def is_targeted(cfg: Mapping, key: str) -> bool:
    """PEFT's check_target_module_exists for the keys we read: exclude_modules, target_modules
    (a regex matched in full, or names matched as the module name or its dotted suffix) and
    layers_to_transform / layers_pattern."""
    exclude = cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith("." + e) for e in exclude):
            return False
    targets = cfg.get("target_modules")
    if targets == "all-linear":  # peft expands it before saving; the blocks' linears are what it covers
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    targets = targets or []
    if key in targets:
        return True  # named in full: layers_to_transform does not apply (as in PEFT)
    if not any(key.endswith("." + t) for t in targets):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    layers = [layers] if isinstance(layers, int) else layers
    return _layer_of(key, cfg.get("layers_pattern")) in layers


def _patterns(cfg: Mapping) -> List[str]:
    """The regexes of `cfg` (what PEFT matches as a regex)."""
    out = [v for k in ("target_modules", "exclude_modules") for v in [cfg.get(k)] if isinstance(v, str)
           and v != "all-linear"]
    for k in ("rank_pattern", "alpha_pattern"):
        out += list(cfg.get(k) or {})
    layers_pattern = cfg.get("layers_pattern")
    out += [layers_pattern] if isinstance(layers_pattern, str) else list(layers_pattern or [])
    return out


def resolve(cfg: Mapping, modules: Sequence[str]) -> Dict[str, Match]:
    """Each module name -> (targeted, rank_pattern key, alpha_pattern key), in this process."""
    ranks, alphas = list(cfg.get("rank_pattern") or {}), list(cfg.get("alpha_pattern") or {})
    return {m: (is_targeted(cfg, m), get_pattern_key(ranks, m), get_pattern_key(alphas, m)) for m in modules}


def resolve_bounded(cfg: Mapping, modules: Sequence[str], timeout: Optional[float] = None) -> Dict[str, Match]:
    """`resolve`, with the config's regexes (if any) checked and run in a child process that
    is killed after `timeout` seconds (default MATCH_TIMEOUT_S). PatternError says which bound
    was passed."""
    timeout = MATCH_TIMEOUT_S if timeout is None else timeout
    patterns = _patterns(cfg)
    if not patterns:
        return resolve(cfg, modules)
    for p in patterns:
        if not isinstance(p, str) or len(p) > MAX_PATTERN_CHARS:
            raise PatternError("a pattern of adapter_config.json is not a string of at most %d characters: %.80r"
                               % (MAX_PATTERN_CHARS, p))
        try:
            re.compile(p)
        except re.error as e:
            raise PatternError("adapter_config.json: %.80r is not a regular expression (%s)" % (p, e))
    keys = ("target_modules", "exclude_modules", "rank_pattern", "alpha_pattern", "layers_pattern",
            "layers_to_transform")
    request = json.dumps({"cfg": {k: cfg.get(k) for k in keys}, "modules": list(modules)})
    try:
        done = subprocess.run([sys.executable, "-m", __name__], input=request, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PatternError("adapter_config.json's patterns took more than %.0f s to match %d module names "
                           "(a pattern that backtracks without end?)" % (timeout, len(modules)))
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise PatternError("matching adapter_config.json's patterns failed: %s" % (lines[-1] if lines else done.returncode))
    return {m: (bool(t), r, a) for m, (t, r, a) in json.loads(done.stdout).items()}


if __name__ == "__main__":  # the child of resolve_bounded: JSON in, JSON out
    _request = json.load(sys.stdin)
    json.dump(resolve(_request["cfg"], _request["modules"]), sys.stdout)
