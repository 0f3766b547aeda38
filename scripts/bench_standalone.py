#!/usr/bin/env python3
"""Standalone decode speed: mdi on one node vs Hugging Face transformers generate().

Both run in this one process, on the SAME weights (mdi's prepared model directory, mapped back
to a transformers LlamaForCausalLM: attn.qkv -> q/k/v_proj, mlp.gate_up -> gate/up_proj, tied
head), with the same torch threads, float32, greedy decoding, the same prompt token ids and
N new tokens with EOS disabled on both sides (so both always generate exactly N tokens).

Decode-only rate: prefill is excluded by timing from the first generated token to the last,
(N - 1) / (t_last - t_first). mdi timestamps each token in its pipeline (Sample.token_times,
the mdi.starter.pipeline API with a local loop, i.e. exactly what a one-node `batch.run` executes);
transformers timestamps each token through a streamer passed to generate() (its put() is
called once per new token, right after the token is chosen). The median gap between tokens is
recorded as a noise-robust second figure.

Repeats alternate mdi / transformers (and which goes first), so both see the same machine
noise; the ratio mdi / transformers is computed per repeat and summarised as median [min, max].
Also checks that both produce the same greedy token ids.

Example:
  python scripts/bench_standalone.py --n-tokens 64 --repeats 5 --out results/bench_standalone.json
"""
import argparse
import os
import sys
import time
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (adds the repo root to sys.path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints a table and writes every raw number to --out.",
        epilog="Decode-only tokens/s = (N-1) / (time from first to last generated token). "
               "Reported as median [min, max] over --repeats; ratio = mdi / transformers, per repeat. "
               "Only Llama-family models (SmolLM2, TinyLlama, ...) can be mapped to transformers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=benchlib.DEFAULT_MODEL, help="prepared mdi model directory (Llama family)")
    p.add_argument("--prompt", default=benchlib.DEFAULT_PROMPT, help="prompt text (encoded once with mdi's tokenizer)")
    p.add_argument("--n-tokens", type=int, default=64, help="new tokens per generation")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per implementation")
    p.add_argument("--threads", type=int, default=1, help="torch threads (both implementations)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "results", "bench_standalone.json"),
                   help="JSON record with all raw numbers")
    args = p.parse_args(argv)
    if args.n_tokens < 3 or args.repeats < 1 or args.threads < 1:
        p.error("need --n-tokens >= 3, --repeats >= 1, --threads >= 1")
    return args


# --------------------------------------------------------------------------- mdi

def mdi_generate(chunk, prompt_ids: List[int], n_tokens: int) -> Tuple[List[int], List[float]]:
    """Greedy, EOS disabled; returns the new ids and each token's time since the call began."""
    from mdi.ring.transport import LocalLoop
    from mdi.starter.pipeline import Pipeline
    from mdi.starter.sample import make_samples
    from mdi.model.sampling import SamplingParams
    chunk.allocate_cache(1, len(prompt_ids) + n_tokens)
    samples = make_samples([""], [prompt_ids], n_tokens, seed=1)
    Pipeline(chunk, LocalLoop(), 0, SamplingParams(temperature=0.0), eos_id=None).run(samples)
    chunk.free_cache()
    return samples[0].token_ids, samples[0].token_times


# --------------------------------------------------------------------------- transformers

def hf_state_dict(config, sd: Dict[str, Any]) -> Dict[str, Any]:
    """Inverse of mdi's canonical Llama mapping (mdi.model.files.convert.convert_llama)."""
    H, KV, D, I = config.n_head, config.n_kv_head, config.head_dim, config.intermediate_size
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["norm_f.weight"]}
    for i in range(config.n_layer):
        s, d = "blocks.%d." % i, "model.layers.%d." % i
        q, k, v = sd[s + "attn.qkv.weight"].split([H * D, KV * D, KV * D], 0)
        gate, up = sd[s + "mlp.gate_up.weight"].split([I, I], 0)
        out.update({
            d + "input_layernorm.weight": sd[s + "norm1.weight"],
            d + "self_attn.q_proj.weight": q, d + "self_attn.k_proj.weight": k,
            d + "self_attn.v_proj.weight": v, d + "self_attn.o_proj.weight": sd[s + "attn.proj.weight"],
            d + "post_attention_layernorm.weight": sd[s + "norm2.weight"],
            d + "mlp.gate_proj.weight": gate, d + "mlp.up_proj.weight": up,
            d + "mlp.down_proj.weight": sd[s + "mlp.down.weight"],
        })
    out["lm_head.weight"] = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["tok_emb.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def load_hf(path: str, source):
    """transformers LlamaForCausalLM holding exactly mdi's prepared weights (float32)."""
    import torch
    import transformers
    from mdi.model.files.store import load_weights
    c = source.config
    if c.family != "llama" or c.bias:
        sys.exit("bench_standalone: only bias-free Llama-family models map to transformers (got %s)" % c.family)
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim, max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tied_head, attention_bias=False, mlp_bias=False,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    model = transformers.LlamaForCausalLM(hf_config).to(torch.float32).eval()
    from mdi.model.quantization.quant import QParts
    weights = load_weights(path, (0, c.n_layer), True, True, torch.float32)  # a GGUF's Q4/Q8 blocks as they are
    sd = hf_state_dict(c, {k: v.dequantize(torch.float32) if isinstance(v, QParts) else v for k, v in weights.items()})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (c.tied_head and k == "lm_head.weight")]
    if missing or unexpected:
        sys.exit("bench_standalone: weight mapping failed: missing %s, unexpected %s" % (missing[:3], unexpected[:3]))
    if c.tied_head:
        model.tie_weights()
    return model


def _token_clock():
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """generate() calls put() once with the prompt, then once per new token."""

        def __init__(self) -> None:
            self.times = []  # type: List[float]
            self._prompt_seen = False

        def put(self, value) -> None:
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    return TokenClock()


def hf_generate(model, prompt_ids: List[int], n_tokens: int) -> Tuple[List[int], List[float]]:
    """generate(): greedy, EOS disabled (eos_token_id=None), default (dynamic) KV cache."""
    import torch
    from transformers import GenerationConfig
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    gen = GenerationConfig(do_sample=False, max_new_tokens=n_tokens, min_new_tokens=0,
                           eos_token_id=None, pad_token_id=0, bos_token_id=None)
    clock = _token_clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, streamer=clock)
    new = out[0, len(prompt_ids):].tolist()
    return new, [t - t0 for t in clock.times]


# --------------------------------------------------------------------------- measurement

def first_difference(a: List[int], b: List[int]) -> int:
    """Index of the first differing token, -1 when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def measure(args: argparse.Namespace, chunk, model, prompt_ids: List[int]) -> Dict[str, Any]:
    impls = {"mdi": lambda: mdi_generate(chunk, prompt_ids, args.n_tokens),
             "transformers": lambda: hf_generate(model, prompt_ids, args.n_tokens)}
    for fn in impls.values():  # warm-up: allocator, thread pools, first-call paths
        fn()
    runs = {name: [] for name in impls}  # type: Dict[str, List[Dict[str, Any]]]
    ids = {}  # type: Dict[str, List[int]]
    for r in range(args.repeats):
        order = ["mdi", "transformers"] if r % 2 == 0 else ["transformers", "mdi"]
        for name in order:
            tokens, times = impls[name]()
            if len(tokens) != args.n_tokens:
                raise RuntimeError("%s generated %d tokens, expected %d" % (name, len(tokens), args.n_tokens))
            ids.setdefault(name, tokens)
            runs[name].append(dict(benchlib.decode_timing(times), order=order.index(name)))
        print("  repeat %d/%d: mdi %.2f tok/s, transformers %.2f tok/s"
              % (r + 1, args.repeats, runs["mdi"][-1]["tokens_per_s"], runs["transformers"][-1]["tokens_per_s"]),
              flush=True)
    return {"runs": runs, "ids": ids}


def summarise(m: Dict[str, Any]) -> Dict[str, Any]:
    runs = m["runs"]
    out = {}  # type: Dict[str, Any]
    for name, rs in runs.items():
        out[name] = {"tokens_per_s": benchlib.summarize([r["tokens_per_s"] for r in rs]),
                     "ms_per_token_mean": benchlib.summarize([1000 * r["mean_s"] for r in rs]),
                     "ms_per_token_median_gap": benchlib.summarize([1000 * r["median_s"] for r in rs]),
                     "prefill_first_token_ms": benchlib.summarize([1000 * r["first_token_s"] for r in rs])}
    pairs = list(zip(runs["mdi"], runs["transformers"]))
    out["ratio_mdi_over_transformers"] = benchlib.summarize([a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs])
    out["ratio_median_gap"] = benchlib.summarize([b["median_s"] / a["median_s"] for a, b in pairs])
    diff = first_difference(m["ids"]["mdi"], m["ids"]["transformers"])
    out["same_greedy_ids"] = diff == -1
    out["first_different_token"] = diff
    return out


def report(args: argparse.Namespace, s: Dict[str, Any], info: Dict[str, Any]) -> None:
    rows = []
    for name in ("mdi", "transformers"):
        r = s[name]
        rows.append([name, benchlib.fmt_stat(r["tokens_per_s"], "%.2f"), benchlib.fmt_stat(r["ms_per_token_mean"], "%.2f"),
                     benchlib.fmt_stat(r["ms_per_token_median_gap"], "%.2f"),
                     benchlib.fmt_stat(r["prefill_first_token_ms"], "%.0f")])
    rows.append(["ratio mdi/transformers", benchlib.fmt_stat(s["ratio_mdi_over_transformers"], "%.3f"), "",
                 benchlib.fmt_stat(s["ratio_median_gap"], "%.3f"), ""])
    benchlib.print_table(
        "Standalone decode, %s, %d new tokens, %d thread(s), float32, greedy; median [min, max] of %d repeats"
        % (os.path.basename(os.path.normpath(args.model)), args.n_tokens, args.threads, args.repeats),
        ["", "decode tok/s", "ms/token (mean)", "ms/token (median gap)", "prefill+1st token ms"], rows)
    same = s["same_greedy_ids"]
    print("greedy token ids identical (mdi vs transformers, %d tokens): %s%s"
          % (args.n_tokens, "yes" if same else "NO",
             "" if same else " (first difference at new token %d)" % s["first_different_token"]))
    print("target: ratio >= 1.0 -> %s" % ("met" if s["ratio_mdi_over_transformers"]["median"] >= 1.0 else "NOT met"))
    print(benchlib.note_load(info))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    info = benchlib.machine_info(args.threads)
    import transformers
    info["transformers"] = transformers.__version__
    print("loading %s into mdi and transformers ..." % args.model, flush=True)
    source, chunk = benchlib.load_mdi(args.model)
    model = load_hf(args.model, source)
    prompt_ids = source.tokenizer.encode(args.prompt)
    print("prompt %r = %d tokens; %d warm-up + %d timed runs each" % (args.prompt, len(prompt_ids), 1, args.repeats),
          flush=True)
    m = measure(args, chunk, model, prompt_ids)
    benchlib.finish_machine_info(info)
    s = summarise(m)
    report(args, s, info)
    record = {"benchmark": "standalone", "args": vars(args), "machine": info, "prompt_ids": prompt_ids,
              "method": {"decode_rate": "(N-1)/(t_last - t_first) per run, prefill excluded",
                         "mdi": "mdi.starter.pipeline.Pipeline + LocalLoop on the whole-model chunk (what a one-node "
                                "starter.run executes), Sample.token_times",
                         "transformers": "LlamaForCausalLM(mdi weights).generate(greedy, eos off), "
                                         "per-token times from a streamer",
                         "ratio": "per repeat, mdi tokens/s / transformers tokens/s (interleaved runs)"},
              "summary": s, "runs": m["runs"], "token_ids": m["ids"]}
    benchlib.save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
