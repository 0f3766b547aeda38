"""mdi-start: run a model split across the nodes of a YAML config (batch, --serve, --check,
--perplexity)."""
import argparse
import signal
import sys
import time
from typing import List, Optional

from mdi.cli.arguments import (ArgumentParser, add_kernel_argument, add_quant_arguments, device_name, kv_type,
                               positive_int, thread_count)
from mdi.cli.output import check_output, judge_samples, report, report_perplexity, write_start_failure
from mdi.cli.process import EXIT_CONFIG, EXIT_RUN, fail, interrupt_on_sigterm, setup_process, stopped
from mdi.cli.progress import PerplexityProgress, Progress
from mdi.model.layout import CheckpointError
from mdi.model.source import check_model_path
from mdi.model.tokenizers import TokenizerError
from mdi.runconfig.speculation import MAX_DRAFT_LIMIT, SPECULATION_METHODS
from mdi.model.backend import BACKENDS, KV_TYPES, PREFILL_WEIGHTS
from mdi.runconfig import (ConfigError, parse_kernel_memory, parse_prefix_cache, GenerationSpec, ModelSpec,
                           NodeSpec, RunConfig, RuntimeSpec, check_quant, load_config, parse_speculation)


def start_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mdi-start",
        description="Run a model split across the nodes of a YAML config (a one-node config runs "
                    "standalone). Flags override the file.",
        epilog="Example: mdi-start --config configs/ring3.yaml --prompt 'The capital of France is' "
               "--n-tokens 16 --temperature 0")
    p.add_argument("--config", help="run configuration (YAML); see README 'Configuration' (this or --model is "
                   "needed)")
    p.add_argument("--model", help="model path (prepared mdi dir, HF dir, .gguf or nanoGPT ckpt.pt); "
                                   "overrides model.path")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt; give several times for several samples")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME",
                   help="the LoRA adapter (a name under the config's adapters:) of the prompt at the same "
                        "position; give it once per --prompt, 'base' for none; later prompts run on the base")
    p.add_argument("--n-samples", type=positive_int, help="samples in flight; prompts are repeated to fill them "
                   "(default: the config's generation.n_samples, else one per prompt)")
    p.add_argument("--n-tokens", type=int, help="tokens to generate per sample (default: the config's, else 100)")
    p.add_argument("--temperature", type=float, help="0 for greedy decoding (default: the config's, else 0.8)")
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens; 0 or -1: all (default: the "
                   "config's, else all)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (default: the config's, else 1: off)")
    p.add_argument("--seed", type=int,
                   help="run seed; each sample's generator derives from it (default: the config's, else 1)")
    p.add_argument("--context-shift", action="store_true",
                   help="a sample that reaches the model's context keeps its prompt (up to half the context), "
                        "drops the older half of the rest and goes on (generation.context_shift); without it, "
                        "it stops there")
    p.add_argument("--speculation", metavar="|".join(SPECULATION_METHODS[:2] + ("draft:PATH",)),
                   help="speculative decoding (generation.speculation): ngram drafts tokens by prompt lookup "
                        "over each sample's own prompt and output, draft:PATH with a smaller model of the same "
                        "tokenizer (prepared dir, HF dir or GGUF, quantized as model.quant) on the starter, and "
                        "every pass verifies them in the ring; output is exactly the plain run's (greedy) or has "
                        "its distribution. It pays on answers that copy (rewrites, quotes, code edits) and "
                        "switches itself off where drafts miss")
    p.add_argument("--draft-max", type=positive_int, metavar="K",
                   help="with --speculation: drafted tokens per pass, at most (default 8, at most %d)" % MAX_DRAFT_LIMIT)
    p.add_argument("--prefix-cache", metavar="SIZE",
                   help="earlier prompts' KV kept on every node (runtime.prefix_cache) for later requests that "
                        "start the same way (a chat's next turn): auto (default: half of what each node spares "
                        "beside its weights and KV cache), off, or a size per node such as 512MB")
    p.add_argument("--kernel-memory", metavar="SIZE",
                   help="what quantized kernels may hold beyond the stored weights on each node "
                        "(runtime.kernel_memory): off (default: a node holds its stored weights and no more), "
                        "auto (whatever its memory spares) or a size per node such as 64MB; faster kernels "
                        "(fbgemm's int8, second copies for prefill passes) only within it")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations dtype (default: the config's model.dtype, else float32)")
    p.add_argument("--compute-dtype", choices=["float32", "float16", "bfloat16"],
                   help="compute in this dtype while storing weights in --dtype (e.g. float16 weights, "
                        "float32 compute on GPUs without fast half arithmetic such as the TX2)")
    add_quant_arguments(p)
    add_kernel_argument(p)
    p.add_argument("--backend", choices=BACKENDS,
                   help="what every node computes with (runtime.backend): ggml (llama.cpp's kernels on the "
                        "model's GGUF tensors as stored), torch, or auto (default: the config's, else "
                        "$MDI_BACKEND, else auto: each node measures both on its "
                        "own shapes once and keeps the faster, so the choice, and the greedy text, can change with "
                        "--n-samples; name ggml for ids that do not)")
    p.add_argument("--kv-type", type=kv_type, metavar="{%s}" % ",".join(KV_TYPES),
                   help="the ggml backend's KV cache type (runtime.kv_type; default f16, q8_0 halves it, "
                        "f32 doubles it and agrees with torch's float32 reference; float16, float32 and upper "
                        "case are taken too)")
    p.add_argument("--prefill-weights", choices=PREFILL_WEIGHTS,
                   help="ggml: how a prompt's passes multiply (runtime.prefill_weights): quantized (the weights "
                        "as stored: a prompt's bits are llama.cpp's), dequantized (in the graph, from the pass size "
                        "this CPU measured faster: up to 3x faster prefill on CPUs with bfloat16; greedy ids may then "
                        "depend on how a prompt is chunked) or auto (default: dequantized from 64 rows where measured "
                        "faster there, ids independent of chunking, on nodes whose backend auto chose; quantized on "
                        "a backend asked for by name)")
    p.add_argument("--device", type=device_name, help="cpu, cuda or cuda:N for the starter (default: the config's, "
                   "else cpu)")
    p.add_argument("--threads", type=thread_count, help="compute threads of the starter and of every worker started "
                   "without its own --threads, or auto (runtime.threads; default: the config's)")
    p.add_argument("--metrics-out", metavar="FILE.json", help="write the run's metrics record here")
    p.add_argument("--quiet", action="store_true",
                   help="print only the summary line (on stdout), and on stderr only warnings and errors (a recovery, "
                        "a failure), none of the start-up notes")
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
    p.add_argument("--chat-template", metavar="FILE.jinja",
                   help="with --serve: render chat requests with this Jinja template instead of the model's own "
                        "(serve.chat_template; a GGUF without one gets a plain 'role: text' fallback)")
    p.add_argument("--insecure", action="store_true",
                   help="with --serve or --dashboard: allow a non-loopback --host without a shared secret")
    p.add_argument("--perplexity", metavar="FILE.txt",
                   help="measure the model's perplexity on this UTF-8 text file instead of generating (as llama.cpp's "
                        "llama-perplexity does: windows of --ppl-ctx tokens, the second half of each scored), "
                        "standalone or over the ring; prints perplexity and tokens/s")
    p.add_argument("--ppl-ctx", type=positive_int, metavar="N",
                   help="with --perplexity: window length in tokens (default: the model's context, at most 512)")
    p.add_argument("--ppl-max-windows", type=positive_int, metavar="N",
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
            # --top-k 0 or -1 turns a config's top_k off, as the HTTP API's and llama.cpp's do
            setattr(g, key, None if key == "top_k" and value in (0, -1) else value)
    if args.context_shift:
        g.context_shift = True
    if args.speculation or args.draft_max:
        given = parse_speculation("--speculation", args.speculation, paths=True) if args.speculation else g.speculation
        raw = {"method": given.method, "max_draft": args.draft_max or g.speculation.max_draft,
               "ngram_min": g.speculation.ngram_min, "ngram_max": g.speculation.ngram_max, "fill": g.speculation.fill}
        if given.method == "draft":
            raw.update(draft=given.draft, quant=g.speculation.quant)
        elif given.method == "off" and args.draft_max:
            raise ConfigError("--draft-max: speculation is off (give --speculation ngram or draft:PATH too)")
        g.speculation = parse_speculation("--speculation/--draft-max", raw, paths=True)
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
    if args.prefix_cache is not None:
        cfg.runtime.prefix_cache = parse_prefix_cache("--prefix-cache", args.prefix_cache)
    if args.kernel_memory is not None:
        cfg.runtime.kernel_memory = parse_kernel_memory("--kernel-memory", args.kernel_memory)
    check_quant("--quant", cfg.model)
    if args.backend:
        cfg.runtime.backend = args.backend
        for node in cfg.nodes + cfg.spares:  # the flag is for the whole ring
            node.backend = None
    if args.kv_type:
        cfg.runtime.kv_type = args.kv_type
    if args.prefill_weights:
        cfg.runtime.prefill_weights = args.prefill_weights
    if args.device:
        cfg.starter.device = args.device
    if args.threads is not None:
        cfg.runtime.threads = args.threads
    from mdi.runconfig import _check_generation
    _check_generation("command line", g, flags=True)
    return cfg


def _check_utf8(text: str, what: str) -> None:
    """ConfigError where `text` came from bytes that are not UTF-8 (Python hands such command-line
    bytes on as lone surrogates, which a tokenizer refuses with a traceback or encodes wrongly)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError("%s is not UTF-8 text (byte 0x%02x at character %d)"
                          % (what, ord(text[e.start]) & 0xFF, e.start))


def start_main(argv: Optional[List[str]] = None) -> int:
    args = start_parser().parse_args(argv)
    try:
        from mdi.starter import batch  # (torch, numpy...: Ctrl-C meanwhile is one line too)
    except KeyboardInterrupt as e:
        return stopped(e)

    hangup = signal.getsignal(signal.SIGHUP)  # a closed terminal (ssh gone) stops it as SIGTERM does
    previous = interrupt_on_sigterm(batch.Interrupted, also_sighup=True)  # the ring stops as on Ctrl-C
    try:
        return _start(args, batch)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGHUP, hangup)


def _start(args: argparse.Namespace, batch) -> int:
    from mdi.ring.auth import TokenError, load_token
    try:
        for i, prompt in enumerate(args.prompt, 1):
            _check_utf8(prompt, "--prompt %d" % i)
        check_output(args.metrics_out, "--metrics-out")  # before the run, not after it
        cfg = _config_from_args(args)
        # before a missing prompt or anything else is said; a config's relative path names where it looked
        check_model_path(cfg.model.path, args.config if args.config and not args.model else None)
        cfg.runtime.token = load_token(cfg.runtime.token_file)
        setup_process(log_level="WARNING" if args.quiet else "INFO", threads=cfg.runtime.threads)
        if not args.serve:  # (--check and --perplexity serve nothing either: refused there too)
            if args.port is not None:
                raise ConfigError("--port goes with --serve (a batch run's dashboard: --dashboard PORT)")
            if args.chat_template:
                raise ConfigError("--chat-template goes with --serve (a batch run's prompts are plain text)")
            if (args.host or args.insecure) and args.dashboard is None:
                raise ConfigError("--host and --insecure go with --serve or --dashboard")
        if args.perplexity is not None:
            return _perplexity(cfg, args)
        if args.ppl_ctx is not None or args.ppl_max_windows is not None:
            raise ConfigError("--ppl-ctx and --ppl-max-windows go with --perplexity FILE")
        if args.check:  # the samples the run would hold, --n-samples and --adapter counted
            for flag, given in (("--serve", args.serve), ("--metrics-out", args.metrics_out),
                                ("--dashboard", args.dashboard is not None)):
                if given:
                    raise ConfigError("%s does not go with --check (it checks the nodes and generates nothing)" % flag)
            from mdi.starter.planning.preflight import preflight
            return preflight(cfg, args.prompt, args.n_samples, args.adapter)
        if args.serve:
            return _serve(cfg, args)
        from mdi.starter.planning.run_shape import expand_prompts
        prompts = expand_prompts(cfg, args.prompt, args.n_samples)
        progress = Progress(len(prompts), cfg.generation.n_tokens) if sys.stderr.isatty() else None
        dashboard = _dashboard(cfg, args, len(prompts)) if args.dashboard is not None else None
        monitor = dashboard.monitor if dashboard is not None else None
        begun = time.perf_counter()
        try:
            result = batch.run(cfg, prompts, on_token=_each(progress, monitor.on_token if monitor else None),
                               on_engine=monitor.attach if monitor else None, adapters=args.adapter)
        except BaseException as e:
            if monitor is not None:
                monitor.finished(str(e) or type(e).__name__)
            if isinstance(e, RuntimeError) and not isinstance(e, batch.RunFailed):  # the ring never started
                write_start_failure(args, prompts, e, time.perf_counter() - begun)
            raise
        finally:
            if progress is not None:
                progress.close()
            if dashboard is not None:
                dashboard.close()
    except (ConfigError, CheckpointError, TokenizerError, TokenError) as e:
        return fail(str(e), EXIT_CONFIG)
    except batch.RunFailed as e:
        report(e.result, args)  # the partial texts and metrics are not lost (a write's failure: said too)
        return fail(str(e), 128 + e.signum if e.signum else EXIT_RUN)
    except (KeyboardInterrupt, batch.Interrupted) as e:
        return stopped(e)
    except RuntimeError as e:
        return fail(str(e), EXIT_RUN)
    return judge_samples(result, report(result, args))


def _dashboard(cfg: RunConfig, args: argparse.Namespace, n_samples: int):
    """A batch run's dashboard (`--dashboard [PORT]`), listening before the run starts."""
    from mdi.serving.server import default_model_id
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
    if args.chat_template:
        cfg.serve.chat_template = args.chat_template
    check_serve("command line: serve", cfg.serve)
    from mdi.system.memory import limit_malloc_arenas
    limit_malloc_arenas()  # before the HTTP threads: what one request frees, the next reuses (see there)
    from mdi.serving.server import serve
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
        report_perplexity(e.result, args)  # the windows scored so far are not lost
        return fail(str(e), 128 + e.signum if e.signum else EXIT_RUN)
    if progress is not None:
        progress.close()
    return report_perplexity(result, args)

