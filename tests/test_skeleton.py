"""The three scripts as one family: what is not the algorithm is the same text in loop.py, arpo.py and
t2po.py, the algorithm sits under the same headings in the same order, and the shared update stays finite
where the log-ratio is huge (each script's objective, every LOOP importance weight) or abandons the step."""

import ast
import dataclasses
import math
import os
import re

import numpy as np
import pytest
import torch

import arpo
import loop
import t2po
from common.models import TINY_MODEL, load_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"loop": loop, "arpo": arpo, "t2po": t2po}
# the shared skeleton: changed in all three scripts at once, or the diff between two of them stops
# showing the algorithm alone
SHARED = ["TrainingSample", "sample_tokens", "build_batch", "action_logprobs", "microbatches",
          "keep_logprobs", "stacked", "policy_logprobs", "low_var_kl", "update", "LOSS_STATS",
          "step_rng", "sample_seed", "step_tasks", "held_out", "probe", "cold_start", "Envs",
          "overruns", "main"]
# each paper's own, under the same name in every script
PER_SCRIPT = ["Args", "PRESETS", "REPORTED", "check_args", "rollout", "training_rollouts",
              "training_samples", "policy_loss", "loss_divisor", "rollout_metrics", "mechanism_summary", "evaluate",
              "demonstrations", "build_envs", "planned_sequence"]


def top_level(name: str) -> dict[str, str]:
    """A script's top-level definitions and assignments, as source text without comments."""
    tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out[node.name] = ast.unparse(node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.unparse(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ast.unparse(node)
    return out


def test_the_skeleton_is_the_same_text_in_all_three_scripts():
    defs = {name: top_level(name) for name in SCRIPTS}
    for shared in SHARED:
        texts = {name: defs[name].get(shared) for name in SCRIPTS}
        assert None not in texts.values(), (shared, [n for n, t in texts.items() if t is None])
        assert texts["loop"] == texts["arpo"] == texts["t2po"], f"{shared} differs between the scripts"
    for own in PER_SCRIPT:
        assert all(own in defs[name] for name in SCRIPTS), own


def test_a_changed_line_of_the_skeleton_is_caught():
    # the check above compares text: one edited line in one script breaks it (a guard for the guard)
    defs = top_level("t2po")
    edited = defs["update"].replace("optimizer.step()", "optimizer.step()\n    pass", 1)
    assert edited != defs["update"] and edited != top_level("loop")["update"]


def headings(name: str) -> list[str]:
    """The section headings of a script: '# ARGUMENTS', '# ALGORITHM...', '# SCAFFOLDING...'."""
    text = open(os.path.join(ROOT, f"{name}.py")).read()
    return re.findall(r"^# ((?:ARGUMENTS|ALGORITHM|SCAFFOLDING)[^\n]*)", text, re.M)


def test_every_script_reads_arguments_algorithm_then_scaffolding_in_the_same_order():
    for name in SCRIPTS:
        kinds = [h.split()[0].split(":")[0] for h in headings(name)]
        assert kinds[0] == "ARGUMENTS"
        last_algorithm = max(i for i, k in enumerate(kinds) if k == "ALGORITHM")
        assert all(k == "SCAFFOLDING" for k in kinds[last_algorithm + 1:]), (name, kinds)
        algorithm = [h for h in headings(name) if h.startswith("ALGORITHM:")]
        order = [next(i for i, h in enumerate(algorithm) if h.startswith(f"ALGORITHM: the {part}"))
                 for part in ("rollout", "advantage", "objective")]
        assert order == sorted(order), (name, algorithm)  # rollout, advantage, objective
    shared = [[h for h in headings(name) if h.startswith("SCAFFOLDING:")] for name in SCRIPTS]
    assert shared[0] == shared[1] == shared[2] and len(shared[0]) == 2


def test_no_lambda_assignment_and_no_line_over_100_characters():
    for name in SCRIPTS:
        text = open(os.path.join(ROOT, f"{name}.py")).read()
        assert not re.findall(r"^\s*[\w.]+\s*=\s*lambda\b", text, re.M), name
        assert max(len(line) for line in text.splitlines()) <= 100, name


# ---------------------------------------------------------------- huge log-ratios stay finite

def one_token_batch(log_ratio: float, advantage: float) -> tuple[torch.Tensor, dict]:
    """Two rows of two action tokens whose log pi - log pi_old is `log_ratio`; pi_ref = pi_old."""
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    old = torch.full((2, 2), -1.0 - log_ratio)
    return logp, {"action_mask": torch.ones(2, 2), "advantages": torch.full((2, 2), advantage),
                  "old_logp": old, "ref_logp": old}


def script_args(name: str, **extra):
    return SCRIPTS[name].Args(kl_coef=0.1, **extra)


CASES = [("loop", {"importance_weight": level}) for level in ("token", "turn", "trajectory")] + [
    ("arpo", {"loss_agg": agg}) for agg in ("token-mean", "seq-mean-token-mean")] + [("t2po", {})]


@pytest.mark.parametrize("log_ratio", [50.0, -50.0, 100.0, -100.0])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize(("name", "extra"), CASES)
def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient(name, extra, log_ratio, advantage):
    # f311b87 exponentiated the raw log-ratio: e^89 overflows float32, so a ratio of inf times the
    # advantage gave an infinite loss and NaN gradients; verl clamps log r to [-20, 20] first
    logp, batch = one_token_batch(log_ratio, advantage)
    loss, stats = SCRIPTS[name].policy_loss(logp, batch, script_args(name, **extra))
    loss.backward()
    assert math.isfinite(float(loss.detach())) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
    assert math.isfinite(stats["kl"])


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_low_var_kl_gradient_is_finite_when_the_reference_is_far_above(name):
    # x = log pi_ref - log pi = 95 > 88.7: exp(x) overflows float32; the clamp of x to 20 keeps the
    # gradient finite (e^20 - 1 times -1 below the estimate's clamp at 10: the gradient is 0 there)
    logp = torch.tensor([-100.0], requires_grad=True)
    SCRIPTS[name].low_var_kl(logp, torch.tensor([-5.0])).sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert float(SCRIPTS[name].low_var_kl(torch.tensor([-1.0]), torch.tensor([-1.5]))) == pytest.approx(
        math.exp(-0.5) + 0.5 - 1)  # e^x - x - 1 at x = -0.5


def tiny_samples(n: int = 4) -> list:
    rng = np.random.default_rng(0)
    return [t2po.TrainingSample((i,), rng.integers(5, 100, 4).tolist(), rng.integers(5, 100, 3).tolist(),
                                [1, 1, 1], [1.0 if i % 2 else -1.0] * 3) for i in range(n)]


def test_a_minibatch_with_a_non_finite_loss_abandons_the_update_and_leaves_the_weights(monkeypatch):
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL, dtype="float32")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    args = t2po.Args(minibatch_size=2, micro_batch_size=2, share_prefixes=False)

    def nan_loss(logp, batch, args):
        return (logp * float("nan")).sum(), {"clipped": 0.0}

    monkeypatch.setattr(t2po, "policy_loss", nan_loss)
    out = t2po.update(model, optimizer, tiny_samples(), args, np.random.default_rng(0))
    assert out["abandoned"] == 1.0 and out["gradient_steps"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_kl_threshold_abandons_once_pi_moved_too_far_from_pi_old():
    # two minibatches: the first takes a big step (lr 1), so the second's k1 = E[-log pi/pi_old] per
    # sample is far from 0 and passes the threshold: its step is not taken
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL, dtype="float32")
    optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
    args = t2po.Args(minibatch_size=2, micro_batch_size=2, share_prefixes=False, kl_threshold=1e-6,
                     max_grad_norm=1e9)
    out = t2po.update(model, optimizer, tiny_samples(), args, np.random.default_rng(0))
    assert out["gradient_steps"] == 1 and out["abandoned"] == 1.0
    free = dataclasses.replace(args, kl_threshold=0.0)  # 0: off
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL, dtype="float32")
    out = t2po.update(model, torch.optim.SGD(model.parameters(), lr=50.0), tiny_samples(), free,
                      np.random.default_rng(0))
    assert out["gradient_steps"] == 2 and out["abandoned"] == 0.0


def test_a_minibatch_of_zero_advantages_is_not_computed_but_adamw_still_steps():
    # every advantage 0 and no KL: the gradient is 0, so no forward runs; AdamW's step on a zero
    # gradient still moves weights that earlier steps gave momentum (as computing it would)
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL, dtype="float32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    args = t2po.Args(minibatch_size=8, micro_batch_size=2, share_prefixes=False)
    t2po.update(model, optimizer, tiny_samples(), args, np.random.default_rng(0))  # momentum
    zero = [dataclasses.replace(s, advantages=[0.0] * 3) for s in tiny_samples()]
    calls = []
    forward = model.forward

    def counted(*a, **k):
        calls.append(1)
        return forward(*a, **k)

    model.forward = counted
    before = [p.detach().clone() for p in model.parameters()]
    out = t2po.update(model, optimizer, zero, args, np.random.default_rng(1))
    assert calls == [] and out["gradient_steps"] == 1
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("base_eval", [True, False])
def test_a_cold_start_that_learned_nothing_is_evaluated_only_when_nothing_else_precedes_rl(base_eval,
                                                                                        tmp_path):
    # the toy env has no expert and the tiny model never wins: RFT keeps no sample, the policy is
    # the one loaded; with the base evaluation it would say the same again, without it nothing would
    # precede RL (t2po's default skips the base evaluation)
    flags = ["--base-eval"] if base_eval else ["--no-base-eval"]
    final = t2po.main(["--env", "toy", "--model", "tiny-random", "--cold-start-episodes", "2",
                       "--group-size", "2", "--tasks-per-step", "1", "--max-turns", "1",
                       "--max-new-tokens", "4", "--tti-chunk", "4", "--eval-tasks", "2", "--steps", "1",
                       "--threads", "1", "--out", str(tmp_path / "run"), *flags])
    assert ("base" in final) == base_eval
    assert ("cold_start" in final) == (not base_eval)
