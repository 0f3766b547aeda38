"""mdi on a CUDA GPU: the paths that CPU runs never take (tensors moved to the device, CUDA
kernels, activations between a GPU and the wire) give what the CPU paths and transformers give.

- float32: prefill and cached decode logits within 1e-4 of transformers on the same device;
- float16 / bfloat16: greedy ids identical to transformers' in the same dtype for 32 tokens, on
  random models with clear margins and on the shipped trained NanoGPT; where they part, only
  at a genuine near tie of the reference (its top-2 margin below HALF_TIE, printed), and its
  logits no farther from float32's than transformers' own are;
- a ring of real processes sharing the GPU (starter + 2 workers, layers [1, 2, 1]) gives the
  standalone greedy ids; a mixed ring (starter on the CPU, workers on the GPU) gives the CPU's;
- quantized int8/int4 layers compute their dequantized twins on the device, and the CUDA int4
  kernels (tinygemm, sm80+) are offered, measured right and never silently rejected;
- batched passes (prefill and decode rows of several samples in one forward) match each sample
  alone on the device, and a ring with max_batch > 1 gives the unbatched ids;
- float16 weights computing in float16 on the GPU run a ring whose activations cross the wire
  as float16, with the standalone ids;
- speculative decoding on the device (drafts verified as rows of one pass, passes in flight on
  guesses, stale ones dropped) gives the plain greedy ids, on one process and on the ring, and
  the starter measures its pass costs there.

Without a GPU the same tests run with device "cpu" (CI), so their own logic is checked on every
machine (the CUDA int4 kernels' tests then check their CPU twins) and a change that breaks them
is found before a GPU run; tests that only mean something on a GPU skip there. Diagnostics (tie
margins, logit errors, kernel choices) are printed: -s or -rP shows them for passing tests.
"""
import importlib.util
import os
import threading

import pytest
import torch
from safetensors import safe_open

from conftest import CHARS, ROOT, free_ports, tiny_config, tiny_model
from ringconfigs import parse_run_config
from mdi.model.config import ModelConfig
from mdi.model.files.checkpoints import read_checkpoint, read_hf_dir
from mdi.model.files.store import save_model_dir
from mdi.model.layout import QuantSpec
from mdi.model.quantization import kernel_choice, qkernels
from mdi.model.quantization.quant import convert, dequantize, gather, quantize, uniform_layout
from mdi.model.row_batch import RowBatch
from mdi.model.source import ModelSource, build_chunk
from mdi.model.tokenizers import char_tokenizer
from mdi.model.transformer import full_model
from mdi.ring.wire import payload_nbytes
from mdi.starter import batch
from mdi.starter.control import NodeRegistry


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NANOGPT = os.path.join(ROOT, "models", "nanogpt-shakespeare")
PREFILL, DECODE, GREEDY = 24, 20, 32
PROMPTS = ["The quick brown fox jumps", "Hi", "To be, or not to be, that is", "0123", "abc def ghi jkl mno pqr",
           "x", "Once upon a time there", "ring"]
# A greedy step that two half-precision computations may rightly decide differently (a near tie):
# the reference's best two logits, and mdi's pick and the reference's best, closer than this
# fraction of the step's largest |logit|. float16 keeps 11 significant bits, bfloat16 8: on these
# models each computation's logits stray from float32's by up to ~0.5% (float16) and ~5%
# (bfloat16) of that scale (measured on the CPU, transformers' as much as mdi's), so two of them
# from each other by up to twice that.
HALF_TIE = {torch.float16: 2e-2, torch.bfloat16: 1.2e-1}
# mdi's half-precision logits on the reference's path may stray from float32's at most this many
# times as far as transformers' own do, plus a few units of the dtype's last place at the logits' scale.
HALF_ERROR_RATIO, HALF_ERROR_ULPS = 2.0, 4


@pytest.fixture(scope="session")
def device():
    """"cuda" where there is a GPU, else "cpu"."""
    return DEVICE


def skip_unless_dtype_runs(dtype, device):
    if dtype == torch.bfloat16 and device == "cuda" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16 arithmetic")


# --------------------------------------------------------------------------- transformers twins

def _widen(model):
    """Weights wider than transformers' init: wider logit margins, and text that does not
    collapse to one token (10-28 distinct ids in 32). Not conftest.tiny_model's 0.3: through 4
    layers that amplifies bfloat16's rounding to ~20% of the logits' scale (transformers' own)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)


def _random_pair(builder, path, widen):
    torch.manual_seed(0)
    _, hf = builder(path)
    if widen:
        _widen(hf)
    hf.eval().save_pretrained(str(path))
    hf = type(hf).from_pretrained(str(path)).eval()  # compare what is on disk, as mdi reads it
    config, weights = read_hf_dir(str(path))
    prompts = [[5, 17, 99, 3, 250, 42], [1, 2, 3], [400, 7, 7, 7, 123, 9, 64, 300, 11, 2]]
    return hf, config, weights, prompts


def hf_nanogpt_twin():
    """transformers' GPT2LMHeadModel holding the shipped NanoGPT's weights (the inverse of
    mdi.model.files.convert.convert_gpt2: Conv1D weights are [in, out]), and its prompts as ids."""
    import transformers
    config, sd = read_checkpoint(NANOGPT)
    cfg = transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, n_inner=config.intermediate_size, layer_norm_epsilon=config.norm_eps,
        activation_function="gelu" if config.gelu_approximate == "none" else "gelu_new",
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(cfg)
    out = {"transformer.wte.weight": sd["tok_emb.weight"], "transformer.wpe.weight": sd["pos_emb.weight"],
           "transformer.ln_f.weight": sd["norm_f.weight"], "transformer.ln_f.bias": sd["norm_f.bias"]}
    pairs = [("ln_1", "norm1"), ("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
             ("ln_2", "norm2"), ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj")]
    for i in range(config.n_layer):
        for theirs, ours in pairs:
            w = sd["blocks.%d.%s.weight" % (i, ours)]
            out["transformer.h.%d.%s.weight" % (i, theirs)] = w.t().contiguous() if w.dim() == 2 else w
            out["transformer.h.%d.%s.bias" % (i, theirs)] = sd["blocks.%d.%s.bias" % (i, ours)]
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert not unexpected and all(k == "lm_head.weight" or k.endswith("attn.bias") for k in missing), \
        (missing, unexpected)
    hf.tie_weights()
    tok = ModelSource(NANOGPT).tokenizer
    prompts = [tok.encode_prompt(p) for p in ("ROMEO:", "JULIET:\nO ", "First Citizen:\nWe")]
    return hf.eval(), config, sd, prompts


def _builders():
    """test_model_parity's random transformers models, then the shipped NanoGPT; none without
    transformers (those tests then skip, the others still run)."""
    if importlib.util.find_spec("transformers") is None:
        return []
    from test_model_parity import hf_gpt2, hf_llama, hf_llama3, hf_qwen2, hf_qwen3
    return [hf_gpt2, hf_llama, hf_llama3, hf_qwen2, hf_qwen3, "nanogpt"]


MODEL_IDS = ["gpt2", "llama-gqa", "llama3-rope-scaling", "qwen2", "qwen3", "nanogpt-shakespeare"]


def make_pair(builder, tmp_path, widen):
    if builder == "nanogpt":
        return hf_nanogpt_twin()  # trained: its own margins
    return _random_pair(builder, tmp_path, widen)


def chunk_device(chunk):
    return next(chunk.parameters()).device


@torch.no_grad()
def mdi_greedy(chunk, prompt, n=GREEDY):
    """n greedy ids after `prompt` on a full-model chunk, one cached step at a time, every
    tensor on the chunk's device."""
    dev = chunk_device(chunk)
    chunk.allocate_cache(1, len(prompt) + n)
    x = chunk.forward_blocks(chunk.embed(torch.tensor(prompt, device=dev), 0), 0, 0)
    got = []
    for _ in range(n):
        token = int(chunk.head(x[-1:]).argmax())
        got.append(token)
        pos = len(prompt) + len(got) - 1
        x = chunk.forward_blocks(chunk.embed(torch.tensor([token], device=dev), pos), 0, pos)
    return got


@torch.no_grad()
def mdi_logits_along(chunk, prompt, tokens):
    """mdi's logits [len(tokens), vocab] at each step of a path it is made to follow (the
    prompt, then `tokens` one cached step at a time), as float32 on the CPU."""
    dev = chunk_device(chunk)
    chunk.allocate_cache(1, len(prompt) + len(tokens))
    out = [chunk.head(chunk.forward_blocks(chunk.embed(torch.tensor(prompt, device=dev), 0), 0, 0)[-1:])]
    for i, token in enumerate(tokens[:-1]):
        pos = len(prompt) + i
        out.append(chunk.head(chunk.forward_blocks(chunk.embed(torch.tensor([token], device=dev), pos), 0, pos)))
    return torch.cat(out).float().cpu()


@torch.no_grad()
def hf_greedy(hf, prompt, device, n=GREEDY):
    """transformers' own greedy generation: the ids and the logits each step chose from.
    No end-of-sequence id (so nothing is masked and all n steps run), and an explicit
    attention mask: generate() would otherwise take the pad id (0, NanoGPT's newline) for padding."""
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float().cpu() for step in out.logits]


def near_tie(ref, token, rel):
    """(the reference's top-2 margin, how far `token` is behind its best, the tolerance), and
    whether both are within it: `rel` of the step's largest |logit|."""
    top = ref.topk(2).values
    tol = rel * float(ref.abs().max())
    margin, behind = float(top[0] - top[1]), float(top[0] - ref[token])
    return margin, behind, tol, margin <= tol and behind <= tol


def assert_same_or_near_ties(got, expected, ref_logits, along, rel, what):
    """mdi's own greedy ids are the reference's, or part from them first at a near tie; and on
    the reference's path (`along`: mdi's logits there) every step mdi would decide otherwise
    is a near tie too, so the 32 steps are all checked even after a tie was broken the other way."""
    assert len(got) == len(expected) == len(ref_logits) == len(along)
    if got != expected:
        k = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        margin, behind, tol, ok = near_tie(ref_logits[k], got[k], rel)
        print("%s: ids part at step %d of %d: reference %d, mdi %d; reference top-2 margin %.4g, mdi's token %.4g "
              "behind (tolerance %.4g)" % (what, k, len(expected), expected[k], got[k], margin, behind, tol))
        assert ok, "%s: greedy ids differ at step %d where the reference's margin is %.4g and mdi's token %.4g " \
            "behind, over %.4g: not a near tie" % (what, k, margin, behind, tol)
    for k, (ours, ref) in enumerate(zip(along, ref_logits)):
        pick = int(ours.argmax())
        if pick != expected[k]:
            margin, behind, tol, ok = near_tie(ref, pick, rel)
            assert ok, "%s: on the reference's path mdi picks %d, not %d, at step %d where the reference's margin " \
                "is %.4g and that token %.4g behind, over %.4g: not a near tie" \
                % (what, pick, expected[k], k, margin, behind, tol)


# ------------------------------------------------------------------------- 1. float32 parity

@pytest.mark.timeout(180)
@pytest.mark.parametrize("builder", _builders(), ids=MODEL_IDS)
@torch.no_grad()
def test_float32_logits_match_transformers(device, builder, tmp_path):
    hf, config, weights, _ = make_pair(builder, tmp_path, widen=False)
    hf = hf.to(device)
    ours = build_chunk(config, weights, 0, config.n_layer, True, True, torch.float32, device)
    assert chunk_device(ours).type == device and ours.cache is None
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (PREFILL + DECODE,), device=device)
    reference = hf(ids[None]).logits[0]
    ours.allocate_cache(2, PREFILL + DECODE)
    assert ours.cache.k.device.type == device
    slot = 1  # not slot 0, so a wrong slot selection would show
    logits = [ours.head(ours.forward_blocks(ours.embed(ids[:PREFILL], 0), slot, 0))]
    for t in range(PREFILL, PREFILL + DECODE):
        logits.append(ours.head(ours.forward_blocks(ours.embed(ids[t:t + 1], t), slot, t)))
    got = torch.cat(logits)
    assert got.device.type == device
    assert (got[:PREFILL] - reference[:PREFILL]).abs().max().item() <= 1e-4
    assert (got[PREFILL:] - reference[PREFILL:]).abs().max().item() <= 1e-4


# ---------------------------------------------------------------- 2. float16 / bfloat16 greedy

@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("builder", _builders(), ids=MODEL_IDS)
@torch.no_grad()
def test_half_precision_greedy_ids_match_transformers(device, builder, dtype, tmp_path, request):
    skip_unless_dtype_runs(dtype, device)
    hf, config, weights, prompts = make_pair(builder, tmp_path, widen=True)
    hf = hf.to(device=device, dtype=dtype)
    ours = build_chunk(config, weights, 0, config.n_layer, True, True, dtype, device)
    assert next(ours.parameters()).dtype == dtype and ours.compute_dtype is None
    exact = build_chunk(config, weights, 0, config.n_layer, True, True, torch.float32, device)  # test 1's
    for prompt in prompts:
        what = "%s prompt %s" % (request.node.callspec.id, prompt)
        expected, logits = hf_greedy(hf, prompt, device)
        assert len(expected) == GREEDY
        got = mdi_greedy(ours, prompt)
        along = mdi_logits_along(ours, prompt, expected)
        assert_same_or_near_ties(got, expected, logits, along, HALF_TIE[dtype], what)
        # As accurate as transformers in the same dtype: the float32 logits on the same path
        # are the yardstick for both.
        truth = mdi_logits_along(exact, prompt, expected)
        ours_off = float((along - truth).abs().max())
        theirs_off = float((torch.stack(logits) - truth).abs().max())
        slack = HALF_ERROR_ULPS * torch.finfo(dtype).eps * float(truth.abs().max())
        print("%s: largest logit error vs float32: mdi %.4g, transformers %.4g" % (what, ours_off, theirs_off))
        assert ours_off <= HALF_ERROR_RATIO * theirs_off + slack, \
            "%s: mdi's %s logits stray %.4g from float32's, transformers' %.4g" % (what, dtype, ours_off, theirs_off)


# --------------------------------------------------------------------------------- ring helpers

@pytest.fixture(scope="module")
def data_ports():
    return free_ports(4)


def ring_config(model, workers, data_ports, counts, device, worker_device=None, dtype="float32",
                n_tokens=16, speculation="off", **runtime):
    """A ring: the starter and len(counts) - 1 workers; `device` is model.device (the starter's
    and, unless `worker_device` says otherwise, the workers'). counts [n]: standalone."""
    on_workers = {} if worker_device is None else {i: {"device": worker_device} for i in range(1, len(counts))}
    return parse_run_config(model, workers[:len(counts) - 1], "test_cuda", layers=counts, data_ports=data_ports,
                            node_options=on_workers, device=device, dtype=dtype, n_tokens=n_tokens,
                            generation={"seed": 7, "speculation": speculation},
                            runtime=dict({"ring_timeout": 60}, **runtime))


def run_ids(cfg, prompts, drafter_factory=None):
    """Every sample's ids and the run's result; `drafter_factory` replaces the speculation
    method's drafter (None: the method's own)."""
    def hook(engine):
        engine.drafter_factory = drafter_factory
    result = batch.run(cfg, prompts, on_engine=hook)
    assert all(s.finish_reason == "length" for s in result.samples), [s.error for s in result.samples]
    return [s.token_ids for s in result.samples], result


def worker_devices(cfg):
    """The device each worker of `cfg` reports holding its weights on (GET /status)."""
    registry = NodeRegistry.for_run(cfg)
    return [registry.client(node).status().device for node in cfg.workers]


# ------------------------------------------------------------------ 3. a ring sharing the GPU

@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ring_sharing_the_device_matches_standalone(device, family, tiny_models, workers, data_ports):
    """Starter and two worker processes on one GPU, five samples in flight."""
    model = tiny_models[family]
    prompts = PROMPTS[:5]
    alone, _ = run_ids(ring_config(model, workers, data_ports, [4], device), prompts)
    cfg = ring_config(model, workers, data_ports, [1, 2, 1], device)
    got, result = run_ids(cfg, prompts)
    assert got == alone
    assert len(result.metrics()["nodes"]) == 3 and all(n["messages_sent"] > 0 for n in result.metrics()["nodes"])
    assert worker_devices(cfg) == [device, device]


# ------------------------------------------------------------ 4. starter on CPU, workers on GPU

@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mixed_ring_cpu_starter_device_workers_matches_cpu(device, family, tiny_models, workers, data_ports):
    model = tiny_models[family]
    prompts = PROMPTS[:3]
    alone, _ = run_ids(ring_config(model, workers, data_ports, [4], "cpu"), prompts)
    cfg = ring_config(model, workers, data_ports, [1, 1, 1, 1], "cpu", worker_device=device)
    got, result = run_ids(cfg, prompts)
    assert got == alone
    # The run's per-node metrics do not name a node's device: each worker's /status does.
    assert worker_devices(cfg) == [device] * 3
    assert len(result.metrics()["nodes"]) == 4



@pytest.mark.timeout(300)
def test_memory_a_gpu_node_reports_and_checks_is_the_gpus(device, tiny_models, workers, data_ports):
    """On a discrete GPU the weights and cache live in its own memory: what a worker holding
    layers there reports free (/status, which the planner and --check read) and what the
    starter checks its chunk against are the GPU's free memory, not the host's RAM."""
    if device != "cuda" or torch.cuda.get_device_properties(0).is_integrated:
        pytest.skip("needs a discrete GPU (a Jetson's GPU draws on the host's RAM)")
    from mdi.system.memory import available_memory_bytes, free_bytes_on
    slack = 2 << 30  # other processes of the suite may allocate in between
    free, total = torch.cuda.mem_get_info()
    host = available_memory_bytes()
    assert abs(free_bytes_on("cuda") - free) <= slack and free_bytes_on("cuda") <= total
    cfg = ring_config(tiny_models["llama"], workers, data_ports, [1, 1, 1, 1], device)
    run_ids(cfg, PROMPTS[:2])
    for node in cfg.workers:
        status = NodeRegistry.for_run(cfg).client(node).status()
        assert status.device == device
        got = status.memory.available_bytes
        assert abs(got - torch.cuda.mem_get_info()[0]) <= slack, (node.name, got, free, host)


@pytest.mark.timeout(120)
def test_decode_on_a_fresh_thread_compiles_no_attention_graph_per_length(device, tiny_models):
    """A worker decodes each run on a new thread, one key length more at every step. torch's
    cuDNN attention compiled a graph per length and per thread (NVRTC), 20-40 ms per ring hop
    on an H200: a chunk placed on a GPU keeps it out, so the steps run flash or memory-efficient
    attention kernels, none of cuDNN's."""
    if device != "cuda":
        pytest.skip("cuDNN attention exists only on a GPU")
    from torch.profiler import ProfilerActivity, profile
    chunk = ModelSource(tiny_models["llama"]).load_chunk(0, 4, True, True, torch.float16, device)
    assert not getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)()
    names = []

    def decode():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mdi_greedy(chunk, [1, 2, 3], n=12)
        names.extend(e.key for e in prof.key_averages())

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join(60)
    assert names, "the profiler saw no CUDA kernel"
    assert not [n for n in names if "cudnn" in n.lower()], names

# ------------------------------------------------------------------- 5. quantized layers

@pytest.fixture
def policy_reset():
    """qkernels' preference is process-wide: put the default back whatever a test set."""
    yield
    qkernels.set_preference(None)


@torch.no_grad()
def _compare(config, layout, policy, tol, device):
    """A chunk holding `layout`'s weights quantized vs a float chunk holding them dequantized,
    both on `device` (tests/test_quant.py's _compare there): prefill and a cached step."""
    torch.manual_seed(3)
    model = full_model(config)
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0, 0.3 if config.n_embd <= 64 else config.n_embd ** -0.5)
    stored = gather(convert(model.state_dict(), layout, torch.float32))
    twin = convert(stored, {}, torch.float32)
    qkernels.set_preference(policy)
    n = config.n_layer
    q = build_chunk(config, convert(stored, layout, torch.float32), 0, n, True, True, torch.float32, device,
                    quant=layout)
    f = build_chunk(config, twin, 0, n, True, True, torch.float32, device)
    ids = torch.randint(0, config.vocab_size, (12,), device=device)
    outs = []
    for chunk in (q, f):
        chunk.allocate_cache(1, 32)
        a = chunk.head(chunk.forward_blocks(chunk.embed(ids, 0), 0, 0))
        b = chunk.head(chunk.forward_blocks(chunk.embed(ids[:1], 12), 0, 12))
        outs.append(torch.cat([a, b]))
    assert outs[0].device.type == device
    diff = float((outs[0] - outs[1]).abs().max() / (outs[1].max() - outs[1].min()))
    assert diff <= tol, (policy, diff)
    return q


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 32), ("int4", 32)])
def test_quantized_chunk_computes_its_dequantized_twin(device, family, kind, group, policy_reset):
    config = tiny_config(family)
    layout = uniform_layout(config, (0, config.n_layer), True, True, kind, group)
    chunk = _compare(config, layout, "exact", 1e-5, device)
    layers = [m for m in chunk.modules() if type(m).__name__ == "QuantLinear"]
    assert layers and all(m.kernel.exact for m in layers)
    assert all(t.device.type == device for m in layers for t in m.packed.values() if isinstance(t, torch.Tensor))
    _compare(config, layout, "fast", 0.15, device)  # whatever this device measures fastest
    print("%s %s/%s fast:" % (family, kind, group), kernel_choice.chosen_by_weight())  # what the device offered


# Where these kernels apply: n_in a multiple of 1024, n_out of 8, groups of 32..256 (tinygemm).
# On the CPU their CPU twins stand in, so that this test's own logic runs.
INT4_KERNELS = {"cuda": ("int4pack-cuda", "int8-as-2xint4-cuda"), "cpu": ("int4pack-cpu", "int8-as-2xint4-cpu")}
WIDE = (64, 1024)  # n_out, n_in


def _wide_parts(spec, device):
    torch.manual_seed(5)
    parts = quantize(torch.randn(*WIDE), spec)
    return {k: t.to(device) for k, t in parts.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", [QuantSpec("int4", 32), QuantSpec("int4", 128), QuantSpec("int8", 32),
                                  QuantSpec("int8", 256)], ids=QuantSpec.label)
def test_int4_kernels_are_offered_right_and_chosen_on_the_device(device, spec, policy_reset):
    """tinygemm's packed int4 (and int8 as two int4 halves): a kernel measured wrong is never
    picked, so a broken packing would fall back to dequant in silence; here it must not."""
    dev = torch.device(device)
    name = INT4_KERNELS[device][0 if spec.kind == "int4" else 1]
    if device == "cuda":
        assert torch.cuda.get_device_capability(dev) >= (8, 0), "tinygemm needs sm80+: not this test's GPU"
    kernel = next(k for k in qkernels.KERNELS if k.name == name)
    n_out, n_in = WIDE
    if not kernel.supports(spec, n_out, n_in, dev):
        assert device == "cpu", "%s does not support %s %dx%d on this GPU" % (name, spec, n_out, n_in)
        pytest.skip("this torch has no %s" % name)
    assert name in qkernels.available("fast", dev)
    assert name in qkernels.available(name, dev)
    parts = _wide_parts(spec, device)
    # The kernel itself, on a few rows, against the dequantized float32 product.
    x = torch.randn(5, n_in, device=device)
    ref = (x @ dequantize(parts, spec, n_in).T).float()
    y = kernel.run(x, kernel.pack(parts, spec, n_in), spec, n_in)
    assert y.device.type == device and y.shape == ref.shape and y.dtype == x.dtype
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    print("%s %s: error %.3g of the output's largest value (tolerance %g)" % (name, spec.label(), err, kernel.tolerance))
    assert err <= kernel.tolerance, (name, err)
    # choose() under `fast` measures it and must not have found it wrong or unusable.
    qkernels.set_preference("fast")
    kernel_choice.choose(parts, spec, n_in, dev, "test")
    key = (spec, n_out, n_in, dev.type, torch.get_num_threads(), "fast")
    note = kernel_choice._notes.get(key, {}).get(name)
    assert note is None and kernel_choice._measured[key].get(name) is not None, "%s rejected: %s" % (name, note)
    entry = next(e for e in kernel_choice.chosen() if e["device"] == dev.type and e["weight"] == "%s %dx%d"
                 % (spec.label(), n_out, n_in))
    print("chosen:", entry)
    assert name in entry["why"] and "%s wrong" % name not in entry["why"]
    # Asked for by name, it is the one used.
    qkernels.set_preference(name)
    chosen, packed = kernel_choice.choose(parts, spec, n_in, dev, "test")
    assert chosen.name == name
    assert all(t.device.type == device for t in packed.values() if isinstance(t, torch.Tensor))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_wide_quantized_chunk_uses_the_int4_kernels_and_computes_its_twin(device, kind, policy_reset):
    """A 1024-wide Llama layer quantized in groups of 32: under a kernel's name every block
    weight multiplies with the device's int4 kernel, within bfloat16 rounding of the twin."""
    name = INT4_KERNELS[device][0 if kind == "int4" else 1]
    if name not in qkernels.available(name, torch.device(device)):
        assert device == "cpu", "%s is not offered on this GPU" % name
        pytest.skip("this torch has no %s" % name)
    config = ModelConfig(name="wide-llama", family="llama", vocab_size=len(CHARS), n_layer=1, n_embd=1024,
                         n_head=8, n_kv_head=4, intermediate_size=1024, block_size=64, tied_head=False)
    layout = uniform_layout(config, (0, 1), False, False, kind, 32)  # the blocks; embedding and head float
    chunk = _compare(config, layout, name, 5e-2, device)
    kernels = {n: m.kernel.name for n, m in chunk.named_modules() if type(m).__name__ == "QuantLinear"}
    assert len(kernels) == 4 and set(kernels.values()) == {name}, kernels


# -------------------------------------------------------------------------- 6. batched passes

@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@torch.no_grad()
def test_a_mixed_batch_matches_each_sample_alone(device, family):
    """One forward over a decode row, a whole prompt, a prompt chunk and another decode row of
    four samples gives each sample's own pass (tests/test_batching.py's test, on the device);
    then three steps of decode rows only (the one-SDPA path)."""
    model = tiny_model(family)
    chunk = build_chunk(model.config, model.state_dict(), 0, model.config.n_layer, True, True, torch.float32, device)
    chunk.allocate_cache(8, 64)
    torch.manual_seed(1)
    # Slots 0-3 are served in batches, slots 4-7 one sample at a time: same histories.
    history = {0: 9, 1: 0, 2: 3, 3: 20}
    ids = {s: torch.randint(0, 90, (40,), device=device) for s in history}
    for slot, n in history.items():
        if n:
            for offset in (0, 4):
                chunk.forward_blocks(chunk.embed(ids[slot][:n], 0), slot + offset, 0)

    def both(counts):
        rows = torch.cat([ids[s][history[s]:history[s] + counts[s]] for s in history])
        b = RowBatch.of(list(history), [history[s] for s in history], [counts[s] for s in history], rows.device)
        batched = chunk.head(chunk.forward_rows(chunk.embed_rows(rows, b.positions), b))
        alone = torch.cat([chunk.head(chunk.forward_blocks(
            chunk.embed(ids[s][history[s]:history[s] + counts[s]], history[s]), s + 4, history[s])) for s in history])
        return batched, alone

    def close(batched, alone):  # float32 sums of other lengths and orders: relative 1e-4
        return (batched - alone).abs().max().item() <= 1e-4 * max(1.0, alone.abs().max().item())

    batched, alone = both({0: 1, 1: 7, 2: 5, 3: 1})
    assert batched.device.type == device
    assert close(batched, alone)
    history = {0: 10, 1: 7, 2: 8, 3: 21}
    for step in range(3):
        assert close(*both({s: 1 for s in history})), step
        history = {s: n + 1 for s, n in history.items()}
    # The caches the batches wrote are the ones single passes wrote.
    assert torch.allclose(chunk.cache.k[:, :4], chunk.cache.k[:, 4:], rtol=1e-4, atol=1e-4)
    assert torch.allclose(chunk.cache.v[:, :4], chunk.cache.v[:, 4:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@torch.inference_mode()  # as every inference path runs: graphs are never recorded under autograd
def test_a_recorded_step_computes_the_eager_one(device, family, monkeypatch):
    """mdi.model.graph_decode: decode steps of 1 and 3 samples at scattered positions, and
    verification-like steps of 1 and 2 samples with 4 rows each, replayed from CUDA graphs (on a
    CPU: the same static-tensor logic, run eagerly), give the eager blocks' outputs and cache
    rows within float32 rounding, step after step, each row's keys and values written only at
    its own slot and position; a prompt (rows of unequal samples) runs the eager blocks."""
    from mdi.model import graph_decode
    model = tiny_model(family)
    chunk = build_chunk(model.config, model.state_dict(), 0, model.config.n_layer, True, True, torch.float32, device)
    chunk.allocate_cache(4, 64)
    torch.manual_seed(2)
    history = {0: 5, 1: 17, 3: 30}
    for slot, n in history.items():
        b = RowBatch.of([slot], [0], [n], torch.device(device))
        chunk.forward_rows(chunk.embed_rows(torch.randint(0, 90, (n,), device=device), b.positions), b)
    steps = {}  # type: dict

    def close(a, b):  # float32 sums in other orders (the whole slot, masked): relative 1e-5
        return (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())

    def step(slots, rows=1):
        starts = [history[s] for s in slots]

        def frame():
            return RowBatch.of(slots, starts, [rows] * len(slots), torch.device(device))
        x = chunk.embed_rows(torch.randint(0, 90, (rows * len(slots),), device=device), frame().positions)
        before = chunk.cache.k.clone(), chunk.cache.v.clone()
        monkeypatch.setenv(graph_decode.ENV, "0")
        eager = chunk.forward_rows(x, frame())
        eager_cache = chunk.cache.k.clone(), chunk.cache.v.clone()
        chunk.cache.k.copy_(before[0])
        chunk.cache.v.copy_(before[1])
        monkeypatch.delenv(graph_decode.ENV)
        if device == "cuda":
            got = chunk.forward_rows(x, frame())
        else:
            key = (len(slots), rows)
            got = steps.setdefault(key, graph_decode.DecodeStep(chunk, len(slots), rows, x.dtype, record=False))(
                chunk, x, frame())
        assert close(got, eager), (slots, starts, rows)
        assert close(chunk.cache.k, eager_cache[0]) and close(chunk.cache.v, eager_cache[1]), (slots, starts, rows)
        for s in slots:
            history[s] += rows

    for _ in range(3):
        step([1])
        step([0, 1, 3])
        step([3], rows=4)
        step([0, 1], rows=4)
    if device == "cuda":
        recorded = chunk._decode_script["graphs"].steps
        assert {key[:2] for key in recorded} == {(1, 1), (3, 1), (1, 4), (2, 4)}
        assert all(st.graph is not None for st in recorded.values())
    b = RowBatch.of([2, 0], [0, history[0]], [6, 1], torch.device(device))  # a prompt beside a decode row: eager
    chunk.forward_rows(chunk.embed_rows(torch.randint(0, 90, (7,), device=device), b.positions), b)
    assert len(chunk._decode_script["graphs"].steps) == (4 if device == "cuda" else 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ring_ids_do_not_depend_on_batching(device, family, tiny_models, workers, data_ports):
    """Eight samples on a ring of three, in frames of several samples (and prompts in chunks of
    4 tokens), give the ids of one process computing one sample at a time."""
    model = tiny_models[family]
    prompts = PROMPTS[:8]
    reference, alone = run_ids(ring_config(model, workers, data_ports, [4], device, max_batch=1), prompts)
    assert alone.metrics()["nodes"][0]["samples_per_forward_max"] == 1
    for max_batch, prefill_chunk in (("auto", 256), (8, 4)):
        cfg = ring_config(model, workers, data_ports, [1, 2, 1], device, max_batch=max_batch,
                          prefill_chunk=prefill_chunk)
        got, result = run_ids(cfg, prompts)
        assert got == reference, (max_batch, prefill_chunk)
        assert max(node["samples_per_forward_max"] for node in result.metrics()["nodes"]) > 1


# ---------------------------------------------------- 7. float16 weights, float16 on the wire

def make_half_model(path, family):
    """conftest's tiny model with float16-exact weights, stored as float16."""
    model = tiny_model(family, half_exact=True)
    save_model_dir(path, model.config, {k: v.half() for k, v in model.state_dict().items()}, "tests/test_cuda.py")
    char_tokenizer(CHARS).save(path)
    return path


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("on_torch")  # float16 checkpoints without a GGUF
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_float16_ring_matches_standalone_float16(device, family, workers, data_ports, tmp_path):
    model = make_half_model(str(tmp_path / family), family)
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        assert f.get_tensor("blocks.0.attn.qkv.weight").dtype == torch.float16  # stored as float16
    prompts = PROMPTS[:3]
    # One sample per frame: every node multiplies the same shapes as standalone, so the
    # float16 arithmetic is the same and the ids are exactly equal.
    alone, _ = run_ids(ring_config(model, workers, data_ports, [4], device, dtype="float16", max_batch=1), prompts)
    got, result = run_ids(ring_config(model, workers, data_ports, [1, 2, 1], device, dtype="float16", max_batch=1),
                          prompts)
    assert got == alone
    # Activations travel as float16 (raw codec, the compute dtype): a decode hop carries 64
    # values of 2 bytes, fewer bytes than float32's payload alone.
    half, single = payload_nbytes(1, 64, torch.float16, "raw"), payload_nbytes(1, 64, torch.float32, "raw")
    for node in result.metrics()["nodes"]:
        per_message = node["bytes_sent_by_kind"]["decode"] / node["messages_sent_by_kind"]["decode"]
        print(node["name"], "decode bytes per message", per_message)
        assert half <= per_message < single, (node["name"], per_message)


# ------------------------------------------------------------ 8. speculative decoding

def test_drafts_verified_on_the_device_give_the_plain_greedy_ids(device, quick_ways, tiny_models, monkeypatch):
    """One process, passes of drafted rows in flight as on a ring of three (stale ones dropped
    when a guess fails): drafts that are always right, never right, or right 60% of the time
    give the plain run's ids on the device."""
    from test_speculation import CPU_ROWS, TickClock, oracle, run_local
    from mdi.runconfig import SpeculationSpec
    from mdi.starter import speculation
    monkeypatch.setattr(speculation.decoder, "time", TickClock())  # the ways taken, whatever the timing
    for family in ("gpt2", "llama"):
        chunk = ModelSource(tiny_models[family]).load_chunk(0, 4, True, True, torch.float32, device)
        chunk.allocate_cache(4, 128)
        prompts = PROMPTS[:2]
        plain, _ = run_local(chunk, prompts, 40)
        for agree, n_stages in ((1.0, 3), (0.0, 3), (0.6, 3), (0.6, 1)):
            got, pipe = run_local(chunk, prompts, 40, SpeculationSpec("ngram", max_draft=6), oracle(plain, agree),
                                  n_stages=n_stages, max_batch=2, costs=CPU_ROWS)  # costs where filling is tried
            assert got == plain, (family, agree, n_stages)
            c = pipe.spec_counters
            assert c.drafted > 0 and (c.accepted == c.drafted if agree == 1.0 else c.accepted < c.drafted)
            if (agree, n_stages) == (0.6, 3):
                assert c.passes_stale > 0  # passes built on guesses that failed, dropped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_speculation_in_a_ring_on_the_device_gives_the_plain_ids(device, family, tiny_models, workers, data_ports):
    """The starter and two workers on the GPU, one and two samples: n-gram drafts and an oracle
    right half the time give the plain ring's ids; the starter timed its passes on the device."""
    from mdi.lab.oracle_drafter import OracleDrafter
    model = tiny_models[family]
    for prompts in (PROMPTS[2:3], PROMPTS[:2]):
        plain, _ = run_ids(ring_config(model, workers, data_ports, [1, 2, 1], device, n_tokens=40), prompts)
        half_right = lambda s: OracleDrafter(s.prompt_ids, len(s.prompt_ids), plain[s.index], 0.5, seed=s.index,
                                             vocab=len(CHARS))
        for spec, factory in (({"method": "ngram", "max_draft": 6}, None), ("ngram", half_right)):
            cfg = ring_config(model, workers, data_ports, [1, 2, 1], device, n_tokens=40, speculation=spec)
            got, result = run_ids(cfg, prompts, factory)
            assert got == plain, (len(prompts), spec)
            record = result.metrics()["nodes"][0]["speculation"]
            print(family, len(prompts), spec, "pass costs on the device", record["pass_costs"],
                  "drafted", record["drafted"], "accepted", record["accepted"])
            costs = record["pass_costs"]
            assert costs[0] == 1.0 and all(c > 0 for c in costs)
            if factory is not None:
                assert 0 < record["accepted"] < record["drafted"]
