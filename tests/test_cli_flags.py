"""Flags and settings a user gets wrong, or right in a way the program refused (h62's walk
through the README): each is one line naming what was wrong, or does what the README says."""
import logging
import os
import subprocess

from conftest import BIN, ROOT
from test_cli import assert_one_line_error, mdi_start, write
from mdi.cli.start import _config_from_args, start_parser
from mdi.model.tokenizers import char_tokenizer
from mdi.serving.prompts import ChatTemplate


def test_a_config_that_is_a_directory_is_said_so(tmp_path):
    assert_one_line_error(mdi_start("--config", str(tmp_path), "--prompt", "x"), "a directory, not a config file")


def test_a_typo_in_mdi_backend_is_refused_naming_it(tmp_path):
    path = write(tmp_path, "model: {path: x}\n")
    for args in (["--config", path], ["--model", "x"]):
        proc = subprocess.run([os.path.join(BIN, "mdi-start")] + args + ["--prompt", "x"], capture_output=True,
                              text=True, timeout=60, env=dict(os.environ, MDI_BACKEND="gmml"))
        assert_one_line_error(proc, "$MDI_BACKEND", "'gmml'")


def test_n_samples_must_be_positive():
    assert_one_line_error(mdi_start("--model", "m", "--prompt", "a", "--n-samples", "0"), "--n-samples",
                          "an integer >= 1")


def test_threads_auto_and_top_k_off_from_the_command_line(tmp_path):
    path = write(tmp_path, "model: {path: x}\ngeneration: {top_k: 50}\nruntime: {threads: 2}\n")
    cfg = _config_from_args(start_parser().parse_args(["--config", path, "--threads", "auto", "--top-k", "0"]))
    assert cfg.runtime.threads == "auto" and cfg.generation.top_k is None
    cfg = _config_from_args(start_parser().parse_args(["--config", path, "--top-k", "5"]))
    assert cfg.generation.top_k == 5 and cfg.runtime.threads == 2


def test_a_model_without_a_chat_template_is_said_when_serving_starts(caplog):
    with caplog.at_level(logging.WARNING):
        template = ChatTemplate(char_tokenizer(list("abc ")))
    assert template.source == "fallback"
    assert any("no chat template" in r.getMessage() and "--chat-template" in r.getMessage() for r in caplog.records)


def test_prepare_refused_before_writing_says_nothing_of_a_partial_result(tmp_path):
    out = tmp_path / "held"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = subprocess.run([os.path.join(BIN, "mdi-prepare"), os.path.join(ROOT, "models", "nanogpt-shakespeare"),
                           "--out", str(out), "--quant", "q9_9"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "q9_9" in proc.stderr and "partial result" not in proc.stderr, proc.stderr
    assert os.listdir(str(out)) == ["notes.txt"]
