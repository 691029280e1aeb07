"""ARPO: Agentic Reinforced Policy Optimization (Dong et al., arXiv 2507.19849, ICLR 2026).

A tool-using agent answers a question in one response that interleaves reasoning with tool calls
(`<python>code</python>`, `<search>query</search>`). Generation pauses at each closing tool tag, the
tool's output is inserted as `<result>...</result>` (environment tokens: masked out of the loss),
and generation continues. ARPO changes *where the sampling budget goes*:

1. entropy-based adaptive rollout: per question a budget of M rollouts, N of them started globally.
   After every tool result the next k tokens are generated and their step entropy compared with the
   rollout's initial step entropy; P = alpha + beta * dH decides whether to fork Z partial rollouts
   that share the prefix up to the result. Forks stop once the question has M rollouts; if every
   path ends early with fewer than M, fresh global rollouts fill the budget.
2. advantage attribution: GRPO advantages per question. Soft (default): every rollout gets its own
   advantage on all of its tokens; shared-prefix tokens have identical ratios in every rollout
   holding them, so their updates average implicitly. Hard (`--attribution hard`): a shared-prefix
   token gets the mean advantage of the rollouts that share it, under the paper's per-response mean
   (1/|y_i|): under a token mean it would give soft's gradient exactly.
3. the hierarchical reward of the environment (format error -1, answer F1, +0.1 when both tools
   used) and a PPO-clip loss with dual clip, token-mean over the batch (the code; `--loss-agg`).

`--rollout global` turns 1 off (M independent trajectories: GRPO at the same rollout budget). Before
RL (`--cold-start`) the packaged SmolLM2-135M, which never writes the format, is fine-tuned on the
`tools` env's scripted expert (the paper starts from a Tool-Star SFT model). `python arpo.py` (CPU,
~15 min), `--preset paper` (M=16, N=8, k=20, ...), `--env toy --model tiny-random` (seconds);
docs/arpo.md: the equations beside these lines, the hyper-parameters.
"""

from __future__ import annotations

import copy
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from common import cli, dist, models, run
from common.cli import opt
from common.logprobs import token_logprobs
from common.run import RunArgs
from envs.base import require


@dataclass
class Args(RunArgs):
    """ARPO (Dong et al. 2025), entropy-based adaptive rollout for tool agents: docs/arpo.md."""

    preset: Literal["auto", "none", "cpu", "paper"] = opt(
        "run", "auto", "settings filled into every flag not given: cpu, our defaults; paper, M=16 "
        "N=8 k=20 Z=1, 5 tool calls, lr 1e-6, 128 questions/step; auto: the one named after --env "
        "(none is)")
    env: str = "tools"  # offline python/search questions
    max_turns: int = opt("environment", 1, "unused: ARPO writes one response per question; "
                         "--max-tool-calls bounds its tool turns", ge=1)
    steps: int = 8
    max_new_tokens: int = 256  # per response, results included (code: 4096): fits every expert demo
    cold_start_episodes: int = 32
    rollout: Literal["arpo", "global"] = opt("algorithm", "arpo", "arpo: entropy-based adaptive "
                                             "rollout; global: M independent trajectories (GRPO)")
    initial_rollouts: int = opt("algorithm", 2, "N: rollouts started globally (paper: 8)", ge=1)
    branch_k: int = opt("algorithm", 20, "k: tokens whose entropy is the step entropy", ge=1)
    entropy: Literal["topk", "exact"] = opt(
        "algorithm", "topk", "step entropy. topk (the authors' code; beta, tau tuned on it): -sum "
        "p log p over the top-10 log-probs + the sampled token, summed over k tokens, / ln|V|; "
        "exact (ours): the full-vocabulary entropy, a short segment scaled up to k")
    beta: float = opt("algorithm", 0.2, "beta: entropy weight in P = alpha + beta*dH")
    tau: float = opt("algorithm", 0.5, "tau: branch threshold (P > tau forks)")
    fork_z: int = opt("algorithm", 1, "Z: partial rollouts forked when the rule fires", ge=0)
    max_tool_calls: int = opt("rollout", 3, "tool calls per rollout (code: 3-6, 5 said)", ge=0)
    stop_at_answer: bool = opt("rollout", True, "end the response at </answer> (ours; the code "
                               "stops only at tool tags and trains the tokens up to EOS; --preset "
                               "paper: off)")
    attribution: Literal["soft", "hard"] = opt("algorithm", "soft", "advantage attribution")
    loss_agg: Literal["auto", "token-mean", "seq-mean-token-mean"] = opt(
        "algorithm", "auto", "auto: token-mean with soft attribution (the code), "
        "seq-mean-token-mean with hard (the paper's 1/|y_i|; under a token mean hard gives soft's "
        "gradient exactly)")
    minibatches: int = opt("optimisation", 1, "optimizer steps per RL step (code: 128/16=8)", ge=1)
    clip_low: float = opt("algorithm", 0.2, "PPO clip epsilon below 1", ge=0, lt=1,
                          why="the ratio's lower bound 1 - eps must stay positive")
    clip_high: float = opt("algorithm", 0.2, "PPO clip epsilon above 1", ge=0)
    dual_clip: float = opt("algorithm", 3.0, "dual-clip c: bound of -A*ratio when A < 0", gt=1,
                           why="as verl asserts")
    search_topk: int = opt("environment", 1, "passages per <search> result (ours: 1, so that "
                           "look-ups fit the budget; the env's default: 3; the authors' code: 10 "
                           "web results)", ge=1)
    unsafe_python: bool = opt("environment", False, "run the tools env's python where the kernel "
                              "gives its sandbox no isolation, with only a python audit hook and "
                              "rlimits")
    max_minutes: float = opt("run", 14.0, "stop training early when the next step and the final "
                             "eval would overrun (0 = off)", ge=0)


# --preset: cpu, our defaults; paper, the paper's rollout settings (official scripts, 7B/8B). Each
# preset is written out here and never changed after.
PRESETS: dict[str, dict] = {
    "cpu": {},
    "paper": dict(group_size=16, initial_rollouts=8, branch_k=20, beta=0.2, tau=0.5, fork_z=1,
                  max_tool_calls=5, lr=1e-6, tasks_per_step=128, minibatches=8,
                  max_new_tokens=4096, max_minutes=0.0,
                  cold_start=False,  # bring the SFT'd model with --model
                  search_topk=3,  # ours, the env's default (the code: 10 web results)
                  gradient_checkpointing=True, stop_at_answer=False),
}


def check_args(args: Args) -> None:
    """The rule between flags (each flag's own bounds are declared with it)."""
    if args.initial_rollouts > args.group_size:
        raise cli.bad_flag("arpo.py", "initial_rollouts", args.initial_rollouts,
                           f"must be <= --group-size ({args.group_size}): N of M start globally")


TOOL_TAGS = ("python", "search")
TOOL_STOPS = [f"</{tag}>" for tag in TOOL_TAGS]  # generation pauses at a closing tool tag (code)
STOP_STRINGS = TOOL_STOPS + ["</answer>"]  # and with --stop-at-answer (ours) ends after the answer
ENTROPY_TOPK = 10  # the authors' code asks vLLM for 10 log-probs a token (it adds the sampled one)


def topk_token_entropy(top_logprobs: list[float], sampled_logprob: float) -> float:
    """The authors' per-token term: -sum p log p over the top-10 log-probs (descending) and the
    sampled token when it is not among them (vLLM returns both, keyed by token id). A truncated
    entropy: at most log 11 per token however flat the distribution is."""
    terms = list(top_logprobs)
    if not terms or sampled_logprob < terms[-1]:  # below the 10th: not one of the top 10
        terms.append(sampled_logprob)
    return -sum(math.exp(lp) * lp for lp in terms)


def step_entropy(entropies: list[float], k: int, vocab_size: int, estimator: str = "topk") -> float:
    """Step entropy of a segment from its per-token entropies H_t = -sum_j p_tj log p_tj, divided by
    log|V| (paper: "sum all values of the entropy matrix, normalise"; code: / log|V|).

    topk (the authors' code): the sum over the segment's first k tokens (fewer when the segment is
    shorter). exact (ours): a segment shorter than k is scaled up to k (mean * k), so a short
    segment is not mistaken for a confident one."""
    first = entropies[:k]
    if not first:
        return 0.0
    total = k * sum(first) / len(first) if estimator == "exact" else sum(first)
    return total / math.log(vocab_size)


def branch_rule(delta_h: float, alpha: float, beta: float, tau: float) -> bool:
    """Eq. (branch): P_t = alpha + beta * dH_t; fork Z partial rollouts iff P_t > tau.

    alpha is the base sampling probability, drawn alpha ~ U(0, 1) at each decision (as the official
    code does), so the probability of a fork is clip(1 - tau + beta * dH, 0, 1): beta = 0 gives the
    base rate 1 - tau, a large entropy rise always forks, a large drop never does."""
    return alpha + beta * delta_h > tau


@dataclass
class Rollout:
    """One response under construction: a path in the question's rollout tree."""
    question: int                                           # index of the question in the batch
    response_ids: list[int] = field(default_factory=list)   # generated + inserted tokens
    action_mask: list[int] = field(default_factory=list)    # 1 = policy token, 0 = <result> tokens
    old_logprobs: list[float] = field(default_factory=list)  # sampling log-probs (0 for results)
    h_initial: float | None = None  # step entropy of the first k tokens of the initial reasoning
    probe: bool = False             # a result was just inserted: the next k tokens decide a fork
    tool_calls: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TOOL_TAGS})
    # calls in the prefix shared with the parent, run by it (a fork's own: tool_calls - these)
    shared_calls: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TOOL_TAGS})
    done: bool = False
    finish: str = ""                # eos | length | tool_limit | empty_call
    parent: int | None = None       # rollout it was forked from (None: a global rollout)
    fork_point: int = 0             # number of response tokens shared with the parent
    delta_h: list[float] = field(default_factory=list)      # dH at each tool result (logged)


def fork(parent: Rollout, parent_index: int, at: int) -> Rollout:
    """A partial rollout sharing the parent's first `at` response tokens (its state there)."""
    child = copy.deepcopy(parent)
    child.response_ids = parent.response_ids[:at]
    child.action_mask = parent.action_mask[:at]
    child.old_logprobs = parent.old_logprobs[:at]
    child.parent, child.fork_point, child.probe, child.delta_h = parent_index, at, False, []
    child.shared_calls = dict(parent.tool_calls)  # it starts after a result: all calls so far
    return child


def adaptive_rollout(num_questions: int, *, group_size: int, initial_rollouts: int, fork_z: int,
                     k: int, beta: float, tau: float, max_tool_calls: int, max_new_tokens: int,
                     vocab_size: int, generate_segments, run_tool, rng: random.Random,
                     entropy: str = "topk") -> list[Rollout]:
    """Build each question's rollout tree until it holds exactly M = group_size finished rollouts.

    generate_segments(rollouts, budgets) -> one segment per rollout (token_ids, logprobs,
        entropies: the per-token terms of the `entropy` estimator, finish_reason "stop" | "eos" |
        "length", stop_string): the continuation of each rollout's prompt + response, until a
        closing tool tag, end of sequence, or its token budget.
    run_tool(rollout, tag) -> token ids of the inserted "<result>...</result>" block; None for an
        empty call, which ends the rollout (the code's rule).
    initial_rollouts = group_size and fork_z = 0 give trajectory-level sampling (GRPO).
    """
    rollouts = [Rollout(q) for q in range(num_questions) for _ in range(initial_rollouts)]
    size = [initial_rollouts] * num_questions  # rollouts per question, live or done
    while True:
        # Budget rule: a question whose paths all ended with fewer than M gets fresh rollouts.
        live_questions = {r.question for r in rollouts if not r.done}
        for q in range(num_questions):
            if q not in live_questions and size[q] < group_size:
                rollouts += [Rollout(q) for _ in range(group_size - size[q])]
                size[q] = group_size
        live = [i for i, r in enumerate(rollouts) if not r.done]
        if not live:
            return rollouts
        budgets = [max_new_tokens - len(rollouts[i].response_ids) for i in live]
        segments = generate_segments([rollouts[i] for i in live], budgets)
        for i, seg in zip(live, segments, strict=True):
            r = rollouts[i]
            start = len(r.response_ids)  # the node right after the last tool result (or the prompt)
            if r.h_initial is None:
                # per rollout, never reused
                r.h_initial = step_entropy(seg.entropies, k, vocab_size, entropy)
            elif r.probe:
                # Entropy variation after the tool result: dH_t = H_t - H_initial over k tokens.
                delta_h = step_entropy(seg.entropies, k, vocab_size, entropy) - r.h_initial
                r.delta_h.append(delta_h)
                r.probe = False
                if size[r.question] < group_size and branch_rule(delta_h, rng.random(), beta, tau):
                    z = min(fork_z, group_size - size[r.question])  # forks stop once M exist
                    rollouts += [fork(r, i, start) for _ in range(z)]
                    size[r.question] += z
            r.response_ids += list(seg.token_ids)
            r.action_mask += [1] * len(seg.token_ids)
            r.old_logprobs += list(seg.logprobs)
            room = max_new_tokens - len(r.response_ids)
            tag = seg.stop_string[2:-1] if seg.finish_reason == "stop" and seg.stop_string else None
            if tag not in TOOL_TAGS or room <= 0:  # eos, </answer>, or out of budget: it ends
                out_of_room = seg.finish_reason == "length" or room <= 0
                r.done, r.finish = True, "length" if out_of_room else "eos"
            elif sum(r.tool_calls.values()) >= max_tool_calls:
                r.done, r.finish = True, "tool_limit"  # as the code: end the response, no result
            elif (result := run_tool(r, tag)) is None:
                r.done, r.finish = True, "empty_call"  # as the code: it ends, no result (-1)
            else:
                result = result[:room]
                r.tool_calls[tag] += 1
                r.response_ids += result
                r.action_mask += [0] * len(result)  # environment tokens: no gradient
                r.old_logprobs += [0.0] * len(result)
                r.probe = True
                if len(r.response_ids) >= max_new_tokens:
                    r.done, r.finish = True, "length"


def grpo_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps) over a question's M rollouts (unbiased std: verl)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std() if len(rewards) > 1 else torch.tensor(0.0, dtype=torch.float64)
    return ((r - r.mean()) / (std + eps)).tolist()


def shared_prefix_lengths(rollouts: list[Rollout], i: int) -> list[float]:
    """For each rollout j of the same tree: how many leading response tokens j shares with i.

    Along the tree path i -> common ancestor -> j every edge (child, parent) shares the child's
    fork_point tokens, so the path shares the minimum of them; different trees share nothing."""
    def lineage(j: int) -> dict[int, float]:  # ancestor -> tokens shared with it
        out, shared = {j: math.inf}, math.inf
        while rollouts[j].parent is not None:
            shared = min(shared, rollouts[j].fork_point)
            j = rollouts[j].parent
            out[j] = shared
        return out

    mine = lineage(i)
    lengths = []
    for j in range(len(rollouts)):
        theirs = lineage(j)
        common = [a for a in theirs if a in mine]  # theirs runs from j upwards: first = closest
        lengths.append(min(mine[common[0]], theirs[common[0]]) if common else 0)
    return lengths


def token_advantages(rollouts: list[Rollout], rewards: list[float], attribution: str
                     ) -> list[list[float]]:
    """Per-token advantages of one question's rollouts (all in the same list, parents by index).

    soft: every token of rollout i gets A_i.
    hard: token t of rollout i gets the mean of A_j over the rollouts j that hold the same token t
          (shared prefix), i.e. A_shared = 1/d sum_{j=1..d} A_j; branch tokens keep A_i."""
    adv = grpo_advantages(rewards)
    if attribution == "soft":
        return [[adv[i]] * len(r.response_ids) for i, r in enumerate(rollouts)]
    out = []
    for i, r in enumerate(rollouts):
        shared = np.array(shared_prefix_lengths(rollouts, i))  # (G,)
        positions = np.arange(len(r.response_ids))[:, None]     # (T, 1)
        holders = shared[None, :] > positions                   # (T, G): j holds token t
        out.append(((holders * np.array(adv)[None, :]).sum(1) / holders.sum(1)).tolist())
    return out


def batch_advantages(rollouts: list[Rollout], rewards: list[float], attribution: str
                     ) -> list[list[float]]:
    """GRPO statistics per question (its M rollouts: one tree or more), token advantages."""
    out: list[list[float]] = [[] for _ in rollouts]
    for q in sorted({r.question for r in rollouts}):
        idx = [i for i, r in enumerate(rollouts) if r.question == q]
        local = {i: j for j, i in enumerate(idx)}
        group = [copy.copy(rollouts[i]) for i in idx]
        for g in group:  # parent indices into the question's own list
            g.parent = local[g.parent] if g.parent is not None else None
        advantages = token_advantages(group, [rewards[i] for i in idx], attribution)
        for i, a in zip(idx, advantages, strict=True):
            out[i] = a
    return out


def ppo_dual_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                       weights: torch.Tensor, clip_low: float, clip_high: float, dual_clip: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """All (b, t). Returns (the sum of the weighted per-token losses, the number of clipped tokens).

    L = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); for A < 0 additionally bounded by -c A
    (dual clip: a huge ratio on a negative-advantage token cannot blow the loss up). `weights` are
    the tokens' (`loss_weights`; 0 for tool results and padding); `update` divides the sum by the
    weights' sum over the whole mini-batch, so micro-batches add up to its weighted mean."""
    ratio = torch.exp(logp - old_logp)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(clipped, -adv * dual_clip)
    per_token = torch.where(adv < 0, dual, clipped)
    is_clipped = ((loss2 > loss1) | ((adv < 0) & (dual < clipped))).float()
    return (per_token * weights).sum(), (is_clipped * (weights > 0)).sum()


def loss_weights(action_mask: torch.Tensor, loss_agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights of the loss, (B, T-1), and what each row adds to the normaliser, (B,): the
    loss divides by the sum of the latter over the mini-batch (a whole number: exact on any number
    of ranks).

    token-mean (the code's loss_agg_mode): weight 1 per policy token, normaliser the token count.
    seq-mean-token-mean (the paper's, 1/G sum_i 1/|y_i| sum_t): weight 1/|y_i|, normaliser the
    number of responses. Only under it does hard attribution change the gradient: a shared token's
    copies carry A_i / |y_i| (soft) or mean(A) / |y_i| (hard): sums that differ if the |y_i| do."""
    lengths = action_mask.sum(1)  # (B,) policy tokens per response
    if loss_agg == "token-mean":
        return action_mask.clone(), lengths
    return action_mask / lengths.clamp(min=1)[:, None], (lengths > 0).to(action_mask.dtype)


def resolve_loss_agg(args: Args) -> str:
    if args.loss_agg != "auto":
        return args.loss_agg
    return "seq-mean-token-mean" if args.attribution == "hard" else "token-mean"


def build_prompt(tokenizer, question: str, info: dict) -> list[int]:
    """The chat the environment asks for (tools: its system prompt, the tool format, the question);
    the toy env gives none: the question as the user's message."""
    messages = info.get("messages") or [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def last_tool_call(text: str, tag: str) -> str:
    """The content of the last <tag>...</tag> in the response so far (the call that just closed)."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, end)
    return text[start + len(tag) + 2:end].strip() if 0 <= start < end else ""


def execute_tool(env, tag: str, content: str) -> str:
    """Run one tool call through the env (python: the sandbox; search: the offline corpus)."""
    if not hasattr(env, "execute_tool"):  # the toy env (`TOOLLESS_ENVS`): build_envs refuses others
        return "error: this environment has no tools"
    return env.execute_tool(tag, content)


def score_response(env, task, response: str) -> tuple[float, dict]:
    """The environment's reward for a whole response (tools: ARPO's hierarchical reward)."""
    env.reset(task)
    _, reward, _, info = env.step(response)
    return float(reward), info


def rollout(generator, tokenizer, env, prompts: list[list[int]], args: Args, rng: random.Random, *,
            greedy: bool = False) -> list[Rollout]:
    """ARPO (or global) rollouts of a batch of prompts (one per question): every finished one."""
    eos = tokenizer.eos_token_id
    top_k = ENTROPY_TOPK if args.entropy == "topk" else 0  # log-probs per token the estimator reads
    stops = STOP_STRINGS if args.stop_at_answer else TOOL_STOPS

    def generate_segments(rollouts: list[Rollout], budgets: list[int]):
        # A continuation is prompt + response so far: the backend re-reads the prefix (vLLM: prefix
        # cache hit, no recomputation; HF: one prefill of the whole prefix). Fresh seeds per call,
        # so a fork does not replay its parent's noise at the same positions.
        samples = generator.generate([prompts[r.question] + r.response_ids for r in rollouts], n=1,
                                     max_new_tokens=max(budgets), stop=stops,
                                     temperature=0.0 if greedy else args.temperature,
                                     seeds=[rng.randrange(2**31) for _ in rollouts],
                                     logprobs_k=top_k)
        segments = []
        for (s,), budget in zip(samples, budgets, strict=True):
            seg = copy.copy(s)
            seg.token_ids, seg.logprobs = list(s.token_ids[:budget]), list(s.logprobs[:budget])
            if len(s.token_ids) > budget:
                seg.finish_reason = "length"
            elif s.finish_reason == "eos" and len(seg.token_ids) < budget:
                # train the stop too (its log-prob is recomputed): the EOS id it sampled
                # (Qwen2.5/Qwen3 end at <|im_end|> or <|endoftext|>)
                stop = s.stop_token_id if s.stop_token_id is not None else eos
                seg.token_ids, seg.logprobs = seg.token_ids + [stop], seg.logprobs + [0.0]
            if top_k:  # the estimator's per-token terms
                pairs = zip(s.top_logprobs[:budget], s.logprobs[:budget], strict=True)
                seg.entropies = [topk_token_entropy(top, lp) for top, lp in pairs]
            else:
                seg.entropies = list(s.entropies[:budget])
            segments.append(seg)
        return segments

    def run_tool(r: Rollout, tag: str) -> list[int] | None:
        content = last_tool_call(tokenizer.decode(r.response_ids, skip_special_tokens=True), tag)
        if not content:  # `<python></python>`, or a closing tag without its opening one
            return None
        output = execute_tool(env, tag, content)
        result = f" <result>\n{output}\n</result>"  # the code's layout
        return tokenizer.encode(result, add_special_tokens=False)

    m, n, z = (1, 1, 0) if greedy else (args.group_size, args.initial_rollouts, args.fork_z)
    if args.rollout == "global":
        n, z = m, 0  # trajectory-level sampling: M independent rollouts, no forks (GRPO)
    return adaptive_rollout(len(prompts), group_size=m, initial_rollouts=n, fork_z=z,
                            k=args.branch_k, beta=args.beta, tau=args.tau,
                            max_tool_calls=args.max_tool_calls,
                            max_new_tokens=args.max_new_tokens, vocab_size=len(tokenizer),
                            generate_segments=generate_segments, run_tool=run_tool, rng=rng,
                            entropy=args.entropy)


def score_rollouts(env, tasks: list, rollouts: list[Rollout], tokenizer
                   ) -> tuple[list[float], list[dict]]:
    rewards, infos = [], []
    for r in rollouts:
        text = tokenizer.decode(r.response_ids, skip_special_tokens=True)
        reward, info = score_response(env, tasks[r.question], text)
        rewards.append(reward)
        infos.append(info)
    return rewards, infos


def step_rng(seed: int, step: int) -> random.Random:
    """The randomness of step `step` (rollout seeds, fork draws, mini-batch order) from the rank's
    seed and the step alone: ranks sample apart, and a resume on any number of ranks continues."""
    return random.Random(f"{dist.rank_seed(seed)}:{step}")


def build_batch(prompts: list[list[int]], rollouts: list[Rollout], advantages: list[list[float]],
                pad_id: int, device=None) -> dict[str, torch.Tensor]:
    """One right-padded sequence per rollout: prompt + response. Targets are shifted by one:
    position t of the (B, T-1) tensors scores token t+1; `action_mask` is 1 on the response tokens
    the policy sampled (0 on the prompt, the tool results and the padding). On `device`: the
    policy's (on a GPU the forward refuses inputs left on the CPU).

    No rollouts (a rank whose shard is empty under torchrun): one two-token row that counts nothing,
    so the rank can still run the zero-weight forward/backward passes DDP waits for."""
    if not rollouts:
        return {"input_ids": torch.full((1, 2), pad_id, dtype=torch.long, device=device),
                "attention_mask": torch.ones(1, 2, dtype=torch.long, device=device),
                "action_mask": torch.zeros(1, 1, device=device),
                "adv": torch.zeros(1, 1, device=device)}
    seqs = [prompts[r.question] + r.response_ids for r in rollouts]
    t = max(map(len, seqs))
    ids, attention, action_mask, adv = [], [], [], []
    for seq, r, a in zip(seqs, rollouts, advantages, strict=True):
        before, pad = len(prompts[r.question]) - 1, t - len(seq)  # prompt targets; padding
        ids.append(seq + [pad_id] * pad)
        attention.append([1] * len(seq) + [0] * pad)
        action_mask.append([0.0] * before + [float(m) for m in r.action_mask] + [0.0] * pad)
        adv.append([0.0] * before + [float(x) for x in a] + [0.0] * pad)
    return {"input_ids": torch.tensor(ids, dtype=torch.long, device=device),  # (B, T)
            "attention_mask": torch.tensor(attention, dtype=torch.long, device=device),  # (B, T)
            "action_mask": torch.tensor(action_mask, device=device),  # (B, T-1), results masked
            "adv": torch.tensor(adv, device=device)}  # (B, T-1)


def micro_batch(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """The given rows of every tensor of the batch."""
    return {k: v[rows] for k, v in batch.items()}


def action_logprobs(model, batch: dict[str, torch.Tensor], temperature: float,
                    share_prefixes: bool = True) -> torch.Tensor:
    """log pi(token) at every target of the batch, under softmax(logits / temperature), trimmed to
    its longest sequence: (b, t-1); a shared prefix (the question, a trunk) runs once."""
    t = int(batch["attention_mask"].sum(1).max())
    return token_logprobs(model, batch["input_ids"][:, :t], batch["attention_mask"][:, :t],
                          temperature=temperature, share_prefixes=share_prefixes)


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref), e^x - x - 1 with x = log pi_ref - log
    pi_theta, clamped to [-10, 10]: the authors' verl fork (scripts: kl_loss_type=low_var_kl)."""
    log_ratio = ref_logp - logp
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


def update(policy, optimizer, batch: dict, args: Args, rng: random.Random, reference=None) -> dict:
    """One PPO epoch over the batch in `minibatches` optimizer steps (code: 1 epoch, mini-batch 16).
    With --kl-coef the k3 KL to the initial policy joins the loss: `reference`, or with LoRA (None)
    the base model, adapter off.

    Under torchrun `batch` holds this rank's questions and `policy` is the DDP-wrapped model: the
    token-mean divides by the global policy-token count, and the loss is multiplied by
    `dist.grad_scale()` because DDP averages gradients over ranks; so one optimizer step is the same
    update on 1, 2 or 8 ranks. Every rank runs as many micro-batches (`dist.same_count`)."""
    b, size, kl_on = batch["input_ids"].shape[0], args.micro_batch_size, args.kl_coef > 0
    micro = lambda rows: dist.same_count([rows[i:i + size] for i in range(0, len(rows), size)], [0])
    # pi_old: the policy that sampled the batch, recomputed under the training model as verl does.
    # With one optimizer step per batch the policy is still pi_old during the update, so
    # logp.detach() is the same number and the extra forward pass is skipped.
    recompute = args.minibatches > 1
    with torch.no_grad():
        batch["old_logp"] = torch.zeros_like(batch["adv"])
        batch["ref_logp"] = torch.zeros_like(batch["adv"])
        for rows, _ in micro(list(range(b))) if recompute or kl_on else []:
            mb = micro_batch(batch, rows)
            if recompute:
                lp = action_logprobs(policy, mb, args.temperature, args.share_prefixes)
                batch["old_logp"][rows, :lp.shape[1]] = lp
            if kl_on:  # pi_ref: the initial policy, frozen; with LoRA the base model, adapter off
                ref = policy if reference is None else reference
                adapter_off = models.unwrap(policy).disable_adapter() if reference is None else None
                with adapter_off or nullcontext():
                    lp = action_logprobs(ref, mb, args.temperature, args.share_prefixes)
                batch["ref_logp"][rows, :lp.shape[1]] = lp
    order = list(range(b))
    rng.shuffle(order)
    stats = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "grad_norm": 0.0}
    # (B, T-1) token weights, (B,) each row's share of the normaliser
    token_weight, units = loss_weights(batch["action_mask"], resolve_loss_agg(args))
    policy.train()
    for rows_mb in np.array_split(order, args.minibatches):  # exactly `minibatches` on every rank
        rows_mb = rows_mb.tolist()
        # the global mini-batch's weighted mean: every rank divides by the same tokens / responses
        normaliser = max(1.0, dist.all_reduce(units[rows_mb].sum().item()))
        for rows, weight in micro(rows_mb):
            # all-zero advantages (every rollout -1, say): exactly zero gradient, skipped jointly
            active = weight > 0 and (kl_on or bool(batch["adv"][rows].any()))
            if not dist.all_reduce(int(active), "max"):
                continue
            mb = micro_batch(batch, rows)
            logp = action_logprobs(policy, mb, args.temperature, args.share_prefixes)
            t = logp.shape[1]
            weights, adv = token_weight[rows, :t] * weight, mb["adv"][:, :t]
            old_logp = mb["old_logp"][:, :t] if recompute else logp.detach()
            loss_sum, clipped = ppo_dual_clip_loss(logp, old_logp, adv, weights, args.clip_low,
                                                   args.clip_high, args.dual_clip)
            loss = loss_sum / normaliser
            if kl_on:  # KL(pi || ref), aggregated as the loss
                kl = (low_var_kl(logp, mb["ref_logp"][:, :t]) * weights).sum() / normaliser
                loss = loss + args.kl_coef * kl
                stats["kl"] += kl.item()
            (loss * dist.grad_scale()).backward()  # weight 0: a zero gradient the ranks still sum
            stats["loss"] += loss.item()
            stats["clipped"] += clipped.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats["grad_norm"] += float(grad_norm)
    policy.eval()
    total = max(1.0, dist.all_reduce(batch["action_mask"].sum().item()))
    loss, clipped, kl = (dist.all_reduce(stats[k]) for k in ("loss", "clipped", "kl"))  # summed
    return {"loss": loss / args.minibatches, "clip_fraction": clipped / total,
            "kl": kl / args.minibatches, "grad_norm": stats["grad_norm"] / args.minibatches}


def demo_rollout(tokenizer, segments: list[tuple[str, int]], question: int = 0) -> Rollout:
    """The demonstration as a Rollout, its segments tokenized one by one as a rollout's, results
    masked (`action_mask` 0): `build_batch` masks them exactly as in the RL loss."""
    r = Rollout(question)
    for text, policy in segments:
        ids = tokenizer.encode(text, add_special_tokens=False)
        r.response_ids += ids
        r.action_mask += [policy] * len(ids)
    return r


def cold_start(r: run.Run, env, train_tasks: list, args: Args) -> dict:
    """SFT on the env's scripted expert (the paper starts RL from a Tool-Star SFT model): the NLL of
    the expert's tokens in its correct demonstrations of `--cold-start-episodes` training questions
    that fit the response budget (the policy could never finish a longer one). {}: none."""
    t0, rng = time.time(), random.Random(args.seed)
    if not hasattr(env, "expert_demo"):
        run.say(f"[cold start] skipped: no scripted expert for the {args.env!r} environment")
        return {}
    prompts, demos = [], []
    for task in rng.sample(train_tasks, min(args.cold_start_episodes, len(train_tasks))):
        question, info = env.reset(task)
        if (segments := env.expert_demo(question)) is None:
            continue
        demo = demo_rollout(r.tokenizer, segments, question=len(demos))
        _, info = score_response(env, task, "".join(text for text, _ in segments))
        if info.get("won") and len(demo.response_ids) <= args.max_new_tokens:
            prompts.append(build_prompt(r.tokenizer, question, info))
            demos.append(demo)
    if not demos:
        run.say("[cold start] skipped: the expert could not demonstrate any of these tasks")
        return {}
    unused = [[0.0] * len(d.response_ids) for d in demos]  # SFT reads no advantage
    batch = build_batch(prompts, demos, unused, r.tokenizer.pad_token_id, device=r.device)  # all

    def log_likelihood(rows: list[int]) -> tuple[torch.Tensor, float]:  # expert tokens, no results
        logp = action_logprobs(r.policy, micro_batch(batch, rows), 1.0, args.share_prefixes)
        mask = batch["action_mask"][rows, :logp.shape[1]]
        return (logp * mask).sum(), mask.sum().item()

    def permute(n: int) -> list[int]:  # an epoch's order, from the stream that chose the questions
        order = list(range(n))
        rng.shuffle(order)
        return order
    loss = run.sft(r.policy, len(demos), log_likelihood, lr=args.cold_start_lr,
                   epochs=args.cold_start_epochs, weight_decay=args.weight_decay,
                   max_grad_norm=args.max_grad_norm, micro_batch_size=args.micro_batch_size,
                   permute=permute)
    r.generator.update_weights(r.model)
    run.say(f"[cold start] SFT on {len(demos)} expert demonstrations, {args.cold_start_epochs} "
            f"epochs: last-epoch loss {loss:.3f} ({time.time() - t0:.0f}s)")
    return {"cold_start/episodes": len(demos), "cold_start/loss": loss,
            "cold_start/time_s": time.time() - t0}


def rollout_metrics(rollouts: list[Rollout], rewards: list[float], infos: list[dict],
                    num_questions: int) -> dict:
    dh = [d for r in rollouts for d in r.delta_h]
    calls = {tag: sum(r.tool_calls[tag] for r in rollouts) for tag in TOOL_TAGS}
    out = {"rollouts": len(rollouts), "reward_mean": float(np.mean(rewards)),
           "success_rate": float(np.mean([bool(i.get("won", False)) for i in infos])),
           "format_error_rate": float(np.mean([rw <= -1 for rw in rewards])),
           "num_tokens": sum(sum(r.action_mask) for r in rollouts),
           "result_tokens": sum(len(r.action_mask) - sum(r.action_mask) for r in rollouts),
           "forks_per_question": sum(r.parent is not None for r in rollouts) / num_questions,
           "tool_limit_rate": float(np.mean([r.finish == "tool_limit" for r in rollouts])),
           "empty_call_rate": float(np.mean([r.finish == "empty_call" for r in rollouts]))}
    for tag in TOOL_TAGS:  # calls written in the M responses of a question
        out[f"tool_calls/{tag}_per_question"] = calls[tag] / num_questions
    # calls actually run per question (the paper's tool-call budget): a fork's shared prefix once
    out["tool_calls/executed_per_question"] = sum(
        r.tool_calls[t] - r.shared_calls[t] for r in rollouts for t in TOOL_TAGS) / num_questions
    out["tool_calls/per_rollout"] = sum(calls.values()) / len(rollouts)
    if dh:
        q = np.quantile(dh, [0.1, 0.5, 0.9])
        out.update({"delta_h/mean": float(np.mean(dh)), "delta_h/p10": float(q[0]),
                    "delta_h/p50": float(q[1]), "delta_h/p90": float(q[2]),
                    "delta_h/count": len(dh)})
    return out


def gather_rollouts(rollouts: list[Rollout], rewards: list[float], infos: list[dict]
                    ) -> tuple[list[Rollout], list[float], list[dict]]:
    """Every rank's rollouts, rewards and outcomes: the metrics of the whole step (rank 0 logs)."""
    outcomes = [{"won": bool(i.get("won", False))} for i in infos]
    parts = dist.all_gather_object((rollouts, rewards, outcomes))
    return ([r for p in parts for r in p[0]], [x for p in parts for x in p[1]],
            [i for p in parts for i in p[2]])


def evaluate(generator, tokenizer, env, tasks: list, args: Args, stage: str) -> dict:
    """Greedy, one rollout per held-out question (no forks): the "eval/..." metrics; transcripts
    (the model's text between tool results, each result as the observation) in <out>/transcripts."""
    prompts = [build_prompt(tokenizer, *env.reset(t)) for t in tasks]
    rng = random.Random(args.seed)
    rollouts = rollout(generator, tokenizer, env, prompts, args, rng, greedy=True)
    rewards, infos = score_rollouts(env, tasks, rollouts, tokenizer)
    run.write_transcripts(args, stage, [run.transcript(
        tokenizer, prompts[r.question] + r.response_ids,
        [0] * len(prompts[r.question]) + r.action_mask,
        task=tasks[r.question], won=info.get("won"), reward=reward)
        for r, reward, info in zip(rollouts, rewards, infos, strict=True)])
    m = rollout_metrics(rollouts, rewards, infos, len(tasks))
    return {"eval/success_rate": m["success_rate"], "eval/reward_mean": m["reward_mean"],
            "eval/format_error_rate": m["format_error_rate"],
            "eval/tool_calls_per_question": m["tool_calls/per_rollout"]}


@dataclass
class Envs:
    """The environment (one: ARPO scores whole responses) and its train / held-out tasks."""
    env: object
    train_tasks: list
    eval_tasks: list


TOOLLESS_ENVS = ("toy",)  # the tests' fast game: one turn (turns=1), no tools


def build_envs(args: Args) -> Envs:
    """The environment and its tasks, before the model loads (a bad --env: one line, no load). ARPO
    runs a response's tool calls through `env.execute_tool` and scores it in one `env.step`: an env
    without that hook is refused (it would play the response as its first turn); toy by name."""
    options = {"turns": 1} if args.env == "toy" else {}  # one response per question: one toy turn
    if args.env == "tools":  # its retriever
        options["topk"] = args.search_topk
    if args.env == "tools" and args.unsafe_python:
        options["unsafe_python"] = True
    env, options, train_tasks, eval_tasks = run.make_env(args, **options)  # --env-options win
    if args.env in TOOLLESS_ENVS and options.get("turns", 1) != 1:
        raise SystemExit(f"arpo.py: --env {args.env!r}: ARPO plays it in one turn; leave turns 1")
    if args.env not in TOOLLESS_ENVS:
        require(env, "execute_tool", script="arpo.py", name=args.env,
                why="ARPO runs the tool calls of one response through it; --env tools has it")
    return Envs(env, train_tasks, eval_tasks)


def summary(extra: dict, n_questions: int, args: Args) -> dict:
    """Print a held-out question before and after RL, then each stage's held-out success and mean
    reward; return them (eval_before, reward_before, ...)."""
    run.report(args, extra, n_questions, also="eval/reward_mean")
    stages = {s: extra[s] for s in run.STAGES if s in extra}  # a resumed run: from its checkpoint
    names = {"base": "before", "cold_start": "cold_start", "rl": "after"}
    return {f"{k}_{names[s]}": m[f"eval/{v}"] for s, m in stages.items()
            for k, v in (("eval", "success_rate"), ("reward", "reward_mean"))}


def step_questions(train_tasks: list, args: Args, step: int) -> list:
    """Step n's --tasks-per-step questions, in order through the training set: the same list on
    every rank, of which each rank rolls out its share of whole questions (`dist.shard`)."""
    first = (step - 1) * args.tasks_per_step
    n = len(train_tasks)
    return dist.shard([train_tasks[(first + i) % n] for i in range(args.tasks_per_step)])


def overruns(args: Args, step: int, t_start: float, step_times: list[float], t_eval: float) -> bool:
    """--max-minutes: would the next step and the final evaluation overrun? Alike on every rank."""
    late = lambda: time.time() - t_start + np.mean(step_times) + t_eval > 60 * args.max_minutes
    return bool(dist.all_reduce(int(args.max_minutes > 0 and step < args.steps and late()), "max"))


@dist.entrypoint
def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = run.parse(Args, argv, PRESETS, check_args)
    if args.dry_run:  # a sequence: the question prompt (tools: 115-152 tokens) + the response
        return run.dry_run(args, 256 + args.max_new_tokens, "256 prompt tokens + --max-new-tokens")
    envs = build_envs(args)  # before the model: errors cost no load
    r = run.setup(args, desc=f"arpo[{args.rollout}]")
    held_out = lambda stage: run.on_main(
        lambda: evaluate(r.generator, r.tokenizer, envs.env, envs.eval_tasks, args, stage))
    t_eval = 0.0  # an evaluation's time, for --max-minutes
    if "base" not in r.extra:  # a resumed run has done these: r.extra holds their results
        t_eval, r.extra["base"] = time.time(), held_out("base")
        t_eval = time.time() - t_eval
        r.logger.log({"step": 0, **r.extra["base"]})
    if args.cold_start and "cold_start" not in r.extra and (
            log := cold_start(r, envs.env, envs.train_tasks, args)):  # {}: it had no demonstration
        run.cold_started_reference(r, args)  # --kl-coef: the KL is to the policy RL starts from
        r.extra["cold_start"] = held_out("cold_start")
        r.logger.log({"step": 0, **log, **{k.replace("eval/", "eval_cold_start/"): v
                                          for k, v in r.extra["cold_start"].items()}})
    line, step_times, t_rl = {"step": r.start_step}, [], time.time()  # time_s: since RL (re)started
    for step in range(r.start_step + 1, args.steps + 1):
        t0, rng = time.time(), step_rng(args.seed, step)
        # 1. the step's questions, each question's rollout tree of M responses
        tasks = step_questions(envs.train_tasks, args, step)
        prompts = [build_prompt(r.tokenizer, *envs.env.reset(t)) for t in tasks]
        rollouts = rollout(r.generator, r.tokenizer, envs.env, prompts, args, rng)
        t_rollout = time.time() - t0
        r.generator.sleep()  # vLLM on GPU: free its memory for training; update_weights wakes it
        # 2. the hierarchical reward; GRPO advantages per question, attributed to the tree's tokens
        rewards, infos = score_rollouts(envs.env, tasks, rollouts, r.tokenizer)
        advantages = batch_advantages(rollouts, rewards, args.attribution)
        # 3. PPO dual-clip update; the next rollouts sample from the new policy
        batch = build_batch(prompts, rollouts, advantages, r.tokenizer.pad_token_id, r.device)
        stats = update(r.policy, r.optimizer, batch, args, rng, r.reference)
        r.generator.update_weights(r.model)
        metrics = rollout_metrics(*gather_rollouts(rollouts, rewards, infos), args.tasks_per_step)
        line = {"step": step, **metrics, **stats, "time_s": time.time() - t_rl,
                "step_time_s": time.time() - t0, "time_rollout_s": t_rollout,
                "time_update_s": time.time() - t0 - t_rollout}  # reward, advantages, update
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            line.update(held_out(f"step_{step}"))
        r.logger.log(line)
        step_times.append(time.time() - t0)
        stop = overruns(args, step, t_start, step_times, t_eval)
        if step % args.save_every == 0 or step == args.steps or stop:
            run.save(r, args, step)
        if stop:
            run.say(f"stopping after step {step}: the next would overrun --max-minutes "
                    f"{args.max_minutes}")
            line["stopped_early_at_step"] = step
            break
    r.extra["rl"] = held_out("rl")
    r.logger.log({"step": line["step"], **r.extra["rl"]})
    r.logger.close()
    final = {**line, **r.extra["rl"], **summary(r.extra, len(envs.eval_tasks), args)}
    dist.cleanup()
    return final


if __name__ == "__main__":
    main()
