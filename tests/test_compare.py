"""benchmarks/compare.py report: the 95% intervals, the paired verdict, and the table and PNG it writes from
run folders in the scripts' real metrics.jsonl format. Every expected number is computed by hand."""

import copy
import json
import math
import os

import pytest

from benchmarks import compare

# metrics.jsonl lines of real 2-step runs (`python <algo>.py --model tiny-random --steps 2`), floats rounded:
# base eval, cold-start eval at step 0, two training rows, the eval after RL
T2PO_ROWS = [
    {"step": 0, "eval/success_rate": 0.0, "eval/score": 0.0, "eval/reward_mean": -0.3,
     "eval/turns_per_episode": 3.0, "eval/tokens_per_turn": 40.0, "eval/think_tokens_per_turn": 19.8333,
     "eval/tti_interventions": 1.0, "eval/tti_wasted_tokens": 484.0, "eval/tds_resamples": 0.0,
     "eval/invalid_format_rate": 1.0},
    {"step": 0, "eval_cold_start/success_rate": 0.0, "eval_cold_start/score": 0.0,
     "eval_cold_start/reward_mean": -0.3, "eval_cold_start/turns_per_episode": 3.0,
     "eval_cold_start/tokens_per_turn": 40.0, "eval_cold_start/think_tokens_per_turn": 20.0,
     "eval_cold_start/tti_interventions": 1.0, "eval_cold_start/tti_wasted_tokens": 480.0,
     "eval_cold_start/tds_resamples": 0.0, "eval_cold_start/invalid_format_rate": 1.0},
    {"step": 1, "success_rate": 0.0, "score": 0.0, "reward_mean": -0.3, "turns_per_episode": 3.0,
     "tokens_per_turn": 40.0, "think_tokens_per_turn": 20.0, "tti_interventions": 1.0,
     "tti_wasted_tokens": 480.0, "tds_resamples": 16.0, "invalid_format_rate": 1.0, "loss": -0.0,
     "clip_fraction": 0.0, "grad_norm": 0.0, "num_tokens": 792, "time_s": 2.2322, "step_time_s": 2.2322,
     "time_rollout_s": 1.475, "time_update_s": 0.7573},
    {"step": 2, "success_rate": 0.0, "score": 0.0, "reward_mean": -0.3, "turns_per_episode": 3.0,
     "tokens_per_turn": 40.0, "think_tokens_per_turn": 20.0, "tti_interventions": 1.0,
     "tti_wasted_tokens": 480.0, "tds_resamples": 16.0, "invalid_format_rate": 1.0, "loss": -0.0,
     "clip_fraction": 0.0, "grad_norm": 0.0, "num_tokens": 792, "time_s": 4.3144, "step_time_s": 2.0818,
     "time_rollout_s": 1.4581, "time_update_s": 0.6237},
    {"step": 2, "eval/success_rate": 0.0, "eval/score": 0.0, "eval/reward_mean": -0.3,
     "eval/turns_per_episode": 3.0, "eval/tokens_per_turn": 40.0, "eval/think_tokens_per_turn": 20.0,
     "eval/tti_interventions": 1.0, "eval/tti_wasted_tokens": 480.0, "eval/tds_resamples": 0.0,
     "eval/invalid_format_rate": 1.0},
]
ARPO_ROWS = [
    {"step": 0, "eval/success_rate": 0.0, "eval/reward_mean": -1.0, "eval/format_error_rate": 1.0,
     "eval/tool_calls_per_question": 0.0},
    {"step": 0, "eval_cold_start/success_rate": 0.0, "eval_cold_start/reward_mean": -1.0,
     "eval_cold_start/format_error_rate": 1.0, "eval_cold_start/tool_calls_per_question": 0.0},
    {"step": 1, "rollouts": 8, "reward_mean": -1.0, "success_rate": 0.0, "format_error_rate": 1.0,
     "num_tokens": 2048, "result_tokens": 0, "forks_per_question": 0.0, "tool_limit_rate": 0.0,
     "empty_call_rate": 0.0, "tool_calls/python_per_question": 0.0, "tool_calls/search_per_question":
     0.0, "tool_calls/executed_per_question": 0.0, "tool_calls/per_rollout": 0.0, "loss": 0.0,
     "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "time_s": 1.3606, "step_time_s": 1.3606},
    {"step": 2, "rollouts": 8, "reward_mean": -1.0, "success_rate": 0.0, "format_error_rate": 1.0,
     "num_tokens": 2048, "result_tokens": 0, "forks_per_question": 0.0, "tool_limit_rate": 0.0,
     "empty_call_rate": 0.0, "tool_calls/python_per_question": 0.0, "tool_calls/search_per_question":
     0.0, "tool_calls/executed_per_question": 0.0, "tool_calls/per_rollout": 0.0, "loss": 0.0,
     "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "time_s": 2.765, "step_time_s": 1.4041},
    {"step": 2, "eval/success_rate": 0.0, "eval/reward_mean": -1.0, "eval/format_error_rate": 1.0,
     "eval/tool_calls_per_question": 0.0},
]
LOOP_ROWS = [
    {"step": 0, "eval/success_rate": 0.0, "eval/reward_mean": 0.0, "eval/env_errors": 0},
    {"step": 0, "cold_start/episodes": 8, "cold_start/loss": 10.7372, "cold_start/time_s": 0.4973,
     "eval_cold_start/success_rate": 0.0, "eval_cold_start/reward_mean": 0.0,
     "eval_cold_start/env_errors": 0},
    {"step": 1, "rollouts": 8, "reward_mean": 0.0, "success_rate": 0.0, "num_tokens": 2252,
     "action_tokens": 144, "turns_mean": 3.0, "truncated_fraction": 0.0, "env_errors": 0,
     "filtered_fraction": 1.0, "loss": 0.0, "gradient_steps": 0, "time_rollout_s": 0.2635,
     "time_logprobs_s": 0.0001, "time_update_s": 0.0, "time_s": 0.2636, "step_time_s": 0.2636},
    {"step": 2, "rollouts": 8, "reward_mean": 0.0, "success_rate": 0.0, "num_tokens": 2599,
     "action_tokens": 144, "turns_mean": 3.0, "truncated_fraction": 0.0, "env_errors": 0,
     "filtered_fraction": 1.0, "loss": 0.0, "gradient_steps": 0, "time_rollout_s": 0.2147,
     "time_logprobs_s": 0.0001, "time_update_s": 0.0, "time_s": 1.0548, "step_time_s": 0.2147},
    {"step": 2, "eval/success_rate": 0.0, "eval/reward_mean": 0.0, "eval/env_errors": 0},
]


def test_interval_is_student_t_with_n_minus_1_dof():
    mean, half, n = compare.interval([1.0, 2.0, 3.0])  # s = 1, t_{0.975,2} = 4.303
    assert (mean, n) == (2.0, 3)
    assert half == pytest.approx(4.303 * 1 / math.sqrt(3), abs=1e-9)  # 2.484
    mean, half, n = compare.interval([1.0, 2.0, 3.0, 4.0, 5.0])  # s = √2.5, t_{0.975,4} = 2.776
    assert (mean, n) == (3.0, 5)
    assert half == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5), abs=1e-9)  # 1.963
    mean, half, n = compare.interval([0.5])  # one seed: no interval
    assert (mean, n) == (0.5, 1) and math.isnan(half)


def test_verdict_on_paired_differences():
    # mean 1/3, s = 0.1443, half-width 4.303 · 0.1443 / √3 = 0.359: [-0.025, 0.692] holds 0 (a normal
    # 1.96 would give 0.163 and call it better)
    assert compare.verdict([0.25, 0.25, 0.5], 1) == "within noise"
    # mean 0.417, same half-width: [0.058, 0.775]
    assert compare.verdict([0.5, 0.5, 0.25], 1) == "method better"
    assert compare.verdict([-0.5, -0.5, -0.25], 1) == "baseline better"
    assert compare.verdict([0.5, 0.5, 0.25], -1) == "baseline better"  # lower is better: more is worse
    assert compare.verdict([-0.5, -0.5, -0.25], -1) == "method better"
    assert compare.verdict([0.5], 1) == "too few seeds"
    # direction 0 (a mechanism's measure): which way it moved, never "better"
    assert compare.verdict([0.5, 0.5, 0.25], 0) == "method higher"
    assert compare.verdict([-0.5, -0.5, -0.25], 0) == "method lower"
    assert compare.verdict([0.25, 0.25, 0.5], 0) == "within noise"


def _run(root, algo, name, template, changes, done=True):
    """A run folder root/algo/name holding `template` with changes {row index: {key: value}}."""
    rows = copy.deepcopy(template)
    for i, update in changes.items():
        rows[i].update(update)
    folder = root / algo / name
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        (folder / "done").write_text("")


def _colour_pixels(png, hex_colour, columns):
    """Pixels of that colour in the image's first `columns` columns (the first panel)."""
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(png)[:, :columns, :3]  # (H, columns, 3) floats in [0, 1]
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image - rgb).max(axis=-1) < 0.02).sum())


def test_report_writes_the_table_and_a_png_per_algorithm(tmp_path, capsys):
    root = tmp_path / "runs"
    for arm, afters, reward in [("token", [0.7, 0.6], 0.9), ("turn", [0.2, 0.1], 0.1),
                                ("trajectory", [0.5, 0.7], 0.5)]:
        for seed, after in enumerate(afters):
            _run(root, "loop", f"{arm}-s{seed}", LOOP_ROWS,
                 {1: {"eval_cold_start/success_rate": 0.5}, 2: {"reward_mean": reward},
                  3: {"reward_mean": reward}, 4: {"eval/success_rate": after}})
    _run(root, "loop", "token-s2", LOOP_ROWS, {4: {"eval/success_rate": 0.0}}, done=False)  # unfinished
    for arm, tokens, last_success in [("t2po", [30, 34, 32], [0.5, 0.75, 0.25]),
                                      ("gigpo", [40, 40, 40], [0.25, 0.25, 0.25])]:
        for seed in range(3):
            _run(root, "t2po", f"{arm}-s{seed}", T2PO_ROWS,
                 {3: {"success_rate": last_success[seed]}, 4: {"eval/tokens_per_turn": tokens[seed]}})
    key = "tool_calls/executed_per_question"
    for arm, calls in [("arpo", [(1, 2), (2, 3)]), ("grpo", [(3, 3), (4, 4)])]:
        for seed, (step1, step2) in enumerate(calls):
            _run(root, "arpo", f"{arm}-s{seed}", ARPO_ROWS, {2: {key: step1}, 3: {key: step2}})
    markdown = tmp_path / "table.md"
    compare.main(["report", "t2po", "arpo", "loop", "--root", str(root), "--figures", str(tmp_path / "fig"),
                  "--markdown", str(markdown)])
    text = markdown.read_text()
    assert text == capsys.readouterr().out
    lines = text.splitlines()
    # loop, 2 finished seeds per arm (t_{0.975,1} = 12.706): token 0.65 ± 12.706 · 0.0707 / √2 = 0.635;
    # token − turn = 0.5, 0.5; token − trajectory = 0.2, -0.1: 0.05 ± 12.706 · 0.212 / √2 = 1.906
    assert "| metric | token (n=2) | turn (n=2) | trajectory (n=2) | token − turn, paired | verdict " \
           "| token − trajectory, paired | verdict |" in lines
    assert "| held-out success, after RL | 0.650 ± 0.635 | 0.150 ± 0.635 | 0.600 ± 1.271 | +0.500 ± 0.000 " \
           "| method better | +0.050 ± 1.906 | within noise |" in lines
    # before RL: the cold start's evaluation (0.5), not the base model's (0.0)
    assert "| held-out success, before RL | 0.500 ± 0.000 | 0.500 ± 0.000 | 0.500 ± 0.000 | +0.000 ± 0.000 " \
           "| within noise | +0.000 ± 0.000 | within noise |" in lines
    # t2po, 3 seeds (t_{0.975,2} = 4.303): tokens 32 ± 4.303 · 2 / √3 = 4.969; differences -10, -6, -8: fewer
    # tokens, the interval [-12.97, -3.03] excludes 0. Last step's success 0.5 ± 4.303 · 0.25 / √3 = 0.621.
    assert "| tokens per turn, held-out after RL ↓ | 32.0 ± 5.0 | 40.0 ± 0.0 | -8.000 ± 4.969 " \
           "| method better |" in lines
    assert "| training success, last step | 0.500 ± 0.621 | 0.250 ± 0.000 | +0.250 ± 0.621 | within noise |" \
        in lines
    # arpo: tool calls run per question, mean over the 2 steps: 1.5, 2.5 vs 3, 4; differences -1.5, -1.5
    assert "| tool calls run per question, training (mean over steps) ↓ | 2.000 ± 6.353 | 3.500 ± 6.353 " \
           "| -1.500 ± 0.000 | method better |" in lines
    import matplotlib.image

    for algo in ("t2po", "arpo", "loop"):
        png = tmp_path / "fig" / f"compare_{algo}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(png).shape[:2] == (400, 1500)  # 3 panels of 5 x 4 inches, 100 dpi
    for colour in ("#1f77b4", "#ff7f0e", "#2ca02c"):  # token, turn, trajectory: C0, C1, C2
        assert _colour_pixels(tmp_path / "fig" / "compare_loop.png", colour, columns=500) > 100  # curves


def test_unwritable_markdown_is_one_line(tmp_path):
    _run(tmp_path, "loop", "token-s0", LOOP_ROWS, {})
    with pytest.raises(SystemExit, match="compare.py report: cannot write .*missing/table.md"):
        compare.main(["report", "loop", "--root", str(tmp_path), "--figures", str(tmp_path / "fig"),
                      "--markdown", str(tmp_path / "missing" / "table.md")])


def test_run_plays_only_the_arms_asked_for_seed_by_seed(tmp_path, monkeypatch):
    calls = []

    def call(cmd, **kw):  # the script makes its --out folder
        calls.append(cmd)
        os.makedirs(cmd[cmd.index("--out") + 1])
        return 0

    monkeypatch.setattr(compare.subprocess, "call", call)
    compare.run("t2po", [0, 1], ["--steps", "2"], str(tmp_path), arms=["gigpo"])
    assert [(c[c.index("--seed") + 1], c[c.index("--out") + 1]) for c in calls] == [
        ("0", str(tmp_path / "t2po" / "gigpo-s0")), ("1", str(tmp_path / "t2po" / "gigpo-s1"))]
    assert all(c[-4:] == ["--no-tti", "--no-tds", "--steps", "2"] for c in calls)
    assert (tmp_path / "t2po" / "gigpo-s1" / "done").exists() and not (tmp_path / "t2po" / "t2po-s0").exists()
    compare.run("t2po", [0, 1], ["--steps", "2"], str(tmp_path), arms=["gigpo"])
    assert len(calls) == 2  # finished runs are skipped
    with pytest.raises(SystemExit, match="unknown arm 'grpo'; choose from t2po, gigpo"):
        compare.run("t2po", [0], [], str(tmp_path), arms=["grpo"])


def test_demo_reports_the_held_out_games_rl_added_per_seed_against_the_lr0_control(tmp_path, capsys,
                                                                                     monkeypatch):
    """`demo`: t2po.py as it is (rl) vs --lr 0 (lr0). Held-out of 8 games: before RL 4/8 in every run; after
    RL 6, 5, 3, 7, 6 (rl) and 4 every seed (lr0, no weight moved). Gains +2 +1 −1 +3 +2: mean 1.4,
    s = √(9.2/4) = 1.517, half-width t_{0.975,4} · s / √5 = 2.776 · 0.678 = 1.883, so [−0.48, 3.28] holds 0;
    4 of 5 seeds gained: 0.8, s = √(0.8/4), half-width 2.776 · 0.2 = 0.555. Probe (fixed training tasks) 0.5
    at step 0 and 0.75 after the last step in rl: +0.25."""
    root = tmp_path / "runs"
    for arm, afters in [("rl", [6, 5, 3, 7, 6]), ("lr0", [4] * 5)]:
        for seed, after in enumerate(afters):
            rows = copy.deepcopy(T2PO_ROWS)
            rows[1].update({"eval_cold_start/success_rate": 0.5, "eval_cold_start/rollouts": 8,
                            "probe/success_rate": 0.5})
            rows[3]["probe/success_rate"] = 0.75 if arm == "rl" else 0.5
            rows[4].update({"eval/success_rate": after / 8, "eval/rollouts": 8})
            _run(root, "demo", f"{arm}-s{seed}", rows, {})
    compare.main(["report", "demo", "--root", str(root), "--figures", str(tmp_path / "fig")])
    lines = capsys.readouterr().out.splitlines()
    assert "| metric | rl (n=5) | lr0 (n=5) | rl − lr0, paired | verdict |" in lines
    assert "| held-out games won, after − before RL | 1.400 ± 1.883 | 0.000 ± 0.000 | +1.400 ± 1.883 " \
           "| within noise |" in lines
    assert "| share of seeds where RL won more held-out games | 0.800 ± 0.555 | 0.000 ± 0.000 " \
           "| +0.800 ± 0.555 | method better |" in lines
    assert "| probe success (training tasks), after − before RL | 0.250 ± 0.000 | 0.000 ± 0.000 " \
           "| +0.250 ± 0.000 | method better |" in lines
    assert (tmp_path / "fig" / "compare_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    calls = []
    monkeypatch.setattr(compare.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or os.makedirs(
        cmd[cmd.index("--out") + 1]) or 0)
    compare.run("demo", [7], [], str(tmp_path / "new"), arms=["lr0"])  # the demo is t2po.py, --lr 0
    assert calls[0][1].endswith("t2po.py") and calls[0][-2:] == ["--lr", "0"]


def test_demo_counts_held_out_wins_per_walkthrough(tmp_path, capsys):
    """Coin collector level 3's seeds 0, 1, 2 and 3 have the walkthroughs west-north, south-east, north-east
    and north-east (envs/textworld_walkthroughs.json). Won after the cold start: seeds 1, 2, 3; after RL:
    0 and 2. So W-N 0 → 1 of 1, S-E 1 → 0 of 1, N-E 2 → 1 of 2."""
    root = tmp_path / "runs"
    _run(root, "demo", "rl-s0", T2PO_ROWS, {1: {"probe/success_rate": 0.5}, 3: {"probe/success_rate": 0.5}})
    folder = root / "demo" / "rl-s0"
    (folder / "args.json").write_text(json.dumps({"env_options": '{"level": 3, "holdout": "walkthrough"}'}))
    (folder / "transcripts").mkdir()
    for stage, won in [("cold_start", [False, True, True, True]), ("rl", [True, False, True, False])]:
        (folder / "transcripts" / f"{stage}.jsonl").write_text("".join(
            json.dumps({"task": seed, "won": w, "turns": []}) + "\n" for seed, w in enumerate(won)))
    assert compare.walkthrough_wins(str(folder)) == {"N-E": [2, 2, 1], "S-E": [1, 1, 0], "W-N": [1, 0, 1]}
    compare.main(["report", "demo", "--root", str(root), "--figures", str(tmp_path / "fig")])
    lines = capsys.readouterr().out.splitlines()
    assert "| run | N-E | S-E | W-N |" in lines
    assert "| rl-s0 | 2 → 1 of 2 | 1 → 0 of 1 | 0 → 1 of 1 |" in lines


def test_trained_mean_skips_steps_that_took_no_gradient_step():
    rows = [{"step": 1, "clip_fraction": 0.2, "gradient_steps": 4},
            {"step": 2, "clip_fraction": 0.0, "gradient_steps": 0},  # filtered whole: no tokens
            {"step": 3, "clip_fraction": 0.1, "gradient_steps": 2}]
    assert compare.trained_mean("clip_fraction")(rows) == pytest.approx(0.15)
    assert compare.trained_mean("clip_fraction")(rows[1:2]) is None


def test_a_loop_run_without_eval_rollouts_takes_its_count_from_args_json(tmp_path):
    rows = [{"step": 0, "eval_cold_start/success_rate": 0.25},
            {"step": 1, "success_rate": 0.5, "gradient_steps": 2},
            {"step": 1, "eval/success_rate": 0.75}]
    _run(tmp_path, "loop-demo", "rl-s7", rows, {})
    (tmp_path / "loop-demo" / "rl-s7" / "args.json").write_text(json.dumps({"eval_tasks": 32}))
    runs, _ = compare.read_runs(str(tmp_path), "loop-demo")
    assert compare.held_out_gain(runs["rl"][7]) == 16  # (0.75 - 0.25) x 32


def test_an_arpo_run_counts_its_sampled_held_out_responses(tmp_path):
    # 32 questions x 4 sampled responses: a rise of 0.25 / 32 is one response won, not 0 questions
    rows = [{"step": 0, "eval_cold_start/success_rate": 11 / 128},
            {"step": 1, "reward_mean": 0.5}, {"step": 1, "eval/success_rate": 12 / 128}]
    _run(tmp_path, "arpo", "arpo-s7", rows, {})
    (tmp_path / "arpo" / "arpo-s7" / "args.json").write_text(
        json.dumps({"eval_tasks": 32, "eval_samples": 4}))
    runs, _ = compare.read_runs(str(tmp_path), "arpo")
    assert compare.held_out_gain(runs["arpo"][7]) == 1
    assert compare.rl_gained(runs["arpo"][7]) == 1.0
