"""generation.speculation (and --speculation, and a served request's `speculation`): which
drafter, its sizes, and the one parser every place that takes the setting uses."""
from dataclasses import dataclass
from typing import Any, Optional

from mdi.model.layout import quant_mode_problem
from mdi.runconfig.checks import ConfigError, check_keys

SPECULATION_METHODS = ("off", "ngram", "draft")
MAX_DRAFT_LIMIT = 32  # drafted tokens per pass: beyond this a pass costs more than it can win


@dataclass
class SpeculationSpec:
    """Speculative decoding (mdi.starter.speculation): the starter drafts tokens, every pass
    verifies them in the ring, and the output is exactly the plain run's (greedy) or has its
    distribution (sampling)."""
    method: str = "off"  # off | ngram (prompt lookup over the sample's own prompt and output) | draft (a model)
    max_draft: int = 8  # drafted tokens per pass, at most (adapted to the measured acceptance)
    ngram_min: int = 2  # the shortest n-gram looked up; the longest is tried first
    ngram_max: int = 4
    fill: bool = True  # keep idle boards busy with passes built on drafts still being verified
    # method draft (mdi.starter.speculation.draft_model): the draft model's path (prepared dir, HF dir or
    # GGUF), and its quantization (None: model.quant). A request's spec never names a path: its
    # `draft` is None and means the server's configured draft model.
    draft: Optional[str] = None
    quant: Optional[str] = None

    @property
    def on(self) -> bool:
        return self.method != "off"


def parse_speculation(where: str, raw: Any, paths: bool = False) -> SpeculationSpec:
    """`off`, `ngram`, `draft`, `draft:PATH`, or a mapping of SpeculationSpec's fields (`{draft:
    PATH}` implies method draft); one ConfigError line naming `where`. YAML reads a bare `off` as
    false and `on` as true: they mean off and ngram. Only a run's own settings (`paths`: its
    config file, its flags) may name a draft model's file: a served request's may only say
    `draft`, the server's own draft model, so no request can make the server read a file."""
    if raw is None or isinstance(raw, bool):
        raw = {"method": "ngram" if raw else "off"}
    if isinstance(raw, str):
        method, colon, path = raw.partition(":")
        raw = {"method": method, "draft": path} if colon and method == "draft" else {"method": raw}
    if isinstance(raw, dict) and "method" not in raw and raw.get("draft") is not None:
        raw = dict(raw, method="draft")
    elif isinstance(raw, dict) and raw and "method" not in raw:  # ({max_draft: 4} had turned speculation off)
        raise ConfigError("%s.method: needed beside %s (off, ngram or draft)" % (where, ", ".join(sorted(raw))))
    spec = SpeculationSpec(**check_keys(where, raw, {"method": (str,), "max_draft": (int,), "ngram_min": (int,),
                                                     "ngram_max": (int,), "fill": (bool,), "draft": (str,),
                                                     "quant": (str,)}))
    if spec.method not in SPECULATION_METHODS:
        raise ConfigError("%s.method: expected one of %s, got %r" % (where, ", ".join(SPECULATION_METHODS), spec.method))
    if spec.method != "draft":
        for key in ("draft", "quant"):
            if key in raw:
                raise ConfigError("%s: unknown key %r for method %s (a draft model's setting: method draft)"
                                  % (where, key, spec.method))
    elif not paths:
        for key in ("draft", "quant"):
            if raw.get(key) is not None:
                raise ConfigError("%s.%s: a request cannot name a draft model's file or quantization; say "
                                  "\"draft\" for the server's own draft model" % (where, key))
    elif not spec.draft:
        raise ConfigError("%s.draft: method draft needs the draft model's path (draft: PATH)" % where)
    problem = quant_mode_problem(spec.quant) if spec.quant is not None else None
    if problem is not None:
        raise ConfigError("%s.quant: %s" % (where, problem))
    if not 1 <= spec.max_draft <= MAX_DRAFT_LIMIT:
        raise ConfigError("%s.max_draft: expected an integer in [1, %d], got %d" % (where, MAX_DRAFT_LIMIT, spec.max_draft))
    if not 1 <= spec.ngram_min <= spec.ngram_max <= 16:
        raise ConfigError("%s: expected 1 <= ngram_min <= ngram_max <= 16, got %d and %d"
                          % (where, spec.ngram_min, spec.ngram_max))
    return spec
