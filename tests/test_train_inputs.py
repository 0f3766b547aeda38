"""Training inputs a server or mdi-train could only fail on late, or fail on badly (h67): an
`out` that can never be written is refused before the job, JSONL lines are cut at "\\n" alone,
an example nested past the stack or with no token is a line or a drop, and --metrics-out never
names a file the run reads."""
import json
import os
import subprocess

import pytest

from conftest import BIN, CHARS
from mdi.model.tokenizers import char_tokenizer
from mdi.runconfig import ConfigError
from mdi.serving.served_files import ServedFiles
from mdi.serving.train_body import out_problem
from mdi.starter.train.train_data import load_windows
from mdi.system.files import output_problem


def test_an_out_that_can_never_be_written_is_refused_before_the_job(tmp_path):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    files = ServedFiles(str(model), {})
    data = tmp_path / "models" / "data.txt"
    data.write_text("hello")
    assert "is a file" in out_problem(str(data / "sub"), files)
    assert "too long" in out_problem(str(tmp_path / "models" / ("x" * 300)), files)
    assert "too long" in output_problem(str(tmp_path / "/".join(["d"] * 2100)), folder=True)
    assert out_problem(str(tmp_path / "models" / "new"), files) is None


def _jsonl(tmp_path, *examples, raw=None):
    path = tmp_path / "d.jsonl"
    path.write_text(raw if raw is not None else "\n".join(json.dumps(e, ensure_ascii=False) for e in examples),
                    encoding="utf-8")
    return str(path)


def test_jsonl_lines_end_at_newline_alone_and_bad_lines_are_one_line(tmp_path):
    tok = char_tokenizer(CHARS + ["\u2028"])
    windows = load_windows(tok, _jsonl(tmp_path, {"prompt": "ab\u2028", "completion": "cd"},
                                       {"prompt": "a", "completion": "b"}), 8)
    assert windows.ids.shape[0] == 2  # U+2028 inside a string is not a line break
    with pytest.raises(ConfigError, match="line 1: JSON nested too deeply"):
        load_windows(tok, _jsonl(tmp_path, raw="[" * 100000 + "]" * 100000), 8)
    empty = load_windows(tok, _jsonl(tmp_path, {"prompt": "", "completion": ""}, {"prompt": "a", "completion": "b"}), 8)
    assert empty.ids.shape[0] == 1  # the empty example dropped, not an IndexError


def test_metrics_out_never_names_a_file_the_run_reads(tmp_path, tiny_models):
    data = tmp_path / "data.txt"
    data.write_text("some text to train on " * 20)
    config = tmp_path / "c.yaml"
    config.write_text("model: {path: %s}\n" % tiny_models["llama"])
    for target in (str(data), str(config), os.path.join(tiny_models["llama"], "mdi_config.json")):
        before = open(target, "rb").read()
        proc = subprocess.run([os.path.join(BIN, "mdi-train"), "--config", str(config), "--data", str(data),
                               "--out", str(tmp_path / "out"), "--metrics-out", target], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and "--metrics-out" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert open(target, "rb").read() == before
