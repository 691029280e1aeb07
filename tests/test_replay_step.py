"""benchmarks/replay_step.py replays a run's step from its checkpoint: same rollout, so same update."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import replay_step  # noqa: E402

import t2po  # noqa: E402


@pytest.mark.slow
def test_replay_reproduces_the_runs_step_and_leaves_the_run_folder_alone(tmp_path, capsys):
    out = str(tmp_path / "run")
    t2po.main(["--env", "toy", "--model", "tiny-random", "--no-cold-start",
               "--group-size", "4", "--tasks-per-step", "2", "--max-turns", "2", "--max-new-tokens", "8",
               "--tti-chunk", "8", "--lr", "1e-3", "--eval-tasks", "1", "--reward", "env",
               "--temperature", "1.0", "--threads", "1", "--steps", "2", "--save-every", "1", "--out", out])
    step2 = [json.loads(line) for line in open(f"{out}/metrics.jsonl") if '"loss"' in line][-1]
    assert step2["step"] == 2
    before = sorted(os.listdir(out)), open(f"{out}/metrics.jsonl").read()

    results = replay_step.main([out, "--step", "1", "--lrs", "1e-3,0", "--prompts", "2"])
    # the update's loss and grad norm come before the optimizer step: equal at any lr, and to the run's
    for lr in (1e-3, 0.0):
        assert results[lr]["loss"] == pytest.approx(step2["loss"], rel=1e-5, abs=1e-7)
        assert results[lr]["grad_norm"] == pytest.approx(step2["grad_norm"], rel=1e-5)
    assert (sorted(os.listdir(out)), open(f"{out}/metrics.jsonl").read()) == before
    printed = capsys.readouterr().out
    assert "step 2: each episode's turns" in printed and "lr 0: loss" in printed
