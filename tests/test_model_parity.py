"""mdi's transformer against Hugging Face transformers on random models saved to disk:
prefill and cached decode logits within 1e-4 (fp32), and identical greedy generations."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from mdi.model.files.checkpoints import read_hf_dir  # noqa: E402
from mdi.model.source import build_chunk  # noqa: E402

PREFILL, DECODE, GREEDY = 24, 20, 32


def hf_gpt2(path):
    cfg = transformers.GPT2Config(vocab_size=500, n_positions=128, n_embd=64, n_layer=4, n_head=4)
    return cfg, transformers.GPT2LMHeadModel(cfg)


def hf_llama(path):
    cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, rope_theta=50000.0)
    return cfg, transformers.LlamaForCausalLM(cfg)


def hf_llama3(path):
    # RoPE scaled as Llama 3.1/3.2 are, over a context 8x the "original" one, all of it used
    cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    return cfg, transformers.LlamaForCausalLM(cfg)


def hf_qwen2(path):
    cfg = transformers.Qwen2Config(vocab_size=500, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True, rope_theta=1000000.0)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random q/k/v biases (they start at zero), so a missing bias would show
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
    return cfg, model


def hf_qwen3(path):
    if not hasattr(transformers, "Qwen3Config"):  # transformers 4.46, Python 3.8's last (.ci/py38)
        pytest.skip("this transformers has no Qwen3")
    # head_dim 16 while hidden / heads = 8: Qwen3's heads are wider than n_embd / n_head
    cfg = transformers.Qwen3Config(vocab_size=500, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, tie_word_embeddings=False, rope_theta=1000000.0)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # q/k norms start at one: make them matter
        for name, p in model.named_parameters():
            if name.endswith("_norm.weight") and "self_attn" in name:
                p.uniform_(0.5, 1.5)
    return cfg, model


@pytest.fixture(params=[hf_gpt2, hf_llama, hf_llama3, hf_qwen2, hf_qwen3],
                ids=["gpt2", "llama-gqa", "llama3-rope-scaling", "qwen2", "qwen3"])
def pair(request, tmp_path):
    torch.manual_seed(0)
    _, hf = request.param(tmp_path)
    hf.eval().save_pretrained(str(tmp_path))
    hf = type(hf).from_pretrained(str(tmp_path)).eval()  # compare what is on disk
    config, weights = read_hf_dir(str(tmp_path))
    ours = build_chunk(config, weights, 0, config.n_layer, True, True, torch.float32, "cpu")
    return hf, ours


@torch.no_grad()
def test_prefill_and_cached_decode_logits(pair):
    hf, ours = pair
    torch.manual_seed(1)
    ids = torch.randint(0, 500, (PREFILL + DECODE,))
    reference = hf(ids[None]).logits[0]
    ours.allocate_cache(2, PREFILL + DECODE)
    slot = 1  # not slot 0, so a wrong slot selection would show
    logits = [ours.head(ours.forward_blocks(ours.embed(ids[:PREFILL], 0), slot, 0))]
    for t in range(PREFILL, PREFILL + DECODE):
        logits.append(ours.head(ours.forward_blocks(ours.embed(ids[t:t + 1], t), slot, t)))
    got = torch.cat(logits)
    assert (got[:PREFILL] - reference[:PREFILL]).abs().max() <= 1e-4
    assert (got[PREFILL:] - reference[PREFILL:]).abs().max() <= 1e-4


@torch.no_grad()
def test_greedy_generation_matches(pair):
    hf, ours = pair
    prompt = torch.tensor([5, 17, 99, 3, 250, 42])
    expected = hf.generate(prompt[None], max_new_tokens=GREEDY, do_sample=False, min_new_tokens=GREEDY,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(ours, prompt) == expected


@torch.no_grad()
def greedy(chunk, prompt, n=GREEDY):
    """n greedy ids after `prompt` on a full-model chunk, one cached step at a time."""
    chunk.allocate_cache(1, len(prompt) + n)
    x = chunk.forward_blocks(chunk.embed(prompt, 0), 0, 0)
    got = []
    for _ in range(n):
        token = int(chunk.head(x[-1:]).argmax())
        got.append(token)
        pos = len(prompt) + len(got) - 1
        x = chunk.forward_blocks(chunk.embed(torch.tensor([token]), pos), 0, pos)
    return got


@torch.no_grad()
def test_slots_are_independent(pair):
    """Interleaving two samples in two cache slots gives each the result it gets alone."""
    _, ours = pair
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([9, 8, 7])
    ours.allocate_cache(2, 8)
    alone = ours.head(ours.forward_blocks(ours.embed(a, 0), 0, 0))[-1]
    ours.allocate_cache(2, 8)
    ours.forward_blocks(ours.embed(a[:2], 0), 0, 0)
    ours.forward_blocks(ours.embed(b, 0), 1, 0)
    interleaved = ours.head(ours.forward_blocks(ours.embed(a[2:], 2), 0, 2))[-1]
    assert torch.allclose(alone, interleaved, atol=1e-5)
