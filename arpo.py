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
`tools` env's scripted expert (the paper starts from a Tool-Star SFT model).

Read top to bottom: the arguments; the ALGORITHM (the step entropy and branch rule, the adaptive
rollout, the advantage attribution, the clipped objective); then the SCAFFOLDING that loop.py and
t2po.py share word for word (the training record, the update, evaluation, the cold start, main).
`python arpo.py` (CPU, ~15 min), `--preset paper` (M=16, N=8, k=20, ...), `--env toy --model
tiny-random` (seconds); docs/arpo.md: the equations beside these lines, the hyper-parameters.
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from common import cli, dist, run
from common.cli import opt
from common.generation import chat_ids
from common.logprobs import token_logprobs
from common.models import unwrap
from envs.base import require
from envs.tools import result_block

# ==================================================================================================
# ARGUMENTS
# ==================================================================================================
Preset = Literal["auto", "none", "cpu", "paper"]


@dataclass
class Args(run.RunArgs):
    """ARPO (Dong et al. 2025), entropy-based adaptive rollout for tool agents: docs/arpo.md."""

    preset: Preset = opt("run", "auto", "fills each flag not given (PRESETS): cpu, our defaults; "
                         "paper, M=16 N=8 k=20 Z=1, 5 tool calls, lr 1e-6, 128 questions/step; "
                         "auto: the one named after --env (none is)")
    # the shared flags (common/run.py) where ARPO's default differs
    env: str = "tools"  # offline python/search questions
    steps: int = 8
    max_new_tokens: int = 256  # per response, results included (code: 4096): fits every expert demo
    cold_start_episodes: int = 32
    cold_start_epochs: int = 2  # two passes at 2.5e-5 learn the tags in every seed piloted; one at
    cold_start_lr: float = 2.5e-5  # 1e-4 learns them or not by seed (results page)
    lr: float = 1e-5  # RL; 2e-5 gained less on the pilot seed, 5e-6 moved little (results page)
    eval_tasks: int = 32  # tools: none of their answers is a training answer (build_envs)
    group_size: int = 8  # M; with 4, a third of the steps had every group of one outcome
    max_minutes: float = 14.0  # the CPU default's budget: stop early rather than overrun
    base_eval: bool = False  # the base model writes no well-formed answer; its ~6 min buy nothing
    max_turns: int = opt("environment", 1, "unused: ARPO writes one response per question; "
                         "--max-tool-calls bounds its tool turns", ge=1)
    rollout: Literal["arpo", "global"] = opt("algorithm", "arpo", "arpo: entropy-based adaptive "
                                             "rollout; global: M independent trajectories (GRPO)")
    initial_rollouts: int = opt("algorithm", 4, "N: rollouts started globally (paper: 8)", ge=1)
    branch_k: int = opt("algorithm", 20, "k: tokens whose entropy is the step entropy", ge=1)
    entropy: Literal["topk", "exact"] = opt(
        "algorithm", "topk", "step entropy. topk (the authors' code; beta, tau tuned on it): -sum "
        "p log p over the top-10 log-probs + the sampled token, summed over k tokens, / ln|V|; "
        "exact (ours): the full-vocabulary entropy, a short segment scaled up to k")
    beta: float = opt("algorithm", 0.2, "beta: entropy weight in P = alpha + beta*dH")
    tau: float = opt("algorithm", 0.5, "tau: branch threshold (P > tau forks)")
    beta_calibration: Literal["off", "spread"] = opt(
        "algorithm", "off", "ours. spread: each step's beta = 1 / (p90 - p10) of dH at this run's "
        "earlier tool results (--beta until 8 are seen), so that P(fork) moves by 1 from this "
        "model's dH p10 to its p90, not by beta * 0.9 (paper: off, beta fixed)")
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
    clip_low: float = opt("algorithm", 0.2, "PPO clip epsilon below 1", ge=0, lt=1,
                          why="the ratio's lower bound 1 - eps must stay positive")
    clip_high: float = opt("algorithm", 0.2, "PPO clip epsilon above 1", ge=0)
    dual_clip: float = opt("algorithm", 3.0, "dual-clip c: bound of -A*ratio when A < 0", gt=1,
                           why="as verl asserts")
    eval_temperature: float = opt("run", 1.0, "held-out sampling temperature (ours; 0: "
                                  "greedy, one response a question): 1.0, --temperature's, scores "
                                  "the policy RL trains, which greedy answers hide", ge=0)
    eval_samples: int = opt("run", 4, "held-out responses a question at --eval-temperature > 0 "
                            "(greedy: one); the success is their mean (ours)", ge=1)
    search_topk: int = opt("environment", 1, "passages per <search> result (ours: 1, so that "
                           "look-ups fit the budget; the env's default: 3; the authors' code: 10 "
                           "web results)", ge=1)
    unsafe_python: bool = opt("environment", False, "run the tools env's python where the kernel "
                              "gives its sandbox no isolation, with only a python audit hook and "
                              "rlimits")


# --preset: cpu, our defaults; paper, the paper's rollout settings (official scripts, 7B/8B). Each
# preset is written out here and never changed after.
PRESETS: dict[str, dict] = {
    "cpu": {},
    "paper": dict(group_size=16, initial_rollouts=8, branch_k=20, beta=0.2, tau=0.5, fork_z=1,
                  max_tool_calls=5, lr=1e-6, tasks_per_step=128,
                  minibatch_size=256,  # the code's mini-batch: 16 questions x M = 16 responses
                  max_new_tokens=4096, max_minutes=0.0,
                  cold_start=False,  # bring the SFT'd model with --model
                  base_eval=True,  # and evaluate it before RL
                  search_topk=3,  # ours, the env's default (the code: 10 web results)
                  gradient_checkpointing=True, stop_at_answer=False),
}
REPORTED = "eval/reward_mean"  # the held-out figure the last line gives beside the successes


def check_args(args: Args) -> None:
    """The rule between flags (each flag's own bounds are declared with it)."""
    if args.initial_rollouts > args.group_size:
        raise cli.bad_flag("arpo.py", "initial_rollouts", args.initial_rollouts,
                           f"must be <= --group-size ({args.group_size}): N of M start globally")
    if args.eval_temperature == 0:  # greedy responses to a question are all alike: play one
        args.eval_samples = 1  # here, so evaluate, --dry-run's plan and args.json agree


# ==================================================================================================
# ALGORITHM (ARPO, arXiv 2507.19849)
# ==================================================================================================
# ALGORITHM: the step entropy and the branch rule
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


def fork_probability(delta_h: float, beta: float, tau: float) -> float:
    """P(fork) under branch_rule with alpha ~ U(0, 1): clip(1 - tau + beta * dH, 0, 1)."""
    return min(1.0, max(0.0, 1.0 - tau + beta * delta_h))


# ALGORITHM: the rollout, entropy-based and adaptive: a tree of M responses per question
def _tool_counts() -> dict[str, int]:
    return dict.fromkeys(TOOL_TAGS, 0)


@dataclass
class Rollout:
    """One response under construction: a path in the question's rollout tree."""

    question: int  # index of the question in the batch
    index: int = 0  # its number among its question's rollouts (0..M-1): its seeds
    response_ids: list[int] = field(default_factory=list)  # generated + inserted tokens
    action_mask: list[int] = field(default_factory=list)  # 1 = policy token, 0 = <result> tokens
    h_initial: float | None = None  # step entropy of the first k tokens of the initial reasoning
    probe: bool = False  # a result was just inserted: the next k tokens decide a fork
    tool_calls: dict[str, int] = field(default_factory=_tool_counts)
    # calls in the prefix shared with the parent, run by it (a fork's own: tool_calls - these)
    shared_calls: dict[str, int] = field(default_factory=_tool_counts)
    done: bool = False
    finish: str = ""  # eos | length | tool_limit | empty_call
    parent: int | None = None  # rollout it was forked from (None: a global rollout)
    fork_point: int = 0  # number of response tokens shared with the parent
    delta_h: list[float] = field(default_factory=list)  # dH at each tool result
    forked: list[bool] = field(default_factory=list)  # whether each of them forked
    could_fork: list[bool] = field(default_factory=list)  # whether its question had room then
    p_fork: list[float] = field(default_factory=list)  # P(fork) the rule gave each of them
    beta: float = 0.0  # the beta its branch decisions used
    group: int = 0  # its question's index among the step's tasks, on any rank (after scoring)
    prompt_ids: list[int] = field(default_factory=list)  # its question's prompt (after scoring)
    reward: float = 0.0  # the environment's reward for the whole response (after scoring)
    won: bool = False


def fork(parent: Rollout, parent_index: int, at: int, index: int) -> Rollout:
    """A partial rollout sharing the parent's first `at` response tokens (its state there)."""
    child = copy.deepcopy(parent)
    child.index = index
    child.response_ids = parent.response_ids[:at]
    child.action_mask = parent.action_mask[:at]
    child.parent, child.fork_point, child.probe = parent_index, at, False
    child.delta_h, child.forked, child.could_fork, child.p_fork = [], [], [], []
    child.shared_calls = dict(parent.tool_calls)  # it starts after a result: all calls so far
    return child


def adaptive_rollout(num_questions: int, *, group_size: int, initial_rollouts: int, fork_z: int,
                     k: int, beta: float, tau: float, max_tool_calls: int, max_new_tokens: int,
                     vocab_size: int, generate_segments, run_tool, rng: np.random.Generator,
                     entropy: str = "topk") -> list[Rollout]:
    """Build each question's rollout tree until it holds exactly M = group_size finished rollouts.

    generate_segments(rollouts, budgets) -> one segment per rollout (token_ids, entropies: the
        per-token terms of the `entropy` estimator, finish_reason "stop" | "eos" | "length",
        stop_string): the continuation of each rollout's prompt + response, until a closing tool
        tag, end of sequence, or its token budget.
    run_tool(rollout, tag) -> token ids of the inserted "<result>...</result>" block; None for an
        empty call, which ends the rollout (the code's rule).
    initial_rollouts = group_size and fork_z = 0 give trajectory-level sampling (GRPO).
    """
    rollouts = [Rollout(q, index=j, beta=beta) for q in range(num_questions)
                for j in range(initial_rollouts)]
    size = [initial_rollouts] * num_questions  # rollouts per question, live or done
    while True:
        # Budget rule: a question whose paths all ended with fewer than M gets fresh rollouts.
        live_questions = {r.question for r in rollouts if not r.done}
        for q in range(num_questions):
            if q not in live_questions and size[q] < group_size:
                rollouts += [Rollout(q, index=j, beta=beta) for j in range(size[q], group_size)]
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
                r.probe = False
                room = size[r.question] < group_size
                fires = room and branch_rule(delta_h, rng.random(), beta, tau)
                r.delta_h.append(delta_h)
                r.forked.append(fires)
                r.could_fork.append(room)
                r.p_fork.append(fork_probability(delta_h, beta, tau))
                if fires:
                    z = min(fork_z, group_size - size[r.question])  # forks stop once M exist
                    rollouts += [fork(r, i, start, size[r.question] + j) for j in range(z)]
                    size[r.question] += z
            r.response_ids += list(seg.token_ids)
            r.action_mask += [1] * len(seg.token_ids)
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
                r.probe = True
                if len(r.response_ids) >= max_new_tokens:
                    r.done, r.finish = True, "length"


def build_prompt(tokenizer, question: str, info: dict) -> list[int]:
    """The chat the environment asks for (tools: its system prompt, the tool format, the question);
    the toy env gives none: the question as the user's message."""
    messages = info.get("messages") or [{"role": "user", "content": question}]
    return chat_ids(tokenizer, messages)  # a question that spells a special token gets text


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


def encode_result(tokenizer, block: str) -> list[int]:
    """A tool's `<result>` block as environment tokens: text only, never a special token. Its
    chat-template markers are escaped already (`&lt;|im_end|>`: envs/tools.py, for every path);
    split_special_tokens also keeps this tokenizer's other special tokens (SmolLM2's `<filename>`,
    Llama 2's `</s>`) as text."""
    return tokenizer.encode(block, add_special_tokens=False, split_special_tokens=True)


def rollout(generator, tokenizer, env, prompts: list[list[int]], groups: list[int], args: Args,
            rng: np.random.Generator, *, step: int, train: bool) -> list[Rollout]:
    """ARPO (or global) rollouts of a batch of prompts (one per question): every finished one.
    groups: the questions' indices among the step's tasks, for the seeds; rng: the fork draws."""
    eos = tokenizer.eos_token_id
    top_k = ENTROPY_TOPK if args.entropy == "topk" else 0  # log-probs per token the estimator reads
    stops = STOP_STRINGS if args.stop_at_answer else TOOL_STOPS

    def generate_segments(rollouts: list[Rollout], budgets: list[int]):
        # A continuation is prompt + response so far: the backend re-reads the prefix (vLLM: prefix
        # cache hit, no recomputation; HF: one prefill of the whole prefix). A seed per segment,
        # so a fork does not replay its parent's noise at the same positions. Held-out: the same
        # noise at every evaluation, so two differ only by the weights (--lr 0's are equal).
        seeds = [sample_seed(args.seed, step if train else 0, int(train), groups[r.question],
                             r.index, len(r.response_ids)) for r in rollouts]
        temperature = args.temperature if train else args.eval_temperature
        samples = generator.generate([prompts[r.question] + r.response_ids for r in rollouts], n=1,
                                     max_new_tokens=max(budgets), stop=stops,
                                     temperature=temperature, seeds=seeds, logprobs_k=top_k)
        segments = []
        for (s,), budget in zip(samples, budgets, strict=True):
            seg = copy.copy(s)
            seg.token_ids = list(s.token_ids[:budget])
            if len(s.token_ids) > budget:
                seg.finish_reason = "length"
            elif s.finish_reason == "eos" and len(seg.token_ids) < budget:
                # train the stop too (its log-prob is recomputed): the EOS id it sampled
                # (Qwen2.5/Qwen3 end at <|im_end|> or <|endoftext|>)
                seg.token_ids.append(s.stop_token_id if s.stop_token_id is not None else eos)
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
        # the code's layout, the agent's tags in the output neutralized (envs/tools.py)
        return encode_result(tokenizer, result_block(execute_tool(env, tag, content)))

    m, n, z = (args.group_size, args.initial_rollouts, args.fork_z) if train else (1, 1, 0)
    if args.rollout == "global":
        n, z = m, 0  # trajectory-level sampling: M independent rollouts, no forks (GRPO)
    return adaptive_rollout(len(prompts), group_size=m, initial_rollouts=n, fork_z=z,
                            k=args.branch_k, beta=args.beta, tau=args.tau,
                            max_tool_calls=args.max_tool_calls,
                            max_new_tokens=args.max_new_tokens, vocab_size=len(tokenizer),
                            generate_segments=generate_segments, run_tool=run_tool, rng=rng,
                            entropy=args.entropy)


def score_response(env, task, response: str) -> tuple[float, dict]:
    """The environment's reward for a whole response (tools: ARPO's hierarchical reward)."""
    env.reset(task)
    _, reward, _, info = env.step(response)
    return float(reward), info


def play(r: run.Run, env, tasks: list, groups: list[int], args: Args, step: int, train: bool
         ) -> list[Rollout]:
    """The questions' rollouts (a tree each, or one greedy response when not training), each
    scored by the environment: reward, won."""
    prompts = [build_prompt(r.tokenizer, *env.reset(task)) for task in tasks]
    rng = step_rng(dist.rank_seed(args.seed), step)  # the fork draws: this rank's own
    rollouts = rollout(r.generator, r.tokenizer, env, prompts, groups, args, rng, step=step,
                       train=train)
    for x in rollouts:
        text = r.tokenizer.decode(x.response_ids, skip_special_tokens=True)
        x.reward, info = score_response(env, tasks[x.question], text)
        x.won = bool(info.get("won", False))
        x.group, x.prompt_ids = groups[x.question], prompts[x.question]
    return rollouts


def training_rollouts(r: run.Run, envs: Envs, args: Args, step: int) -> list[Rollout]:
    """The step's questions (this rank's), a tree of M scored responses each (GRPO: M apart)."""
    mine = step_tasks(envs.train_tasks, args, step)
    calibrate = args.beta_calibration == "spread"
    if calibrate:  # every rank's dH at tool results so far, checkpointed
        args = replace(args, beta=step_beta(r.extra.setdefault("delta_h", []), args))
    rollouts = play(r, envs.pool, [task for _, task in mine], [group for group, _ in mine], args,
                    step, train=True)
    if calibrate:
        r.extra["delta_h"] += [d for part in dist.all_gather_object(
            [d for x in rollouts for d in x.delta_h]) for d in part]
    return rollouts


CALIBRATION_MIN = 8  # dH values --beta-calibration spread waits for


def step_beta(seen: list[float], args: Args) -> float:
    """The step's beta: --beta, or under --beta-calibration spread (ours) 1 / (p90 - p10) of the dH
    values `seen` so far. P(fork) = clip(1 - tau + beta * dH, 0, 1) then rises by 1 (before the
    clip) from dH's p10 to its p90: forks follow the entropy change wherever this model's dH lies
    (a cold-started 135M model's spans ~0.9, so the paper's 0.2 moves P by ~0.2:
    docs/results/arpo.md)."""
    if len(seen) < CALIBRATION_MIN:
        return args.beta
    p10, p90 = np.quantile(seen, [0.1, 0.9])
    return float(1.0 / (p90 - p10)) if p90 > p10 else args.beta


# ALGORITHM: the advantage, GRPO's per question, attributed to the tree's tokens (soft | hard)
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


def training_samples(rollouts: list[Rollout], args: Args) -> list[TrainingSample]:
    """Each response is one training sample: its question's prompt, then the response (its tool
    results masked), each token carrying its attributed advantage."""
    advantages = batch_advantages(rollouts, [r.reward for r in rollouts], args.attribution)
    return [TrainingSample((r.group, r.index), r.prompt_ids, r.response_ids, r.action_mask, a)
            for r, a in zip(rollouts, advantages, strict=True)]


# ALGORITHM: the objective, PPO-clip with dual clip; token-mean, or the paper's 1/|y_i|
def resolve_loss_agg(args: Args) -> str:
    if args.loss_agg != "auto":
        return args.loss_agg
    return "seq-mean-token-mean" if args.attribution == "hard" else "token-mean"


def loss_weights(action_mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """Per-token weights of the loss, (B, T-1). token-mean (the code's loss_agg_mode): 1 per policy
    token. seq-mean-token-mean (the paper's, 1/G sum_i 1/|y_i| sum_t): 1/|y_i|. Only under the
    latter does hard attribution change the gradient: a shared token's copies carry A_i / |y_i|
    (soft) or mean(A) / |y_i| (hard), sums that differ if the |y_i| do."""
    if loss_agg == "token-mean":
        return action_mask
    return action_mask / action_mask.sum(1, keepdim=True).clamp(min=1)


def policy_loss(logp: torch.Tensor, batch: dict[str, torch.Tensor], args: Args
                ) -> tuple[torch.Tensor, dict]:
    """Σ over the batch's policy tokens of w_t · −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A), for A < 0
    at most −c·A (dual clip), ρ = π_θ/π_old, w_t from loss_weights; + β·k3 per token aggregated the
    same way with --kl-coef. update divides it by loss_divisor. Tensors (B, T-1)."""
    adv = batch["advantages"]
    weights = loss_weights(batch["action_mask"], resolve_loss_agg(args))
    ratio = torch.exp(torch.clamp(logp - batch["old_logp"], -20.0, 20.0))  # log ρ clamped: verl
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - args.clip_low, 1 + args.clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(clipped, -adv * args.dual_clip)
    per_token = torch.where(adv < 0, dual, clipped)
    chose_clip = (loss2 > loss1) | ((adv < 0) & (dual < clipped))
    loss = (per_token * weights).sum()
    stats = {"clipped": float((chose_clip.float() * batch["action_mask"]).sum())}
    if args.kl_coef > 0:  # KL(π ‖ π_ref), aggregated as the loss
        kl = (low_var_kl(logp, batch["ref_logp"]) * weights).sum()
        loss = loss + args.kl_coef * kl
        stats["kl"] = kl.item()
    return loss, stats


def loss_divisor(minibatch: list[TrainingSample], args: Args) -> float:
    """The minibatch's policy tokens (token-mean) or responses (seq-mean-token-mean), all ranks."""
    if resolve_loss_agg(args) == "token-mean":
        units = sum(sum(s.action_mask) for s in minibatch)
    else:
        units = sum(1 for s in minibatch if any(s.action_mask))
    return max(1.0, dist.all_reduce(float(units)))


# ==================================================================================================
# SCAFFOLDING: one training record and one update, the same text in loop.py, arpo.py and t2po.py.
# What differs between the papers is `policy_loss` and `loss_divisor` above.
# ==================================================================================================
@dataclass
class TrainingSample:
    """One training sequence: a prompt, then a response trained on the tokens the policy sampled."""

    origin: tuple  # (group, rollout, turn): where it came from, the same on every rank
    prompt_ids: list[int]
    response_ids: list[int]  # everything after the prompt the loss may see
    action_mask: list[int]  # per response token: 1 = the policy sampled it (trained), else 0
    advantages: list[float]  # per response token: A_t
    old_logp: torch.Tensor | None = None  # (len(prompt) + len(response) - 1,): π_old, set in update
    ref_logp: torch.Tensor | None = None  # the same under π_ref (--kl-coef), set in update


def sample_tokens(sample: TrainingSample) -> tuple:
    """What a forward pass sees of a sample: two samples with the same tokens run once."""
    return tuple(sample.prompt_ids), tuple(sample.response_ids), tuple(sample.action_mask)


def build_batch(samples: list[TrainingSample], device=None) -> dict[str, torch.Tensor]:
    """The distinct samples' prompt + response, right-padded: input_ids, attention_mask (U, T) and
    targets (U, T-1), 1 where token t+1 was sampled; rows (B,): each sample's row among them; per
    sample action_mask and advantages (B, T-1), aligned with log-probs (logp[:, t] scores t+1)."""
    row_of: dict[tuple, int] = {}  # a distinct sample's row: the order of first appearance
    unique = []
    for s in samples:
        if sample_tokens(s) not in row_of:
            row_of[sample_tokens(s)] = len(unique)
            unique.append(s)
    rows = [row_of[sample_tokens(s)] for s in samples]
    seqs = [s.prompt_ids + s.response_ids for s in unique]
    targets = [[0] * len(s.prompt_ids) + s.action_mask for s in unique]
    advantages = [[0.0] * len(s.prompt_ids) + s.advantages for s in samples]

    def padded(values: list[list], dtype: torch.dtype) -> torch.Tensor:  # (n, T), zeros after
        return pad_sequence([torch.tensor(v, dtype=dtype, device=device) for v in values],
                            batch_first=True)

    targets_tensor = padded(targets, torch.float32)[:, 1:]  # (U, T-1)
    width = targets_tensor.shape[1]
    return {"input_ids": padded(seqs, torch.long),  # (U, T)
            "attention_mask": padded([[1] * len(s) for s in seqs], torch.long),  # (U, T)
            "targets": targets_tensor,  # (U, T-1)
            "rows": torch.tensor(rows, device=device),  # (B,)
            "action_mask": targets_tensor[rows],  # (B, T-1)
            "advantages": padded(advantages, torch.float32)[:, 1:1 + width]}  # (B, T-1)


def action_logprobs(model, batch: dict[str, torch.Tensor], temperature: float,
                    share_prefixes: bool = True) -> torch.Tensor:
    """(B, T-1) log π(token t+1 | tokens ≤ t) at the sampled tokens (0 elsewhere), under
    softmax(logits / temperature), the rollouts' sampling distribution; a prefix the rows share
    (a group's prompt) runs once with --share-prefixes."""
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                          temperature=temperature, target_mask=batch["targets"],
                          share_prefixes=share_prefixes)  # (U, T-1)
    return logp[batch["rows"]]


def microbatches(samples: list[TrainingSample], size: int, share_prefixes: bool = False
                 ) -> list[tuple[list[TrainingSample], float]]:
    """(samples, weight) micro-batches of at most `size` distinct samples and their copies, in
    prefix order (shared prefixes pack together), as many on every rank: a rank with fewer runs
    weight-0 passes on a placeholder: under DDP each backward, under FSDP2 each forward, is a
    collective."""
    placeholder = TrainingSample((), [0], [0], [1], [0.0])
    filler = samples[:1] or [placeholder]
    copies = defaultdict(list)
    for s in samples:
        copies[sample_tokens(s)].append(s)
    if share_prefixes:
        distinct = sorted(copies)
    else:
        distinct = sorted(copies, key=lambda k: len(k[0]) + len(k[1]))
    parts = [[s for k in distinct[b:b + size] for s in copies[k]]
             for b in range(0, len(distinct), size)]
    return dist.same_count(parts, filler)


def keep_logprobs(samples: list[TrainingSample], logp: torch.Tensor, key: str) -> None:
    """sample.<key> = its row of `logp` (B, T-1), cut to the sample's own length."""
    for s, row in zip(samples, logp, strict=True):
        setattr(s, key, row[:len(s.prompt_ids) + len(s.response_ids) - 1])


def stacked(samples: list[TrainingSample], key: str) -> torch.Tensor:
    """The samples' stored log-probs (`key`), padded to (B, T-1) as action_logprobs returns them."""
    return pad_sequence([getattr(s, key) for s in samples], batch_first=True)


@torch.no_grad()
def policy_logprobs(model, samples: list[TrainingSample], args: Args, key: str,
                    adapter_off: bool = False) -> None:
    """sample.<key> = its log-probs under `model` (adapter_off: LoRA's base model), no gradient."""
    device = next(model.parameters()).device
    for micro, _ in microbatches(samples, args.micro_batch_size, args.share_prefixes):
        with unwrap(model).disable_adapter() if adapter_off else nullcontext():
            logp = action_logprobs(model, build_batch(micro, device), args.temperature,
                                   args.share_prefixes)
        keep_logprobs(micro, logp, key)


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref) (Schulman 2020; verl's low_var_kl): e^x − x − 1,
    x = log π_ref − log π_θ clamped to [−20, 20] first (no NaN gradient from an overflowing exp),
    the estimate then to [−10, 10]."""
    x = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1, min=-10.0, max=10.0)


def update(policy, optimizer, samples: list[TrainingSample], args: Args, rng: np.random.Generator,
           reference=None) -> dict:
    """--ppo-epochs passes over the step's samples in minibatches of about --minibatch-size, an
    optimizer step each: the sum of `policy_loss` over a minibatch divided by its `loss_divisor`.

    Under torchrun `samples` are this rank's: every rank draws the same permutation of the global
    list and trains its part of each minibatch, and the divisor is global, so a step is the same on
    1 or 8 ranks. A minibatch whose loss or gradient is not finite, or whose k1 estimate of
    KL(π_old ‖ π) per sample passes --kl-threshold, abandons the rest of the update (ml-loop)."""
    t0 = time.time()
    gathered = dist.all_gather_object([s.origin for s in samples])
    origins = sorted(origin for part in gathered for origin in part)  # every rank's samples
    mine = {s.origin: s for s in samples}
    n_minibatches = max(1, math.ceil(len(origins) / args.minibatch_size))
    minibatches = []
    for _ in range(args.ppo_epochs if origins else 0):  # a new order each epoch; none: no step
        for part in np.array_split(rng.permutation(len(origins)), n_minibatches):
            minibatches.append([mine[origins[j]] for j in part if origins[j] in mine])
    # π_old, the policy that sampled the rollouts: the first minibatch trains on it before any
    # step, so its own forward, detached, is π_old; every other sample's is computed now
    first = {s.origin for s in minibatches[0]} if minibatches else set()
    later = dict.fromkeys(s.origin for mb in minibatches[1:] for s in mb if s.origin not in first)
    policy_logprobs(policy, [mine[o] for o in later], args, "old_logp")
    if args.kl_coef > 0:  # π_ref: a frozen copy, or with LoRA the base model, adapter off
        policy_logprobs(reference if reference is not None else policy, samples, args, "ref_logp",
                        adapter_off=reference is None)
    time_logprobs = time.time() - t0
    params = [p for p in policy.parameters() if p.requires_grad]
    device = next(policy.parameters()).device
    totals = dict.fromkeys(LOSS_STATS, 0.0)  # this rank's, over the optimizer steps taken
    steps = dict(divisor=0.0, tokens=0.0, grad_norm=0.0, taken=0)
    ratio_min, ratio_max, abandoned = math.inf, -math.inf, False
    policy.train()
    for index, minibatch in enumerate(minibatches):
        divisor = loss_divisor(minibatch, args)  # global
        tokens = dist.all_reduce(float(sum(sum(s.action_mask) for s in minibatch)))  # global
        before, sums = dict(totals), dict.fromkeys(LOSS_STATS, 0.0)  # sums: this minibatch's
        low, high, backward = math.inf, -math.inf, False
        optimizer.zero_grad()
        for micro, weight in microbatches(minibatch, args.micro_batch_size, args.share_prefixes):
            signal = weight > 0 and (args.kl_coef > 0 or any(any(s.advantages) for s in micro))
            if args.ppo_epochs == 1 and not dist.all_reduce(int(signal), "max"):
                continue  # A = 0 on every rank's rows, no KL: a zero gradient, not computed
            batch = build_batch(micro, device)
            logp = action_logprobs(policy, batch, args.temperature, args.share_prefixes)  # (B, T-1)
            batch["action_mask"] = batch["action_mask"] * weight  # weight 0: the placeholder
            if index == 0 or not weight:  # on-policy (the placeholder stores nothing)
                batch["old_logp"] = logp.detach()
            else:
                batch["old_logp"] = stacked(micro, "old_logp")
            if index == 0 and weight and args.ppo_epochs > 1:  # a later epoch reads it
                keep_logprobs(micro, logp.detach(), "old_logp")
            if args.kl_coef > 0:
                batch["ref_logp"] = stacked(micro, "ref_logp") if weight else logp.detach()
            loss, stats = policy_loss(logp, batch, args)
            (loss / divisor * dist.grad_scale()).backward()
            backward = True
            with torch.no_grad():  # the ratio's spread; KL(π_old ‖ π) per sample (ml-loop's k1, k3)
                mask = batch["action_mask"]
                log_ratio = (logp - batch["old_logp"]) * mask  # (B, T-1)
                per_sample = log_ratio.sum(1)  # (B,) log π/π_old over each sample's tokens
                ratios = torch.exp(log_ratio[mask.bool()])
                stats.update(loss=loss.item(), ratio_sum=float(ratios.sum()),
                             ratio_tokens=float(ratios.numel()), k1=float(-per_sample.sum()),
                             k3=float((torch.expm1(per_sample.clamp(max=50.0)) - per_sample).sum()),
                             samples=float(len(micro)) if weight else 0.0)
                if ratios.numel():
                    low, high = min(low, float(ratios.min())), max(high, float(ratios.max()))
            for key, value in stats.items():
                sums[key] += value
                totals[key] += value
        if not backward:  # every micro-batch skipped: AdamW still steps, on a zero gradient
            for p in params:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        reduced = dist.all_reduce(torch.tensor([sums["loss"], sums["k1"], sums["samples"]],
                                               dtype=torch.float64)).tolist()
        k1 = reduced[1] / max(reduced[2], 1.0)
        finite = math.isfinite(reduced[0]) and math.isfinite(grad_norm)
        if not finite or (args.kl_threshold > 0 and abs(k1) > args.kl_threshold):
            optimizer.zero_grad(set_to_none=True)
            totals, abandoned = before, True  # this minibatch counts for nothing
            break
        optimizer.step()
        steps["divisor"] += divisor
        steps["tokens"] += tokens
        steps["grad_norm"] += grad_norm
        steps["taken"] += 1
        ratio_min = min(ratio_min, dist.all_reduce(low, "min"))
        ratio_max = max(ratio_max, dist.all_reduce(high, "max"))
    policy.eval()
    reduced = dist.all_reduce(torch.tensor([totals[k] for k in LOSS_STATS], dtype=torch.float64))
    total = dict(zip(LOSS_STATS, reduced.tolist(), strict=True))  # over ranks
    taken, n = steps["taken"], max(total["samples"], 1.0)
    measured = total["ratio_tokens"] > 0
    out = {"loss": total["loss"] / steps["divisor"] if taken else 0.0,
           "clip_fraction": total["clipped"] / max(steps["tokens"], 1.0),
           "grad_norm": steps["grad_norm"] / max(taken, 1), "gradient_steps": taken,
           "ratio_mean": total["ratio_sum"] / total["ratio_tokens"] if measured else 1.0,
           "ratio_min": ratio_min if measured else 1.0, "ratio_max": ratio_max if measured else 1.0,
           "kl_k1": total["k1"] / n, "kl_k3": total["k3"] / n,
           "abandoned": float(abandoned), "time_logprobs_s": time_logprobs}
    if args.kl_coef > 0:
        out["kl"] = total["kl"] / steps["divisor"] if taken else 0.0
    return out


# what update sums over micro-batches: policy_loss's (loss, clipped tokens, kl) and the ratio's
LOSS_STATS = ("loss", "clipped", "kl", "ratio_sum", "ratio_tokens", "k1", "k3", "samples")


# ==================================================================================================
# SCAFFOLDING of ARPO's own: its metrics, evaluation, the expert's demonstrations, environments
# ==================================================================================================
def response_row(r: Rollout) -> dict:
    """A response's figures for the metrics: a small record each rank sends to rank 0."""
    return {"reward": r.reward, "won": r.won, "forked": r.parent is not None, "finish": r.finish,
            "policy_tokens": sum(r.action_mask),
            "result_tokens": len(r.action_mask) - sum(r.action_mask),
            "calls": dict(r.tool_calls),
            "executed": sum(r.tool_calls[t] - r.shared_calls[t] for t in TOOL_TAGS),
            "delta_h": list(r.delta_h), "forks": list(r.forked), "could_fork": list(r.could_fork),
            "p_fork": list(r.p_fork), "beta": r.beta}


def response_metrics(rows: list[dict], num_questions: int, prefix: str = "") -> dict:
    """Means over responses (reward, success, format errors, endings), tool calls per question,
    and the branch signal dH at tool results with the share of them that forked."""
    rewards = [row["reward"] for row in rows]
    dh = [d for row in rows for d in row["delta_h"]]
    out = {"rollouts": len(rows), "reward_mean": float(np.mean(rewards)),
           "success_rate": float(np.mean([row["won"] for row in rows])),
           "format_error_rate": float(np.mean([rw <= -1 for rw in rewards])),
           "num_tokens": sum(row["policy_tokens"] for row in rows),
           "result_tokens": sum(row["result_tokens"] for row in rows),
           "forks_per_question": sum(row["forked"] for row in rows) / num_questions,
           "tool_limit_rate": float(np.mean([row["finish"] == "tool_limit" for row in rows])),
           "empty_call_rate": float(np.mean([row["finish"] == "empty_call" for row in rows]))}
    for tag in TOOL_TAGS:  # calls written in the M responses of a question
        calls = sum(row["calls"][tag] for row in rows)
        out[f"tool_calls/{tag}_per_question"] = calls / num_questions
    # calls actually run per question (the paper's tool-call budget): a fork's shared prefix once
    out["tool_calls/executed_per_question"] = sum(row["executed"] for row in rows) / num_questions
    out["tool_calls/per_rollout"] = sum(sum(row["calls"].values()) for row in rows) / len(rows)
    if dh:
        q = np.quantile(dh, [0.1, 0.5, 0.9])
        out.update({"delta_h/mean": float(np.mean(dh)), "delta_h/p10": float(q[0]),
                    "delta_h/p50": float(q[1]), "delta_h/p90": float(q[2]),
                    "delta_h/count": len(dh)})
    return {prefix + k: v for k, v in out.items()}


def rollout_metrics(rollouts: list[Rollout], samples: list[TrainingSample], args: Args) -> dict:
    """The step's responses over all ranks, and whether its forks followed dH."""
    rows = [row for part in dist.all_gather_object([response_row(r) for r in rollouts])
            for row in part]
    return {**response_metrics(rows, args.tasks_per_step), **fork_metrics(rows, args)}


def fork_metrics(rows: list[dict], args: Args) -> dict:
    """The branch decisions a fork was possible at (its question had fewer than M responses): how
    many, the forks made, the mean P(fork) the rule gave them, and the forks made in the step's top
    and bottom quartile of dH (counts, so that a run's steps can be pooled)."""
    decisions = [(d, f, p) for row in rows
                 for d, f, room, p in zip(row["delta_h"], row["forks"], row["could_fork"],
                                          row["p_fork"], strict=True)
                 if room]
    out = {"branch/decisions": len(decisions), "branch/forks": sum(f for _, f, _ in decisions),
           "branch/beta": rows[0]["beta"] if rows else args.beta}
    if not decisions:
        return out
    dh = np.array([d for d, _, _ in decisions])
    forks = np.array([f for _, f, _ in decisions], dtype=float)
    low, high = np.quantile(dh, [0.25, 0.75])
    top, bottom = dh >= high, dh <= low
    out.update({"branch/p_fork_mean": float(np.mean([p for _, _, p in decisions])),
                "branch/top_quartile_decisions": int(top.sum()),
                "branch/top_quartile_forks": int(forks[top].sum()),
                "branch/bottom_quartile_decisions": int(bottom.sum()),
                "branch/bottom_quartile_forks": int(forks[bottom].sum())})
    return out


def mechanism_summary(lines: list[dict], args: Args) -> str:
    """The run's last line on ARPO's own mechanisms, over the RL steps this process ran: the forks
    after tool results, the entropy change dH that drives them, and the tool calls run."""
    steps = [line for line in lines if "rollouts" in line]
    if not steps:
        return "ARPO: no RL step ran"
    forks = np.mean([line["forks_per_question"] for line in steps])
    calls = np.mean([line["tool_calls/executed_per_question"] for line in steps])
    dh = [line["delta_h/p50"] for line in steps if "delta_h/p50" in line]
    median = f"{np.median(dh):+.3f}" if dh else "none"
    text = (f"ARPO, {len(steps)} steps ({args.rollout} rollout): {forks:.2f} forked responses and "
            f"{calls:.2f} tool calls run per question (means over steps); dH at tool results, "
            f"median of the steps' medians: {median}")
    pooled = {key: sum(line.get(f"branch/{key}", 0) for line in steps)
              for key in ("decisions", "forks", "top_quartile_decisions", "top_quartile_forks",
                          "bottom_quartile_decisions", "bottom_quartile_forks")}
    if pooled["decisions"]:
        text += (f"; forked at {pooled['forks']} of {pooled['decisions']} tool results with room, "
                 f"{pooled['top_quartile_forks']} of {pooled['top_quartile_decisions']} in a "
                 f"step's top dH quartile, {pooled['bottom_quartile_forks']} of "
                 f"{pooled['bottom_quartile_decisions']} in its bottom one")
    betas = [line["branch/beta"] for line in steps if "branch/beta" in line]
    if args.beta_calibration != "off" and betas:
        text += f"; beta (--beta-calibration spread) {min(betas):.2f} to {max(betas):.2f}"
    return text


def evaluate(r: run.Run, pool, tasks: list, args: Args, step: int, stage: str,
             prefix: str = "eval/") -> dict:
    """--eval-samples responses per question at --eval-temperature (greedy: one), no forks, after
    `step` updates: success and reward are means over them; transcripts (the model's text between
    tool results, each result as the observation) in <out>/transcripts."""
    copies = [task for task in tasks for _ in range(args.eval_samples)]  # (questions x samples,)
    rollouts = play(r, pool, copies, list(range(len(copies))), args, step, train=False)
    run.write_transcripts(args, stage, [run.transcript(
        r.tokenizer, x.prompt_ids + x.response_ids, [0] * len(x.prompt_ids) + x.action_mask,
        task=copies[x.question], won=x.won, reward=x.reward) for x in rollouts])
    m = response_metrics([response_row(x) for x in rollouts], len(copies))
    return {prefix + "success_rate": m["success_rate"], prefix + "reward_mean": m["reward_mean"],
            prefix + "format_error_rate": m["format_error_rate"],
            prefix + "tool_calls_per_question": m["tool_calls/per_rollout"]}


def demo_rollout(tokenizer, segments: list[tuple[str, int]], question: int = 0) -> Rollout:
    """The demonstration as a Rollout, its segments tokenized one by one as a rollout's, results
    masked (`action_mask` 0), exactly as in the RL loss."""
    r = Rollout(question)
    for text, policy in segments:
        ids = (tokenizer.encode(text, add_special_tokens=False) if policy
               else encode_result(tokenizer, text))
        r.response_ids += ids
        r.action_mask += [policy] * len(ids)
    return r


def demonstrations(r: run.Run, envs: Envs, args: Args, rng: np.random.Generator
                   ) -> tuple[list[TrainingSample], int, int]:
    """The env's scripted expert on --cold-start-episodes training questions (the paper starts RL
    from a Tool-Star SFT model): its correct demonstrations that fit the response budget (the
    policy could never finish a longer one), a sample each; (samples, won, played)."""
    if not hasattr(envs.env, "expert_demo"):
        run.say(f"[cold start] skipped: no scripted expert for the {args.env!r} environment")
        return [], 0, 0
    n = min(args.cold_start_episodes, len(envs.train_tasks))
    samples = []
    for i in rng.choice(len(envs.train_tasks), n, replace=False):
        task = envs.train_tasks[i]
        question, info = envs.env.reset(task)
        if (segments := envs.env.expert_demo(question)) is None:
            continue
        demo = demo_rollout(r.tokenizer, segments)
        _, outcome = score_response(envs.env, task, "".join(text for text, _ in segments))
        if outcome.get("won") and len(demo.response_ids) <= args.max_new_tokens:
            prompt = build_prompt(r.tokenizer, question, info)
            samples.append(TrainingSample((len(samples),), prompt, demo.response_ids,
                                          demo.action_mask, [0.0] * len(demo.response_ids)))
    return samples, len(samples), n


TOOLLESS_ENVS = ("toy",)  # the tests' fast game: one turn (turns=1), no tools


def build_envs(args: Args) -> Envs:
    """The environment and its tasks, before the model loads (a bad --env: one line, no load). ARPO
    runs a response's tool calls through `env.execute_tool` and scores it in one `env.step`, so the
    env itself plays every rollout: an env without that hook is refused (it would play the response
    as its first turn); toy by name."""
    options = {"turns": 1} if args.env == "toy" else {}  # one response per question: one toy turn
    if args.env == "tools":  # its retriever; held-out questions whose answers training never has
        options["topk"] = args.search_topk
        options["holdout"] = "answer"
    if args.env == "tools" and args.unsafe_python:
        options["unsafe_python"] = True
    env, options, train_tasks, eval_tasks = run.make_env(args, **options)  # --env-options win
    if args.env in TOOLLESS_ENVS and options.get("turns", 1) != 1:
        raise SystemExit(f"arpo.py: --env {args.env!r}: ARPO plays it in one turn; leave turns 1")
    if args.env not in TOOLLESS_ENVS:
        require(env, "execute_tool", script="arpo.py", name=args.env,
                why="ARPO runs the tool calls of one response through it; --env tools has it")
    main = dist.is_main()
    return Envs(env, options, train_tasks, eval_tasks, env, env if main else None,
                env if main and args.probe_tasks else None)


def planned_sequence(args: Args) -> tuple[int, str]:
    """--dry-run's longest training sequence: the question prompt (tools: 115-152 tokens) and the
    response."""
    return 256 + args.max_new_tokens, "256 prompt tokens + --max-new-tokens"


# ==================================================================================================
# SCAFFOLDING: randomness, tasks, evaluation, the cold start, environments, main(); the same text in
# loop.py, arpo.py and t2po.py
# ==================================================================================================
def step_rng(seed: int, step: int) -> np.random.Generator:
    """The randomness of step `step` (1-based; 0: before RL) from the seed and the step alone: a
    resume continues exactly. With --seed, the step's tasks and the update's order, the same on
    every rank."""
    return np.random.default_rng([seed, (step - 1) % 2**32])


def sample_seed(*key: int) -> int:
    """A sampling seed from a key of whole numbers (the run's seed, the step, the rollout, the
    turn): the same on every rank and for any number of ranks, so a rollout depends on neither."""
    return int(np.random.SeedSequence([k % 2**32 for k in key]).generate_state(1)[0] % 2**31)


def step_tasks(train_tasks: list, args: Args, step: int) -> list[tuple[int, object]]:
    """This rank's share of the step's --tasks-per-step training tasks, drawn without replacement
    from the seed and the step: (group, task) pairs, the group its index among the step's tasks."""
    picks = step_rng(args.seed, step).choice(len(train_tasks), args.tasks_per_step, replace=False)
    return dist.shard([(group, train_tasks[i]) for group, i in enumerate(picks)])


def held_out(r: run.Run, envs: Envs, args: Args, stage: str, step: int) -> dict:
    """The held-out evaluation after `step` updates: rank 0 plays, the others wait for it."""
    return run.on_main(partial(evaluate, r, envs.eval_pool, envs.eval_tasks, args, step, stage))


def probe(r: run.Run, envs: Envs, args: Args, step: int) -> dict:
    """--probe-tasks: the first training tasks, played as the held-out ones: a learning curve on
    fixed tasks ({} when off)."""
    if not args.probe_tasks:
        return {}
    tasks = envs.train_tasks[:args.probe_tasks]
    return run.on_main(partial(evaluate, r, envs.probe_pool, tasks, args, step,
                               f"probe_step_{step}", "probe/"))


def cold_start(r: run.Run, envs: Envs, args: Args) -> dict:
    """Supervised fine-tuning on the winning episodes of `demonstrations` (the mean negative
    log-likelihood of their policy tokens), so that RL starts from a policy whose groups sometimes
    disagree. {}: nothing to learn from."""
    t0 = time.time()
    rng = np.random.default_rng(args.seed)  # the plain seed: the same data on every rank
    samples, won, played = demonstrations(r, envs, args, rng)
    run.say(f"[cold start] {len(samples)} samples from {won}/{played} winning episodes")
    if not samples:
        return {}

    def log_likelihood(rows: list[int]) -> tuple[torch.Tensor, float]:
        batch = build_batch([samples[i] for i in rows], r.device)
        logp = action_logprobs(r.policy, batch, 1.0, args.share_prefixes)  # (B, T-1)
        return (logp * batch["action_mask"]).sum(), float(batch["action_mask"].sum())

    def permute(n: int) -> list[int]:  # each epoch's order
        return rng.permutation(n).tolist()

    with run.precision(args):
        loss = run.sft(r.policy, len(samples), log_likelihood, lr=args.cold_start_lr,
                       weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                       epochs=args.cold_start_epochs, micro_batch_size=args.micro_batch_size,
                       permute=permute)
    r.generator.update_weights(r.model)
    run.say(f"[cold start] SFT loss {loss:.3f} ({time.time() - t0:.0f}s)")
    return {"cold_start/episodes": won, "cold_start/samples": len(samples),
            "cold_start/loss": loss, "cold_start/time_s": time.time() - t0}


@dataclass
class Envs:
    """The environment and its tasks, built before the model loads."""

    env: object  # the environment itself: its scripted expert, --dry-run's prompts
    options: dict  # the options every copy of it gets
    train_tasks: list
    eval_tasks: list
    pool: object  # what plays this rank's training rollouts
    eval_pool: object  # rank 0: what plays the held-out tasks (None on other ranks)
    probe_pool: object  # rank 0, with --probe-tasks: what plays the first training tasks


def overruns(args: Args, step: int, t_begin: float, step_times: list[float], t_eval: float) -> bool:
    """--max-minutes: would the next step and the final evaluation overrun? Alike on every rank."""
    if args.max_minutes <= 0 or step >= args.steps:
        return False
    needed = time.time() - t_begin + sum(step_times) / len(step_times) + t_eval
    return bool(dist.all_reduce(int(needed > 60 * args.max_minutes), "max"))


@dist.entrypoint
def main(argv: list[str] | None = None) -> dict:
    t_begin = time.time()
    args = run.parse(Args, argv, PRESETS, check_args)
    if args.dry_run:  # the memory plan per rank; no weights load
        return run.dry_run(args, *planned_sequence(args))
    envs = build_envs(args)  # before the model: a bad --env costs no load
    r = run.setup(args)
    t_eval = 0.0  # one held-out evaluation's seconds, for --max-minutes
    if args.base_eval and not r.extra:  # a resumed run has done it
        t0 = time.time()
        r.extra["base"] = held_out(r, envs, args, "base", 0)
        t_eval = time.time() - t0
        curve = {} if args.cold_start else probe(r, envs, args, 0)  # else after the cold start
        r.logger.log({"step": 0, **r.extra["base"], **curve})
    if args.cold_start and "cold_start" not in r.extra:
        log = cold_start(r, envs, args)  # {}: nothing to learn from, the policy as loaded
        if log or "base" not in r.extra:  # evaluated unless the base evaluation already says it
            run.cold_started_reference(r, args)  # --kl-coef: the KL is to the policy RL starts from
            t0 = time.time()
            r.extra["cold_start"] = held_out(r, envs, args, "cold_start", 0)
            t_eval = time.time() - t0
            held = {k.replace("eval/", "eval_cold_start/"): v
                    for k, v in r.extra["cold_start"].items()}
            r.logger.log({"step": 0, **log, **probe(r, envs, args, 0), **held})
            run.save(r, args, 0)
    line, step_times, t_rl = {"step": r.start_step}, [], time.time()  # time_s: since RL (re)started
    step_lines = []  # this process's steps, for the mechanisms' summary
    for step in range(r.start_step + 1, args.steps + 1):
        t0 = time.time()
        # 1. rollout: the step's tasks, --group-size rollouts each (this rank's groups)
        rollouts = training_rollouts(r, envs, args, step)
        r.generator.sleep()  # vLLM on GPU: free its memory for training; update_weights wakes it
        t_rollout = time.time() - t0
        # 2. advantages: one training sample per trained sequence
        samples = training_samples(rollouts, args)
        # 3. the update; the next rollouts sample from the new policy
        with run.precision(args):  # bf16 matmuls where --autocast asks for them
            trained = update(r.policy, r.optimizer, samples, args, step_rng(args.seed, step),
                             r.reference)
        r.generator.update_weights(r.model)
        step_times.append(time.time() - t0)
        line = {"step": step, **rollout_metrics(rollouts, samples, args), **trained,
                "time_s": time.time() - t_rl, "step_time_s": step_times[-1],
                "time_rollout_s": t_rollout, "time_update_s": step_times[-1] - t_rollout,
                **probe(r, envs, args, step)}
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            line.update(held_out(r, envs, args, f"step_{step}", step))
        r.logger.log(line)
        step_lines.append(line)
        stop = overruns(args, step, t_begin, step_times, t_eval)
        if step % args.save_every == 0 or step == args.steps or stop:
            run.save(r, args, step)
        if stop:
            run.say(f"stopping after step {step}: the next would overrun --max-minutes "
                    f"{args.max_minutes}")
            line["stopped_early_at_step"] = step
            break
    r.extra["rl"] = held_out(r, envs, args, "rl", line["step"])
    r.logger.log({"step": line["step"], **r.extra["rl"]})
    r.logger.close()
    run.report(args, r.extra, len(envs.eval_tasks), REPORTED, t_begin)
    run.say(mechanism_summary(step_lines, args))
    dist.cleanup()
    return {**line, **r.extra}


if __name__ == "__main__":
    main()
