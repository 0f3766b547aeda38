"""A second kernel for prefill passes (mdi.model.quantization.kernel_choice.choose_kernels): chosen per row
count from measurements (faked here: timing belongs in benchmarks), kept only within the memory
a node spares, counted, and computing what the single-kernel layer computes."""
import pytest
import torch

from conftest import tiny_config
from mdi.model.layout import QuantSpec
from mdi.model.quantization import kernel_choice, kernel_memory, kernel_report, qkernels
from mdi.model.quantization.quant import convert, gather, quantize, uniform_layout
from mdi.model.source import build_chunk
from mdi.model.transformer import full_model

CPU = torch.device("cpu")
INT4 = next(k for k in qkernels.KERNELS if k.name == "int4pack-cpu")
FBGEMM = qkernels.INT8_FBGEMM
SPEC = QuantSpec("int4", 32)
pytestmark = pytest.mark.skipif(not (INT4.supports(SPEC, 64, 128, CPU) and FBGEMM.supports(SPEC, 64, 128, CPU)),
                                reason="this torch lacks the CPU int4 packed kernel or fbgemm")

# ms for a pass of r rows: int4pack wins one row, fbgemm from 8 rows on (0.3 + 0.4 > 0.5 + 0.16)
ROOMY = 1 << 30  # what a node spares: room for any second copy here
CROSSING = {"int4pack-cpu": (0.3, 0.05), "int8dyn-fbgemm": (0.5, 0.02), "dequant": (5.0, 0.1)}


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    # measured afresh with the fake timings: nothing recalled from, or kept for, other processes
    monkeypatch.setattr(kernel_memory, "recall", lambda key: None)
    monkeypatch.setattr(kernel_memory, "remember", lambda key, entry: None)

    def clear(allowance=None):
        qkernels.set_preference(None)
        kernel_choice.set_memory_allowance(allowance)
        for table in (kernel_choice._measured, kernel_choice._measured_prefill, kernel_choice._notes,
                      kernel_choice._choices, kernel_choice._crossovers):
            table.clear()
    clear()
    yield
    clear(kernel_choice.DEFAULT_ALLOWANCE)


@pytest.fixture
def fake_timings(monkeypatch):
    """kernel_choice times (kernel, kind, rows) with `timings[name] = (ms for a pass, ms per row)`,
    or `timings[name/kind]` for one weight kind; kernels not named take 100 ms."""
    timings = dict(CROSSING)
    monkeypatch.setattr(kernel_choice, "_timed",
                        lambda kernel, packed, spec, n_in, x: (kernel.name, spec.kind, x.shape[0]))

    def fake_time(what, device, evict_from, resident=()):
        name, kind, rows = what
        base, per_row = timings.get(name + "/" + kind, timings.get(name, (100.0, 0.0)))
        return (base + per_row * rows) / 1e3
    monkeypatch.setattr(kernel_choice, "_time", fake_time)
    return timings


def weight(n_out: int = 64, n_in: int = 128):
    torch.manual_seed(0)
    return quantize(torch.randn(n_out, n_in) * 0.05, SPEC)


def test_prefill_rows_are_the_default_prefill_chunk():
    from mdi.runconfig import DEFAULT_PREFILL_CHUNK
    assert kernel_choice.PREFILL_ROWS == DEFAULT_PREFILL_CHUNK


def test_a_second_kernel_for_many_rows_from_the_measured_crossing(fake_timings):
    kernel_choice.set_memory_allowance(ROOMY)
    choice = kernel_choice.choose_kernels(weight(), SPEC, 128, CPU, "a layer")
    assert choice.kernel is INT4 and choice.prefill_kernel is FBGEMM
    assert choice.prefill_from == 8  # 4 rows: 0.5 against 0.58 ms; 8 rows: 0.7 against 0.66
    entry = kernel_choice.chosen()[0]
    assert (entry["kernel"], entry["prefill_kernel"], entry["prefill_from_rows"]) == ("int4pack-cpu", "int8dyn-fbgemm", "8")
    text = kernel_choice.chosen_by_weight()["int4/g32 64x128"]
    assert text.startswith("int4pack-cpu: policy fast:") and "3.500 at 64 rows" in text  # each candidate's times, and why
    assert kernel_report.summary(kernel_choice.chosen_by_weight()) == \
        "int4pack-cpu x1; prefill passes from 8 rows: int8dyn-fbgemm x1 (a second copy each)"
    # a layer that multiplies few rows (the head) keeps one kernel, as `choose` does
    assert kernel_choice.choose_kernels(weight(), SPEC, 128, CPU, many_rows=False).prefill_kernel is None
    assert kernel_choice.choose(weight(), SPEC, 128, CPU)[0] is INT4


@pytest.mark.parametrize("fbgemm,expected", [((0.5, 0.045), "only 1.04x faster"),  # a near tie: no copy
                                              ((0.2, 0.02), "the fastest at 64 rows")])  # good at both: one kernel
def test_one_kernel_where_none_is_clearly_faster_on_many_rows(fake_timings, fbgemm, expected, monkeypatch):
    monkeypatch.setattr(kernel_choice, "PREFILL_GAIN", 1.15)  # a margin asked of the second kernel
    kernel_choice.set_memory_allowance(ROOMY)
    fake_timings["int8dyn-fbgemm"] = fbgemm
    choice = kernel_choice.choose_kernels(weight(), SPEC, 128, CPU)
    assert choice.prefill_kernel is None and expected in kernel_choice.chosen_by_weight()["int4/g32 64x128"]
    assert choice.kernel is (FBGEMM if fbgemm[0] < 0.3 else INT4)


def test_the_second_copy_is_kept_only_within_what_the_node_spares(fake_timings):
    copy = kernel_choice.copy_bytes(FBGEMM, SPEC, 64, 128, keeps_canonical=False)
    assert copy == FBGEMM.held_bytes(SPEC, 64, 128)
    # second copies may take PREFILL_SHARE of what the node spares: one byte short
    kernel_choice.set_memory_allowance(int((copy - 1) / kernel_choice.PREFILL_SHARE))
    choice = kernel_choice.choose_kernels(weight(), SPEC, 128, CPU)
    assert choice.kernel is INT4 and choice.prefill_kernel is None
    assert "its copy needs" in kernel_choice.chosen_by_weight()["int4/g32 64x128"]
    assert kernel_report.summary(kernel_choice.chosen_by_weight()) == \
        "int4pack-cpu x1; faster for prefill but not spared by the node's memory: int8dyn-fbgemm x1"
    kernel_choice.set_memory_allowance(int(copy / kernel_choice.PREFILL_SHARE))
    spare = kernel_choice.memory_allowance()
    choice = kernel_choice.choose_kernels(weight(), SPEC, 128, CPU)
    assert choice.prefill_kernel is FBGEMM and kernel_choice.memory_allowance() == spare - copy  # spent
    assert kernel_choice.choose_kernels(weight(), SPEC, 128, CPU).prefill_kernel is None  # no share left
    # a process that does not know its memory keeps no copy (a copy only buys speed)
    kernel_choice.set_memory_allowance(None)
    assert kernel_choice.choose_kernels(weight(), SPEC, 128, CPU).prefill_kernel is None
    assert "does not know what its memory spares" in kernel_choice.chosen_by_weight()["int4/g32 64x128"]
    # a kernel named by the policy is that kernel for every pass
    qkernels.set_preference("int4pack-cpu")
    kernel_choice.set_memory_allowance(ROOMY)
    assert kernel_choice.choose_kernels(weight(), SPEC, 128, CPU).prefill_kernel is None


def test_a_layer_holds_and_counts_both_kernels(fake_timings):
    from mdi.model.layers import QuantLinear
    from mdi.model.layers import held_bytes
    kernel_choice.set_memory_allowance(ROOMY)
    module = QuantLinear(128, 64, False, SPEC)
    for suffix, t in weight().items():
        getattr(module, suffix).copy_(t)
    module.pick_kernel("blocks.0.attn.qkv")
    assert module.kernel is INT4 and module.prefill_kernel is FBGEMM and module.qweight is None
    int4_bytes = sum(t.numel() * t.element_size() for t in module.packed.values())
    assert held_bytes(module) == int4_bytes + FBGEMM.held_bytes(SPEC, 64, 128)
    head = QuantLinear(128, 64, False, SPEC)
    for suffix, t in weight().items():
        getattr(head, suffix).copy_(t)
    head.pick_kernel("lm_head")  # its passes are decode-sized
    assert head.prefill_kernel is None


def _chunks():
    """The same int4 tiny Llama twice: kernels chosen with a second one for passes of 8 rows or
    more (int4pack-cpu for fewer, int8dyn-fbgemm for more), and int4pack-cpu for every pass."""
    config = tiny_config("llama")
    layout = uniform_layout(config, (0, config.n_layer), True, True, "int4", 32)
    torch.manual_seed(3)
    stored = gather(convert(full_model(config).state_dict(), layout, torch.float32))
    chunks = []
    for policy in ("fast", "int4pack-cpu"):
        qkernels.set_preference(policy)
        chunks.append(build_chunk(config, convert(stored, layout, torch.float32), 0, config.n_layer, True, True,
                                  torch.float32, "cpu", quant=layout))
    return config, chunks


def _dual_chunks(fake_timings):
    """_chunks() with room for the second copy: every block layer of the first holds int4pack-cpu
    for passes under 8 rows and int8dyn-fbgemm from 8 (checked)."""
    fake_timings["dequant/int8"] = (0.0, 0.0)  # the head (int8 per channel): the reference in both chunks
    kernel_choice.set_memory_allowance(ROOMY)
    config, (dual, single) = _chunks()
    blocks = [m for n, m in dual.named_modules() if n.startswith("blocks.") and hasattr(m, "prefill_kernel")]
    assert blocks and all(m.kernel is INT4 and m.prefill_kernel is FBGEMM and m.prefill_from == 8 for m in blocks)
    return config, dual, single


def test_a_model_with_two_kernels_computes_what_one_kernel_computes(fake_timings):
    config, dual, single = _dual_chunks(fake_timings)
    torch.manual_seed(4)
    ids = torch.randint(0, config.vocab_size, (20,))
    logits = []
    for chunk in (dual, single):
        chunk.allocate_cache(1, 32)
        with torch.no_grad():
            few = chunk.head(chunk.forward_blocks(chunk.embed(ids[:4], 0), 0, 0))  # 4 rows: the decode kernel
            steps = [chunk.head(chunk.forward_blocks(chunk.embed(ids[i:i + 1], i), 0, i)) for i in (4, 5)]  # decode
            many = chunk.head(chunk.forward_blocks(chunk.embed(ids[6:18], 6), 0, 6))  # 12 rows: the prefill kernel
            after = chunk.head(chunk.forward_blocks(chunk.embed(ids[18:19], 18), 0, 18))  # decode after it
        logits.append((torch.cat([few] + steps), many, after))
    (few_dual, many_dual, after_dual), (few_single, many_single, after_single) = logits
    assert torch.equal(few_dual, few_single)  # fewer rows than the crossing: the same kernel, the same bits
    # many rows: the integer kernel, rounded as it rounds (its own tolerance for one layer's output)
    scale = float(many_single.max() - many_single.min())
    assert not torch.equal(many_dual, many_single)  # the second kernel ran
    assert float((many_dual - many_single).abs().max()) / scale <= FBGEMM.tolerance
    assert float((after_dual - after_single).abs().max()) / scale <= FBGEMM.tolerance  # its keys and values are in the cache


def test_a_lead_that_does_not_hold_when_timed_in_turns_earns_no_copy(fake_timings, monkeypatch):
    """The screening's one timing at 64 rows may catch the decode kernel in another process's
    burst: the two are timed again in turns before a copy is kept."""
    screened = set()
    fake = kernel_choice._time

    def bursty(what, *rest):
        name, kind, rows = what
        if name == "int4pack-cpu" and rows == kernel_choice.PREFILL_ROWS and name not in screened:
            screened.add(name)
            return 1.0  # a burst
        return fake(what, *rest)
    monkeypatch.setattr(kernel_choice, "_time", bursty)
    fake_timings["int8dyn-fbgemm"] = (0.5, 0.05)  # in truth no faster on many rows
    kernel_choice.set_memory_allowance(ROOMY)
    choice = kernel_choice.choose_kernels(weight(), SPEC, 128, CPU)
    assert choice.kernel is INT4 and choice.prefill_kernel is None
    assert "timed in turns: not %.2fx" % kernel_choice.PREFILL_GAIN in kernel_choice.chosen_by_weight()["int4/g32 64x128"]


def test_a_verification_pass_runs_the_decode_kernel_whatever_its_rows(fake_timings):
    """A speculative verification's rows (RowBatch.row_wise) stand for decode steps: a chunk
    that keeps a prefill kernel from 8 rows gives a 12-row verification the decode kernel's
    bits, those of the single-kernel chunk and of the decode steps one by one."""
    from mdi.model.row_batch import RowBatch
    config, dual, single = _dual_chunks(fake_timings)
    torch.manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (16,))
    out = []
    for chunk in (dual, single):
        chunk.allocate_cache(1, 32)
        with torch.no_grad():
            chunk.forward_blocks(chunk.embed(ids[:4], 0), 0, 0)
            rows = chunk.forward_rows(chunk.embed(ids[4:16], 4), RowBatch.of([0], [4], [12], row_wise=True))
            steps = torch.cat([chunk.forward_blocks(chunk.embed(ids[i:i + 1], i), 0, i) for i in range(4, 16)])
        out.append((rows, steps))
    (rows_dual, steps_dual), (rows_single, steps_single) = out
    assert torch.equal(rows_dual, rows_single) and torch.equal(rows_dual, steps_dual)
    assert torch.equal(steps_dual, steps_single)


def test_layers_of_one_shape_that_chose_differently_are_each_reported(fake_timings):
    """The memory a node spares ran out partway through its load: the first layers of a shape
    took fbgemm (faster here, larger), the later ones int4pack. Reports count matrices per
    kernel and show both outcomes, not only the last layer's; start_report starts a new load's."""
    fake_timings["int8dyn-fbgemm"] = (0.1, 0.0)  # fastest on one row
    extra = kernel_choice.extra_bytes(FBGEMM, SPEC, 64, 128)
    kernel_choice.set_memory_allowance(2 * extra)
    kernel_choice.start_report()
    kinds = [kernel_choice.choose_kernels(weight(), SPEC, 128, CPU).kernel for _ in range(5)]
    assert kinds == [FBGEMM, FBGEMM, INT4, INT4, INT4]
    report = kernel_choice.chosen_by_weight()
    assert report["int4/g32 64x128"].startswith("int4pack-cpu: policy fast:")
    assert report["int4/g32 64x128"].endswith("; on 3 matrices") and "int8dyn-fbgemm needs" in report["int4/g32 64x128"]
    assert report["int4/g32 64x128 #2"].startswith("int8dyn-fbgemm:") and report["int4/g32 64x128 #2"].endswith(
        "; on 2 matrices")
    assert kernel_report.summary(report).startswith("int4pack-cpu x3, int8dyn-fbgemm x2")
    assert [e["matrices"] for e in kernel_choice.chosen()] == ["3", "2"]
    with kernel_choice.unreported():  # a profile's blocks, loaded meanwhile: reports keep naming the run's
        kernel_choice.choose_kernels(weight(), SPEC, 128, CPU)
    assert kernel_choice.chosen_by_weight() == report
    kernel_choice.start_report()
    assert kernel_choice.chosen_by_weight() == {}


@pytest.mark.parametrize("policy, kernel, words", [
    ("exact", "dequant", "dequant (the only candidate; not timed)"),
    ("int4pack-cpu", "int4pack-cpu", "int4pack-cpu (named; not timed); dequant (the fallback; not timed)"),
    ("int4pack-cuda", "dequant", "int4pack-cuda does not run here on int4/g32 weights"),
])
def test_exact_and_named_kernels_are_reported_as_taken_not_as_timed(policy, kernel, words):
    qkernels.set_preference(policy)
    kernel_choice.start_report()
    assert kernel_choice.choose_kernels(weight(), SPEC, 128, CPU).kernel.name == kernel
    text = kernel_choice.chosen_by_weight()["int4/g32 64x128"]
    assert text.startswith("%s: policy %s: " % (kernel, policy)) and words in text and " ms" not in text, text
    summary = kernel_report.summary(kernel_choice.chosen_by_weight())
    assert summary.startswith("%s x1" % kernel)
    assert ("int4pack-cuda (runtime.quant_kernel) does not run on 1 of them" in summary) == (policy == "int4pack-cuda")



def test_by_default_no_kernel_holds_more_than_the_stored_weight(fake_timings, monkeypatch):
    """A process that sets no allowance (a node whose runtime.kernel_memory is the default 0)
    holds each weight as stored: fbgemm, fastest on every row count here, is neither packed nor
    kept, for decode or prefill, whatever the timings say; reports say what would opt in."""
    kernel_choice.set_memory_allowance(kernel_choice.DEFAULT_ALLOWANCE)
    assert kernel_choice.DEFAULT_ALLOWANCE == 0
    fake_timings["int8dyn-fbgemm"] = (0.01, 0.001)
    packed = []
    real_pack = FBGEMM.pack
    monkeypatch.setattr(FBGEMM, "pack", lambda *a: packed.append(1) or real_pack(*a))
    choice = kernel_choice.choose_kernels(weight(), SPEC, 128, CPU, "a layer")
    assert choice.kernel is INT4 and choice.prefill_kernel is None and not packed
    assert kernel_choice.extra_bytes(choice.kernel, SPEC, 64, 128) == 0
    assert "runtime.kernel_memory" in kernel_choice.chosen_by_weight()["int4/g32 64x128"]
    # opted in: the same layer takes it
    kernel_choice.set_memory_allowance(ROOMY)
    assert kernel_choice.choose_kernels(weight(), SPEC, 128, CPU).kernel is FBGEMM


@pytest.mark.parametrize("setting,spare,expected", [(0, 1 << 30, 0), (None, 1 << 30, 0), (0, None, 0),
                                                    (64 << 20, 1 << 30, 64 << 20), (64 << 20, 10 << 20, 10 << 20),
                                                    (64 << 20, None, 64 << 20), (64 << 20, -5, 0),
                                                    ("auto", 1 << 30, 1 << 30), ("auto", None, None)])
def test_the_allowance_a_node_loads_with(setting, spare, expected):
    """runtime.kernel_memory to the allowance: none by default, a size within what the node
    spares, auto all it spares (no limit where its memory is unknown, as before)."""
    assert kernel_choice.allowance_for(setting, spare) == expected


def test_a_remembered_entry_where_dequant_failed_is_measured_again(monkeypatch):
    """A hand-edited kernels.json whose every kernel, dequant too, is null left nothing to choose
    from: min() of nothing, a ValueError at load."""
    held = {"decode": {"dequant": None, "int4pack-cpu": None}, "prefill": {}, "notes": {}, "crossovers": {}}
    monkeypatch.setattr(kernel_memory, "recall", lambda key: held)
    kernel_choice._recall(("a key",))
    assert ("a key",) not in kernel_choice._measured
    held["decode"]["dequant"] = 0.004
    kernel_choice._recall(("a key",))
    assert kernel_choice._measured[("a key",)] == {"dequant": 0.004, "int4pack-cpu": None}
