"""LoRA adapters (mdi.model.adapters.adapter_files reads them, mdi.model.adapters.lora applies them) against peft
on random tiny Hugging Face models: a PEFT directory read into mdi names (q/k/v and gate/up
fused) computes PeftModel's logits within 1e-4 in float32, prefill and cached decode; base rows
stay the base model's; a mixed batch equals each sample alone; merging equals applying; a
llama.cpp LoRA GGUF of the same adapter computes the same; what mdi does not model is refused
naming the file and the tensor or key."""
import json
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from mdi.model.adapters.adapter_files import load_adapter, load_any, load_gguf_lora  # noqa: E402
from mdi.model.adapters.lora import AdapterError, merge_adapter  # noqa: E402
from mdi.model.adapters.peft_targets import get_pattern_key  # noqa: E402
from mdi.model.files.checkpoints import read_hf_dir  # noqa: E402
from mdi.model.layout import expected_keys  # noqa: E402
from mdi.model.row_batch import RowBatch  # noqa: E402
from mdi.model.source import build_chunk  # noqa: E402
from test_model_parity import hf_gpt2, hf_llama, hf_qwen3  # noqa: E402

PREFILL, DECODE, VOCAB = 20, 20, 500
LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_gemma3(path):
    """A tiny Gemma3ForCausalLM (its modules named as Llama's; sliding window 4 on every other
    layer, norms that matter)."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, sliding_window=4, sliding_window_pattern=2, max_position_embeddings=64,
        query_pre_attn_scalar=20, rope_local_base_freq=100.0, initializer_range=0.1)
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return cfg, model


CASES = {  # name -> (HF model maker, LoraConfig keywords)
    "gpt2": (hf_gpt2, dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)),
    "llama": (hf_llama, dict(target_modules=LLAMA_ALL)),
    "llama-rslora": (hf_llama, dict(target_modules=LLAMA_ALL, use_rslora=True)),
    "llama-rank-pattern": (hf_llama, dict(target_modules=LLAMA_ALL, rank_pattern={"q_proj": 4, "mlp.down_proj": 12},
                                          alpha_pattern={"v_proj": 40})),
    "llama-some-layers": (hf_llama, dict(target_modules=["q_proj", "v_proj", "up_proj"], layers_to_transform=[1, 3])),
    "qwen3": (hf_qwen3, dict(target_modules=LLAMA_ALL)),
    "gemma3": (hf_gemma3, dict(target_modules=LLAMA_ALL)),
}


def make_adapter(tmp_path, make, seed=0, **lora):
    """A random base model and a random (B != 0) LoRA on it, both saved; returns the dirs."""
    torch.manual_seed(seed)
    _, model = make(None)
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    model.eval().save_pretrained(base_dir)
    kw = dict(r=8, lora_alpha=16, init_lora_weights=False)
    kw.update(lora)
    pm = peft.get_peft_model(model, peft.LoraConfig(**kw))
    with torch.no_grad():  # a delta the size of a fine-tune's (nn.Linear's default init is far larger)
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    pm.save_pretrained(adapter_dir)
    return base_dir, adapter_dir


def base_chunk(base_dir, first=0, last=None, with_embedding=True, with_head=True):
    """mdi's chunk of the saved base model, as the parity tests build it (float32, CPU)."""
    config, weights = read_hf_dir(base_dir)
    last = config.n_layer if last is None else last
    keys = expected_keys(config, (first, last), with_embedding, with_head)
    return build_chunk(config, {k: weights[k] for k in keys}, first, last, with_embedding, with_head,
                       torch.float32, "cpu")


def base_config(base_dir):
    return read_hf_dir(base_dir)[0]


def hf_model(base_dir):
    config = transformers.AutoConfig.from_pretrained(base_dir)
    cls = transformers.GPT2LMHeadModel if config.model_type == "gpt2" else transformers.AutoModelForCausalLM
    return cls.from_pretrained(base_dir).eval()


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    make, lora = CASES[request.param]
    base_dir, adapter_dir = make_adapter(tmp_path, make, **lora)
    reference = peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir).eval()
    chunk = base_chunk(base_dir)
    adapter = load_adapter(adapter_dir, chunk.config)
    return dict(name=request.param, base_dir=base_dir, adapter_dir=adapter_dir, reference=reference,
                base=hf_model(base_dir), config=chunk.config, chunk=chunk, adapter=adapter)


def ids_of(seed=1, n=PREFILL + DECODE):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g)


@torch.no_grad()
def run(chunk, ids, adapter_id, slot=1):
    """Logits of a 20-token prefill then one cached decode step per token, as RowBatches."""
    chunk.allocate_cache(2, len(ids))

    def step(start, count):
        x = chunk.embed(ids[start:start + count], start)
        batch = RowBatch.of([slot], [start], [count], adapters=[adapter_id])
        return chunk.head(chunk.forward_rows(x, batch))
    out = [step(0, PREFILL)] + [step(t, 1) for t in range(PREFILL, len(ids))]
    return torch.cat(out)


@torch.no_grad()
def test_logits_match_peft(case):
    chunk, adapter = case["chunk"], case["adapter"]
    chunk.set_adapter(1, adapter.weights)
    ids = ids_of()
    want = case["reference"](input_ids=ids[None]).logits[0]
    base = case["base"](input_ids=ids[None]).logits[0]
    assert (want - base).abs().max() > 1e-2  # the adapter changes something worth checking
    got = run(chunk, ids, 1)
    assert (got[:PREFILL] - want[:PREFILL]).abs().max() <= 1e-4
    assert (got[PREFILL:] - want[PREFILL:]).abs().max() <= 1e-4
    # adapter 0 is the base model, with the adapter still held
    assert (run(chunk, ids, 0) - base).abs().max() <= 1e-4


def test_adapter_rows_are_slices_where_consecutive():
    cpu = torch.device("cpu")
    side_by_side = RowBatch.of([0, 1, 2, 3], [0, 0, 0, 0], [2, 1, 3, 1], adapters=[1, 1, 0, 2]).adapter_rows(cpu)
    assert side_by_side == [(1, slice(0, 3)), (2, slice(6, 7))]
    apart = RowBatch.of([0, 1, 2], [0, 0, 0], [2, 1, 1], adapters=[1, 2, 1]).adapter_rows(cpu)
    assert apart[0][0] == 1 and apart[0][1].tolist() == [0, 1, 3] and apart[1] == (2, slice(2, 3))


@torch.no_grad()
def test_mixed_batch_equals_each_alone(case):
    chunk = case["chunk"]
    chunk.set_adapter(1, case["adapter"].weights)
    a, b = ids_of(2, 7), ids_of(3, 5)
    alone = [run_alone(chunk, a, 1), run_alone(chunk, b, 0)]
    chunk.allocate_cache(2, 8)
    x = torch.cat([chunk.embed(a[:6], 0), chunk.embed(b[:4], 0)])
    first = chunk.head(chunk.forward_rows(x, RowBatch.of([0, 1], [0, 0], [6, 4], adapters=[1, 0])))
    x = torch.cat([chunk.embed(a[6:], 6), chunk.embed(b[4:], 4)])
    second = chunk.head(chunk.forward_rows(x, RowBatch.of([0, 1], [6, 4], [1, 1], adapters=[1, 0])))
    assert torch.allclose(torch.cat([first[:6], second[:1]]), alone[0], atol=1e-5)
    assert torch.allclose(torch.cat([first[6:], second[1:]]), alone[1], atol=1e-5)


@torch.no_grad()
def test_an_adapter_s_rows_apart_in_a_batch(case):
    """A worker merging frames may put one adapter's samples apart: the gather path."""
    chunk = case["chunk"]
    chunk.set_adapter(1, case["adapter"].weights)
    seqs = [ids_of(5, 4), ids_of(6, 3), ids_of(7, 5)]
    alone = [run_alone(chunk, q, a) for q, a in zip(seqs, [1, 0, 1])]
    chunk.allocate_cache(3, 8)
    x = torch.cat([chunk.embed(q[:-1], 0) for q in seqs])
    batch_ = RowBatch.of([0, 1, 2], [0, 0, 0], [len(q) - 1 for q in seqs], adapters=[1, 0, 1])
    assert not isinstance(batch_.adapter_rows(torch.device("cpu"))[0][1], slice)
    first = chunk.head(chunk.forward_rows(x, batch_))
    x = torch.cat([chunk.embed(q[-1:], len(q) - 1) for q in seqs])
    last = chunk.head(chunk.forward_rows(x, RowBatch.of([0, 1, 2], [len(q) - 1 for q in seqs], [1, 1, 1],
                                                        adapters=[1, 0, 1])))
    row = 0
    for i, q in enumerate(seqs):
        got = torch.cat([first[row:row + len(q) - 1], last[i:i + 1]])
        assert torch.allclose(got, alone[i], atol=1e-5), i
        row += len(q) - 1


@torch.no_grad()
def run_alone(chunk, ids, adapter_id):
    chunk.allocate_cache(1, len(ids))
    x = chunk.embed(ids[:-1], 0)
    first = chunk.head(chunk.forward_rows(x, RowBatch.of([0], [0], [len(ids) - 1], adapters=[adapter_id])))
    x = chunk.embed(ids[-1:], len(ids) - 1)
    last = chunk.head(chunk.forward_rows(x, RowBatch.of([0], [len(ids) - 1], [1], adapters=[adapter_id])))
    return torch.cat([first, last])


@torch.no_grad()
def test_merged_weights_equal_the_adapter(case):
    config, weights = read_hf_dir(case["base_dir"])
    merged = merge_adapter(weights, case["adapter"])
    chunk = build_chunk(config, merged, 0, config.n_layer, True, True, torch.float32, "cpu")
    ids = ids_of()
    want = case["reference"](input_ids=ids[None]).logits[0]
    assert (run(chunk, ids, 0) - want).abs().max() <= 1e-4
    changed = {k for k in weights if merged[k] is not weights[k]}
    assert changed == {k + ".weight" for k in case["adapter"].weights}  # the rest are the same tensors


def test_adapter_bookkeeping(case):
    adapter, config = case["adapter"], case["config"]
    n = config.n_layer
    assert adapter.kind == "lora" and adapter.alpha == 16.0
    want_layers = {1, 3} if case["name"] == "llama-some-layers" else set(range(n))
    assert adapter.layers() == want_layers
    low = adapter.for_layers(0, 2)
    assert {int(k.split(".")[1]) for k in low} == want_layers & {0, 1}
    assert adapter.nbytes() == adapter.nbytes(low) + adapter.nbytes(adapter.for_layers(2, n))
    assert adapter.rank == (12 if case["name"] == "llama-rank-pattern" else 8)
    for a, b in adapter.weights.values():  # numpy: a ggml starter reads adapters without torch
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype == np.float32 and a.shape[0] == b.shape[1]


@torch.no_grad()
def test_split_chunks_take_their_layers(case):
    """Two nodes, blocks [0, 2) and [2, n), each holding only its layers' pairs."""
    adapter, n = case["adapter"], case["config"].n_layer
    front = base_chunk(case["base_dir"], 0, 2, True, False)
    back = base_chunk(case["base_dir"], 2, n, False, True)
    front.set_adapter(1, adapter.for_layers(0, 2))
    back.set_adapter(1, adapter.for_layers(2, n))
    ids = ids_of(n=12)
    front.allocate_cache(1, 12)
    back.allocate_cache(1, 12)
    batch = RowBatch.of([0], [0], [12], adapters=[1])
    got = back.head(back.forward_rows(front.forward_rows(front.embed(ids, 0), batch), batch))
    want = case["reference"](input_ids=ids[None]).logits[0]
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.usefixtures("on_torch")  # a float checkpoint without a GGUF, against peft's float model
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ring_logits_match_peft(family, workers, tmp_path, monkeypatch):
    """Over a real 3-node ring (starter + 2 worker processes, each holding only its layers'
    A/B matrices): the logits the starter's head computes for a 20-token prompt and each
    cached decode step equal PeftModel's on the same ids within 1e-4."""
    from mdi.model.transformer import ModelChunk
    from mdi.starter import batch
    from mdi.starter.planning import run_shape
    from test_adapter_ring import config_for
    make, lora = CASES[family]
    base_dir, adapter_dir = make_adapter(tmp_path, make, **lora)
    from tokenizers import Tokenizer, models  # any tokenizer over the vocabulary: the ids are given
    Tokenizer(models.WordLevel({"t%d" % i: i for i in range(VOCAB)}, unk_token="t0")).save(
        os.path.join(base_dir, "tokenizer.json"))
    ids = ids_of(seed=4, n=PREFILL)
    monkeypatch.setattr(run_shape, "encode_prompts", lambda source, prompts: [ids.tolist()])
    heads = []
    plain_head = ModelChunk.head

    def recording_head(self, x):  # the starter runs in this process: record what it samples from
        out = plain_head(self, x)
        heads.append(out.detach().clone())
        return out
    monkeypatch.setattr(ModelChunk, "head", recording_head)
    n_layer = read_hf_dir(base_dir)[0].n_layer
    cfg = config_for(base_dir, {"a": adapter_dir}, workers[:2], counts=[1, 1, n_layer - 2], n_tokens=DECODE)
    sample = batch.run(cfg, ["(ids given above)"], adapters=["a"]).samples[0]
    assert len(heads) == len(sample.token_ids) >= 2
    seen = torch.cat([ids, torch.tensor(sample.token_ids[:-1])])
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir).eval()(input_ids=seen[None]).logits[0]
    got = torch.cat(heads)
    assert (got - want[PREFILL - 1:]).abs().max() <= 1e-4


# ----------------------------------------------------------------------------- refusals

@pytest.fixture
def llama_adapter(tmp_path):
    return make_adapter(tmp_path, hf_llama, target_modules=LLAMA_ALL)


def wide_llama(_):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=176, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    return cfg, transformers.LlamaForCausalLM(cfg)


def test_adapter_of_another_base_is_refused(tmp_path, llama_adapter):
    base_dir, _ = llama_adapter
    _, wide = make_adapter(tmp_path / "wide", wide_llama, target_modules=LLAMA_ALL)
    with pytest.raises(AdapterError) as e:
        load_adapter(wide, base_config(base_dir))
    msg = str(e.value)
    assert "\n" not in msg and "adapter adapter: %s: base_model.model.model.layers.0." \
        % os.path.join(wide, "adapter_model.safetensors") in msg  # the file, then the tensor
    assert "mlp.down_proj.lora_B.weight has shape [96, 8], the base model needs [64, 8]" in msg


def test_torch_save_only_adapter_is_refused(tmp_path, llama_adapter):
    base_dir, adapter_dir = llama_adapter
    os.rename(os.path.join(adapter_dir, "adapter_model.safetensors"), os.path.join(adapter_dir, "adapter_model.bin"))
    with pytest.raises(AdapterError, match=r"adapter_model\.bin is a torch\.save file, which mdi never reads"):
        load_adapter(adapter_dir, base_config(base_dir))


def test_a_bfloat16_adapter_reads_as_its_float32_values(llama_adapter):
    """numpy has no bfloat16: such a file's values are widened from its own bytes, exactly, and a
    mixed file's other tensors read as they are."""
    base_dir, adapter_dir = llama_adapter
    config = base_config(base_dir)

    def to_bf16(tensors):
        for i, k in enumerate(sorted(tensors)):
            tensors[k] = tensors[k].to(torch.bfloat16 if i % 2 else torch.float16)
    edit_tensors(adapter_dir, to_bf16)
    adapter = load_adapter(adapter_dir, config)
    from safetensors.torch import load_file
    rounded = {k: t.float() for k, t in load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).items()}
    edit_tensors(adapter_dir, lambda t: t.update(rounded))
    want = load_adapter(adapter_dir, config)
    assert adapter.weights.keys() == want.weights.keys()
    for k, (a, b) in want.weights.items():
        assert np.array_equal(adapter.weights[k][0], a) and np.array_equal(adapter.weights[k][1], b), k


def test_dora_is_refused(tmp_path):
    base_dir, adapter_dir = make_adapter(tmp_path, hf_llama, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(AdapterError, match=r"adapter_config\.json sets use_dora = true: DoRA is not supported"):
        load_adapter(adapter_dir, base_config(base_dir))


def edit_config(adapter_dir, **changes):
    fn = os.path.join(adapter_dir, "adapter_config.json")
    with open(fn) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(fn, "w") as f:
        json.dump(cfg, f)


def edit_tensors(adapter_dir, change):
    from safetensors.torch import load_file, save_file
    fn = os.path.join(adapter_dir, "adapter_model.safetensors")
    tensors = load_file(fn)
    change(tensors)
    save_file(tensors, fn)


@pytest.mark.parametrize("edit, match", [
    (lambda d: edit_config(d, peft_type="IA3"), r"peft_type \"IA3\", only LORA"),
    (lambda d: edit_config(d, bias="all"), r"sets bias = \"all\""),
    (lambda d: edit_config(d, modules_to_save=["lm_head"]), r"sets modules_to_save"),
    (lambda d: edit_config(d, target_modules=LLAMA_ALL + ["lm_head"]), r"targets lm_head: .* not supported yet"),
    (lambda d: edit_config(d, layers_to_transform=[0, 4]), r"layers_to_transform names layer 4, outside"),
    (lambda d: edit_tensors(d, lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(VOCAB, 8)})),
     r"holds base_model\.model\.lm_head\.lora_A\.weight: .* not supported yet"),
    (lambda d: edit_tensors(d, lambda t: t.update({
        "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.zeros(8, 8)})),
     r"self_attn\.rotary\.lora_A\.weight: model\.layers\.0\.self_attn\.rotary is not a linear layer mdi knows"),
    (lambda d: edit_tensors(d, lambda t: t.update({
        "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)})),
     r"layers\.7\.self_attn\.q_proj\.lora_A\.weight, for layer 7; the base model has 4 layers"),
    (lambda d: edit_tensors(d, lambda t: t.pop("base_model.model.model.layers.2.mlp.up_proj.lora_B.weight")),
     r"holds base_model\.model\.model\.layers\.2\.mlp\.up_proj\.lora_A\.weight but not its lora_B"),
    (lambda d: edit_tensors(d, lambda t: [t.pop(k) for k in list(t) if "layers.2.mlp.up_proj" in k]),
     r"has no base_model\.model\.model\.layers\.2\.mlp\.up_proj\.lora_A\.weight, which adapter_config\.json targets"),
    (lambda d: edit_config(d, target_modules=["q_proj"]), r"mlp\.down_proj\.lora_A\.weight, a module adapter_config"),
    (lambda d: edit_tensors(d, lambda t: t.update({
        "base_model.model.vision.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.vision.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)})),
     r"holds base_model\.model\.vision\.layers\.0\.self_attn\.q_proj\.lora_A\.weight, of a second stack of blocks"),
    (lambda d: edit_config(d, r=4),
     r"down_proj\.lora_A\.weight has shape \[8, 176\], its rank 8 is not the 4 adapter_config"),
], ids=["peft-type", "bias", "modules-to-save", "lm-head-target", "layer-outside", "lm-head-tensor", "unknown-module",
        "layer-tensor-outside", "half-pair", "missing-module", "untargeted-tensor", "two-stacks", "rank-mismatch"])
def test_unsupported_adapters_are_refused(llama_adapter, edit, match):
    base_dir, adapter_dir = llama_adapter
    edit(adapter_dir)
    with pytest.raises(AdapterError, match=match) as e:
        load_adapter(adapter_dir, base_config(base_dir))
    assert "\n" not in str(e.value) and str(e.value).startswith("adapter adapter: ")


def test_a_mix_adds_the_scaled_deltas(llama_adapter, tmp_path):
    from mdi.lab.random_lora import write_random_lora
    from mdi.model.adapters.lora import SoftPrompt, mix_adapters
    base_dir, adapter_dir = llama_adapter
    config = base_config(base_dir)
    one = load_adapter(adapter_dir, config)
    # the second adapter leaves layer 0 alone: a mix holds each layer its parts touch
    other = load_adapter(write_random_lora(str(tmp_path / "other"), config, seed=9, rank=3,
                                           layers=range(1, config.n_layer)), config)
    mix = mix_adapters([(one, 0.5), (other, -2.0)], "mix")
    assert set(mix.weights) == set(one.weights) | set(other.weights)
    for name, (a, b) in mix.weights.items():
        want = sum(s * (x.weights[name][1] @ x.weights[name][0]) for x, s in ((one, 0.5), (other, -2.0))
                   if name in x.weights)
        assert np.allclose(b @ a, want, atol=1e-6), name
    assert mix.rank == one.rank + other.rank
    soft = SoftPrompt("soft", "p", torch.zeros(2, config.n_embd))
    with pytest.raises(AdapterError, match="soft is a prompt-tuning adapter"):
        mix_adapters([(one, 1.0), (soft, 1.0)], "bad")


def test_merge_refuses_quantized_weights(llama_adapter):
    from mdi.model.quantization.quant import convert, gather, uniform_layout
    base_dir, adapter_dir = llama_adapter
    config, weights = read_hf_dir(base_dir)
    adapter = load_adapter(adapter_dir, config)
    quant = uniform_layout(config, (0, config.n_layer), False, False, "int8", None)
    flat = convert(weights, quant, torch.float32)  # what a node loads: qweight / scales tensors
    for stored in (flat, gather(flat)):  # and as a checkpoint holds it: one QParts per weight
        with pytest.raises(AdapterError, match=r"^adapter adapter: blocks\.0\.attn\.proj\.weight is quantized; "
                                               r"merge the adapter into the float weights, then quantize$"):
            merge_adapter(stored, adapter)


def test_pattern_keys_follow_peft():
    from peft.utils.other import get_pattern_key as peft_rule
    keys = ["q_proj", "mlp.down_proj", r"layers\.1\..*v_proj", "layers.3.self_attn.k_proj"]
    for module in ["model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj",
                   "model.layers.1.self_attn.v_proj", "model.layers.0.self_attn.v_proj",
                   "model.layers.3.self_attn.k_proj", "model.layers.13.self_attn.k_proj", "model.layers.0.mlp.xq_proj"]:
        assert get_pattern_key(keys, module) == peft_rule(keys, module)


# ----------------------------------------------------------------------------- LoRA GGUF

def write_lora_gguf(path, adapter_dir, base_dir, arch):
    """The adapter as llama.cpp's convert_lora_to_gguf.py writes it: base tensor names + .lora_a
    / .lora_b, F32, alpha in adapter.lora.alpha, q/k's B rows permuted for the llama arch."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file
    from test_gguf_families import permute

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        lparams = json.load(f)
    with open(os.path.join(base_dir, "config.json")) as f:
        hp = json.load(f)
    n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lparams["lora_alpha"]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hp["num_hidden_layers"])
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    for name in sorted(tensors):
        if ".lora_A." not in name:
            continue
        a, b = tensors[name].astype(np.float32), tensors[name.replace(".lora_A.", ".lora_B.")].astype(np.float32)
        base = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        if arch == "llama" and base.endswith("q_proj.weight"):  # LoraTorchTensor.permute: B's rows only
            b = permute(b, n_head, n_head)
        if arch == "llama" and base.endswith("k_proj.weight"):
            b = permute(b, n_head, n_kv)
        dest = names.get_name(base, try_suffixes=(".weight",))
        w.add_tensor(dest + ".lora_a", a)
        w.add_tensor(dest + ".lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.no_grad()
def test_gguf_lora_matches_peft(tmp_path, arch):
    base_dir, adapter_dir = make_adapter(tmp_path, hf_llama, target_modules=LLAMA_ALL)
    fn = write_lora_gguf(tmp_path / "lora.gguf", adapter_dir, base_dir, arch)
    chunk = base_chunk(base_dir)
    adapter = load_gguf_lora(fn, chunk.config)
    assert adapter.name == "lora" and adapter.rank == 8 and adapter.alpha == 16.0
    peft_adapter = load_adapter(adapter_dir, chunk.config)
    for k, (a, b) in peft_adapter.weights.items():  # the same pairs, whatever the file
        assert np.allclose(adapter.weights[k][0], a) and np.allclose(adapter.weights[k][1], b, atol=1e-7)
    chunk.set_adapter(1, adapter.weights)
    ids = ids_of()
    want = peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir).eval()(input_ids=ids[None]).logits[0]
    assert (run(chunk, ids, 1) - want).abs().max() <= 1e-4
    assert load_adapter(fn, chunk.config).weights.keys() == adapter.weights.keys()  # .gguf paths go here too


def test_gguf_lora_refusals(tmp_path):
    gguf = pytest.importorskip("gguf")
    base_dir, _ = make_adapter(tmp_path, hf_llama, target_modules=["q_proj"])
    config = base_config(base_dir)

    def write(fn, kind="adapter", tensors=()):
        w = gguf.GGUFWriter(str(tmp_path / fn), "llama")
        w.add_type(kind)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        for name, t in tensors:
            w.add_tensor(name, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(tmp_path / fn)

    with pytest.raises(AdapterError, match=r"general\.type = 'model', a LoRA adapter GGUF has 'adapter'"):
        load_gguf_lora(write("model.gguf", "model"), config)
    a, b = np.zeros((8, 64), np.float32), np.zeros((VOCAB, 8), np.float32)
    with pytest.raises(AdapterError, match=r"output\.weight\.lora_a: adapters on the embedding or the LM head"):
        load_gguf_lora(write("head.gguf", tensors=[("output.weight.lora_a", a), ("output.weight.lora_b", b)]), config)
    with pytest.raises(AdapterError, match=r"blk\.0\.attn_q\.weight\.lora_b has shape \[500, 8\], the base model "
                                           r"needs \[64, 8\]"):
        load_gguf_lora(write("wide.gguf", tensors=[("blk.0.attn_q.weight.lora_a", a),
                                                   ("blk.0.attn_q.weight.lora_b", b)]), config)


def test_a_backtracking_target_pattern_is_stopped_and_named(tmp_path, monkeypatch):
    # "(.*.*)*Z" backtracks exponentially on a module name (5 s for 14 characters, for ever
    # for "model.layers.0.self_attn.q_proj"): it runs in a child process, stopped in time, and
    # the caller (a serving starter's thread) is never frozen meanwhile.
    import json
    import time
    from mdi.model.adapters import peft_targets
    from test_adapter_ring import write_peft_lora
    from conftest import tiny_config
    config = tiny_config("llama")
    path = write_peft_lora(str(tmp_path / "evil"), config, seed=1)
    cfg_path = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    monkeypatch.setattr(peft_targets, "MATCH_TIMEOUT_S", 2.0)
    for pattern, needle in (("(.*.*)*Z", "took more than 2 s"), ("x" * 2000, "at most 1000 characters"),
                            ("(unclosed", "not a regular expression")):
        json.dump(dict(cfg, target_modules=pattern), open(cfg_path, "w"))
        t0 = time.monotonic()
        with pytest.raises(AdapterError) as e:
            load_adapter(path, config, "evil")
        assert time.monotonic() - t0 < 30 and needle in str(e.value), str(e.value)
    # a regex that matches every block's linears still loads, through the child process (given
    # the default time: a busy machine may take 2 s to start the child)
    monkeypatch.undo()
    json.dump(dict(cfg, target_modules=r".*\.(qkv|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|"
                                        r"c_attn|c_proj|c_fc)"), open(cfg_path, "w"))
    assert load_adapter(path, config, "ok").rank == 4


@pytest.mark.parametrize("key,value", [("rank_pattern", 0.5), ("rank_pattern", 0), ("alpha_pattern", -1.0),
                                       ("r", 0), ("lora_alpha", float("inf")), ("alpha_pattern", float("inf"))])
def test_a_zero_or_fractional_rank_is_one_line(tmp_path, key, value):
    import json
    from test_adapter_ring import write_peft_lora
    from conftest import tiny_config
    config = tiny_config("llama")
    path = write_peft_lora(str(tmp_path / "a"), config, seed=1)
    cfg_path = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg[key] = {"q_proj": value} if key.endswith("_pattern") else value
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(AdapterError) as e:
        load_adapter(path, config, "a")
    assert key in str(e.value) and "\n" not in str(e.value)


def test_a_finite_but_absurd_lora_alpha_is_refused_at_load_not_at_each_request(tmp_path):
    """lora_alpha 1e30 kept the scaled B finite, so it loaded, and then every request using it
    failed with non-finite logits; a usual alpha (the test's 16, or 1000) still loads."""
    import json
    from test_adapter_ring import write_peft_lora
    from conftest import tiny_config
    config = tiny_config("llama")
    path = write_peft_lora(str(tmp_path / "a"), config, seed=1)
    cfg_path = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    for alpha in (1000.0, 1e30):
        json.dump(dict(cfg, lora_alpha=alpha), open(cfg_path, "w"))
        if alpha < 1e6:
            assert load_adapter(path, config, "a").rank == cfg["r"]
            continue
        with pytest.raises(AdapterError) as e:
            load_adapter(path, config, "a")
        assert "lora_alpha" in str(e.value) and "adapter_model.safetensors" in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_an_adapter_config_nested_past_the_stack_is_one_line_naming_it(tmp_path):
    from test_adapter_ring import write_peft_lora
    from conftest import tiny_config
    config = tiny_config("llama")
    path = write_peft_lora(str(tmp_path / "a"), config, seed=1)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("[" * 200000 + "]" * 200000)
    with pytest.raises(AdapterError, match=r"adapter_config\.json \(") as e:
        load_adapter(path, config, "a")
    assert "cannot read" in str(e.value) and "\n" not in str(e.value)


def test_non_finite_adapter_values_are_refused_naming_the_file_and_tensor(tmp_path, llama_adapter):
    """A NaN in a LoRA the starter holds loaded, and then failed every request naming it; a
    worker's refusal named only its own layer. A soft prompt's got through too."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    base_dir, adapter_dir = llama_adapter
    st = os.path.join(adapter_dir, "adapter_model.safetensors")
    tensors = load_file(st)
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name][0, 0] = np.nan
    save_file(tensors, st)
    with pytest.raises(AdapterError) as e:
        load_adapter(adapter_dir, base_config(base_dir))
    assert "\n" not in str(e.value) and "%s: %s holds NaN or infinite values" % (st, name) in str(e.value)
    soft = tmp_path / "soft"
    soft.mkdir()
    config = base_config(base_dir)
    embeddings = np.ones((2, config.n_embd), np.float32)
    embeddings[1, 3] = np.inf
    save_file({"prompt_embeddings": embeddings}, str(soft / "adapter_model.safetensors"))
    (soft / "adapter_config.json").write_text(json.dumps({"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 2}))
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: prompt_embeddings holds NaN or infinite"):
        load_any(str(soft), config)
