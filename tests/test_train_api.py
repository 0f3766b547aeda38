"""The ring as a Python module (mdi.starter.remote_blocks, issue 38): the hidden states at the
node boundaries and the input gradient through the ring equal one process's forward and
autograd (float32, tiny random GPT-2 and Llama, 1 and 3 nodes on loopback).

The reference is the full tiny model in this process: its blocks one after another over the
same embeddings (ModelChunk's cacheless forward_batch), the loss through its own head."""
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from ringconfigs import parse_run_config
from mdi.model.adapters.lora_train import key_layer
from mdi.ring.train_request import TrainSetup
from mdi.starter.remote_blocks import RemoteBlocks

pytestmark = pytest.mark.usefixtures("module_on_torch")  # training computes on torch (ggml has no backward pass)

SEQ = 12
TOL = 1e-5


def _ids(config, b=3):
    return torch.randint(0, config.vocab_size, (b, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def reference(family, ids):
    """(states entering each layer, last one included; d loss / d the embeddings)."""
    model = tiny_model(family)
    for p in model.parameters():
        p.requires_grad_(False)
    b, t = ids.shape
    with torch.no_grad():
        x = model.embed_rows(ids.reshape(-1), torch.arange(t).repeat(b)).view(b, t, -1)
    x = x.clone().requires_grad_(True)
    states = {0: x.detach()}
    h = x
    for i, block in enumerate(model.blocks.values()):
        h = block.forward_batch(h, model.rope)
        states[i + 1] = h.detach()
    _loss(model.head(h), ids).backward()
    return states, x.grad


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("nodes", [1, 3])
def test_boundaries_and_input_gradient_equal_one_process(tiny_models, workers, family, nodes):
    ring_workers, layers = ((), None) if nodes == 1 else (workers[:2], [1, 2, 1])
    cfg = parse_run_config(tiny_models[family], ring_workers, layers=layers, runtime={"ring_timeout": 30})
    config = tiny_model(family).config
    ids = _ids(config)
    want_states, want_grad = reference(family, ids)
    with RemoteBlocks(cfg, seq_len=SEQ) as ring:
        assert [last - first for first, last in ring.node_layers] == (layers or [config.n_layer])
        x = ring.embed(ids)
        assert torch.allclose(x, want_states[0], atol=TOL, rtol=0)
        x.requires_grad_(True)
        out = ring(x)
        # every node boundary, the one between the two workers included (a "state" copy)
        assert list(out.boundaries) == ([1, 3, config.n_layer] if nodes == 3 else [config.n_layer])
        for layer, h in out.boundaries.items():
            assert _rel(h, want_states[layer]) <= TOL, layer
        _loss(ring.head(out.hidden), ids).backward()
        assert x.grad is not None and _rel(x.grad, want_grad) <= TOL
        # without autograd the batch goes as an eval frame: the same states, nothing kept
        with torch.no_grad():
            again = ring(ids)
            fewer = ring(ids, boundaries=False)  # no copies: the starter's own boundary only
        assert torch.equal(again.hidden, out.hidden.detach())
        assert all(torch.equal(again.boundaries[k], out.boundaries[k]) for k in out.boundaries)
        assert list(fewer.boundaries) == ([1, config.n_layer] if nodes == 3 else [config.n_layer])
        assert torch.equal(fewer.hidden, out.hidden.detach())


def test_a_lora_of_one_s_own_steps_on_every_node(tiny_models, workers):
    cfg = parse_run_config(tiny_models["llama"], workers[:2], layers=[1, 2, 1], runtime={"ring_timeout": 30})
    config = tiny_model("llama").config
    ids = _ids(config, 2)
    setup = TrainSetup(targets=("q", "down"), rank=2, alpha=4.0, lr=1e-2)
    with RemoteBlocks(cfg, seq_len=SEQ, setup=setup) as ring:
        before = {k: (a.clone(), b.clone()) for k, (a, b) in ring.pairs().items()}
        for half in torch.tensor_split(ids, 2):  # two micro-batches, one step
            _loss(ring.head(ring(half).hidden), half).backward()
        ring.step()
        after = ring.pairs()
    assert sorted({key_layer(k) for k in after}) == list(range(config.n_layer))
    assert all(after[k][1].abs().max() > 0 and before[k][1].abs().max() == 0 for k in after)


def test_a_frozen_ring_refuses_to_step_and_a_closed_one_to_run(tiny_models):
    cfg = parse_run_config(tiny_models["gpt2"])
    ring = RemoteBlocks(cfg, seq_len=SEQ)
    with pytest.raises(RuntimeError, match="not open"):
        ring(torch.zeros(1, SEQ, 64))
    with ring:
        with pytest.raises(RuntimeError, match="trains no LoRA"):
            ring.step()
        with pytest.raises(ValueError, match="expected hidden states"):
            ring(torch.zeros(1, SEQ + 1, 64))
