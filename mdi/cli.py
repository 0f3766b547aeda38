"""Command-line entry points: mdi-start, mdi-worker, mdi-prepare and mdi-plan (mdi-bench is mdi.lab.cli).

User errors (bad YAML, missing files, wrong partitions, unreachable nodes) print one line
starting with "mdi: error:" and exit non-zero (2 for configuration errors); no tracebacks.
"""
import argparse
import os
import signal
import sys
import time
from typing import Any, Callable, List, Optional

from mdi.model.layout import CheckpointError
from mdi.model.tokenizers import TokenizerError
from mdi.system.files import write_json
from mdi.runconfig import (ConfigError, GenerationSpec, ModelSpec, NodeSpec, RunConfig, RuntimeSpec, check_quant,
                           load_config)

EXIT_CONFIG = 2
EXIT_RUN = 1


def setup_process(log_level: str = "INFO", log_format: str = "%(message)s", threads: Any = None) -> None:
    """What only an entry point may decide for the whole process: where log messages go,
    which warnings are noise, and how many threads torch uses."""
    import logging
    import warnings
    logging.basicConfig(level=log_level.upper(), format=log_format, stream=sys.stderr)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # Received frames wrap zmq's read-only buffers (mdi/ring/wire.py says why): nothing writes
    # to them, so torch's warning about non-writable tensors does not apply.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    if isinstance(threads, int) and threads > 0:  # "auto" is decided once the model is loaded
        import torch
        torch.set_num_threads(threads)


def _fail(message: str, code: int) -> int:
    print("mdi: error: %s" % message, file=sys.stderr)
    return code


def start_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mdi-start",
        description="Run a model split across the nodes of a YAML config (a one-node config runs "
                    "standalone). Flags override the file.",
        epilog="Example: mdi-start --config configs/ring3.yaml --prompt 'The capital of France is' "
               "--n-tokens 16 --temperature 0")
    p.add_argument("--config", help="run configuration (YAML); see README 'Configuration'")
    p.add_argument("--model", help="model path (prepared mdi dir, HF dir, .gguf or nanoGPT ckpt.pt); "
                                   "overrides model.path")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt; give several times for several samples")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME",
                   help="the LoRA adapter (a name under the config's adapters:) of the prompt at the same "
                        "position; give it once per --prompt, 'base' for none; later prompts run on the base")
    p.add_argument("--n-samples", type=int, help="samples in flight; prompts are repeated to fill them")
    p.add_argument("--n-tokens", type=int, help="tokens to generate per sample (default 100)")
    p.add_argument("--temperature", type=float, help="0 for greedy decoding (default 0.8)")
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, help="run seed; each sample's generator derives from it")
    p.add_argument("--context-shift", action="store_true",
                   help="a sample that reaches the model's context drops the oldest half of its generated "
                        "tokens and goes on (generation.context_shift); without it, it stops there")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights and activations dtype")
    p.add_argument("--compute-dtype", choices=["float32", "float16", "bfloat16"],
                   help="compute in this dtype while storing weights in --dtype (e.g. float16 weights, "
                        "float32 compute on GPUs without fast half arithmetic such as the TX2)")
    add_quant_arguments(p)
    add_kernel_argument(p)
    p.add_argument("--device", help="cpu, cuda or cuda:N for the starter")
    p.add_argument("--threads", type=int, help="torch threads on the starter")
    p.add_argument("--metrics-out", metavar="FILE.json", help="write the run's metrics record here")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    p.add_argument("--check", action="store_true",
                   help="pre-flight check: contact every node and report reachability, version, device, "
                        "free memory and whether its layers and KV cache fit; generates nothing")
    p.add_argument("--serve", action="store_true",
                   help="keep the ring up and serve an OpenAI-compatible HTTP API (POST /v1/completions, "
                        "/v1/chat/completions; GET /v1/models, /metrics) with iteration-level scheduling; "
                        "see the YAML's serve: section")
    p.add_argument("--dashboard", nargs="?", const=0, type=int, metavar="PORT",
                   help="batch run: show the dashboard (the page --serve has at /: the ring, its nodes, "
                        "tokens/s, recoveries) at http://HOST:PORT/ while the run goes on (default port "
                        "serve.port, else the starter node's port)")
    p.add_argument("--host", help="with --serve or --dashboard: address to listen on (default serve.host, "
                                  "127.0.0.1)")
    p.add_argument("--port", type=int, help="with --serve: HTTP port (default serve.port, else the starter "
                                            "node's port)")
    p.add_argument("--insecure", action="store_true",
                   help="with --serve or --dashboard: allow a non-loopback --host without a shared secret")
    p.add_argument("--perplexity", metavar="FILE.txt",
                   help="measure the model's perplexity on this UTF-8 text file instead of generating (as llama.cpp's "
                        "llama-perplexity does: windows of --ppl-ctx tokens, the second half of each scored), "
                        "standalone or over the ring; prints perplexity and tokens/s")
    p.add_argument("--ppl-ctx", type=_positive_int, metavar="N",
                   help="with --perplexity: window length in tokens (default: the model's context, at most 512)")
    p.add_argument("--ppl-max-windows", type=_positive_int, metavar="N",
                   help="with --perplexity: score only the first N windows")
    return p


def _config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.config:
        cfg = load_config(args.config)
    elif args.model:
        cfg = RunConfig(ModelSpec(args.model), [NodeSpec("starter")], GenerationSpec(), RuntimeSpec())
    else:
        raise ConfigError("give --config FILE.yaml or --model PATH")
    if args.model:
        cfg.model.path = args.model
    g = cfg.generation
    for flag, key in (("n_tokens", "n_tokens"), ("temperature", "temperature"), ("top_k", "top_k"),
                      ("top_p", "top_p"), ("seed", "seed")):
        value = getattr(args, flag)
        if value is not None:
            setattr(g, key, value)
    if args.context_shift:
        g.context_shift = True
    if args.dtype:
        cfg.model.dtype = args.dtype
    if args.compute_dtype:
        cfg.model.compute_dtype = args.compute_dtype
    if args.quant:
        cfg.model.quant = args.quant
        for node in cfg.nodes:  # the flag is for the whole ring
            node.quant = None
    if args.group_size:
        cfg.model.group_size = args.group_size
    if args.quant_kernel:
        cfg.runtime.quant_kernel = args.quant_kernel
    check_quant("--quant", cfg.model)
    if args.device:
        cfg.starter.device = args.device
    if args.threads:
        cfg.runtime.threads = args.threads
    from mdi.runconfig import _check_generation
    _check_generation("command line", g)
    return cfg


def start_main(argv: Optional[List[str]] = None) -> int:
    args = start_parser().parse_args(argv)
    from mdi.starter import batch

    def terminate(signum, frame):
        raise batch.Interrupted(signum)

    # SIGTERM (systemd, kill) stops the ring like Ctrl-C: workers are told at once.
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return _start(args, batch)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start(args: argparse.Namespace, batch) -> int:
    from mdi.ring.auth import TokenError, load_token
    try:
        cfg = _config_from_args(args)
        cfg.runtime.token = load_token(cfg.runtime.token_file)
        setup_process(threads=cfg.runtime.threads)
        if args.perplexity is not None:
            return _perplexity(cfg, args)
        if args.ppl_ctx is not None or args.ppl_max_windows is not None:
            raise ConfigError("--ppl-ctx and --ppl-max-windows go with --perplexity FILE")
        if args.check:  # the samples the run would hold, --n-samples and --adapter counted
            from mdi.starter.preflight import preflight
            return preflight(cfg, args.prompt, args.n_samples, args.adapter)
        if args.serve:
            return _serve(cfg, args)
        if args.port is not None:
            raise ConfigError("--port goes with --serve (a batch run's dashboard: --dashboard PORT)")
        if (args.host or args.insecure) and args.dashboard is None:
            raise ConfigError("--host and --insecure go with --serve or --dashboard")
        from mdi.starter.run_shape import expand_prompts
        prompts = expand_prompts(cfg, args.prompt, args.n_samples)
        progress = Progress(len(prompts), cfg.generation.n_tokens) if sys.stderr.isatty() else None
        dashboard = _dashboard(cfg, args, len(prompts)) if args.dashboard is not None else None
        monitor = dashboard.monitor if dashboard is not None else None
        try:
            result = batch.run(cfg, prompts, on_token=_each(progress, monitor.on_token if monitor else None),
                               on_engine=monitor.attach if monitor else None, adapters=args.adapter)
        except BaseException as e:
            if monitor is not None:
                monitor.finished(str(e) or type(e).__name__)
            raise
        finally:
            if progress is not None:
                progress.close()
            if dashboard is not None:
                dashboard.close()
    except (ConfigError, CheckpointError, TokenizerError, TokenError) as e:
        return _fail(str(e), EXIT_CONFIG)
    except batch.RunFailed as e:
        report(e.result, args)  # the partial texts and metrics are not lost
        return _fail(str(e), 128 + e.signum if e.signum else EXIT_RUN)
    except KeyboardInterrupt:
        return _fail("interrupted", 128 + signal.SIGINT)
    except batch.Interrupted as e:
        return _fail("interrupted by %s" % signal.Signals(e.signum).name, 128 + e.signum)
    except RuntimeError as e:
        return _fail(str(e), EXIT_RUN)
    report(result, args)
    return 0


def _dashboard(cfg: RunConfig, args: argparse.Namespace, n_samples: int):
    """A batch run's dashboard (`--dashboard [PORT]`), listening before the run starts."""
    from mdi.serving.api import default_model_id
    from mdi.serving.dashboard import BatchDashboard, BatchMonitor, dashboard_address
    host, port = dashboard_address(cfg, args.dashboard or None, args.host, args.insecure)
    monitor = BatchMonitor(cfg, n_samples, cfg.generation.n_tokens)
    dashboard = BatchDashboard(cfg, monitor, cfg.serve.model_name or default_model_id(cfg.model.path), host, port)
    print("mdi-start: dashboard on %s" % dashboard.url, file=sys.stderr, flush=True)
    return dashboard


def _each(*callbacks):
    """One token callback calling each of `callbacks` that is not None (None if none is)."""
    todo = [c for c in callbacks if c is not None]
    if len(todo) < 2:
        return todo[0] if todo else None

    def each(sample, token: int) -> None:
        for callback in todo:
            callback(sample, token)
    return each


def _serve(cfg: RunConfig, args: argparse.Namespace) -> int:
    if args.dashboard is not None:
        raise ConfigError("--dashboard is for batch runs: --serve shows the dashboard at / on its own port")
    if args.prompt or args.n_samples is not None or args.metrics_out:
        raise ConfigError("--prompt, --n-samples and --metrics-out do not apply to --serve (requests bring "
                          "their own prompts; GET /metrics reports)")
    from mdi.runconfig import check_serve
    if args.host:
        cfg.serve.host = args.host
    if args.port is not None:
        cfg.serve.port = args.port
    check_serve("command line: serve", cfg.serve)
    from mdi.system.memory import limit_malloc_arenas
    limit_malloc_arenas()  # before the HTTP threads: what one request frees, the next reuses (see there)
    from mdi.serving.api import serve
    return serve(cfg, insecure=args.insecure)


def _perplexity(cfg: RunConfig, args: argparse.Namespace) -> int:
    """`--perplexity FILE`: score the file, print perplexity and tokens/s, write --metrics-out."""
    for flag, given in (("--check", args.check), ("--serve", args.serve), ("--dashboard", args.dashboard is not None),
                        ("--prompt", bool(args.prompt)), ("--n-samples", args.n_samples is not None),
                        ("--n-tokens", args.n_tokens is not None)):
        if given:
            raise ConfigError("%s does not go with --perplexity" % flag)
    from mdi.starter import perplexity
    progress = PerplexityProgress() if sys.stderr.isatty() else None
    try:
        result = perplexity.run(cfg, args.perplexity, args.ppl_ctx, args.ppl_max_windows, on_window=progress)
    except perplexity.PerplexityFailed as e:
        if progress is not None:
            progress.close()
        _report_perplexity(e.result, args)  # the windows scored so far are not lost
        return _fail(str(e), 128 + e.signum if e.signum else EXIT_RUN)
    if progress is not None:
        progress.close()
    _report_perplexity(result, args)
    return 0


def _report_perplexity(result, args: argparse.Namespace) -> None:
    if result.n_windows:
        print("mdi: perplexity %.4f over %d windows of %d tokens (%d scored), %.2f s, %.2f tokens/s, %d nodes%s"
              % (result.perplexity, result.n_windows, result.ctx, result.n_scored, result.elapsed,
                 result.tokens_per_s, len(result.nodes), ", partial" if "error" in result.extra else ""),
              flush=True)
    if args.metrics_out:
        write_json(args.metrics_out, result.metrics())


class Progress:
    """One self-overwriting line on a terminal while a batch run generates (on_token callback)."""

    EVERY = 0.25  # seconds between redraws

    def __init__(self, n_samples: int, n_tokens: int) -> None:
        self.total = n_samples * n_tokens
        self.tokens = 0
        self.t0 = self.shown = time.monotonic()

    def __call__(self, sample, token: int) -> None:
        self.tokens += 1
        now = time.monotonic()
        if now - self.shown >= self.EVERY:
            self.shown = now
            rate = self.tokens / max(now - self.t0, 1e-9)
            sys.stderr.write("\rmdi: %d/%d tokens, %.1f tokens/s " % (self.tokens, self.total, rate))
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown > self.t0:  # something was drawn: leave the line clean for what follows
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


class PerplexityProgress(Progress):
    """The progress line of a --perplexity run (its on_window callback)."""

    def __init__(self) -> None:
        super().__init__(0, 0)

    def __call__(self, done: int, total: int, ppl: float, tokens_per_s: float) -> None:  # type: ignore[override]
        now = time.monotonic()
        if now - self.shown >= self.EVERY or done == total:
            self.shown = now
            sys.stderr.write("\rmdi: window %d/%d, perplexity %.4f, %.1f tokens/s " % (done, total, ppl, tokens_per_s))
            sys.stderr.flush()


def report(result, args: argparse.Namespace) -> None:
    if not args.quiet:
        for i, (sample, text) in enumerate(zip(result.samples, result.texts)):
            print("--- sample %d (%d tokens, %s) ---" % (i, len(sample.token_ids), sample.finish_reason or "unfinished"))
            print(sample.prompt + text)
    print(summary_line(result), flush=True)
    kernels = kernels_line(result)
    if kernels and not args.quiet:
        print(kernels, file=sys.stderr)
    note = context_note(result)
    if note:
        print(note, file=sys.stderr)
    if args.metrics_out:
        write_json(args.metrics_out, result.metrics())


def context_note(result) -> Optional[str]:
    """One line when samples stopped at the model's context before their token budget."""
    cut = [s for s in result.samples if s.finish_reason == "context"]
    if not cut:
        return None
    return ("mdi: %d of %d samples stopped at the model's context (%s positions): asked for %d new tokens, got %s; "
            "generation.context_shift: true keeps going with a rolling window"
            % (len(cut), len(result.samples), result.extra.get("context", "?"), cut[0].max_new_tokens,
               "/".join(str(len(s.token_ids)) for s in cut)))


def kernels_line(result) -> Optional[str]:
    """Which kernels each node's quantized layers multiply with (the metrics record has why:
    each candidate's measured time per weight shape); None for a float model."""
    from mdi.model.kernel_choice import summary
    parts = ["%s %s" % (n["name"], summary(n["kernels"])) for n in result.nodes if n.get("kernels")]
    if not parts:
        return None
    return "mdi: quantized kernels (measured per shape, runtime.quant_kernel): " + "; ".join(parts)


def summary_line(result) -> str:
    return ("mdi: %d tokens in %.2f s, %.2f tokens/s, %d samples, %d nodes"
            % (result.n_tokens, result.elapsed, result.tokens_per_s, len(result.samples), len(result.nodes)))


def _arg_type(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse `type=`: `convert`, then `ok`, else argparse's one-line usage error."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError("expected %s, got %r" % (expected, text))
        return value
    return parse


# The OS would take port 80000 modulo 65536 and bind another port.
_tcp_port = _arg_type(int, lambda p: 1 <= p <= 65535, "a TCP port 1-65535")
_positive_int = _arg_type(int, lambda v: v >= 1, "an integer >= 1")
_positive_float = _arg_type(float, lambda v: 0 < v < float("inf"), "a number > 0")  # NaN fails too


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mdi-worker",
        description="Serve one chunk of a model in an mdi ring. Starts blank; the starter sends "
                    "the layer range, neighbours and weights over HTTP. Serves run after run.")
    p.add_argument("--port", type=_tcp_port, default=8081, help="HTTP control port (default 8081); the "
                   "data-plane port is chosen by the starter's config (default port + 1000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--device", help="cpu, cuda or cuda:N; overrides what the starter asks for")
    p.add_argument("--threads", type=_positive_int,
                   help="torch threads for this node; wins over the run's runtime.threads (default: that, "
                        "else torch's default)")
    p.add_argument("--max-memory", type=_positive_float, metavar="GB",
                   help="refuse runs whose KV cache, or pushed weights plus KV cache, would exceed this many "
                        "GB (default: available RAM)")
    p.add_argument("--models-dir", metavar="DIR",
                   help="the only directory whose files a run's weights.path may name (symlinks resolved; "
                        "relative paths are taken from the working directory); default: ./models")
    p.add_argument("--token-file", help="file holding the shared secret required on every request "
                   "(default: $MDI_TOKEN_FILE, else $MDI_TOKEN; never pass the secret itself on the command line)")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening on a non-loopback address without a shared secret")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="DEBUG, INFO, WARNING (default) or ERROR")
    return p


def worker_main(argv: Optional[List[str]] = None) -> int:
    args = worker_parser().parse_args(argv)
    from mdi.system.http_server import HttpServer
    from mdi.worker.app import MAX_BODY_BYTES, admit_headers, create_app
    from mdi.worker.node import Worker
    setup_process(args.log_level, "%(asctime)s %(name)s %(levelname)s %(message)s", args.threads)
    from mdi.system.memory import limit_malloc_arenas
    limit_malloc_arenas()  # before the HTTP server's threads: a board serving run after run stays its size
    max_memory = int(args.max_memory * 1024 ** 3) if args.max_memory else None
    from mdi.ring.auth import TokenError, is_loopback, load_token
    try:
        token = load_token(args.token_file)
    except TokenError as e:
        return _fail(str(e), EXIT_CONFIG)
    if token is None and not args.insecure and not is_loopback(args.host):
        return _fail("refusing to listen on %s without a shared secret: set MDI_TOKEN or --token-file "
                     "(or pass --insecure on a trusted network)" % args.host, EXIT_CONFIG)
    if args.models_dir is not None and not os.path.isdir(args.models_dir):
        return _fail("--models-dir %s is not a directory" % args.models_dir, EXIT_CONFIG)
    worker = Worker(args.host, args.port, args.device, max_memory, token, args.models_dir, args.threads)
    try:
        server = HttpServer(create_app(worker), args.host, args.port, "mdi-http", threads=8, max_connections=128,
                            max_body_bytes=MAX_BODY_BYTES, admit=admit_headers(worker)).start()
    except OSError as e:
        return _fail("cannot listen on %s:%d: %s" % (args.host, args.port, e.strerror or e), EXIT_RUN)
    print("mdi-worker %s listening on http://%s:%d" % (__import__("mdi").__version__, args.host, args.port),
          flush=True)
    try:
        while not worker.shutdown_requested.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    worker.end_run()
    server.close()
    return 0



def prepare_parser() -> argparse.ArgumentParser:
    from mdi.model import prepare
    doc = prepare.__doc__
    p = argparse.ArgumentParser(prog="mdi-prepare", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(doc.split("\n")[2:]))
    p.add_argument("source", help="packaged model name (%s), HF dir, .gguf or nanoGPT ckpt.pt"
                   % ", ".join(prepare.PACKAGED))
    p.add_argument("--out", help="output directory (default models/<name>)")
    p.add_argument("--chunks", action="append", default=[], metavar="N-N-N",
                   help="also cut per-node chunk files for this partition (layer counts); repeatable")
    p.add_argument("--vocab", help="JSON list of characters (character-level nanoGPT models)")
    p.add_argument("--merge-adapter", metavar="PATH",
                   help="merge this LoRA adapter (a PEFT directory or a LoRA GGUF) into the weights before they "
                        "are written (and quantized as --quant says): a model for a ring that serves one task")
    add_quant_arguments(p)
    return p


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    from mdi.model.layout import INT4_GROUPS, QUANT_MODES
    p.add_argument("--quant", choices=QUANT_MODES,
                   help="weights in memory, on disk and on the wire: none (float), int8, int4, or auto (the "
                        "default: a GGUF's own precision class, Q8_0 -> int8, Q4_* -> int4; float stays float)")
    p.add_argument("--group-size", type=_arg_type(int, lambda v: v >= 2, "an integer >= 2"), metavar="G",
                   help="with --quant int8/int4: values sharing one scale (int4: %s, default 32; int8: default "
                        "one scale per output channel)" % "/".join(str(g) for g in INT4_GROUPS))


def add_kernel_argument(p: argparse.ArgumentParser) -> None:
    from mdi.model.qkernels import POLICY_NAMES
    p.add_argument("--quant-kernel", choices=POLICY_NAMES, metavar="POLICY",
                   help="how quantized layers multiply (runtime.quant_kernel): fast (default: the fastest kernel "
                        "measured on each layer's shape here: bfloat16 packed or int8 integer kernels, ~1%% logit "
                        "error), exact (float32 maths only, the same numbers as the dequantized model, several "
                        "times slower), or a kernel: " + ", ".join(POLICY_NAMES[2:]))


def prepare_main(argv: Optional[List[str]] = None) -> int:
    from mdi.model import prepare
    args = prepare_parser().parse_args(argv)
    setup_process()
    name = args.source if args.source in prepare.PACKAGED else os.path.splitext(os.path.basename(args.source.rstrip("/")))[0]
    out = args.out or os.path.join("models", name)
    try:
        prepare.prepare(args.source, out, args.chunks, args.vocab, args.quant or "auto", args.group_size,
                        args.merge_adapter)
    except (CheckpointError, TokenizerError, OSError, ValueError) as e:
        print("mdi-prepare: error: %s" % e, file=sys.stderr)
        return EXIT_CONFIG
    return 0


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mdi-plan",
        description="Split a model's layers over a config's nodes by their measured speed, memory and links: "
                    "every worker times the model's blocks (random weights, nothing of the model is sent), the "
                    "starter its own and the head, all at once, then the split predicted to make the most "
                    "tokens/s for S samples in flight wins (the fastest slowest stage, when S fills the ring). "
                    "A node that would slow the ring gets no layers and is left out, and the plan says why. "
                    "Prints the plan as a table and as YAML; `layers: auto` in a config makes mdi-start plan "
                    "the same way at start.",
        epilog="Example: mdi-plan --config configs/ring3.yaml --samples 6 --write configs/ring3-planned.yaml")
    p.add_argument("--config", required=True, help="run configuration (YAML): its nodes, model and runtime")
    p.add_argument("--samples", type=_positive_int, metavar="S",
                   help="samples in flight to plan for (default: generation.n_samples, else the prompts, else 2 "
                        "per node: enough to keep every node busy)")
    p.add_argument("--max-len", type=_positive_int, metavar="N",
                   help="positions per KV cache slot to budget memory for (default: the longest prompt + "
                        "generation.n_tokens, at most the model's context)")
    p.add_argument("--write", metavar="PLAN.yaml", help="also write the config with the planned layers here")
    p.add_argument("--refresh", action="store_true",
                   help="measure again instead of using the cached profiles ($MDI_PROFILE_CACHE, ~/.cache/mdi)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (for scripts) instead of a table")
    return p


def plan_main(argv: Optional[List[str]] = None) -> int:
    args = plan_parser().parse_args(argv)
    from mdi.model.source import ModelSource
    from mdi.ring.auth import TokenError, load_token
    from mdi.starter.autoplan import apply_plan, plan_ring
    from mdi.starter.control import NodeError
    from mdi.starter.planner import format_plan
    from mdi.starter.run_shape import planning_shape
    try:
        cfg = load_config(args.config)
        cfg.runtime.token = load_token(cfg.runtime.token_file)
        setup_process(threads=cfg.runtime.threads)
        source = ModelSource(cfg.model.path)
        shape = planning_shape(cfg, source, args.samples, args.max_len)
        plan, _ = plan_ring(cfg, source, shape.n_slots, shape.max_len, shape.n_slots, refresh=args.refresh,
                            say=lambda line: print(line, file=sys.stderr, flush=True))
    except (ConfigError, CheckpointError, TokenizerError, TokenError) as e:
        return _fail(str(e), EXIT_CONFIG)
    except NodeError as e:
        return _fail(str(e), EXIT_RUN)
    planned = apply_plan(cfg, plan)
    text = _plan_yaml(args.config, planned, plan)
    if args.json:
        import json
        print(json.dumps(plan.metrics([n.name for n in cfg.nodes]), indent=1))
    else:
        print(format_plan(plan))
        for name, why in plan.dropped.items():
            print("%s: %s" % (name, why))
        print("\n" + text)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
        print("mdi-plan: wrote %s" % args.write, file=sys.stderr)
    return 0


def _plan_yaml(config_path: str, planned: RunConfig, plan) -> str:
    """The user's config file with each kept node's planned layer count and the left-out nodes
    removed (their names in a comment); everything else as they wrote it."""
    import yaml
    from mdi.runconfig import read_yaml
    data = read_yaml(config_path)
    counts = {n.name: n.layers for n in planned.nodes}
    nodes = []
    for i, raw in enumerate(data.get("nodes") or []):
        name = raw.get("name") or ("starter" if i == 0 else "node%d" % i)
        if name in counts:
            nodes.append(dict(raw, layers=counts[name]))
    data["nodes"] = nodes
    head = "# planned by mdi-plan for %d samples in flight: slowest stage %.2f ms, %.1f tokens/s predicted\n" % (
        plan.samples, plan.bottleneck_ms, plan.predicted_tokens_per_s)
    if plan.dropped:
        head += "# left out: %s\n" % ", ".join(sorted(plan.dropped))
    return head + yaml.safe_dump(data, sort_keys=False)


if __name__ == "__main__":
    sys.exit(start_main())
