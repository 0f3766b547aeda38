"""The int8 integer kernels (mdi.model.quantization.qkernels.Int8DynamicLinear over fbgemm): ~14-bit
activations for one read of the weights, a row's result independent of its frame, what they
hold counted, and chosen only within the memory a node spares beside its plan."""
import os

import pytest
import torch

from mdi.model.layout import QuantSpec
from mdi.model.quantization import kernel_memory, kernel_choice, qkernels
from mdi.model.quantization.quant import dequantize, quantize

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not qkernels.INT8_FBGEMM.supports(QuantSpec("int8", 32), 64, 64, CPU),
                                reason="this torch has no fbgemm engine or quantized tensors")


@pytest.fixture(autouse=True)
def clean_state():
    qkernels.set_preference(None)
    kernel_choice.set_memory_allowance(None)
    yield
    qkernels.set_preference(None)
    kernel_choice.set_memory_allowance(kernel_choice.DEFAULT_ALLOWANCE)


def layer(spec: QuantSpec, n_out: int, n_in: int, seed: int = 0):
    torch.manual_seed(seed)
    parts = quantize(torch.randn(n_out, n_in) * 0.05, spec)
    return parts, dequantize(parts, spec, n_in)


@pytest.mark.parametrize("n_out,n_in", [(96, 64), (48, 576), (40, 1536)])
def test_activations_keep_about_14_bits(n_out, n_in):
    """A weight stored int8 per channel is packed as it is, so what remains is the activations'
    rounding: with the rounding error sent along as a second row it is ~1e-4 of the output's
    range even with an outlier channel, where one 7-bit row gives 1e-2 to 1e-1."""
    spec = QuantSpec("int8", n_in)
    parts, w = layer(spec, n_out, n_in)
    linear = qkernels.INT8_FBGEMM.pack(parts, spec, n_in)["linear"]
    x = torch.randn(5, n_in)
    x[:, 3] *= 40  # an outlier channel, as real activations have
    ref = x @ w.T
    err = float((linear(x) - ref).abs().max() / ref.abs().max())
    assert err < 2e-3, err


def test_a_rows_result_does_not_depend_on_its_frame():
    """Each row is scaled and pinned on its own: the same row alone, first or last among others
    of any magnitude gives the same bits."""
    spec = QuantSpec("int4", 32)
    parts, _ = layer(spec, 64, 128)
    linear = qkernels.INT8_FBGEMM.pack(parts, spec, 128)["linear"]
    row = torch.randn(1, 128)
    alone = linear(row)
    for others in (torch.randn(3, 128) * 100, torch.randn(2, 128) * 1e-3, torch.zeros(1, 128)):
        assert torch.equal(linear(torch.cat((row, others)))[:1], alone)
        assert torch.equal(linear(torch.cat((others, row)))[-1:], alone)
    assert torch.equal(linear(torch.zeros(2, 128)), torch.zeros(2, 64))  # an all-zero row stays finite


def test_held_bytes_are_counted_and_bound_by_the_allowance():
    spec = QuantSpec("int4", 32)
    n_out, n_in = 64, 576
    parts, _ = layer(spec, n_out, n_in)
    extra = kernel_choice.extra_bytes(qkernels.INT8_FBGEMM, spec, n_out, n_in)
    assert extra > 0  # 576 values padded to 1024 a row, 1 byte each, against 0.625 stored
    qkernels.set_preference("int8dyn-fbgemm")
    kernel_choice.set_memory_allowance(extra - 1)
    kernel, _ = kernel_choice.choose(parts, spec, n_in, CPU)
    assert kernel is qkernels.DEQUANT  # the named kernel does not fit: the reference it is
    assert "needs" in kernel_choice.chosen_by_weight()["int4/g32 64x576"]
    kernel_choice.set_memory_allowance(extra)
    kernel, packed = kernel_choice.choose(parts, spec, n_in, CPU)
    assert kernel is qkernels.INT8_FBGEMM and kernel_choice.memory_allowance() == 0  # the allowance is spent
    kernel, _ = kernel_choice.choose(parts, spec, n_in, CPU)
    assert kernel is qkernels.DEQUANT  # nothing left for a second layer

    from mdi.model.layers import QuantLinear
    from mdi.model.layers import held_bytes
    kernel_choice.set_memory_allowance(None)
    module = QuantLinear(n_in, n_out, False, spec)
    for suffix, t in parts.items():
        getattr(module, suffix).copy_(t)
    module.pick_kernel("a layer")
    assert module.kernel is qkernels.INT8_FBGEMM and module.qweight is None  # the stored form is let go
    assert held_bytes(module) == qkernels.INT8_FBGEMM.held_bytes(spec, n_out, n_in)


def test_fast_policy_never_picks_what_it_measured_wrong(monkeypatch):
    """A kernel whose output is off is refused by its check, whatever its speed."""
    spec = QuantSpec("int8", 64)
    parts, _ = layer(spec, 32, 64)
    real = qkernels.Int8DynamicLinear.forward
    monkeypatch.setattr(qkernels.Int8DynamicLinear, "forward", lambda self, x: real(self, x) * 1.1)
    monkeypatch.setattr(kernel_memory, "recall", lambda key: None)  # measured here, with the bad kernel
    monkeypatch.setattr(kernel_memory, "remember", lambda key, entry: None)
    qkernels.set_preference("fast")
    kernel_choice._measured.clear()
    kernel, _ = kernel_choice.choose(parts, spec, 64, CPU)
    assert kernel is not qkernels.INT8_FBGEMM
    assert "int8dyn-fbgemm wrong" in kernel_choice.chosen_by_weight()["int8/g64 32x64"]
    kernel_choice._measured.clear()


def test_the_grid_rounding_of_many_rows_is_fake_quantizes_bit_for_bit():
    """Passes of ROUND_BY_OPS_ROWS rows or more round the activations by plain ops (fake_quantize
    is slow on many rows): the same bits, ties included, so a row's result stays its own."""
    spec = QuantSpec("int4", 32)
    parts, _ = layer(spec, 64, 576)
    linear = qkernels.INT8_FBGEMM.pack(parts, spec, 576)["linear"]
    x = torch.rand(64, 576) * 2 - 1
    x[0, :11] = torch.arange(-5, 6) * linear.step / 2  # ties between grid points
    ops = torch.round(x * linear.inv_step).add_(linear.zero).clamp_(0, linear.levels).sub_(linear.zero).mul_(linear.step)
    assert torch.equal(ops, torch.fake_quantize_per_tensor_affine(x, linear.step, linear.zero, 0, linear.levels))
    rows = torch.randn(qkernels.ROUND_BY_OPS_ROWS, 576)
    assert torch.equal(linear(rows)[:1], linear(rows[:1]))  # one row (fake_quantize) as among many (plain ops)


def test_the_perplexity_guard_names_each_kernel_past_its_bound():
    """scripts/bench_quant_quality.py exits 1 naming the rows past their bound: int8 within 1% of
    float32, int4 within 1% of the int4 model's own loss (its exact kernels')."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_quant_quality.py")
    spec = importlib.util.spec_from_file_location("bench_quant_quality", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [{"model": "m", "quant": q, "kernel": k, "vs_float32": v} for q, k, v in (
        ("none", "exact", 0.0), ("int8", "exact", 0.001), ("int8", "fast", 0.009), ("int8", "int8dyn-fbgemm", 0.012),
        ("int4", "exact", 0.05), ("int4", "fast", 0.059), ("int4", "int8dyn-fbgemm", 0.061))]
    assert bench.out_of_bounds(rows) == ["m int8 int8dyn-fbgemm: +1.20% vs float32, bound +1.00%",
                                         "m int4 int8dyn-fbgemm: +6.10% vs float32, bound +6.00%"]
