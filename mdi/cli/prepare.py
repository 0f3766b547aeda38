"""mdi-prepare: turn a checkpoint into an mdi model directory (mdi.model.files.prepare)."""
import argparse
import os
import shutil
import signal
import sys
from typing import Dict, List, Optional, Tuple

from mdi.cli.arguments import ArgumentParser, add_quant_arguments
from mdi.cli.process import EXIT_CONFIG, interrupt_on_sigterm, setup_process
from mdi.model.layout import CheckpointError
from mdi.model.tokenizers import TokenizerError
from mdi.system.files import output_problem


def prepare_parser() -> argparse.ArgumentParser:
    from mdi.model.files import prepare
    doc = prepare.__doc__
    p = ArgumentParser(prog="mdi-prepare", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(doc.split("\n")[2:]))
    p.add_argument("source", help="packaged model name (%s; or its PyPI package's: %s), HF dir, .gguf (llama, "
                   "qwen2, qwen3, gemma3: a GPT-2 GGUF runs as it is, mdi-start --model FILE.gguf, on ggml) or "
                   "nanoGPT ckpt.pt" % (", ".join(prepare.PACKAGED), ", ".join(prepare.PACKAGE_NAMES)))
    p.add_argument("--out", help="output directory (default models/<name>)")
    p.add_argument("--chunks", action="append", default=[], metavar="N-N-N",
                   help="also cut per-node chunk files for this partition (layer counts); repeatable")
    p.add_argument("--vocab", help="JSON list of characters (character-level nanoGPT models)")
    p.add_argument("--merge-adapter", metavar="PATH",
                   help="merge this LoRA adapter (a PEFT directory or a LoRA GGUF) into the weights before they "
                        "are written (and quantized as --quant says): a model for a ring that serves one task")
    add_quant_arguments(p, gguf_types=True)
    return p


def prepare_main(argv: Optional[List[str]] = None) -> int:
    from mdi.model.files import prepare
    from mdi.model.files.store import MDI_CONFIG
    args = prepare_parser().parse_args(argv)
    setup_process()
    args.source = prepare.packaged_name(args.source)
    name = args.source if args.source in prepare.PACKAGED else os.path.splitext(os.path.basename(args.source.rstrip("/")))[0]
    if os.path.basename(args.source) == "ckpt.pt":  # nanoGPT's out_dir/ckpt.pt: the folder names the model
        name = os.path.basename(os.path.dirname(os.path.abspath(args.source))) or name
    out = args.out or os.path.join("models", name)
    if os.path.isdir(args.source) and os.path.realpath(out) == os.path.realpath(args.source):
        ours = os.path.isfile(os.path.join(args.source, MDI_CONFIG))  # only mdi's own folder is rewritten in place
        if args.out is None or not ours:
            return _error("%s %s is the source itself: name another folder with --out%s"
                          % ("the default --out" if args.out is None else "--out", out,
                             " (naming the source again rewrites it in place)" if ours
                             else " (its checkpoint would be overwritten)"), EXIT_CONFIG)
    problem = output_problem(out, folder=True)
    if problem is not None:
        return _error("--out %s: %s" % (out, problem), EXIT_CONFIG)
    fresh = not os.path.exists(out)  # everything in it is this run's: removed if the run fails
    before = None if fresh else _files(out)  # what a failure may have changed in it
    caught: List[int] = []  # the signal that interrupted it

    def interrupted(signum: int) -> BaseException:
        caught.append(signum)
        return KeyboardInterrupt()
    hangup = signal.getsignal(signal.SIGHUP)
    terminate = interrupt_on_sigterm(interrupted, also_sighup=True)  # cleaned up as on Ctrl-C
    try:
        prepare.prepare(args.source, out, args.chunks, args.vocab, args.quant or "auto", args.group_size,
                        args.merge_adapter)
    except (CheckpointError, TokenizerError, OSError, ValueError) as e:
        return _error("%s%s" % (e, _partial(out, before)), EXIT_CONFIG)
    except KeyboardInterrupt:
        return _error("interrupted%s" % _partial(out, before), 128 + (caught[-1] if caught else signal.SIGINT))
    finally:  # (a caller in this process, a test, keeps its own handlers)
        signal.signal(signal.SIGTERM, terminate)
        signal.signal(signal.SIGHUP, hangup)
    return 0


def _error(message: str, code: int) -> int:
    print("mdi-prepare: error: %s" % message, file=sys.stderr)
    return code


def _files(folder: str) -> Dict[str, Tuple[int, int]]:
    """Each file under `folder`: (size, modification time in ns)."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_size, st.st_mtime_ns)
    return out


def _partial(out: str, before: Optional[Dict[str, Tuple[int, int]]]) -> str:
    """What became of the output folder of a failed preparation, said after its error
    (`before`: its files before the run, None where the run made it)."""
    if before is None:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written is left to be loaded
        return ""
    if _files(out) == before:  # refused before anything was written (a bad --quant, say)
        return ""
    return " (%s held files before: it may now hold a partial result beside them)" % out
