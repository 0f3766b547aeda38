"""GET /metrics: an `Observer.snapshot()` (mdi.serving.metrics) in Prometheus' text format."""
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mdi.model.quantization.kernel_report import kernel_counts


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


class _Exposition:
    """Prometheus' text format, one metric family at a time."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def add(self, name: str, kind: str, text: str, samples: List[Tuple[str, Any]]) -> None:
        samples = [(labels, v) for labels, v in samples if v is not None]
        if not samples:
            return
        self.lines.append("# HELP %s %s" % (name, text))
        self.lines.append("# TYPE %s %s" % (name, kind))
        for labels, value in samples:
            if isinstance(value, bool):
                value = int(value)
            self.lines.append("%s%s %s" % (name, labels, repr(float(value)) if isinstance(value, float) else value))

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _counters(out: _Exposition, name: str, values: Dict[str, Any], table: Sequence[Tuple[str, str]]) -> None:
    """One unlabelled counter per (key, help text) of `table`, named `name % key`, from `values`."""
    for key, what in table:
        out.add(name % key, "counter", what, [("", values.get(key, 0))])


def metrics_text(snap: Dict[str, Any]) -> str:
    """A snapshot (`Observer.snapshot`) in Prometheus' text format."""
    ring = [n for n in snap["nodes"] if n["role"] in ("starter", "worker")]

    def per_node(key: str, nodes: Optional[List[Dict[str, Any]]] = None) -> List[Tuple[str, Any]]:
        return [('{node="%s"}' % _label(n["name"]), n.get(key)) for n in (ring if nodes is None else nodes)]

    out = _Exposition()
    out.add("mdi_up", "gauge", "1 while the ring is up and serving.", [("", 1 if snap["serving"] else 0)])
    out.add("mdi_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
            [("", snap["tokens_per_second"])])
    out.add("mdi_generated_tokens_total", "counter", "Tokens generated.", [("", snap["tokens_total"])])
    out.add("mdi_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
            [("", snap["prompt_tokens_total"])])
    out.add("mdi_samples_in_flight", "gauge", "Samples holding a KV cache slot on the ring.", [("", snap["in_flight"])])
    out.add("mdi_slots", "gauge", "Samples in flight at most (KV cache slots per node).", [("", snap["slots"])])
    out.add("mdi_queue_length", "gauge", "Requests waiting for a slot.", [("", snap["queue_length"])])
    out.add("mdi_requests_total", "counter", "Finished requests by finish reason.",
            [('{finish_reason="%s"}' % r, n) for r, n in sorted(snap["requests"].items())])
    out.add("mdi_request_duration_seconds", "summary", "Arrival to last token.",
            [("_sum", snap["latency_sum"]), ("_count", snap["latency_count"])])
    out.add("mdi_time_to_first_token_seconds", "summary", "Arrival to first token.",
            [("_sum", snap["ttft_sum"]), ("_count", snap["ttft_count"])])
    out.add("mdi_time_to_first_token_recent_seconds", "gauge",
            "Mean time to first token of the requests whose first token came in the last 10 s.",
            [("", snap["ttft_recent_seconds"])])
    out.add("mdi_token_interval_seconds", "gauge", "Mean time between two tokens of one sample, over the last 10 s.",
            [("", snap["token_interval_seconds"])])
    out.add("mdi_recoveries_total", "counter", "Times the ring was re-planned after a node failure.",
            [("", len(snap["recoveries"]))])
    out.add("mdi_node_step_seconds", "gauge", "Compute seconds per frame on each node (recent mean; workers "
            "that report compute_seconds).", per_node("step_seconds"))
    out.add("mdi_node_busy_ratio", "gauge", "Share of the last 5 s each node spent computing.", per_node("busy_share"))
    out.add("mdi_node_frames_per_second", "gauge", "Frames each node computed per second (last 5 s).",
            per_node("frames_per_second"))
    out.add("mdi_node_frames_total", "counter", "Frames each node computed.", per_node("frames"))
    out.add("mdi_node_compute_seconds_total", "counter", "Seconds each node spent computing frames.",
            per_node("compute_seconds"))
    out.add("mdi_node_forwards_total", "counter", "Forwards each node ran (one per frame, merged frames once).",
            per_node("forwards"))
    out.add("mdi_node_rows_per_forward", "gauge", "Token rows per forward on each node (mean over the run).",
            per_node("rows_per_forward_mean"))
    out.add("mdi_node_rows_per_forward_max", "gauge", "Most token rows in one forward on each node.",
            per_node("rows_per_forward_max"))
    out.add("mdi_node_samples_per_forward", "gauge", "Samples per forward on each node (mean over the run).",
            per_node("samples_per_forward_mean"))
    out.add("mdi_node_sent_bytes_total", "counter", "Data-plane bytes each node sent.", per_node("bytes_sent"))
    out.add("mdi_node_memory_used_bytes", "gauge", "Memory each node's process holds (RSS, plus CUDA "
            "allocations where it reports them).", per_node("memory_used_bytes"))
    out.add("mdi_node_memory_limit_bytes", "gauge", "Memory each node's process may grow to (--max-memory, "
            "else what it holds plus MemAvailable).", per_node("memory_limit_bytes"))
    _counters(out, "mdi_speculation_%s_total", snap.get("speculation") or {}, (
        ("drafted", "Tokens drafted by speculative decoding whose verdict came back."),
        ("accepted", "Drafted tokens the target accepted."),
        ("verifications", "Passes that came back carrying drafted tokens."),
        ("passes_stale", "Speculative passes that came back after their drafts had failed."),
        ("rows_wasted", "Token rows the ring computed for rejected drafts and stale passes.")))
    _counters(out, "mdi_prefix_cache_%s_total", snap.get("prefix_cache") or {}, (
        ("lookups", "Requests that looked up the prefix cache."),
        ("hits", "Requests that started from positions the prefix cache held."),
        ("misses", "Requests that found nothing to reuse in the prefix cache."),
        ("tokens_reused", "Prompt positions served from the prefix cache instead of computed."),
        ("prompt_tokens", "Prompt positions of the requests that looked the prefix cache up."),
        ("evictions", "Prefix cache entries dropped for room, least recently used first.")))
    _counters(out, "mdi_grammar_%s_total", snap.get("grammar") or {}, (
        ("requests", "Requests whose output a JSON schema, grammar or regex constrained."),
        ("masks", "Token masks those requests' grammars computed (one per token drawn)."),
        ("mask_seconds", "Seconds the starter spent computing those masks.")))
    prefix = snap.get("prefix_cache") or {}
    out.add("mdi_prefix_cache_token_budget", "gauge", "Positions the prefix cache may hold on every node (the tightest "
            "node's budget over its bytes a position).", [("", prefix.get("token_budget"))])
    out.add("mdi_prefix_cache_tokens_held", "gauge", "Positions its entries hold on every node.",
            [("", prefix.get("tokens_held"))])
    out.add("mdi_node_prefix_cache_bytes", "gauge", "Bytes each node's prefix cache holds.",
            per_node("prefix_cache_bytes"))
    out.add("mdi_node_prefix_cache_budget_bytes", "gauge", "Bytes each node could give its prefix cache alone (nodes "
            "on one memory share an auto budget: the index holds mdi_prefix_cache_token_budget positions on each).",
            per_node("prefix_cache_budget_bytes"))
    out.add("mdi_node_prefix_cache_entries", "gauge", "Entries each node's prefix cache holds.",
            per_node("prefix_cache_entries"))
    out.add("mdi_node_prefix_cache_evicted_bytes_total", "counter", "Bytes each node's prefix cache let go.",
            per_node("prefix_cache_bytes_dropped"))
    spec = snap.get("speculation") or {}
    if spec.get("drafted"):
        out.add("mdi_speculation_acceptance_ratio", "gauge", "Drafted tokens accepted, over those drafted.",
                [("", spec.get("acceptance_rate"))])
        out.add("mdi_speculation_accepted_per_pass", "gauge", "Drafted tokens accepted per verifying pass.",
                [("", spec.get("accepted_per_pass"))])
    out.add("mdi_node_passes_cancelled_total", "counter", "Stale speculative passes each worker dropped unrun.",
            per_node("passes_cancelled"))
    out.add("mdi_node_rows_cancelled_total", "counter", "Token rows of the stale passes each worker dropped unrun.",
            per_node("rows_cancelled"))
    out.add("mdi_node_kernel_matrices", "gauge", "Quantized weight matrices each node multiplies with each kernel "
            "(chosen at load by runtime.quant_kernel; /v1/mdi/state says why).",
            [('{node="%s",kernel="%s"}' % (_label(n["name"]), _label(kernel)), count)
             for n in ring for kernel, count in sorted(kernel_counts(n.get("kernels") or {}).items())])
    out.add("mdi_node_backend", "gauge", "1 for what each node computes with (ggml or torch; absent until it chose).",
            [('{node="%s",backend="%s"}' % (_label(n["name"]), _label(n["backend"])), 1)
             for n in ring if n.get("backend")])
    out.add("mdi_node_up", "gauge", "1 when the node answered /status (workers, replaced nodes and spares).",
            per_node("reachable", snap["nodes"]))
    return out.text()
