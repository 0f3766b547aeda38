"""mdi-bench's CSV (mdi.lab.report) and its experiments' `speculation:` key: the drafting
counters of a run's metrics record in spec_* columns, empty when speculation is off."""
import pytest

from test_experiments import _batching_plan, _outcome
from mdi.lab.report import CSV_COLUMNS, make_row
from mdi.lab.spec import ExperimentError

SPEC_COLUMNS = ["spec_drafted", "spec_accepted", "spec_acceptance_rate", "spec_accepted_per_pass",
                "spec_passes_cancelled", "spec_wasted_rows"]


def test_csv_rows_carry_the_speculation_counters(tmp_path):
    exp, plans = _batching_plan(tmp_path, speculation={"method": "ngram", "max_draft": 4})
    plan = plans[0][0]
    assert set(SPEC_COLUMNS) <= set(CSV_COLUMNS)
    starter = {"compute_seconds": 0.5, "speculation": {
        "drafted": 40, "accepted": 30, "acceptance_rate": 0.75, "accepted_per_pass": 2.5, "verifications": 12,
        "passes_stale": 3, "rows_wasted": 17}}
    nodes = [starter, {"compute_seconds": 0.2, "speculation": {"passes_cancelled": 2, "rows_cancelled": 5}},
             {"compute_seconds": 0.2}]
    row = make_row(exp, plan, 1, 1, _outcome(nodes, samples=1, tokens=plan.model.tokens), "off", "runs/x.json", 1)
    assert (row["spec_drafted"], row["spec_accepted"], row["spec_acceptance_rate"], row["spec_accepted_per_pass"]) \
        == ("40", "30", "0.7500", "2.5000")
    assert row["spec_passes_cancelled"] == "3;2;0"
    # the starter and board 1 computed the rows board 1 dropped; board 2 never saw them
    assert row["spec_wasted_rows"] == "22;17;17"
    off = make_row(exp, plan, 1, 1, _outcome([{"compute_seconds": 0.5}] * 3, samples=1, tokens=plan.model.tokens),
                   "off", "runs/y.json", 1)
    assert off["status"] == "ok" and all(off[c] == "" for c in SPEC_COLUMNS)


def test_an_experiment_s_speculation_reaches_every_run_s_config(tmp_path):
    from mdi.lab.emulation import Emulation, EmulationSettings
    from mdi.lab.nodes import Ring
    from mdi.runconfig import parse_config
    exp, plans = _batching_plan(tmp_path, speculation="ngram")
    ring = Ring(plans[0][0], exp, Emulation(EmulationSettings(mode="off"), 3), None, str(tmp_path), print)
    assert parse_config(ring.run_config(1), "ring.yaml").generation.speculation.method == "ngram"
    with pytest.raises(ExperimentError, match="speculation.method: expected one of"):
        _batching_plan(tmp_path, speculation="medusa")
