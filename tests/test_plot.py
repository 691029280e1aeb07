"""common.plot: learning curves of run folders into one PNG."""

import json
import os

import numpy as np
import pytest

from common import plot

# t2po.py's rows: base and cold-start evaluations at step 0, training rows, a final eval row.
T2PO_ROWS = [
    {"step": 0, "eval/success_rate": 0.0, "eval/reward_mean": -0.2},
    {"step": 0, "eval_cold_start/success_rate": 0.25},
    {"step": 1, "success_rate": 0.25, "reward_mean": 0.1, "tokens_per_turn": 30.0, "time_s": 70.0,
     "step_time_s": 70.0},
    {"step": 2, "success_rate": 0.5, "reward_mean": 0.4, "tokens_per_turn": 25.0, "time_s": 135.0,
     "step_time_s": 65.0},
    {"step": 2, "eval/success_rate": 0.75},
]
# loop.py's rows: no tokens_per_turn, but action tokens, rollouts and turns; time_s per step.
LOOP_ROWS = [
    {"step": 0, "eval/success_rate": 0.0},
    {"step": 1, "rollouts": 8, "reward_mean": 0.2, "success_rate": 0.125, "action_tokens": 96,
     "turns_mean": 3.0, "time_s": 40.0},
    {"step": 2, "rollouts": 8, "reward_mean": 0.5, "success_rate": 0.5, "action_tokens": 48,
     "turns_mean": 2.0, "time_s": 42.0},
    {"step": 2, "eval/success_rate": 0.5},
]


def _run(tmp_path, name, rows, tail=""):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return str(folder)


def _colour_pixels(png, hex_colour):
    import matplotlib.image

    image = matplotlib.image.imread(png)[..., :3]  # (H, W, 3) floats in [0, 1]
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image - rgb).max(axis=-1) < 0.02).sum())


def test_two_runs_make_one_png_with_a_line_per_run(tmp_path):
    t2po_run = _run(tmp_path, "t2po-a", T2PO_ROWS, tail='{"step": 3, "succ')  # a row cut short by a kill
    loop_run = _run(tmp_path, "loop-b", LOOP_ROWS)
    out = str(tmp_path / "curves.png")
    plot.main([t2po_run, loop_run, "-o", out])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 20_000  # five panels of lines, axes and text; an empty figure is ~5 kB
    import matplotlib.image

    height, width = matplotlib.image.imread(out).shape[:2]
    assert (width, height) == (1500, 720)  # 3 x 2 panels at 5 x 3.6 inches, 100 dpi
    # each run drawn in its own colour (matplotlib's first two: C0 blue, C1 orange)
    assert _colour_pixels(out, "#1f77b4") > 200
    assert _colour_pixels(out, "#ff7f0e") > 200


def test_panels_whose_keys_no_run_has_are_left_out(tmp_path):
    rows = [{"step": 1, "reward_mean": 0.5, "success_rate": 0.0}, {"step": 2, "reward_mean": 0.7}]
    out = str(tmp_path / "one.png")
    titles = plot.plot_runs([_run(tmp_path, "bare", rows)], out)
    assert titles == ["training reward (reward_mean)", "training success (success_rate)"]
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[1] == 1000  # two panels side by side


def test_values_drawn_are_the_logged_ones():
    # loop.py: 96 action tokens over 8 rollouts x 3 turns = 4 tokens per turn; 48 / (8 x 2) = 3
    assert plot.train_series(LOOP_ROWS, plot._tokens_per_turn) == ([1, 2], [4.0, 3.0])
    assert plot.train_series(LOOP_ROWS, plot._step_seconds) == ([1, 2], [40.0, 42.0])
    # t2po.py: its time_s counts from the start of RL; step_time_s is the step's own
    assert plot.train_series(T2PO_ROWS, plot._step_seconds) == ([1, 2], [70.0, 65.0])
    ev = plot.eval_series(T2PO_ROWS)
    assert ev["base"] == ([0], [0.0]) and ev["cold start"] == ([0], [0.25])
    assert ev["RL"] == ([0, 2], [0.25, 0.75])  # RL starts from the cold-start policy
    assert plot.eval_series(LOOP_ROWS)["RL"] == ([0, 2], [0.0, 0.5])


def test_labels_are_run_names_or_paths_when_names_clash():
    assert plot.run_labels(["runs/a", "runs/b/"]) == ["a", "b"]
    assert plot.run_labels(["x/run", "y/run"]) == ["x/run", "y/run"]


def test_missing_metrics_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"RUN .*nowhere: no metrics.jsonl there"):
        plot.main([str(tmp_path / "nowhere")])


def test_the_rollout_share_of_a_step_has_its_own_panel(tmp_path):
    rows = [{"step": 1, "reward_mean": 0.5, "step_time_s": 60.0, "time_rollout_s": 25.0},
            {"step": 2, "reward_mean": 0.7, "step_time_s": 50.0, "time_rollout_s": 20.0}]
    titles = plot.plot_runs([_run(tmp_path, "timed", rows)], str(tmp_path / "timed.png"))
    assert titles == ["training reward (reward_mean)", "seconds per step",
                      "of which rollout (time_rollout_s)"]


def test_the_probe_curve_is_drawn_dashed_in_the_held_out_panel(tmp_path):
    rows = [{"step": 0, "eval_cold_start/success_rate": 0.25, "probe/success_rate": 0.5},
            {"step": 1, "reward_mean": 0.5, "probe/success_rate": 0.625},
            {"step": 2, "reward_mean": 0.7, "probe/success_rate": 0.75},
            {"step": 2, "eval/success_rate": 0.5}]
    assert plot.probe_series(rows) == ([0, 1, 2], [0.5, 0.625, 0.75])
    assert plot.probe_series(T2PO_ROWS) == ([], [])
    out = str(tmp_path / "probe.png")
    plot.plot_runs([_run(tmp_path, "probed", rows)], out)
    without = str(tmp_path / "bare.png")
    bare = [{k: v for k, v in r.items() if k != "probe/success_rate"} for r in rows]
    plot.plot_runs([_run(tmp_path, "bare", [r for r in bare if len(r) > 1])], without)
    # the probe's line: more of the run's colour than the held-out points alone
    assert _colour_pixels(out, "#1f77b4") > _colour_pixels(without, "#1f77b4") + 100
