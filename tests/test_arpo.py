"""ARPO: step entropy, branch rule, rollout-tree budget, advantage attribution, dual-clip loss."""

import json
import math
import os
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from learning_util import SEEDS, rise, train_curve
from torchrun_util import (
    DIST_SCRIPTS,
    assert_ranks_match_one_process,
    eight_ranks_then_resume,
    torchrun,
)

import arpo
from common import models, run

# ---------------------------------------------------------------------------------------------------
# step entropy and the branch rule


def test_step_entropy_hand_computed():
    # Token distributions: uniform over 4 -> H = log 4; (1/2, 1/2) -> log 2; one-hot -> 0.
    ents = [-4 * 0.25 * math.log(0.25), -2 * 0.5 * math.log(0.5), 0.0, 99.0]
    vocab = 8
    # first k = 3 tokens summed and divided by log |V| = log 8 = 3 log 2: (2 log2 + log2 + 0) / (3 log2)
    assert arpo.step_entropy(ents, k=3, vocab_size=vocab) == pytest.approx(1.0)
    # k larger than the segment: exact (ours) scales the mean over the 4 tokens up to k = 8 tokens ...
    mean = (2 * math.log(2) + math.log(2) + 0 + 99) / 4
    assert arpo.step_entropy(ents, k=8, vocab_size=vocab, estimator="exact") == pytest.approx(
        8 * mean / math.log(8))
    # ... the authors' sum stops at the segment's end
    authors = (3 * math.log(2) + 99) / math.log(8)
    assert arpo.step_entropy(ents, k=8, vocab_size=vocab) == pytest.approx(authors)
    assert arpo.step_entropy([], k=5, vocab_size=vocab) == 0.0


def test_branch_rule_edges():
    rng = random.Random(0)
    alphas = [rng.random() for _ in range(4000)]
    # dH very negative: never forks, whatever alpha is; very positive: always.
    assert not any(arpo.branch_rule(-100.0, a, beta=0.2, tau=0.5) for a in alphas)
    assert all(arpo.branch_rule(100.0, a, beta=0.2, tau=0.5) for a in alphas)
    # beta = 0: the base rate P(alpha > tau) = 1 - tau, whatever dH is
    for tau in (0.5, 0.8):
        rate = sum(arpo.branch_rule(7.0, a, beta=0.0, tau=tau) for a in alphas) / len(alphas)
        assert rate == pytest.approx(1 - tau, abs=0.03)
    # in between: P = clip(1 - tau + beta dH) = 0.5 + 0.2 * 1.5 = 0.8
    rate = sum(arpo.branch_rule(1.5, a, beta=0.2, tau=0.5) for a in alphas) / len(alphas)
    assert rate == pytest.approx(0.8, abs=0.03)


# ---------------------------------------------------------------------------------------------------
# the rollout tree and its budget


def fake_engine(seed: int, stop_p: float = 0.6):
    """A random step function: each segment is 1..12 random tokens ending in a tool tag (prob stop_p),
    EOS, or the budget; entropies random, so dH is random around 0."""
    rng = random.Random(seed)

    def generate_segments(rollouts, budgets):
        out = []
        for b in budgets:
            n = rng.randint(1, 12)
            if n >= b:
                out.append(SimpleNamespace(token_ids=[rng.randrange(1000) for _ in range(b)],
                                           logprobs=[-rng.random() for _ in range(b)],
                                           entropies=[3 * rng.random() for _ in range(b)],
                                           finish_reason="length", stop_string=None))
                continue
            tool = rng.random() < stop_p
            out.append(SimpleNamespace(token_ids=[rng.randrange(1000) for _ in range(n)],
                                       logprobs=[-rng.random() for _ in range(n)],
                                       entropies=[3 * rng.random() for _ in range(n)],
                                       finish_reason="stop" if tool else "eos",
                                       stop_string=rng.choice(arpo.STOP_STRINGS) if tool else None))
        return out

    def run_tool(rollout, tag):
        return [2000 + rng.randrange(10) for _ in range(rng.randint(1, 4))]

    return generate_segments, run_tool


@pytest.mark.parametrize("seed", range(60))
def test_budget_invariant_on_random_trees(seed):
    rng = random.Random(seed)
    questions, m = rng.randint(1, 4), rng.randint(1, 9)
    n = rng.randint(1, m)
    beta = rng.choice([0.0, 0.2, 5.0])
    gen, tool = fake_engine(seed, stop_p=rng.choice([0.3, 0.7, 0.95]))
    rollouts = arpo.adaptive_rollout(questions, group_size=m, initial_rollouts=n, fork_z=rng.randint(1, 3),
                                     k=4, beta=beta, tau=rng.choice([0.2, 0.5, 0.9]),
                                     max_tool_calls=rng.randint(1, 5), max_new_tokens=rng.randint(8, 80),
                                     vocab_size=100, generate_segments=gen, run_tool=tool,
                                     rng=np.random.default_rng(seed))
    # exactly M finished rollouts per question, numbered 0..M-1 (`index`: the rollout's seeds and its
    # training sample's origin; Rollout.old_logprobs, never read, is gone from 1e3f13f on)
    for q in range(questions):
        assert sum(r.question == q for r in rollouts) == m
        assert sorted(r.index for r in rollouts if r.question == q) == list(range(m))
    assert all(r.done for r in rollouts)
    for r in rollouts:
        assert len(r.response_ids) == len(r.action_mask)
        assert len(r.response_ids) <= 80
        if r.parent is None:
            continue
        parent = rollouts[r.parent]
        at = r.fork_point
        assert parent.question == r.question
        # the fork's prefix is the parent's, token for token, up to the fork point ...
        assert r.response_ids[:at] == parent.response_ids[:at]
        assert r.action_mask[:at] == parent.action_mask[:at]
        # ... and the fork point is right after a tool result (environment tokens end there)
        assert at > 0 and parent.action_mask[at - 1] == 0


def test_global_rollout_never_forks():
    gen, tool = fake_engine(1, stop_p=0.9)
    rollouts = arpo.adaptive_rollout(3, group_size=5, initial_rollouts=5, fork_z=0, k=4, beta=100.0, tau=0.0,
                                     max_tool_calls=4, max_new_tokens=60, vocab_size=100,
                                     generate_segments=gen, run_tool=tool, rng=np.random.default_rng(0))
    assert len(rollouts) == 15 and all(r.parent is None for r in rollouts)


def test_forks_happen_when_entropy_rises_and_stop_at_m():
    # Initial reasoning is confident (entropy 0), every post-result segment uncertain (entropy 5):
    # dH > 0 with beta = 100 -> the rule always fires, so the N = 1 global rollout forks until M = 4.
    calls = {"n": 0}

    def gen(rollouts, budgets):
        out = []
        for r in rollouts:
            calls["n"] += 1
            ent = 0.0 if r.h_initial is None else 5.0
            tool = sum(r.tool_calls.values()) < 3
            out.append(SimpleNamespace(token_ids=[7, 8], logprobs=[-0.1, -0.2], entropies=[ent, ent],
                                       finish_reason="stop" if tool else "eos",
                                       stop_string="</python>" if tool else None))
        return out

    def run_tool(r, tag):
        calls["tools"] = calls.get("tools", 0) + 1
        return [9]

    rollouts = arpo.adaptive_rollout(1, group_size=4, initial_rollouts=1, fork_z=2, k=2, beta=100.0, tau=0.5,
                                     max_tool_calls=5, max_new_tokens=100, vocab_size=100,
                                     generate_segments=gen, run_tool=run_tool,
                                     rng=np.random.default_rng(0))
    assert len(rollouts) == 4
    # first result: the root (tokens 7 8 9) forks Z = 2 children at position 3; at its second result
    # (7 8 9 7 8 9) only one slot is left, so one more child at position 6; then no more forks.
    assert [r.parent for r in rollouts] == [None, 0, 0, 0]
    assert [r.fork_point for r in rollouts] == [0, 3, 3, 6]
    assert [r.index for r in rollouts] == [0, 1, 2, 3]  # a fork is numbered after its group's rollouts
    assert rollouts[1].response_ids[:3] == [7, 8, 9] and rollouts[3].response_ids[:6] == [7, 8, 9] * 2
    # the initial entropy is the root's own first segment, inherited by its forks
    assert all(r.h_initial == 0.0 for r in rollouts)
    assert rollouts[0].delta_h[0] == pytest.approx(2 * 5.0 / math.log(100))
    # every response holds 3 python calls (12 written), but the children forked after call 1 ran 2 each and
    # the one forked after call 2 ran 1: 3 + 2 + 2 + 1 = 8 calls executed, as run_tool counted
    m = arpo.response_metrics([arpo.response_row(r) for r in rollouts], num_questions=1)
    assert m["tool_calls/python_per_question"] == 12
    assert m["tool_calls/executed_per_question"] == 8 == calls["tools"]


def test_fresh_global_rollouts_fill_the_budget():
    # Everything ends at once with EOS: no tool call, no fork -> M - N fresh global rollouts.
    def gen(rollouts, budgets):
        return [SimpleNamespace(token_ids=[1], logprobs=[0.0], entropies=[1.0], finish_reason="eos",
                                stop_string=None) for _ in rollouts]

    rollouts = arpo.adaptive_rollout(2, group_size=6, initial_rollouts=2, fork_z=1, k=2, beta=0.2, tau=0.5,
                                     max_tool_calls=5, max_new_tokens=10, vocab_size=100,
                                     generate_segments=gen, run_tool=lambda r, t: [9],
                                     rng=np.random.default_rng(0))
    assert [sum(r.question == q for r in rollouts) for q in (0, 1)] == [6, 6]
    assert all(r.parent is None and r.finish == "eos" for r in rollouts)


def test_tool_call_limit_ends_the_response():
    def gen(rollouts, budgets):
        return [SimpleNamespace(token_ids=[1, 2], logprobs=[0.0, 0.0], entropies=[1.0, 1.0],
                                finish_reason="stop", stop_string="</search>") for _ in rollouts]

    (r,) = arpo.adaptive_rollout(1, group_size=1, initial_rollouts=1, fork_z=1, k=2, beta=0.2, tau=0.5,
                                 max_tool_calls=2, max_new_tokens=100, vocab_size=100,
                                 generate_segments=gen, run_tool=lambda r, t: [9, 9],
                                 rng=np.random.default_rng(0))
    # 2 calls answered (1 2 | 9 9) x 2, the third closing tag ends the response without a result
    assert r.response_ids == [1, 2, 9, 9, 1, 2, 9, 9, 1, 2]
    assert r.action_mask == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert r.tool_calls == {"python": 0, "search": 2} and r.finish == "tool_limit"


# ---------------------------------------------------------------------------------------------------
# advantages


def test_grpo_advantages_hand_computed():
    # rewards 1, 0, 0, -1: mean 0, unbiased std sqrt(2/3)
    adv = arpo.grpo_advantages([1.0, 0.0, 0.0, -1.0])
    s = math.sqrt(2 / 3)
    assert adv == pytest.approx([1 / s, 0.0, 0.0, -1 / s], rel=1e-5)
    assert arpo.grpo_advantages([0.5, 0.5]) == pytest.approx([0.0, 0.0])


def small_tree():
    # 0: global, 6 tokens.  1: forked from 0 at 2, 5 tokens.  2: forked from 1 at 4, 6 tokens.
    # 3: global, 3 tokens.
    r0 = arpo.Rollout(0, response_ids=[1, 2, 3, 4, 5, 6])
    r1 = arpo.Rollout(0, response_ids=[1, 2, 7, 8, 9], parent=0, fork_point=2)
    r2 = arpo.Rollout(0, response_ids=[1, 2, 7, 8, 10, 11], parent=1, fork_point=4)
    r3 = arpo.Rollout(0, response_ids=[5, 5, 5])
    return [r0, r1, r2, r3]


def test_hard_attribution_small_tree():
    rollouts = small_tree()
    rewards = [1.0, 0.0, 0.0, -1.0]
    s = math.sqrt(2 / 3)
    a = [1 / s, 0.0, 0.0, -1 / s]  # GRPO advantages, as in the test above
    adv = arpo.token_advantages(rollouts, rewards, "hard")
    # rollout 0: tokens 0-1 shared by {0, 1, 2}; tokens 2-5 its own
    assert adv[0] == pytest.approx([(a[0] + a[1] + a[2]) / 3] * 2 + [a[0]] * 4, rel=1e-5)
    # rollout 1: tokens 0-1 shared by {0,1,2}; 2-3 by {1,2}; token 4 its own
    assert adv[1] == pytest.approx([a[0] / 3] * 2 + [0.0] * 2 + [0.0], abs=1e-6)
    # rollout 2: same as 1 for tokens 0-3, tokens 4-5 its own
    assert adv[2] == pytest.approx([a[0] / 3] * 2 + [0.0] * 4, abs=1e-6)
    # rollout 3: a tree of its own
    assert adv[3] == pytest.approx([a[3]] * 3, rel=1e-5)
    soft = arpo.token_advantages(rollouts, rewards, "soft")
    assert soft[0] == pytest.approx([a[0]] * 6, rel=1e-5) and soft[3] == pytest.approx([a[3]] * 3, rel=1e-5)


def test_batch_advantages_group_by_question():
    # question 1's tree interleaved with question 0's rollouts; parents are indices into the batch
    tree = small_tree()
    q0 = [arpo.Rollout(0, response_ids=[1]), arpo.Rollout(0, response_ids=[2, 2])]
    batch = [q0[0], arpo.Rollout(1, response_ids=tree[0].response_ids), q0[1],
             arpo.Rollout(1, response_ids=tree[1].response_ids, parent=1, fork_point=2),
             arpo.Rollout(1, response_ids=tree[2].response_ids, parent=3, fork_point=4),
             arpo.Rollout(1, response_ids=tree[3].response_ids)]
    rewards = [1.0, 1.0, 0.0, 0.0, 0.0, -1.0]
    adv = arpo.batch_advantages(batch, rewards, "hard")
    s = math.sqrt(2 / 3)
    a = [1 / s, 0.0, 0.0, -1 / s]  # question 1, as in test_hard_attribution_small_tree
    assert adv[1] == pytest.approx([a[0] / 3] * 2 + [a[0]] * 4, rel=1e-5)
    assert adv[4] == pytest.approx([a[0] / 3] * 2 + [0.0] * 4, abs=1e-6)
    # question 0: rewards 1, 0 -> mean 0.5, unbiased std sqrt(1/2) -> +-0.7071
    assert adv[0] == pytest.approx([0.5 / math.sqrt(0.5)], rel=1e-5)
    assert adv[2] == pytest.approx([-0.5 / math.sqrt(0.5)] * 2, rel=1e-5)
    assert batch[3].parent == 1  # the caller's rollouts are not modified


def test_shared_prefix_between_siblings_and_cousins():
    # 0 root; 1 and 2 both forked from 0 at 3 and 5; 3 forked from 2 at 8.
    rs = [arpo.Rollout(0, response_ids=[0] * 10),
          arpo.Rollout(0, response_ids=[0] * 10, parent=0, fork_point=3),
          arpo.Rollout(0, response_ids=[0] * 10, parent=0, fork_point=5),
          arpo.Rollout(0, response_ids=[0] * 10, parent=2, fork_point=8)]
    assert arpo.shared_prefix_lengths(rs, 1) == [3, math.inf, 3, 3]
    assert arpo.shared_prefix_lengths(rs, 3) == [5, 3, 8, math.inf]


# ---------------------------------------------------------------------------------------------------
# the loss


def loss_batch(old_logp, advantages, action_mask) -> dict:
    """What policy_loss reads of a batch (B, T-1); the rest of build_batch's dict it does not."""
    return {"old_logp": old_logp, "advantages": advantages, "action_mask": action_mask}


def test_dual_clip_loss_hand_computed():
    # ratios e^0 = 1, e^0.5 = 1.65 (A>0: clipped to 1.2), e^2 = 7.39 (A<0: dual-clipped at c = 3),
    # e^-1 = 0.37 (A<0: clipped to 0.8 -> max(-A*0.37, -A*0.8) = 0.8 for A=-1)
    logp = torch.tensor([[0.0, 0.5, 2.0, -1.0]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    args = arpo.Args(clip_low=0.2, clip_high=0.2, dual_clip=3.0)  # soft: token-mean, weight 1 a token
    loss_sum, stats = arpo.policy_loss(logp, loss_batch(old, adv, mask), args)
    expected = -1.0 - 1.2 + 3.0 + 0.8  # the sum: `update` divides by the minibatch's loss_divisor
    assert loss_sum.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clipped"] == 3  # tokens 1, 3 clipped, token 2 dual-clipped
    # masked tokens do not count, in the loss or among the clipped
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    loss_sum, stats = arpo.policy_loss(logp, loss_batch(old, adv, mask), args)
    assert loss_sum.item() == pytest.approx(-1.0 + 0.8, rel=1e-6)
    assert stats["clipped"] == 1


def test_result_tokens_get_no_gradient():
    logp = torch.tensor([[-0.3, -0.2, -0.1, -0.4]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])  # tokens 1, 2 are a <result> block
    loss_sum, _ = arpo.policy_loss(logp, loss_batch(logp.detach(), torch.ones(1, 4), mask), arpo.Args())
    (loss_sum / 2).backward()  # token-mean over the 2 policy tokens
    assert logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0
    # ratio 1 -> d(-A rho)/d logp = -A rho / N = -1/2 on the policy tokens
    assert logp.grad[0, 0].item() == pytest.approx(-0.5) and logp.grad[0, 3].item() == pytest.approx(-0.5)


# ---------------------------------------------------------------------------------------------------
# the rollout on the real `tools` environment, with a scripted policy in place of a model


def test_rollout_on_tools_env_with_scripted_policy():
    from transformers import AutoTokenizer

    from common.generation import Sample
    from common.models import TINY_MODEL, resolve_model_path
    from envs.base import make_env

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TINY_MODEL))
    env = make_env("tools", seed=0)
    task = next(t for t in env.tasks("train") if env.reset(t)[0] == "What is 57676 * 4683 - 23425?")
    call = "<think>big numbers</think><python>print(57676 * 4683 - 23425)</python>"
    answer = "<think>done</think><answer>\\boxed{270073283}</answer>"
    seen = []

    class ScriptedPolicy:  # confident reasoning (entropy 0), uncertain after each result (entropy 8)
        def generate(self, prompts, *, stop, seeds, **kw):
            assert stop == arpo.STOP_STRINGS and len(set(seeds)) == len(seeds)  # fresh noise per row
            out = []
            for p in prompts:
                seen.append(p)
                after_result = tokenizer.decode(p[-8:]).rstrip().endswith("</result>")
                text, tag, ent = (answer, "</answer>", 8.0) if after_result else (call, "</python>", 0.0)
                ids = tokenizer.encode(text, add_special_tokens=False)
                out.append([Sample(ids, [-0.5] * len(ids), [ent] * len(ids), None, "stop", tag)])
            return out

    prompt = arpo.build_prompt(tokenizer, *env.reset(task))
    args = arpo.Args(group_size=4, initial_rollouts=1, fork_z=3, beta=100.0, tau=0.5, max_new_tokens=200,
                     entropy="exact")  # the Samples carry exact entropies only
    rollouts = arpo.rollout(ScriptedPolicy(), tokenizer, env, [prompt], [0], args, np.random.default_rng(0),
                            step=1, train=True)
    # one global rollout; its post-result entropy rises (dH > 0, beta 100) so it forks Z = 3 at the result
    assert [r.parent for r in rollouts] == [None, 0, 0, 0]
    root = rollouts[0]
    n_call = len(tokenizer.encode(call, add_special_tokens=False))
    result = [t for t, m in zip(root.response_ids, root.action_mask, strict=True) if m == 0]
    assert tokenizer.decode(result) == " <result>\n270073283\n</result>"  # the sandbox ran the code
    assert root.action_mask[:n_call] == [1] * n_call
    assert all(r.fork_point == n_call + len(result) for r in rollouts[1:])
    # a fork re-submits the shared prefix (prompt + call + result) and generates only its own answer
    assert sum(p == prompt + root.response_ids[:n_call + len(result)] for p in seen) == 4
    scored = [arpo.score_response(env, task, tokenizer.decode(r.response_ids, skip_special_tokens=True))
              for r in rollouts]
    assert [reward for reward, _ in scored] == [1.0] * 4  # F1 = 1, python only: no 0.1 bonus
    assert all(info["won"] for _, info in scored)
    assert rollouts[0].tool_calls == {"python": 1, "search": 0}


# ---------------------------------------------------------------------------------------------------
# end to end


TOY = ["--env", "toy", "--model", "tiny-random", "--backend", "hf", "--tasks-per-step", "2",
       "--group-size", "8", "--initial-rollouts", "4", "--max-new-tokens", "4", "--lr", "5e-2",
       "--micro-batch-size", "16", "--eval-tasks", "1", "--base-eval",
       "--max-minutes", "0"]  # ARPO's 14-minute budget would cut a run on a slow or busy machine


def train_rewards(out) -> list[float]:
    import json

    return [x["reward_mean"] for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "reward_mean" in x]


@pytest.mark.slow
def test_end_to_end_reward_rises_on_toy(tmp_path):
    """ARPO learns. The `tools` reward of a random-init model is always -1 (it never writes
    <think>/<answer>), so the advantage is 0 and nothing can be learned; the toy env (reward = fraction of
    spaces in the response) has variance across rollouts, so it shows that the loop learns. The same code
    path runs: adaptive rollout (no tool tags -> no forks, fresh global rollouts fill M), GRPO advantage,
    dual-clip. The reward rises over 25 steps in the mean over three seeds (tests/learning_util.py says
    why no single trajectory is asserted).

    Cannot pass by chance: with `--lr 1e-12` (no learning) the rise of seeds 0-5 was -0.041 to +0.011
    (std 0.019; the mean of three seeds: 0.011), so the margin 0.05 is 4.5 standard deviations away.
    Cannot fail by numerics: with learning, seeds 0-5 rose by 0.237, 0.401, 0.231, 0.190, 0.060, 0.900
    (seed 4 never took off but still drifted up; 1 and 2 threads gave the same curves), so even three
    seeds as slow as seed 4 clear 0.05.
    """
    rises = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        final = arpo.main([*TOY, "--steps", "25", "--save-every", "5", "--seed", str(seed),
                           "--out", str(out)])
        rewards = train_curve(str(out), "reward_mean")
        assert len(rewards) == 25
        # main returns the held-out results per stage (1e3f13f: r.extra; was "eval_after")
        assert "eval/success_rate" in final["rl"] and (out / "checkpoints").exists()
        rises.append(rise(rewards))
    assert sum(rises) / len(rises) > 0.05, rises


def _killed_then_resumed(argv: list[str], tmp_path, monkeypatch, kill_at: int, before_resume=None) -> tuple:
    """arpo.main(argv) uninterrupted into tmp_path/straight; again into tmp_path/resumed, killed inside its
    `kill_at`-th update (after the previous step's checkpoint), then, after `before_resume()`, resumed there.
    Returns both runs' return values and their final checkpoints' (state, weights)."""
    from common import checkpoint, models

    straight = arpo.main([*argv, "--out", str(tmp_path / "straight")])
    real_update, calls = arpo.update, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == kill_at:
            raise KeyboardInterrupt
        return real_update(*a, **k)

    monkeypatch.setattr(arpo, "update", interrupted)
    with pytest.raises(KeyboardInterrupt):
        arpo.main([*argv, "--out", str(tmp_path / "resumed")])
    monkeypatch.setattr(arpo, "update", real_update)
    if before_resume is not None:
        before_resume()
    resumed = arpo.main([*argv, "--out", str(tmp_path / "resumed"), "--resume"])
    finals = []
    for name in ("straight", "resumed"):
        model, _ = models.load_policy(models.TINY_MODEL)
        state = checkpoint.load_checkpoint(str(tmp_path / name), model, None)
        finals.append((state, model.state_dict()))
    return straight, resumed, finals


@pytest.mark.slow
def test_resume_after_interruption_matches_uninterrupted_run(tmp_path, monkeypatch, capsys):
    """The weights and the training lines of a run killed in step 3 and resumed equal an uninterrupted
    run's; so do the held-out results of the stages before RL, which the checkpoint keeps (a resumed run
    used to lose them from its summary and its return value)."""
    small = [*TOY, "--group-size", "2", "--initial-rollouts", "1", "--steps", "3", "--save-every", "1"]
    # dies inside iteration 3, after iteration 2's checkpoint; capsys keeps the resumed run's output
    straight, resumed, finals = _killed_then_resumed(small, tmp_path, monkeypatch, kill_at=3,
                                                     before_resume=capsys.readouterr)
    for state, _ in finals:
        assert state["step"] == 3 and set(state["extra"]) == {"base"}  # toy: no expert, no cold start
    for k, v in finals[0][1].items():
        assert torch.equal(v, finals[1][1][k]), k
    assert train_rewards(tmp_path / "straight") == train_rewards(tmp_path / "resumed")[-3:]
    stages = ("base", "rl")  # the held-out results per stage (1e3f13f; were eval_before, eval_after, ...)
    assert {k: resumed[k] for k in stages} == {k: straight[k] for k in stages}
    assert set(resumed["base"]) >= {"eval/success_rate", "eval/reward_mean"}
    summary = r"success \(\d+ tasks\): base \S+ -> rl \S+  \| reward_mean: base "  # resumed
    assert re.search(summary, capsys.readouterr().out)
    rows = (tmp_path / "straight" / "metrics.jsonl").read_text()
    assert "cold_start" not in rows  # nor a held-out row for a cold start that did not happen


@pytest.mark.slow
def test_resume_after_the_cold_start_skips_it_and_reloads_its_kl_reference(tmp_path, monkeypatch):
    """The tools env's expert demonstrations fit 160 tokens, so the cold start trains. A run killed in RL
    step 2 resumes from step 1's checkpoint without a second cold start, reads the KL reference (the
    cold-started policy) from <out>/reference, and ends with the uninterrupted run's weights and KL."""
    import json

    small = ["--env", "tools", "--model", "tiny-random", "--group-size", "2", "--initial-rollouts", "2",
             "--tasks-per-step", "1", "--max-new-tokens", "160", "--max-minutes", "0", "--steps", "2",
             "--save-every", "1", "--eval-tasks", "2", "--cold-start-episodes", "4", "--kl-coef", "0.1",
             "--weight-decay", "0.5", "--lr", "1e-3", "--threads", "1"]  # decay moves the policy from it
    def no_second_cold_start():
        monkeypatch.setattr(arpo, "cold_start", lambda *a, **k: pytest.fail("the resumed run redid it"))

    # dies inside step 2, after step 1's checkpoint was written
    straight, resumed, finals = _killed_then_resumed(small, tmp_path, monkeypatch, kill_at=2,
                                                     before_resume=no_second_cold_start)
    for state, _ in finals:
        assert state["step"] == 2 and set(state["extra"]) == {"cold_start"}  # the default: no base eval
    for k, v in finals[0][1].items():
        assert torch.equal(v, finals[1][1][k]), k
    kls = [[x["kl"] for x in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if "kl" in x] for name in ("straight", "resumed")]
    assert kls[0][1] > 0 and kls[1][-1] == kls[0][1]  # step 2's KL: to the same reference
    assert resumed["cold_start"] == straight["cold_start"]  # 1e3f13f: was "eval_cold_start"


def test_paper_preset_is_one_flag_and_explicit_flags_win():
    argv = ["--preset", "paper", "--group-size", "8"]
    args = run.parse(arpo.Args, argv, arpo.PRESETS, arpo.check_args)
    assert (args.initial_rollouts, args.branch_k, args.beta, args.tau, args.fork_z, args.max_tool_calls) == (
        8, 20, 0.2, 0.5, 1, 5)
    assert args.group_size == 8 and args.lr == 1e-6 and args.max_minutes == 0.0
    default = run.parse(arpo.Args, [], arpo.PRESETS, arpo.check_args)
    assert (default.group_size, default.initial_rollouts, default.rollout, default.attribution) == (
        8, 4, "arpo", "soft")
    assert (default.cold_start_episodes, default.cold_start_epochs, default.cold_start_lr,
            default.lr) == (32, 2, 2.5e-5, 1e-5)
    assert (default.eval_temperature, default.eval_samples) == (1.0, 4)  # the held-out: sampled
    # the base model writes no well-formed answer: the default skips its ~6-minute evaluation; the
    # paper preset has no cold start, so it evaluates the model it is given before RL
    assert not default.base_eval and default.cold_start
    assert run.parse(arpo.Args, ["--preset", "paper"], arpo.PRESETS, arpo.check_args).base_eval
    with pytest.raises(SystemExit, match="^arpo.py: with --no-base-eval and --no-cold-start"):
        run.parse(arpo.Args, ["--no-cold-start"], arpo.PRESETS, arpo.check_args)
    # the CPU run: one passage per search, so every kind of question fits the 256-token response budget
    assert (default.search_topk, default.max_new_tokens, args.search_topk) == (1, 256, 3)


def test_search_topk_sets_the_passages_per_search_result():
    # --env-options, the user's, win over the script's own options
    for argv, passages in (([], 1), (["--search-topk", "3"], 3), (["--env-options", '{"topk": 2}'], 2)):
        env = arpo.build_envs(run.parse(arpo.Args, argv, arpo.PRESETS, arpo.check_args)).env
        result = env.execute_tool("search", "population of the city of Quibri")
        assert [line.startswith(f"Doc {i + 1} ") for i, line in enumerate(result.splitlines())] == \
            [True] * passages, result


def test_search_topk_below_one_is_a_clear_error():
    with pytest.raises(SystemExit, match="--search-topk 0: must be >= 1"):
        arpo.main(["--search-topk", "0"])


# ---------------------------------------------------------------------------------------------------
# cold start: the scripted expert and its SFT


def test_cold_start_trains_on_the_expert_tokens_only(monkeypatch):
    from envs.base import make_env

    model, tokenizer = models.load_policy(models.TINY_MODEL)
    segments = [("<think>a</think>\n<python>print(1)</python>", 1), (" <result>\n1\n</result>", 0),
                ("\n<answer>\\boxed{1}</answer>", 1)]
    demo = arpo.demo_rollout(tokenizer, segments)
    masked = [t for t, m in zip(demo.response_ids, demo.action_mask, strict=True) if m == 0]
    assert tokenizer.decode(masked) == " <result>\n1\n</result>"
    # the cold start on one tools question, lr 0: the weights stay put and run.sft's loss is the NLL of the
    # expert's tokens under the model, the result block left out
    env = make_env("tools", seed=0)
    task = next(t for t in env.tasks("train") if env.reset(t)[0] == "What is 57676 * 4683 - 23425?")
    losses, pushed, real_sft = [], [], run.sft
    monkeypatch.setattr(run, "sft", lambda *a, **k: losses.append(real_sft(*a, **k)) or losses[-1])
    r = SimpleNamespace(model=model, policy=model, tokenizer=tokenizer, device="cpu",
                        generator=SimpleNamespace(update_weights=pushed.append))
    # the one cold start of the three scripts (1e3f13f): cold_start(r, envs, args), its data from
    # arpo.demonstrations; one training task here, so the expert plays exactly it
    envs = arpo.Envs(env, {}, [task], [], env, env, None)
    log = arpo.cold_start(r, envs, arpo.Args(cold_start_lr=0.0, micro_batch_size=4))
    assert log["cold_start/episodes"] == 1 and log["cold_start/loss"] == losses[0]
    assert pushed == [model]  # the generator samples from the fine-tuned weights
    demo = arpo.demo_rollout(tokenizer, env.expert_demo(env.reset(task)[0]))
    prompt = arpo.build_prompt(tokenizer, *env.reset(task))
    ids = torch.tensor([prompt + demo.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # (T-1, V)
    p = len(prompt)
    nll = [-logp[p - 1 + i, tok].item() for i, (tok, m) in enumerate(zip(demo.response_ids, demo.action_mask,
                                                                         strict=True)) if m == 1]
    every = [-logp[p - 1 + i, tok].item() for i, tok in enumerate(demo.response_ids)]
    assert losses == [pytest.approx(sum(nll) / len(nll), rel=1e-4)]
    assert abs(sum(every) / len(every) - sum(nll) / len(nll)) > 1e-3  # the mask matters to the number


# ---------------------------------------------------------------------------------------------------
# torchrun: 2 ranks on CPU (gloo)

@pytest.mark.slow
def test_torchrun_update_equals_single_process(tmp_path):
    out, script = tmp_path / "params.pt", os.path.join(DIST_SCRIPTS, "arpo_update.py")
    proc = torchrun(script, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, _ = models.load_policy(models.TINY_MODEL, dtype="float64")
    assert_ranks_match_one_process(str(out), script, list(start.parameters()))


@pytest.mark.slow
def test_torchrun_eight_ranks_log_global_metrics_once_and_resume_on_one_and_two(tmp_path):
    """World size 8 (issue 26): 3 questions x M=4 on 8 ranks (5 without a question), then the 8-rank
    checkpoint resumes on 2 ranks and on one process."""
    flags = [*TOY, "--tasks-per-step", "3", "--group-size", "4", "--initial-rollouts", "2"]
    _, lines, final = eight_ranks_then_resume("arpo.py", arpo.main, flags, tmp_path)
    train = [x for x in lines if "reward_mean" in x]
    assert [x["step"] for x in train] == [1] and train[0]["rollouts"] == 12  # every rank's, logged once
    assert sum("eval/success_rate" in x for x in lines) == 2  # before and after, rank 0 only
    assert final["step"] == 2 and final["rollouts"] == 12


def test_dry_run_prints_the_memory_plan_without_loading_weights(capsys):
    # Qwen3-4B is not on this machine: the plan comes from its known shape alone
    assert arpo.main(["--dry-run", "--model", "Qwen/Qwen3-4B", "--max-new-tokens", "4096"]) == {}
    out = capsys.readouterr().out
    assert "model Qwen/Qwen3-4B: 36 layers" in out
    assert "strategy none on 1 rank(s)" in out  # one process: nothing to wrap
    assert "4 seqs*4352 tok" in out  # --micro-batch-size 4 sequences of 256 prompt + 4096 response tokens


# ---------------------------------------------------------------------------------------------------
# bad input: one line naming the flag, before the model loads


@pytest.mark.parametrize("flag,value", [
    ("--eval-tasks", "0"), ("--temperature", "-1"), ("--temperature", "0"), ("--steps", "0"),
    ("--steps", "-1"),
    ("--max-new-tokens", "0"), ("--tasks-per-step", "0"), ("--group-size", "0"), ("--branch-k", "0"),
    ("--fork-z", "-1"), ("--max-tool-calls", "-1"), ("--minibatch-size", "0"), ("--micro-batch-size", "0"),
    ("--save-every", "0"), ("--eval-every", "-1"), ("--lr", "-1e-5"), ("--lr", "nan"), ("--clip-low", "1"),
    ("--clip-high", "-0.1"), ("--dual-clip", "1"), ("--max-grad-norm", "0"), ("--kl-coef", "-0.1"),
    ("--lora-rank", "-1"), ("--cold-start-epochs", "-1"), ("--search-topk", "0"), ("--group-size", "1"),
    ("--initial-rollouts", "0"), ("--initial-rollouts", "9"), ("--max-turns", "0"), ("--seed", "-1"),
    ("--max-minutes", "-1"), ("--eval-samples", "0"), ("--eval-temperature", "-0.5")])
def test_nonsense_values_end_in_one_line_naming_the_flag(flag, value, monkeypatch, tmp_path):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the flag was checked")
    monkeypatch.setattr(models, "load_policy", no_model)
    with pytest.raises(SystemExit) as e:
        arpo.main([f"{flag}={value}", "--out", str(tmp_path / "run")])  # = : argparse reads -1e-5 as a flag
    message = str(e.value.code)
    assert message.startswith(f"arpo.py: {flag} ") and ": must be " in message, message
    assert "\n" not in message
    assert not (tmp_path / "run").exists()  # nothing written either


def test_one_rollout_per_question_is_refused():
    # issue 23: GRPO's advantage (r - mean) / std is undefined with one rollout in the group
    with pytest.raises(SystemExit, match=r"^arpo.py: --group-size 1: must be >= 2 \(a group-relative "):
        arpo.main(["--group-size", "1", "--initial-rollouts", "1"])
    with pytest.raises(SystemExit, match=r"^arpo.py: --initial-rollouts 3: must be <= --group-size \(2\)"):
        arpo.main(["--group-size", "2", "--initial-rollouts", "3"])


@pytest.mark.parametrize("temperature, asked, samples", [(0.0, 3, 1), (0.7, 3, 3)])
def test_held_out_plays_each_question_eval_samples_times_at_eval_temperature(
        temperature, asked, samples, tmp_path, monkeypatch):
    """Each held-out question is answered --eval-samples times at --eval-temperature (a seed per
    response, so the samples differ; greedy: once, the others would be alike), and the success is
    the mean over all of them; training rollouts keep --temperature."""
    from common.generation import HFGenerator
    real, calls = HFGenerator.generate, []

    def recording(self, prompts, *a, **k):
        calls.append((len(prompts), k["temperature"], k["seeds"]))
        return real(self, prompts, *a, **k)

    monkeypatch.setattr(HFGenerator, "generate", recording)
    out = tmp_path / "run"
    final = arpo.main([*TOY, "--steps", "1", "--eval-tasks", "2", "--no-base-eval",
                       "--eval-temperature", str(temperature), "--eval-samples", str(asked),
                       "--out", str(out)])
    rows = [json.loads(line) for line in open(out / "transcripts" / "rl.jsonl")]
    assert len(rows) == 2 * samples
    assert json.load(open(out / "args.json"))["eval_samples"] == samples  # what compare.py reads
    assert sum(row["won"] for row in rows) / len(rows) == final["rl"]["eval/success_rate"]
    # the first and the last generate calls: the evaluations before and after RL (toy: one segment)
    for held_out in (calls[0], calls[-1]):
        assert held_out[:2] == (2 * samples, temperature)
        assert len(set(held_out[2])) == 2 * samples  # a seed per response
    assert {t for _, t, _ in calls[1:-1]} == {1.0}  # the training rollouts: --temperature


def test_held_out_samples_repeat_their_noise_so_an_lr_0_run_evaluates_equal(tmp_path):
    """Sampled held-out responses draw the same noise at every evaluation: with --lr 0 the
    evaluations before and after RL are the same responses (step-dependent seeds differ)."""
    out = tmp_path / "run"
    arpo.main([*TOY, "--steps", "2", "--eval-tasks", "3", "--no-base-eval", "--lr", "0",
               "--eval-temperature", "1", "--eval-samples", "4", "--out", str(out)])
    before, after = (open(out / "transcripts" / f"{s}.jsonl").read() for s in ("cold_start", "rl"))
    assert before == after and len(before.splitlines()) == 12
    assert len({json.loads(line)["prompt"] + str(json.loads(line)["turns"])
                for line in before.splitlines()}) > 3  # and the 4 samples of a question differ


def test_paper_preset_keeps_explicit_flags_in_every_spelling():
    # `--no-flag` and `--flag=value` are explicit too; the old argv matching missed the first
    argv = ["--preset=paper", "--no-gradient-checkpointing", "--group-size=8", "--lr", "3e-6"]
    args = run.parse(arpo.Args, argv, arpo.PRESETS, arpo.check_args)
    assert (args.gradient_checkpointing, args.group_size, args.lr) == (False, 8, 3e-6)
    assert (args.initial_rollouts, args.max_new_tokens, args.cold_start) == (8, 4096, False)  # the preset's
    assert run.parse(arpo.Args, ["--preset", "paper"], arpo.PRESETS).gradient_checkpointing is True
    with pytest.raises(SystemExit):  # an abbreviation cannot slip past the preset: refused
        run.parse(arpo.Args, ["--preset", "paper", "--group", "8"], arpo.PRESETS)


def test_environment_without_seed_is_built_and_a_missing_package_names_its_install(monkeypatch, tmp_path):
    import importlib.util

    from envs import base, toy

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the environment was built")
    monkeypatch.setattr(models, "load_policy", no_model)
    class ToolToy(toy.ToyEnv):  # a one-step env with the tool hook ARPO needs
        def execute_tool(self, tag: str, content: str) -> str:
            return "42"

    # an environment whose factory takes no seed (as alfworld's): built without one
    monkeypatch.setitem(base._REGISTRY, "seedless", lambda: ToolToy(turns=1))
    envs = arpo.build_envs(run.parse(arpo.Args, ["--env", "seedless", "--eval-tasks", "3"], arpo.PRESETS))
    assert isinstance(envs.env, ToolToy) and len(envs.eval_tasks) == 3 and envs.train_tasks

    def missing(**options):
        raise ImportError("Foo is not installed; set it up with: pip install foo")
    monkeypatch.setitem(base._REGISTRY, "needs-foo", missing)
    with pytest.raises(SystemExit, match=r"^arpo.py: --env 'needs-foo': .*pip install foo$"):
        arpo.main(["--env", "needs-foo", "--out", str(tmp_path / "a")])
    if importlib.util.find_spec("alfworld") is None:  # the real one, where it is not installed (as here)
        with pytest.raises(SystemExit) as e:
            arpo.main(["--env", "alfworld", "--out", str(tmp_path / "b")])
        assert "pip install alfworld" in str(e.value.code) and "\n" not in str(e.value.code)


def test_an_env_without_the_tool_hook_is_refused_in_one_line_before_the_model_loads(monkeypatch, tmp_path):
    # issue 46: ARPO runs a response's tool calls through env.execute_tool and scores the response in one
    # env.step; an env without the hook used to answer every call with an error and play one turn
    from envs import base, toy

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the environment was checked")
    monkeypatch.setattr(models, "load_policy", no_model)
    monkeypatch.setitem(base._REGISTRY, "no-tools", lambda seed=0: toy.ToyEnv(turns=2, seed=seed))
    two_turn_toy = ["--env", "toy", "--env-options", '{"turns": 2}']
    no_hook = r"^arpo.py: --env 'no-tools' has no execute_tool\(tag, content\)"
    for argv, says in ((["--env", "no-tools"], no_hook),
                       (two_turn_toy, r"^arpo.py: --env 'toy': .*turns")):
        with pytest.raises(SystemExit, match=says) as e:
            arpo.main([*argv, "--model", "tiny-random", "--out", str(tmp_path / "run")])
        assert "\n" not in str(e.value.code)
    # the toy env, the tests' fast game, is admitted by name: one turn, no tools
    envs = arpo.build_envs(run.parse(arpo.Args, ["--env", "toy"], arpo.PRESETS))
    assert envs.env.turns == 1 and not hasattr(envs.env, "execute_tool")
    assert arpo.execute_tool(envs.env, "python", "print(1)") == "error: this environment has no tools"


# ---------------------------------------------------------------------------------------------------
# the step-entropy estimator: the authors' top-10 terms by default, the exact entropy as an option


def test_topk_step_entropy_hand_computed():
    # token 1: top log-probs ln .5, ln .3; the sampled token is the second (in the top): two terms
    h1 = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3))  # 0.70777
    # token 2: top ln .6, ln .2; the sampled token has p = .05, below them: vLLM returns it too, a third term
    h2 = -(0.6 * math.log(0.6) + 0.2 * math.log(0.2) + 0.05 * math.log(0.05))  # 0.77818
    terms = [arpo.topk_token_entropy([math.log(0.5), math.log(0.3)], math.log(0.3)),
             arpo.topk_token_entropy([math.log(0.6), math.log(0.2)], math.log(0.05))]
    assert terms == pytest.approx([h1, h2], rel=1e-12)
    # 0.32267
    assert arpo.step_entropy(terms, k=20, vocab_size=100) == pytest.approx((h1 + h2) / math.log(100))
    assert arpo.step_entropy(terms, k=1, vocab_size=100) == pytest.approx(h1 / math.log(100))  # first k only
    assert arpo.ENTROPY_TOPK == 10 and arpo.Args().entropy == "topk"


def test_fork_decision_reads_the_chosen_estimator():
    """A flat top-10 before the tool call (exact H = topk term = ln 10 per token) and a distribution spread
    over the whole vocabulary after it (exact H = 10 nats, but each of the top-10 tokens has p = 1e-4, so
    the top-10 term is 10 * 1e-4 * ln 1e4): the exact entropy rises, the authors' estimate falls. With
    beta = 5 the first always forks and the second never does."""
    from transformers import AutoTokenizer

    from common.generation import Sample
    from common.models import TINY_MODEL, resolve_model_path
    from envs.base import make_env

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TINY_MODEL))
    env = make_env("tools", seed=0)
    task = next(t for t in env.tasks("train") if env.reset(t)[0] == "What is 57676 * 4683 - 23425?")
    call = "<think>big numbers</think><python>print(57676 * 4683 - 23425)</python>"
    answer = "<think>done</think><answer>\\boxed{270073283}</answer>"
    asked = []

    class ScriptedPolicy:
        def generate(self, prompts, *, logprobs_k=0, **kw):
            asked.append(logprobs_k)
            out = []
            for p in prompts:
                after = tokenizer.decode(p[-8:]).rstrip().endswith("</result>")
                text, tag, exact, lp = (answer, "</answer>", 10.0, math.log(1e-4)) if after else (
                    call, "</python>", math.log(10), math.log(0.1))
                ids = tokenizer.encode(text, add_special_tokens=False)
                out.append([Sample(ids, [lp] * len(ids), [exact] * len(ids),
                                   [[lp] * 10 for _ in ids] if logprobs_k else None, "stop", tag)])
            return out

    prompt = arpo.build_prompt(tokenizer, *env.reset(task))
    log_v = math.log(len(tokenizer))
    expected = {"topk": 3 * (10 * 1e-4 * math.log(1e4) - math.log(10)) / log_v,
                "exact": 3 * (10.0 - math.log(10)) / log_v}
    for estimator, forks, k in (("topk", 0, 10), ("exact", 3, 0)):
        asked.clear()
        args = arpo.Args(group_size=4, initial_rollouts=1, fork_z=3, beta=5.0, tau=0.5, branch_k=3,
                         max_new_tokens=200, entropy=estimator)
        rollouts = arpo.rollout(ScriptedPolicy(), tokenizer, env, [prompt], [0], args,
                                np.random.default_rng(0), step=1, train=True)
        assert set(asked) == {k}  # the top-10 log-probs are asked for only when they are read
        assert rollouts[0].delta_h == pytest.approx([expected[estimator]], rel=1e-9)
        assert sum(r.parent is not None for r in rollouts) == forks


# ---------------------------------------------------------------------------------------------------
def test_low_var_kl_is_k3_clamped_as_the_authors_verl():
    # k3 = e^x - x - 1, x = log ref - log pi: 0 where they agree, e^-1 at x = -1; at x = 20 clamped to 10
    logp, ref = torch.tensor([-0.5, -1.0, -20.0]), torch.tensor([-0.5, -2.0, 0.0])
    assert arpo.low_var_kl(logp, ref).tolist() == pytest.approx([0.0, math.exp(-1.0), 10.0])
    # below the clamp the gradient is k3's, d/dlogp = 1 - e^x; a clamped token gets none
    logp = torch.tensor([-1.0, -20.0], requires_grad=True)
    arpo.low_var_kl(logp, torch.tensor([-2.0, 0.0])).sum().backward()
    assert logp.grad.tolist() == pytest.approx([1 - math.exp(-1.0), 0.0])


# hard attribution under the paper's objective


def crafted_tree() -> tuple[list, list[float]]:
    """Rollout 0 = [a, b, b]; rollout 1 forked from it after a: [a, c]; rollout 2 = [d], its own tree.
    Rewards 1, 0.5, 0: mean 0.5, unbiased std 0.5, so A = (1, 0, -1)."""
    return [arpo.Rollout(0, index=0, response_ids=[11, 12, 12], action_mask=[1, 1, 1]),
            arpo.Rollout(0, index=1, response_ids=[11, 14], action_mask=[1, 1], parent=0, fork_point=1),
            arpo.Rollout(0, index=2, response_ids=[15], action_mask=[1])], [1.0, 0.5, 0.0]


def crafted_samples(attribution: str, group: int = 7) -> list:
    """The crafted tree scored as `play` leaves it (reward, group, prompt), made into the training
    samples main() trains on: arpo.training_samples, one per response."""
    rollouts, rewards = crafted_tree()
    for r, reward in zip(rollouts, rewards, strict=True):
        r.reward, r.group, r.prompt_ids = reward, group, [5, 6, 7]
    return arpo.training_samples(rollouts, arpo.Args(attribution=attribution))


def test_training_samples_one_per_response_with_its_attributed_advantage():
    # A = (1, 0, -1) (crafted_tree); hard: token a, held by rollouts 0 and 1, gets (1 + 0) / 2
    a = 0.5 / (0.5 + 1e-6)  # grpo_advantages' eps
    expected = {"soft": [[a] * 3, [0.0] * 2, [-a]], "hard": [[a / 2, a, a], [a / 2, 0.0], [-a]]}
    for attribution, advantages in expected.items():
        samples = crafted_samples(attribution)
        assert [s.origin for s in samples] == [(7, 0), (7, 1), (7, 2)]  # (group, index): any rank's
        assert all(s.prompt_ids == [5, 6, 7] for s in samples)
        assert [s.response_ids for s in samples] == [[11, 12, 12], [11, 14], [15]]
        assert [s.action_mask for s in samples] == [[1, 1, 1], [1, 1], [1]]
        for s, adv in zip(samples, advantages, strict=True):
            assert s.advantages == pytest.approx(adv, rel=1e-12, abs=1e-12), attribution
        assert all(s.old_logp is None and s.ref_logp is None for s in samples)  # set by update


def test_hard_attribution_changes_the_gradient_only_under_the_paper_objective():
    """The log-prob of a token is a function of its tree node (prefix + token): rows 0 and 1 hold the
    same node `a`, so its parameter theta_a receives both rows' gradients. At ratio 1 the gradient of the
    loss on theta_node is -sum over the copies of A_it * w_it / sum(w).
      token-mean (w = 1, sum 6): soft -(1 + 0)/6, hard -(1/2 + 1/2)/6: both -1/6, the same gradient.
      paper, w = 1/|y_i| (|y| = 3, 2, 1; sum = 3 responses): soft -(1/3 + 0/2)/3 = -1/9,
      hard -(1/2 / 3 + 1/2 / 2)/3 = -5/36.
    Since 1e3f13f policy_loss applies the weights itself and the sum(w) it is divided by is the
    script's loss_divisor of the minibatch's samples: both checked here by hand."""
    rollouts, rewards = crafted_tree()
    node = [[0, 1, 2], [0, 3], [4]]  # a, b(1), b(2), c, d: the shared token a is node 0
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    expected = {  # theta gradients a, b1, b2, c, d (A_c = 0; d: -(-1) w / sum)
        ("soft", "token-mean"): [-1 / 6, -1 / 6, -1 / 6, 0, 1 / 6],
        ("hard", "token-mean"): [-1 / 6, -1 / 6, -1 / 6, 0, 1 / 6],
        ("soft", "seq-mean-token-mean"): [-1 / 9, -1 / 9, -1 / 9, 0, 1 / 3],
        ("hard", "seq-mean-token-mean"): [-5 / 36, -1 / 9, -1 / 9, 0, 1 / 3]}
    weights = {"token-mean": mask.tolist(),  # 1 a policy token; the paper's: 1/|y_i|
               "seq-mean-token-mean": [[1 / 3] * 3, [1 / 2, 1 / 2, 0], [1, 0, 0]]}
    for (attribution, agg), grad in expected.items():
        args = arpo.Args(attribution=attribution, loss_agg=agg)
        hand = torch.tensor(weights[agg], dtype=torch.float64)
        assert torch.allclose(arpo.loss_weights(mask, agg), hand, rtol=1e-12, atol=0), agg
        divisor = arpo.loss_divisor(crafted_samples(attribution), args)
        assert divisor == (6 if agg == "token-mean" else 3)  # tokens, or responses
        theta = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        logp = torch.stack([torch.cat([theta[row], theta.new_zeros(3 - len(row))]) for row in node])  # (3, 3)
        adv = torch.zeros(3, 3, dtype=torch.float64)
        for i, a in enumerate(arpo.token_advantages(rollouts, rewards, attribution)):
            adv[i, :len(a)] = torch.tensor(a)
        loss_sum, _ = arpo.policy_loss(logp, loss_batch(logp.detach(), adv, mask), args)
        (loss_sum / divisor).backward()
        assert theta.grad.tolist() == pytest.approx(grad, rel=1e-5, abs=1e-9), (attribution, agg)
    # --attribution hard alone takes the paper's objective; soft keeps the code's token mean
    assert arpo.resolve_loss_agg(arpo.Args(attribution="hard")) == "seq-mean-token-mean"
    assert arpo.resolve_loss_agg(arpo.Args()) == "token-mean"
    assert arpo.resolve_loss_agg(arpo.Args(attribution="hard", loss_agg="token-mean")) == "token-mean"


def test_hard_and_soft_updates_differ_on_the_model_only_under_the_paper_objective():
    # the same crafted tree through update on the tiny model (float64, plain SGD): soft and hard
    # attribution move the weights the same under a token mean, differently under the paper's objective
    from common.models import TINY_MODEL, load_policy

    moved = {}
    for attribution, agg in (("soft", "token-mean"), ("hard", "token-mean"), ("soft", "seq-mean-token-mean"),
                             ("hard", "auto")):
        torch.manual_seed(0)
        model, tokenizer = load_policy(TINY_MODEL, dtype="float64")
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        # one minibatch (--minibatch-size 32 >= 3 responses), as --minibatches 1 was
        args = arpo.Args(attribution=attribution, loss_agg=agg, micro_batch_size=2, max_grad_norm=1e9)
        stats = arpo.update(model, torch.optim.SGD(model.parameters(), lr=1.0), crafted_samples(attribution),
                            args, np.random.default_rng(0))
        assert stats["gradient_steps"] == 1
        moved[attribution, agg] = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    token_mean = (moved["soft", "token-mean"] - moved["hard", "token-mean"]).abs().max().item()
    paper = (moved["soft", "seq-mean-token-mean"] - moved["hard", "auto"]).abs().max().item()
    scale = moved["soft", "token-mean"].abs().max().item()
    # token mean: equal up to the float32 rounding of the advantages (measured 2.6e-8 of the largest step
    # before 1e3f13f, 0 since); the paper's objective: 11% of it (measured, 11.3% since 1e3f13f)
    assert token_mean < 1e-6 * scale and paper > 0.05 * scale, (token_mean, paper, scale)


def test_lora_kl_reference_is_the_base_model_with_the_adapter_off():
    # a trained adapter (lora_B away from its zero init): the KL's reference log-probs are the base model's,
    # bit for bit, and the KL term is on
    torch.manual_seed(0)
    model, tokenizer = models.load_policy(models.TINY_MODEL, lora_rank=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    base, _ = models.load_policy(models.TINY_MODEL)
    samples = crafted_samples("soft")
    stats = arpo.update(model, torch.optim.SGD(model.parameters(), lr=0.0), samples,
                        arpo.Args(kl_coef=0.1, lora_rank=4), np.random.default_rng(0))
    batch = arpo.build_batch(samples)
    with torch.no_grad():
        expected = arpo.action_logprobs(base.eval(), batch, 1.0)  # (3, t-1)
        adapted = arpo.action_logprobs(model, batch, 1.0)  # the adapter is on again
    # update keeps each sample's reference log-probs on it (sample.ref_logp, 1e3f13f: was batch["ref_logp"])
    assert torch.equal(arpo.stacked(samples, "ref_logp"), expected)
    assert not torch.allclose(adapted, expected) and stats["kl"] > 0


@pytest.mark.slow
def test_lora_kl_run_loads_the_model_once_and_the_kl_acts(tmp_path, monkeypatch):
    # with LoRA the reference is the policy's own base weights (adapter off): no second model is loaded
    loads, real_load = [], models.load_policy

    def counted(*a, **k):
        loads.append(a[0])
        return real_load(*a, **k)
    monkeypatch.setattr(models, "load_policy", counted)
    monkeypatch.setattr(arpo, "load_policy", counted, raising=False)  # the old script imported it by name
    out = tmp_path / "run"
    # 2 questions x 8 responses in minibatches of 8: two optimizer steps (was --minibatches 2, 1e3f13f)
    arpo.main([*TOY, "--lora-rank", "4", "--kl-coef", "0.1", "--minibatch-size", "8", "--steps", "1",
               "--out", str(out)])
    assert loads == ["tiny-random"]
    (line,) = [x for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "kl" in x]
    assert line["gradient_steps"] == 2
    assert line["kl"] > 0  # the second mini-batch's policy has moved away from the base model


# ---------------------------------------------------------------------------------------------------
# where a response ends: the answer (ours, a flag), an empty tool call (the code's rule)


class OneSegmentPolicy:
    """Writes `text` (closing with `tag`) as the first segment, then the answer; records each call's stops."""

    def __init__(self, tokenizer, text: str, tag: str):
        self.tokenizer, self.text, self.tag, self.stops = tokenizer, text, tag, []

    def generate(self, prompts, *, stop, logprobs_k=0, **kw):
        from common.generation import Sample
        self.stops.append(stop)
        out = []
        for p in prompts:
            after = self.tokenizer.decode(p[-8:]).rstrip().endswith("</result>")
            text, tag = ("<think>done</think><answer>\\boxed{1}</answer>", "</answer>") if after else (
                self.text, self.tag)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append([Sample(ids, [-0.5] * len(ids), [1.0] * len(ids),
                               [[-0.5] * 10 for _ in ids] if logprobs_k else None, "stop", tag)])
        return out


def tools_task():
    from transformers import AutoTokenizer

    from common.models import TINY_MODEL, resolve_model_path
    from envs.base import make_env

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TINY_MODEL))
    env = make_env("tools", seed=0)
    task = next(t for t in env.tasks("train") if env.reset(t)[0] == "What is 57676 * 4683 - 23425?")
    return tokenizer, env, task, arpo.build_prompt(tokenizer, *env.reset(task))


def test_an_empty_tool_call_ends_the_rollout_with_a_format_error(monkeypatch):
    # the code: an empty call (content '' after strip) gets no result and the rollout ends there (-1)
    tokenizer, env, task, prompt = tools_task()
    ran = []
    monkeypatch.setattr(arpo, "execute_tool", lambda env, tag, content: ran.append(content) or "x")
    args = arpo.Args(group_size=2, initial_rollouts=2, max_new_tokens=200)
    for call, calls_run in (("<think>hm</think><python>  \n</python>", 0),
                            ("<think>hm</think><python>1</python>", 2)):
        ran.clear()
        policy = OneSegmentPolicy(tokenizer, call, "</python>")
        # play: the rollout, then each response scored by the env (as training_rollouts and evaluate)
        r = SimpleNamespace(generator=policy, tokenizer=tokenizer)
        rollouts = arpo.play(r, env, [task], [0], args, step=1, train=True)
        assert len(ran) == calls_run
        assert all(x.prompt_ids == prompt and x.group == 0 for x in rollouts)
        if calls_run == 0:
            assert [x.finish for x in rollouts] == ["empty_call"] * 2
            assert all(all(x.action_mask) for x in rollouts)
            assert tokenizer.decode(rollouts[0].response_ids) == call  # no result inserted, nothing more
            assert [x.reward for x in rollouts] == [-1.0, -1.0] and not any(x.won for x in rollouts)
            rows = [arpo.response_row(x) for x in rollouts]
            assert arpo.response_metrics(rows, 1)["empty_call_rate"] == 1.0
        else:  # a call with content runs and the response goes on to its answer
            assert all(r.finish == "eos" and r.tool_calls["python"] == 1 for r in rollouts)


def test_stop_at_answer_is_ours_and_the_paper_preset_stops_only_at_tool_tags():
    tokenizer, env, task, prompt = tools_task()
    tools_only = ["</python>", "</search>"]
    for argv, stops in (([], [*tools_only, "</answer>"]), (["--no-stop-at-answer"], tools_only),
                        (["--preset", "paper"], tools_only)):
        args = run.parse(arpo.Args, argv, arpo.PRESETS)
        args.group_size = args.initial_rollouts = 1
        policy = OneSegmentPolicy(tokenizer, "<think>a</think><python>1</python>", "</python>")
        arpo.rollout(policy, tokenizer, env, [prompt], [0], args, np.random.default_rng(0), step=1,
                     train=True)
        assert all(s == stops for s in policy.stops), argv


def test_the_mechanisms_summary_averages_forks_calls_and_the_entropy_change_by_hand():
    args = arpo.Args()
    lines = [{"rollouts": 8, "forks_per_question": 1.0, "tool_calls/executed_per_question": 3.0,
              "delta_h/p50": -0.2},
             {"rollouts": 8, "forks_per_question": 2.0, "tool_calls/executed_per_question": 5.0,
              "delta_h/p50": 0.4},
             {"rollouts": 8, "forks_per_question": 0.0, "tool_calls/executed_per_question": 1.0}]
    text = arpo.mechanism_summary(lines, args)
    # forks (1 + 2 + 0) / 3, calls (3 + 5 + 1) / 3, the median of the two steps' medians
    assert "3 steps (arpo rollout): 1.00 forked responses and 3.00 tool calls" in text
    assert "median of the steps' medians: +0.100" in text
    assert arpo.mechanism_summary([], args) == "ARPO: no RL step ran"


def test_fork_metrics_count_decisions_with_room_and_the_quartiles_by_hand():
    args = arpo.Args(beta=0.2, tau=0.5)
    # P(fork) as the rollout recorded it, clip(1 - 0.5 + 0.2 dH, 0, 1): 0.3, 0.5, 0.9; 0.7, 1.0
    rows = [{"delta_h": [-1.0, 0.0, 2.0], "forks": [False, True, True],
             "could_fork": [True, True, True], "p_fork": [0.3, 0.5, 0.9], "beta": 0.2},
            {"delta_h": [1.0, 5.0], "forks": [False, False], "could_fork": [True, False],
             "p_fork": [0.7, 1.0], "beta": 0.2}]
    m = arpo.fork_metrics(rows, args)
    # 4 decisions with room (5.0 had none): dH -1, 0, 2, 1; quartiles of those: 25% -0.25, 75% 1.25
    assert m["branch/decisions"] == 4 and m["branch/forks"] == 2 and m["branch/beta"] == 0.2
    assert m["branch/p_fork_mean"] == pytest.approx((0.3 + 0.5 + 0.9 + 0.7) / 4)
    assert (m["branch/top_quartile_decisions"], m["branch/top_quartile_forks"]) == (1, 1)  # dH 2
    assert (m["branch/bottom_quartile_decisions"], m["branch/bottom_quartile_forks"]) == (1, 0)
    assert arpo.fork_metrics([{"delta_h": [], "forks": [], "could_fork": [], "p_fork": [],
                               "beta": 0.2}], args) == {
        "branch/decisions": 0, "branch/forks": 0, "branch/beta": 0.2}
    steps = [{"rollouts": 4, "forks_per_question": 1.0, "tool_calls/executed_per_question": 1.0,
              **m}, {"rollouts": 4, "forks_per_question": 1.0,
                     "tool_calls/executed_per_question": 1.0, **m}]
    text = arpo.mechanism_summary(steps, args)
    assert "forked at 4 of 8 tool results with room, 2 of 2 in a step's top dH quartile, 0 of 2" \
        in text
    assert "beta" not in text  # --beta-calibration off: fixed, nothing to say
    spread = arpo.Args(beta_calibration="spread")
    steps[1]["branch/beta"] = 1.25
    assert arpo.mechanism_summary(steps, spread).endswith(
        "; beta (--beta-calibration spread) 0.20 to 1.25")


def test_a_full_question_records_no_room_to_fork_and_draws_no_alpha():
    # M = N = 1: every decision finds its question full; the branch rule's alpha is never drawn
    rng = np.random.default_rng(0)
    gen, tool = fake_engine(3, stop_p=0.95)
    rollouts = arpo.adaptive_rollout(2, group_size=1, initial_rollouts=1, fork_z=1, k=4, beta=0.2,
                                     tau=0.5, max_tool_calls=4, max_new_tokens=80, vocab_size=100,
                                     generate_segments=gen, run_tool=tool, rng=rng)
    decisions = [room for r in rollouts for room in r.could_fork]
    assert decisions and not any(decisions)
    assert [len(r.could_fork) for r in rollouts] == [len(r.delta_h) for r in rollouts]
    assert rng.random() == np.random.default_rng(0).random()


def test_each_decision_records_the_fork_probability_its_rule_gave():
    rng = np.random.default_rng(3)
    gen, tool = fake_engine(3, stop_p=0.9)
    rollouts = arpo.adaptive_rollout(2, group_size=6, initial_rollouts=2, fork_z=1, k=4, beta=0.7,
                                     tau=0.5, max_tool_calls=4, max_new_tokens=80, vocab_size=100,
                                     generate_segments=gen, run_tool=tool, rng=rng)
    decisions = [(d, p) for r in rollouts for d, p in zip(r.delta_h, r.p_fork, strict=True)]
    assert decisions and all(r.beta == 0.7 for r in rollouts)
    for delta_h, p in decisions:  # alpha ~ U(0, 1) and alpha + beta dH > tau
        assert p == pytest.approx(min(1.0, max(0.0, 0.5 + 0.7 * delta_h)))


def test_beta_calibration_spread_is_one_over_the_dh_p10_to_p90_by_hand():
    seen = [float(x) for x in range(-5, 6)]  # -5..5: numpy's linear quantiles p10 -4, p90 4
    spread = arpo.Args(beta=0.2, beta_calibration="spread")
    assert arpo.step_beta(seen, spread) == pytest.approx(1 / 8)
    assert arpo.step_beta(seen[:7], spread) == 0.2  # fewer than 8 seen: --beta
    assert arpo.step_beta([0.5] * 9, spread) == 0.2  # no spread: --beta
    # P(fork) = clip(1 - tau + beta dH, 0, 1) = 0.5 + dH / 8: 0 at dH's p10, 1 at its p90
    assert arpo.fork_probability(-4.0, 1 / 8, 0.5) == pytest.approx(0.0)
    assert arpo.fork_probability(4.0, 1 / 8, 0.5) == pytest.approx(1.0)


def test_training_rollouts_play_with_the_calibrated_beta_and_remember_the_dh(monkeypatch):
    played = []

    def fake_play(r, env, tasks, groups, args, step, train):
        played.append(args.beta)
        return [SimpleNamespace(delta_h=[0.25 * step, -0.5]), SimpleNamespace(delta_h=[])]

    monkeypatch.setattr(arpo, "play", fake_play)
    envs = SimpleNamespace(train_tasks=list(range(10)), pool=None)
    r = SimpleNamespace(extra={})
    args = arpo.Args(beta=0.2, beta_calibration="spread", tasks_per_step=2)
    for step in range(1, 6):
        arpo.training_rollouts(r, envs, args, step)
    # 2 dH a step: steps 1-4 play with --beta (fewer than 8 seen), step 5 with 1 / (p90 - p10)
    # of the 8 seen: 0.25, 0.5, 0.75, 1.0 and four -0.5; p10 = -0.5, p90 = 0.75 + 0.3 * 0.25
    assert played == [0.2, 0.2, 0.2, 0.2, pytest.approx(1 / (0.825 + 0.5))]
    assert sorted(r.extra["delta_h"]) == [-0.5] * 5 + [0.25, 0.5, 0.75, 1.0, 1.25]
    off, played[:] = SimpleNamespace(extra={}), []
    for step in range(1, 6):  # off: the paper's fixed beta, and nothing kept in the checkpoint
        arpo.training_rollouts(off, envs, arpo.Args(beta=0.2, tasks_per_step=2), step)
    assert played == [0.2] * 5 and off.extra == {}
