"""mdi-prepare: turn a checkpoint into an mdi model directory (mdi.model.files.prepare)."""
import argparse
import os
import shutil
import signal
import sys
from typing import List, Optional

from mdi.cli.arguments import ArgumentParser, add_quant_arguments
from mdi.cli.process import EXIT_CONFIG, setup_process
from mdi.model.layout import CheckpointError
from mdi.model.tokenizers import TokenizerError
from mdi.system.files import output_problem


def prepare_parser() -> argparse.ArgumentParser:
    from mdi.model.files import prepare
    doc = prepare.__doc__
    p = ArgumentParser(prog="mdi-prepare", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(doc.split("\n")[2:]))
    p.add_argument("source", help="packaged model name (%s), HF dir, .gguf (llama, qwen2, qwen3, gemma3: "
                   "a GPT-2 GGUF runs as it is, mdi-start --model FILE.gguf, on ggml) or nanoGPT ckpt.pt"
                   % ", ".join(prepare.PACKAGED))
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
    args = prepare_parser().parse_args(argv)
    setup_process()
    name = args.source if args.source in prepare.PACKAGED else os.path.splitext(os.path.basename(args.source.rstrip("/")))[0]
    out = args.out or os.path.join("models", name)
    if args.out is None and os.path.isdir(args.source) and os.path.realpath(out) == os.path.realpath(args.source):
        return _error("the default --out %s is the source itself: name the folder to write with --out (the "
                      "source again rewrites it in place)" % out, EXIT_CONFIG)
    problem = output_problem(out, folder=True)
    if problem is not None:
        return _error("--out %s: %s" % (out, problem), EXIT_CONFIG)
    fresh = not os.path.exists(out)  # everything in it is this run's: removed if the run fails
    try:
        prepare.prepare(args.source, out, args.chunks, args.vocab, args.quant or "auto", args.group_size,
                        args.merge_adapter)
    except (CheckpointError, TokenizerError, OSError, ValueError) as e:
        return _error("%s%s" % (e, _partial(out, fresh)), EXIT_CONFIG)
    except KeyboardInterrupt:
        return _error("interrupted%s" % _partial(out, fresh), 128 + signal.SIGINT)
    return 0


def _error(message: str, code: int) -> int:
    print("mdi-prepare: error: %s" % message, file=sys.stderr)
    return code


def _partial(out: str, fresh: bool) -> str:
    """What became of the output folder of a failed preparation, said after its error."""
    if fresh:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written is left to be loaded
        return ""
    return " (%s held files before: it may now hold a partial result beside them)" % out
