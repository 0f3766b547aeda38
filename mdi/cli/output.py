"""What a finished run prints (its samples, the summary line, notes on stderr) and writes
(--metrics-out)."""
import argparse
import sys
from typing import Optional, Sequence

from mdi.cli.process import EXIT_CONFIG, EXIT_RUN, fail
from mdi.runconfig import ConfigError
from mdi.system.files import output_problem, write_json


def write_metrics(result, args: argparse.Namespace) -> int:
    """--metrics-out written (0), or its one error line (EXIT_CONFIG): checked before the run
    (`check_output`), a disk can still fill or a folder go away meanwhile."""
    if not args.metrics_out:
        return 0
    try:
        write_json(args.metrics_out, result.metrics())
    except OSError as e:
        return fail("--metrics-out %s: cannot write it: %s" % (args.metrics_out, e.strerror or e), EXIT_CONFIG)
    return 0


def write_start_failure(args: argparse.Namespace, prompts: Sequence[str], error: BaseException, seconds: float) -> None:
    """--metrics-out of a run whose ring never started (a node down or refusing): its prompts, the
    error and the stage, as the record of a run that failed later says them (best effort: the
    error line that follows is what counts)."""
    if not args.metrics_out:
        return
    record = {"samples": [{"prompt": p, "token_ids": [], "text": "", "finish_reason": None} for p in prompts],
              "n_tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0, "n_nodes": 0, "nodes": [],
              "error": str(error) or type(error).__name__, "stage": "start-up", "startup_seconds": round(seconds, 3)}
    try:
        write_json(args.metrics_out, record)
    except OSError as e:
        print("mdi: --metrics-out %s: cannot write it: %s" % (args.metrics_out, e.strerror or e), file=sys.stderr)


def check_output(path: Optional[str], flag: str, folder: bool = False) -> None:
    """ConfigError, before any work, where `path` (a flag's file or folder) cannot be written."""
    problem = output_problem(path, folder) if path else None
    if problem is not None:
        raise ConfigError("%s %s: %s" % (flag, path, problem))


def report(result, args: argparse.Namespace) -> int:
    if not args.quiet:
        for i, (sample, text) in enumerate(zip(result.samples, result.texts)):
            print("--- sample %d (%d tokens, %s) ---" % (i, len(sample.token_ids), sample.finish_reason or "unfinished"))
            print(sample.prompt + text)
    print(summary_line(result), flush=True)
    node_lines(result, args)
    for note in (speculation_line(result), context_note(result)):
        if note:
            print(note, file=sys.stderr)
    return write_metrics(result, args)


def judge_samples(result, code: int) -> int:
    """A finished run's exit: `code` (its report's), else EXIT_RUN with one line where samples
    failed (their texts so far are printed and recorded: the run still failed)."""
    failed = [s for s in result.samples if s.finish_reason == "error"]
    if not failed:
        return code
    fail("%d of %d samples failed (%s)" % (len(failed), len(result.samples), failed[0].error), EXIT_RUN)
    return code or EXIT_RUN  # (a record that could not be written: its own code, said above)


def node_lines(result, args: argparse.Namespace) -> None:
    """The nodes' backends and kernels on stderr, after a run that did not fail: a failed run's
    one line there is its error."""
    if args.quiet or "error" in result.extra:
        return
    for line in (backends_line(result), kernels_line(result)):
        if line:
            print(line, file=sys.stderr)


def backends_line(result) -> Optional[str]:
    """What each node computed with (mdi.model.backend): "mdi: backends: starter ggml, w1 torch"."""
    named = ["%s %s" % (n.name, n.backend) for n in result.nodes if getattr(n, "backend", None)]
    return "mdi: backends: %s" % ", ".join(named) if named else None


def context_note(result) -> Optional[str]:
    """One line when samples stopped at the model's context before their token budget."""
    from mdi.starter.sample import FinishReason
    cut = [s for s in result.samples if s.finish_reason == FinishReason.CONTEXT]
    if not cut:
        return None
    return ("mdi: %d of %d samples stopped at the model's context (%s positions): asked for %d new tokens, got %s; "
            "generation.context_shift: true keeps going with a rolling window"
            % (len(cut), len(result.samples), result.extra.get("context", "?"), cut[0].max_new_tokens,
               "/".join(str(len(s.token_ids)) for s in cut)))


def speculation_line(result) -> Optional[str]:
    """What speculation did (drafted, accepted, per pass, stale passes); None when it was off."""
    spec = result.nodes[0].speculation if result.nodes else {}
    if not spec:
        return None
    if not spec["drafted"]:
        if len(result.samples) > len(result.nodes):
            return ("mdi: speculation: nothing drafted (%d samples on %d nodes: while samples outnumber nodes, plain "
                    "decoding and batching fill the ring)" % (len(result.samples), len(result.nodes)))
        return "mdi: speculation: nothing drafted (no n-gram of the output recurred, or drafts did not pay here)"
    return ("mdi: speculation: %d tokens drafted, %d accepted (%.0f%%), %.2f accepted per verifying pass, "
            "%d stale passes, %d rows computed for nothing"
            % (spec["drafted"], spec["accepted"], 100 * spec["acceptance_rate"], spec["accepted_per_pass"],
               spec["passes_stale"], spec["rows_wasted"]))


def kernels_line(result) -> Optional[str]:
    """Which kernels each node's quantized layers multiply with (the metrics record has why:
    each candidate's measured time per weight shape); None for a float model."""
    from mdi.model.quantization.kernel_report import summary
    parts = ["%s %s" % (n.name, summary(n.kernels)) for n in result.nodes if n.kernels]
    if not parts:
        return None
    return ("mdi: quantized kernels (xN: weight matrices; chosen at load by runtime.quant_kernel, why in the metrics "
            "record): " + "; ".join(parts))


def summary_line(result) -> str:
    return ("mdi: %d tokens in %.2f s, %.2f tokens/s, %d samples, %d nodes"
            % (result.n_tokens, result.elapsed, result.tokens_per_s, len(result.samples), len(result.nodes)))


def report_perplexity(result, args: argparse.Namespace) -> int:
    if result.n_windows:
        # The backend scored too: its bits differ, and `auto` may choose another for a ring than alone.
        backends = sorted({n.backend for n in result.nodes if getattr(n, "backend", None)})
        print("mdi: perplexity %.4f over %d windows of %d tokens (%d scored), %.2f s, %.2f tokens/s, %d nodes%s%s"
              % (result.perplexity, result.n_windows, result.ctx, result.n_scored, result.elapsed,
                 result.tokens_per_s, len(result.nodes), " on " + "+".join(backends) if backends else "",
                 ", partial" if "error" in result.extra else ""), flush=True)
    node_lines(result, args)
    return write_metrics(result, args)
