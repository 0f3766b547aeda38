"""One home for a run's size (mdi.starter.planning.run_shape): `mdi-start --check` checks the slots and
positions the run then allocates (--n-samples, a soft prompt's virtual tokens and the
tokenizer's BOS counted), and mdi-plan plans for the same positions."""
import json
import re

import pytest
import torch
import yaml
from safetensors.torch import save_file

from ringconfigs import write_run_config
from mdi.cli.plan import plan_main
from mdi.cli.start import start_main
from mdi.model.source import ModelSource
from mdi.runconfig import load_config, samples_per_frame
from mdi.starter import batch
from mdi.starter.planning.run_shape import expand_prompts

N_VIRTUAL = 3


def soft_prompt(path, width):
    """A PEFT prompt-tuning adapter of N_VIRTUAL virtual tokens."""
    path.mkdir()
    save_file({"prompt_embeddings": torch.randn(N_VIRTUAL, width)}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": N_VIRTUAL, "token_dim": width}))
    return str(path)


@pytest.fixture
def config_file(tiny_models, tmp_path):
    model = tiny_models["llama"]
    soft = soft_prompt(tmp_path / "soft", ModelSource(model).config.n_embd)
    return write_run_config(tmp_path / "run.yaml", model, adapters={"soft": soft}, n_tokens=6,
                            generation={"prompts": ["Once upon a time"]})


def checked_shape(capsys, argv):
    """(samples, positions) from `mdi-start ARGV --check`'s model line."""
    assert start_main(argv + ["--check"]) == 0
    found = re.search(r"; (\d+) samples x (\d+) positions", capsys.readouterr().out)
    assert found, "no model line in the check's output"
    return int(found.group(1)), int(found.group(2))


def allocated_shape(config_file, prompts, n_samples, adapters):
    """(slots, positions) the batch run itself allocates on its node."""
    seen = {}
    cfg = load_config(config_file)
    batch.run(cfg, expand_prompts(cfg, prompts, n_samples),
              on_engine=lambda engine: seen.update(slots=engine.n_slots, positions=engine.max_len),
              adapters=adapters)
    return seen["slots"], seen["positions"]


@pytest.mark.parametrize("adapter", [[], ["soft"]], ids=["base", "soft-prompt"])
def test_check_sees_the_slots_and_positions_the_run_allocates(config_file, capsys, adapter):
    argv = ["--config", config_file, "--n-samples", "8"] + sum((["--adapter", a] for a in adapter), [])
    checked = checked_shape(capsys, argv)
    assert checked == allocated_shape(config_file, [], 8, adapter)
    assert checked[0] == 8
    # the prompt's ids (BOS included) + the soft prompt's virtual tokens + the tokens to generate
    tok = ModelSource(load_config(config_file).model.path).tokenizer
    assert checked[1] == len(tok.encode_prompt("Once upon a time")) + (N_VIRTUAL if adapter else 0) + 6


def test_mdi_plan_plans_the_positions_of_the_run(config_file, capsys, tmp_path, monkeypatch):
    """mdi-plan plans for the run of the config's prompts: the same positions per slot."""
    from mdi.starter.planning import run_plan
    cfg = yaml.safe_load(open(config_file))
    cfg["nodes"] = [{"name": "starter", "layers": "auto"}]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    planned = {}
    real = run_plan.plan_ring

    def recording(cfg, source, samples, max_len, *args, **kwargs):
        planned.update(samples=samples, max_len=max_len)
        return real(cfg, source, samples, max_len, *args, **kwargs)
    monkeypatch.setattr(run_plan, "plan_ring", recording)
    monkeypatch.setenv("MDI_PROFILE_CACHE", str(tmp_path / "profiles"))
    assert plan_main(["--config", str(path), "--samples", "5", "--json"]) == 0
    capsys.readouterr()
    assert (planned["samples"], planned["max_len"]) == checked_shape(capsys, ["--config", config_file, "--n-samples", "5"])


def test_mdi_plan_refuses_fewer_samples_than_the_config_s_prompts(tiny_models, tmp_path, capsys):
    """The written config's run would hold every prompt, more than the plan was made for."""
    path = write_run_config(tmp_path / "two.yaml", tiny_models["llama"], generation={"prompts": ["a", "b", "c"]})
    assert plan_main(["--config", path, "--samples", "2"]) == 2
    assert "--samples 2 is smaller than the 3 prompts of %s's generation.prompts" % path in capsys.readouterr().err


@pytest.mark.parametrize("setting,in_flight,nodes,expected", [
    ("auto", 12, 3, 4), ("auto", 1, 3, 1), ("auto", 7, 3, 3), (2, 12, 3, 2), (8, 3, 3, 3), (1, 0, 3, 1)])
def test_samples_per_frame_is_one_rule(setting, in_flight, nodes, expected):
    from mdi.starter.planning.planner import groups
    assert samples_per_frame(setting, in_flight, nodes) == expected
    if in_flight:
        assert groups(in_flight, nodes, setting)[0] == expected


def test_mdi_plan_refuses_to_write_over_the_config_it_plans(tiny_models, tmp_path, capsys):
    """--write naming --config had replaced the user's file (comments, layers: auto) with the plan (h79)."""
    path = write_run_config(tmp_path / "ring.yaml", tiny_models["llama"])
    before = open(path).read()
    link = tmp_path / "same.yaml"
    link.symlink_to(path)
    for target in (path, str(link)):
        assert plan_main(["--config", path, "--write", target]) == 2
        assert "is the --config being planned" in capsys.readouterr().err
    assert open(path).read() == before
