"""benchmarks/mechanisms.py's pure parts: LOOP's filter counts from metrics.jsonl lines, and the relative
difference of two parameter sets. Expected numbers by hand."""

import json

import pytest
import torch

from benchmarks import mechanisms

# loop.py metrics.jsonl: an eval line (no filter figures) and two training lines of 8 rollouts each
LOOP_LINES = [
    {"step": 0, "eval/success_rate": 0.0},
    {"step": 1, "rollouts": 8, "filtered_fraction": 0.5, "env_errors": 1, "abandoned": 0.0, "kl_k1": 0.9,
     "truncated_fraction": 0.25},
    {"step": 2, "rollouts": 8, "filtered_fraction": 1.0, "env_errors": 0, "abandoned": 1.0, "kl_k1": 21.0,
     "truncated_fraction": 0.0},
]


def test_loop_counts_split_the_filter_into_small_advantage_and_failed_rollouts():
    out = mechanisms.loop_counts(LOOP_LINES)
    # dropped: 0.5 * 8 + 1.0 * 8 = 12 of 16; 1 of them failed, so 11 for |A| < threshold
    assert out["iterations"] == 2 and out["rollouts"] == 16
    assert out["filtered_per_iteration"] == [0.5, 1.0]
    assert out["filtered_fraction"] == pytest.approx(12 / 16)
    assert (out["dropped_small_advantage"], out["dropped_env_failed"]) == (11, 1)
    assert out["iterations_abandoned_kl"] == 1 and out["kl_k1_max"] == 21.0
    assert out["truncated_fraction"] == pytest.approx(2 / 16)  # 0.25 * 8 truncated rollouts of 16


def test_relative_difference_over_all_parameters():
    a = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([1.0])}
    b = {"w": torch.tensor([0.0, 4.0]), "b": torch.tensor([1.0])}
    # ‖a − b‖ = sqrt(9 + 16 + 0) = 5; ‖b‖ = sqrt(16 + 1)
    assert mechanisms.relative(a, b) == pytest.approx(5 / 17 ** 0.5)
    assert mechanisms.relative(b, b) == 0.0


def test_t2po_flags_reach_the_measured_setting_on_top_of_the_default_run(monkeypatch):

    import t2po_tds

    from common import run

    seen = {}

    def stop(args, **options):  # the first thing real_turns does with the parsed settings
        seen["args"] = args
        raise RuntimeError("stop here")

    monkeypatch.setattr(run, "make_env", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        t2po_tds.real_turns(2, 4, 0, ("--tti-min-think", "8", "--tds-eta", "0.03"))
    args = seen["args"]
    assert (args.tti_min_think, args.tds_eta, args.tti_epsilon) == (8, 0.03, 0.12)  # ε left at the default run's
    assert (args.group_size, args.tasks_per_step, args.tds_max_try) == (4, 2, 1)
    assert args.max_turns == 4  # the default run's preset still applies


def test_tds_separation_by_hand_and_none_without_repeats():

    import t2po_tds

    def record(repeat: bool, gamma: float) -> dict:
        return dict(repeat=repeat, gamma_before=gamma, gamma_now=gamma, lengths=[3, 3],
                    prev=dict(entropies=[1.0]), cur=dict(entropies=[1.0]))

    # one repeat (Γ 0.1) against others 0.2 (above it: 1), 0.05 (below: 0), 0.1 (tie: 0.5) -> 1.5 / 3
    out = t2po_tds.summary([record(True, 0.1), record(False, 0.2), record(False, 0.05), record(False, 0.1)],
                           eta=0.15)["gamma_now"]
    assert (out["separation"], out["median_repeat"], out["median_other"]) == (0.5, 0.1, 0.1)
    assert (out["resampled"], out["of_them_repeats"]) == (3, 1)  # Γ 0.1 (the repeat), 0.05, 0.1 < 0.15
    # no repeat: nothing to separate, and no median of repeats (not a misleading 0)
    out = t2po_tds.summary([record(False, 0.1), record(False, 0.3)], eta=0.15)["gamma_now"]
    assert (out["separation"], out["median_repeat"], out["median_other"]) == (None, None, 0.2)
    import os

    with open(os.path.join(mechanisms.HERE, "results", "mechanisms", "t2po_long_thoughts_seed1.json")) as f:
        measured = json.load(f)["t2po"]  # a committed measurement, for the table's other rows
    assert "| - (median Γ, repeats / others: - / 0.2) |" in mechanisms.table(
        {"t2po": {**measured, "tds_gamma_separation": out["separation"],
                  "tds_gamma_median_repeat_other": [out["median_repeat"], out["median_other"]]}})


def test_json_folder_is_made_before_the_measurement(monkeypatch, tmp_path):
    out = tmp_path / "runs" / "mechanisms.json"  # runs/ does not exist in a fresh clone

    def measure(*args):
        assert out.parent.is_dir()  # made first: a path that cannot be written fails before the run
        return {}

    monkeypatch.setattr(mechanisms, "t2po_mechanisms", measure)
    monkeypatch.setattr(mechanisms, "table", lambda result: "")
    monkeypatch.setattr("sys.argv", ["mechanisms.py", "--only", "t2po", "--json", str(out)])
    mechanisms.main()
    assert json.loads(out.read_text())["t2po"] == {}
