"""The shipped character-level NanoGPT: it loads, writes Shakespeare-like text, gives the same
greedy tokens over a ring as alone, and the training script that made it still works."""
import json
import os
import subprocess
import sys

from conftest import ROOT
from ringconfigs import parse_run_config
from mdi.starter import batch

MODEL = os.path.join(ROOT, "models", "nanogpt-shakespeare")


def run(workers=(), layers=None, n_tokens=80):
    return batch.run(parse_run_config(MODEL, workers, "nanogpt", layers=layers, n_tokens=n_tokens),
                     ["ROMEO:", "JULIET:"])


def test_shipped_checkpoint_is_small_and_trained():
    size = sum(os.path.getsize(os.path.join(MODEL, f)) for f in os.listdir(MODEL))
    assert size < 8e6
    record = json.load(open(os.path.join(MODEL, "training.json")))
    assert record["final_val_loss"] < 2.0  # nats/char; an untrained model is at ln(84) = 4.4
    text = run().texts[0]
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) > 5 and any(w.lower() in ("the", "and", "i", "to", "of", "my", "a") for w in words)


def test_ring_matches_standalone(workers):
    alone = [s.token_ids for s in run().samples]
    assert [s.token_ids for s in run(workers[:2], [1, 2, 1]).samples] == alone


def test_training_script_writes_a_loadable_model(tmp_path):
    out = tmp_path / "ng"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_nanogpt.py"), "--steps", "3",
                           "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
                           "--batch-size", "4", "--eval-iters", "1", "--final-eval-iters", "1",
                           "--sample-chars", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = parse_run_config(str(out), label="t", n_tokens=5)
    assert len(batch.run(cfg, ["ROMEO:"]).samples[0].token_ids) == 5
