"""POST /v1/mdi/train's body, checked field by field (a 400 naming the field, one line), as the
job it asks for: mdi-train's settings (mdi.cli.train) for a LoRA trained beside serving.

    {"data": PATH, "out": DIR, "name": ADAPTER, "method": "lora", "rank": 8, "alpha": 16,
     "targets": ["q", "k", "v", "o", "gate", "up", "down"] (or "q,v"), "steps": 10,
     "batch_size": 4, "micro_batches": M, "seq_len": 128, "lr": 1e-4, "seed": 0}

`data` and `out` must lie under the folders POST /v1/mdi/adapters loads from (the model's and
the configured adapters' parents): a client may neither read nor write elsewhere on the
starter. `out` must be new or an empty folder, and neither be, lie inside nor hold the model's
or a served adapter's path (`served_files`): the job writes its adapter there at its end.
`name` (optional) is the adapter the trained LoRA is served as once the job is done.
"""
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from mdi.model.adapters.lora_train import TARGETS, check_targets
from mdi.ring.train_request import TrainSetup
from mdi.runconfig import ADAPTER_NAME, BASE_ADAPTER
from mdi.serving.served_files import ServedFiles, where
from mdi.serving.validation import bad_field
from mdi.system.files import output_problem

FIELDS = ("data", "out", "name", "method", "rank", "alpha", "targets", "steps", "batch_size", "micro_batches",
          "seq_len", "lr", "seed")
MAX_STEPS = 1000000
MAX_BATCH = 4096
MAX_RANK = 1024


@dataclass(frozen=True)
class TrainJobSpec:
    """One training job beside serving: what mdi-train's flags would say."""
    data: str  # real path of the training data (text, or JSONL prompt/completion)
    out: str  # real path of the PEFT directory written at the end
    name: Optional[str]  # the adapter it is served as when done (None: only written)
    setup: TrainSetup
    steps: int
    batch_size: int
    micro_batches: int
    seq_len: int
    seed: int


def _int(body: Dict[str, Any], field: str, default: Optional[int], low: int, high: int) -> int:
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_field(field, "expected an integer from %d to %d" % (low, high))
    return value


def _float(body: Dict[str, Any], field: str, default: float, high: float) -> float:
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise bad_field(field, "expected a number above 0 and at most %g" % high)
    return float(value)


def _path(body: Dict[str, Any], field: str, files: ServedFiles) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value or "\0" in value:
        raise bad_field(field, "expected a path (a non-empty string)")
    real = files.under(value)
    if real is None:
        raise bad_field(field, "paths must lie under %s" % where(files.roots))
    return real


NAME_TAKEN = "%r is already served (the model or a loaded adapter)"


def _out(body: Dict[str, Any], files: ServedFiles) -> str:
    """Where the job may write its adapter: never over served files, never over anything at all."""
    out = _path(body, "out", files)
    problem = out_problem(out, files)
    if problem is not None:
        raise bad_field("out", problem)
    return out


def out_problem(out: str, files: ServedFiles) -> Optional[str]:
    """Why a job may not write its adapter to `out` (None: it may). Asked when the request
    comes, again as the job starts and once more before it writes (TrainJob._finish): another
    job may have written there meanwhile (h67: a second job rewrote the adapter the first one
    served)."""
    shown = files.shown(out)
    clash = files.clash(out)
    if clash is not None:
        return "%s %s: training must not write over served files" % (shown, clash)
    if os.path.exists(out) and not os.path.isdir(out):
        return "%s exists and is not a directory" % shown
    if os.path.isdir(out) and os.listdir(out):
        return "%s already holds files: name a new or empty folder" % shown
    problem = output_problem(out, folder=True)  # under a file, too long: found before the job, not after it
    return None if problem is None else "%s: %s" % (shown, files.scrub(problem))  # (it may name a path itself)


def _targets(value: Any) -> List[str]:
    if isinstance(value, str):
        value = [t.strip() for t in value.split(",") if t.strip()]
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise bad_field("targets", "expected a list of %s (or one comma-separated string)" % ",".join(TARGETS))
    return value


def parse_train_body(body: Dict[str, Any], files: ServedFiles, n_nodes: int, max_seq_len: int,
                     taken_names: Sequence[str]) -> TrainJobSpec:
    """The job `body` asks for; ApiError 400 naming the first bad field. `files`: where data and
    out may lie, and what out must not touch; `taken_names`: names a new adapter may not have
    (the model's, those loaded)."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise bad_field(unknown[0], "unknown field (expected some of %s)" % ", ".join(FIELDS))
    data = _path(body, "data", files)
    if not os.path.isfile(data):
        raise bad_field("data", "no such file: %s" % files.shown(data))
    out = _out(body, files)
    name = body.get("name")
    if name is not None:
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name) or name == BASE_ADAPTER:
            raise bad_field("name", "letters, digits, '_', '.' or '-' (at most 64), not 'base'")
        if name in taken_names:
            raise bad_field("name", NAME_TAKEN % name)
    method = body.get("method", "lora")
    if method != "lora":
        raise bad_field("method", "only \"lora\" trains beside serving (prompt tuning: not yet)")
    rank = _int(body, "rank", 8, 1, MAX_RANK)
    alpha = _float(body, "alpha", 16.0, 1e6)
    try:
        targets = check_targets(_targets(body.get("targets", list(TARGETS))))
    except ValueError as e:
        raise bad_field("targets", str(e).replace("--targets: ", ""))
    steps = _int(body, "steps", 10, 1, MAX_STEPS)
    batch = _int(body, "batch_size", 4, 1, MAX_BATCH)
    micro = _int(body, "micro_batches", min(n_nodes, batch), 1, batch)
    seq_len = _int(body, "seq_len", min(128, max_seq_len), 2, max_seq_len)
    lr = _float(body, "lr", 1e-4, 10.0)
    seed = _int(body, "seed", 0, 0, 2 ** 63 - 1)
    setup = TrainSetup(targets=targets, rank=rank, alpha=alpha, lr=lr)
    return TrainJobSpec(data, out, name, setup, steps, batch, micro, seq_len, seed)
