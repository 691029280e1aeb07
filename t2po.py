"""T²PO, Token- and Turn-level Policy Optimization (ICML 2026, arXiv 2605.02178): GiGPO (verl-agent)
plus TTI, which forces `</think>\\n<action>` once the thinking's uncertainty M_t has flattened out,
and TDS (training only), which resamples a turn whose uncertainty Φ_k barely differs from the
previous turn's; RFT first. `--no-tti --no-tds`: GiGPO; and `--step-advantage-weight 0`: GRPO.

Read top to bottom: the arguments; the ALGORITHM (a turn's prompt and format, the uncertainty
signal, TTI, TDS, the rollout, GiGPO's advantage, the clipped objective); then the SCAFFOLDING that
loop.py and arpo.py share word for word (the training record, the update, evaluation, the cold
start, main). docs/t2po.md puts the paper's equations beside these lines.
"""

from __future__ import annotations

import difflib
import math
import re
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from common import cli, dist, run
from common.cli import opt
from common.generation import chat_ids, first_prefix_containing
from common.logprobs import token_logprobs
from common.models import unwrap
from envs.base import EnvPool, require

# ==================================================================================================
# ARGUMENTS
# ==================================================================================================
Preset = Literal["auto", "none", "textworld", "webshop-lite", "webshop", "alfworld", "search"]


@dataclass
class Args(run.RunArgs):
    """T²PO (ICML 2026): GiGPO + uncertainty-guided thinking stop (TTI), turn resampling (TDS)."""

    preset: Preset = opt("run", "auto", "fills each flag not given (PRESETS): textworld, "
                         "webshop-lite (ours, CPU); the paper's webshop, alfworld, search, NOT "
                         "from the paper's RFT checkpoints: pass one as --model")
    # the shared flags (common/run.py) where T²PO's default differs
    steps: int = 3
    tasks_per_step: int = 1  # paper 16
    temperature: float = 0.7  # paper 1.0
    max_new_tokens: int = 40  # paper 300 / 500
    eval_tasks: int = 6
    weight_decay: float = 0.0
    cold_start_episodes: int = 6
    cold_start_lr: float = 5e-5
    epochs: int = opt("run", 0, "> 0: --steps from this many epochs of the tasks (search: 1); an "
                      "explicit --steps wins over a preset's epochs", ge=0, overridden_by="steps")
    history_length: int = opt("environment", 2, "P: past turns in the prompt (2; search 4)", ge=0)
    max_obs_chars: int = opt("environment", 200, "observation chars kept in prompts", ge=1)
    eval_temperature: float = opt("run", 0.0, "0 = greedy; paper's val sampling: 0.6", ge=0)
    eval_top_p: float = opt("run", 1.0, "paper's val sampling: 0.95", gt=0, le=1)
    eval_top_k: int = opt("run", 0, "paper's val sampling: 20", ge=0)
    # uncertainty signal M_t (paper Sec. 3.1); alpha and j are not published: ours
    alpha: float = opt("algorithm", 0.5, "M_t = α·H̃_t + (1−α)·(1 − C̃_t)", ge=0, le=1)
    top_j: int = opt("algorithm", 5, "j: top-j log-probs in the confidence C_t (ours)", ge=1)
    tti: bool = opt("algorithm", True, "token-level thinking intervention")
    tti_window: int = opt("algorithm", 8, "N: mean of |ΔM| over the last N+1 tokens (ours)", ge=0)
    tti_epsilon: float = opt("algorithm", 0.05, "ε: act once mean |ΔM| < ε (ours)", ge=0)
    tti_min_think: int = opt("algorithm", 16, "L_min: thinking tokens before TTI (ours)", ge=0)
    tti_max_think: int = opt("algorithm", 0, "L_max thinking cap; 0: max_new_tokens minus min(32, "
                             "max_new_tokens/2) for the action (authors: 450; search 500)", ge=0)
    tti_chunk: int = opt("algorithm", 40, "tokens between TTI scans (waste ≤ chunk)", ge=1)
    tds: bool = opt("algorithm", True, "turn-level dynamical sampling (training only)")
    tds_eta: float = opt("algorithm", 0.3, "η: resample the turn when |Φ_k − Φ_{k−1}| < η", ge=0)
    tds_max_try: int = opt("algorithm", 2, "B_max: resamples per turn", ge=0)
    success_reward: float = opt("environment", 10.0, "reward = this × success")
    reward: Literal["success", "env"] = opt("environment", "success", "success: 10 × won (paper); "
                                            "env: 10 × the env's final reward (WebShop score)")
    format_penalty: float = opt("algorithm", 0.1, "p_t: off an ill-formed turn's own scores", ge=0)
    inadmissible_invalid: bool = opt("environment", False, "inadmissible is invalid (ALFWorld)")
    gamma: float = opt("algorithm", 0.95, "γ for step-level discounted returns", ge=0, le=1)
    step_advantage_weight: float = opt("algorithm", 1.0, "ω in A = A_E + ω·A_S")
    std_normalize: bool = opt("algorithm", False, "verl-agent's mean_std_norm: (x − mean) / std "
                              "over each group's turns (off: the paper's trajectory mean)")
    step_similarity: float = opt("algorithm", 1.0, "anchor states group at difflib ratio ≥ this "
                                 "(1 = identical; verl-agent's enable_similarity)", gt=0, le=1)
    clip_eps: float = opt("algorithm", 0.2, "PPO clip ε", gt=0)
    dual_clip: float = opt("algorithm", 3.0, "dual-clip c: for A < 0 the loss is at most c·|A| "
                           "per token (verl's clip_ratio_c); 0 = off", ge=0)
    cold_start_source: Literal["auto", "expert", "sample"] = opt(
        "cold start", "auto", "RFT's successful trajectories: from the env's scripted expert where "
        "it has one (auto), else rejection sampling from the policy (sample)")
    expert_thoughts: Literal["short", "long", "overthink"] = opt(
        "cold start", "short", "RFT's expert thoughts (ours): one short reason; long: TextWorld's "
        "~40 tokens quoting the task's sentence for the step; overthink: the decision, the short "
        "reason, then ~25 tokens that add nothing (thinking past the decision, for TTI to cut). "
        "long and overthink need --max-new-tokens 96")


# The paper's (examples/*_trainer/train_*.sh: webshop validates on 2 x 128 tasks; 200 epochs of 16
# tasks = 200 steps), RFT off; textworld, webshop-lite: ours, for a CPU. A flag given wins.
PRESETS: dict[str, dict] = {
    "webshop": dict(
        group_size=8, tasks_per_step=16, max_turns=15, max_new_tokens=300, lr=1e-6,
        history_length=2, tti_max_think=450, eval_tasks=256, steps=200, cold_start=False,
        minibatch_size=128, max_obs_chars=100_000, micro_batch_size=8, lora_rank=0,
        temperature=1.0, gradient_checkpointing=True, weight_decay=0.01, autocast="auto",
        eval_temperature=0.6, eval_top_p=0.95, eval_top_k=20),
    "alfworld": dict(
        group_size=8, tasks_per_step=16, max_turns=50, max_new_tokens=500, lr=1e-6,
        history_length=2, tti_max_think=450, eval_tasks=128, steps=200, cold_start=False,
        std_normalize=True, kl_coef=0.01, minibatch_size=256, inadmissible_invalid=True,
        max_obs_chars=100_000, micro_batch_size=8, lora_rank=0, temperature=1.0,
        gradient_checkpointing=True, weight_decay=0.01, autocast="auto",
        eval_temperature=0.6, eval_top_p=0.95, eval_top_k=20),
    "search": dict(  # its script sets no num_think_tokens: the config default 500; no val sampling
        group_size=5, tasks_per_step=256, max_turns=4, max_new_tokens=500, lr=1e-6,
        history_length=4, tti_max_think=500, eval_tasks=512, epochs=1, cold_start=False,
        std_normalize=True, step_similarity=0.9, minibatch_size=256, max_obs_chars=100_000,
        micro_batch_size=8, lora_rank=0, temperature=1.0, gradient_checkpointing=True,
        weight_decay=0.01, autocast="auto"),
    "webshop-lite": dict(env_options='{"num_options": 0, "obs_format": "verl"}', reward="env",
                         tds_max_try=1, autocast="auto"),
    "textworld": dict(
        steps=12, lr=5e-6, temperature=0.7, base_eval=False, autocast="auto",
        env_options='{"level": 4, "train_games": 16, "eval_games": 32, "holdout": "walkthrough"}',
        tasks_per_step=4, group_size=4, eval_tasks=32, max_turns=4, cold_start_episodes=4,
        cold_start_epochs=2, tds_max_try=1, inadmissible_invalid=True,
        expert_thoughts="long", max_new_tokens=96, tti_chunk=96, tti_epsilon=0.12, tds_eta=0.013,
        eval_temperature=0.6, eval_top_p=0.95, eval_top_k=20),
}
# the authors' RFT checkpoints, in the Hugging Face collection willhx/t2po (their scripts' MODEL)
RFT_CHECKPOINTS = {"webshop": "willhx/Qwen3-4B-rft-webshop-5",
                   "alfworld": "willhx/Qwen3-4B-rft-alfworld-e5"}
REPORTED = "eval/score"  # the held-out figure the last line gives beside the successes


def check_args(args: Args) -> None:
    """Rules between flags (each flag's bounds are declared with it); the paper presets' warning."""
    if 0 < args.dual_clip <= 1:
        raise cli.bad_flag("t2po.py", "dual_clip", args.dual_clip, "must be > 1 (or 0 = off)")
    if args.expert_thoughts == "long" and args.env != "textworld":
        raise cli.bad_flag("t2po.py", "expert_thoughts", args.expert_thoughts, "long thoughts "
                           f"quote TextWorld's task sentences, which --env {args.env!r} lacks")
    paper = args.preset in ("webshop", "alfworld", "search")
    if paper and args.model != RFT_CHECKPOINTS.get(args.preset):
        checkpoint = RFT_CHECKPOINTS.get(args.preset, "huggingface.co/collections/willhx/t2po")
        run.say(f"WARNING: the {args.preset} preset starts from {args.model}, NOT from the paper's "
                f"RFT checkpoint ({checkpoint}); its numbers are not comparable to the paper's")


# ==================================================================================================
# ALGORITHM (T²PO, arXiv 2605.02178)
# ==================================================================================================
# ALGORITHM: a turn's prompt and format
@dataclass
class Turn:
    prompt_ids: list[int]  # the turn's prompt (task, last P turns, observation), chat template on
    response_ids: list[int]  # the sampled tokens, and TTI's forced `</think>\n<action>` if it fired
    action_mask: list[int]  # per response token: 1 = the policy sampled it, 0 = forced by TTI
    anchor: str = ""  # the raw observation the turn acted on: GiGPO's anchor state
    reward: float = 0.0  # r_t: success_reward × outcome on the episode's last turn, else 0
    penalty: float = 0.0  # p_t: --format-penalty if the turn was ill-formed, else 0
    valid: bool = True  # well formed (and admissible, with --inadmissible-invalid)
    admissible: bool = True  # the environment accepted the action (its info's valid_action)
    action: str = ""  # what the environment was sent
    observation: str = ""  # what it answered
    think_tokens: int = 0  # tokens before the thinking's end (natural or forced by TTI)
    intervened: bool = False  # TTI forced the action
    wasted_tokens: int = 0  # tokens generated past TTI's cut and dropped
    resamples: int = 0  # times TDS resampled the turn
    # what the mechanisms saw, logged (not trained on)
    gamma: float | None = None  # TDS's Γ_k for the turn's first sample (training, k > 0)
    first_repeat: bool | None = None  # that first sample repeated the previous turn's action
    first_valid: bool | None = None  # that first sample was well formed (training)
    flatness: float | None = None  # the least mean |ΔM| over the thinking's windows past L_min
    uncut_think_tokens: int | None = None  # a cut turn: the thinking's length with no cut, if known
    uncut_same_action: bool | None = None  # a cut turn: the uncut sample wrote the same action
    discarded: list = field(default_factory=list)  # texts TDS resampled away, in order


@dataclass
class Episode:
    task: object
    group: int  # index of its task in the step's list (on every rank): GiGPO's group
    key: int = 0  # the episode's number in the step, the same on every rank: its seeds
    won: bool = False
    score: float = 0.0  # the environment's task score (WebShop's reward), logged
    turns: list = field(default_factory=list)  # Turn; ExpertTurn in expert_episodes


@dataclass
class ExpertTurn:
    prompt: str  # the prompt the policy sees at this state, as text
    text: str  # the expert's `<think>…</think>\n<action>…</action>`
    valid: bool = True  # the expert's turns are well formed


@dataclass
class Response:  # one generated response (generate_turn), before it becomes a Turn
    ids: list[int] = field(default_factory=list)  # sampled and forced tokens
    action_mask: list[int] = field(default_factory=list)  # 1 = sampled, 0 = forced
    entropies: list[float] = field(default_factory=list)  # H_t of each sampled token
    confidences: list[float] = field(default_factory=list)  # C_t of each sampled token
    think_tokens: int = 0  # tokens before the thinking's end (natural or forced)
    intervened: bool = False  # TTI forced the action
    wasted: int = 0  # tokens generated past TTI's cut, dropped
    finished: bool = False  # the action is written (generate_turn's phase 1 needs no phase 2)
    uncut_ids: list[int] | None = None  # TTI cut: the same sample uncut, when its call wrote it all


TURN_TEMPLATE = ("Task: {task}\n{history}Step {step}. Observation: {observation}\n"
                 "Admissible actions: [{actions}].\nReason step by step inside <think> </think>, "
                 "then give one admissible action inside <action> </action>.")


def build_turn_prompt(task: str, history: list[tuple[str, str]], observation: str,
                      admissible: list[str], history_length: int, max_obs_chars: int) -> str:
    """history: every (observation, action) so far, the last P shown; verl-agent's, in 44 tokens."""
    shown = history[-history_length:] if history_length > 0 else []
    first = len(history) - len(shown) + 1
    lines = "".join(f"[Observation {first + i}: '{o[:max_obs_chars]}', Action {first + i}: '{a}']\n"
                    for i, (o, a) in enumerate(shown))
    lines = f"Your last {len(shown)} of {len(history)} steps:\n{lines}" if lines else ""
    actions = ", ".join(f"'{a}'" for a in admissible) if admissible else "any text command"
    text = TURN_TEMPLATE.format(task=task, history=lines, step=len(history) + 1,
                                observation=observation[:max_obs_chars], actions=actions)
    # a page or passage that spells a chat-template marker (`<|im_end|>`) stays text: no forged turn
    return text.replace("<|", "&lt;|")


def encode_prompt(tokenizer, text: str) -> list[int]:
    return chat_ids(tokenizer, [{"role": "user", "content": text}])  # the text stays text


# Format check and projection as the official env_package/*/projection.py: ill-formed still acts.
FORMAT_RE = re.compile(r"^\s*<think>(.*?)</think>\s*<action>(.*?)</action>\s*$",
                       re.DOTALL | re.IGNORECASE)
TAG_RES = {tag: re.compile(pattern, re.IGNORECASE) for tag, pattern in [
    ("<think>", r"<\s*think\s*>"), ("</think>", r"</\s*think\s*>"),
    ("<action>", r"<\s*action\s*>"), ("</action>", r"</\s*action\s*>")]}
CJK_RE = re.compile(r"[\u4e00-\u9fff]")  # the official check: Chinese text is ill-formed


def parse_response(text: str, admissible: list[str] | None = None) -> tuple[str, bool]:
    """(action, valid); linear in len(text): FORMAT_RE runs only if each tag occurs exactly once."""
    counts_ok = all(len(pattern.findall(text)) == 1 for pattern in TAG_RES.values())
    match = FORMAT_RE.match(text) if counts_ok and not CJK_RE.search(text) else None
    if match is not None:
        action = match.group(2).strip().lower()
        return action, admissible is None or action in {a.lower() for a in admissible}
    opening = TAG_RES["<action>"].search(text)
    closing = TAG_RES["</action>"].search(text, opening.end()) if opening else None
    if closing is not None:
        return text[opening.end():closing.start()].strip().lower(), False
    return text[-30:], False


# ALGORITHM: the uncertainty signal M_t (paper Sec. 3.1)
def token_confidence(top_logprobs: list[float], j: int) -> float:
    """C_t = −(1/j) Σ_{i≤j} log p_t^(i) over the top-j probabilities (DeepConf; high = peaked)."""
    top = sorted(top_logprobs, reverse=True)[:j]
    return -sum(top) / len(top)


def minmax(values: list[float], causal: bool) -> list[float]:
    """x̃_t = (x_t − x_min)/(x_max − x_min) over the span or (causal) tokens ≤ t; flat: 0 (ours)."""
    out, lo, hi = [], math.inf, -math.inf
    if not causal and values:
        lo, hi = min(values), max(values)
    for x in values:
        if causal:
            lo, hi = min(lo, x), max(hi, x)
        out.append((x - lo) / (hi - lo) if hi > lo else 0.0)
    return out


def uncertainty(entropies: list[float], confidences: list[float], alpha: float,
                causal: bool) -> list[float]:
    """M_t = α·H̃_t + (1−α)·(1 − C̃_t)  (paper Eq. for the self-calibrated uncertainty)."""
    h, c = minmax(entropies, causal), minmax(confidences, causal)
    return [alpha * ht + (1 - alpha) * (1 - ct) for ht, ct in zip(h, c, strict=True)]


# ALGORITHM: TTI, token-level thinking intervention
FORCED_TEXT = "</think>\n<action>"  # the paper forces `</think>`, `\n`, `<action>`


def flatness(m: list[float], t: int, window: int) -> float:
    """mean_{s=t−N..t} |M_s − M_{s−1}|: how much M still moves at token t (TTI compares it to ε)."""
    deltas = [abs(m[s] - m[s - 1]) for s in range(t - window, t + 1)]
    return sum(deltas) / len(deltas)


def tti_fire_index(m: list[float], *, min_think: int, max_think: int, window: int, epsilon: float,
                   start: int = 0) -> int | None:
    """First t ≥ start to cut after: t+1 = L_max, or t+1 ≥ L_min and mean_{t−N..t} |ΔM_s| < ε."""
    for t in range(start, len(m)):
        if t + 1 >= max_think:
            return t
        if t + 1 >= min_think and t >= window + 1 and flatness(m, t, window) < epsilon:
            return t
    return None


def generate_turn(generator, tokenizer, prompts: list[list[int]], seeds: list[int], args: Args, *,
                  temperature: float, top_p: float = 1.0, top_k: int = 0,
                  tti: bool) -> list[Response]:
    """One response per prompt; TTI: thinking in chunks, cut where the rule fires, FORCED_TEXT."""
    budget = args.max_new_tokens
    max_think = args.tti_max_think or budget - min(32, budget // 2)  # leave room for the action
    gen_kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs_k=args.top_j)
    forced = tokenizer(FORCED_TEXT, add_special_tokens=False)["input_ids"]
    outs = [Response() for _ in prompts]

    def extend(out: Response, sample, n: int) -> None:
        out.ids += sample.token_ids[:n]
        out.action_mask += [1] * n
        out.entropies += sample.entropies[:n]
        out.confidences += [token_confidence(lp, args.top_j) for lp in sample.top_logprobs[:n]]

    # Phase 1 (TTI only): a chunk runs on past a natural </think> to </action>: one call may do all
    thinking = list(range(len(prompts))) if tti else []
    while thinking:
        chunk = min(args.tti_chunk, budget - min(len(outs[i].ids) for i in thinking))
        samples = generator.generate([prompts[i] + outs[i].ids for i in thinking],
                                     max_new_tokens=chunk, stop=["</action>"],
                                     seeds=[seeds[i] for i in thinking], **gen_kwargs)
        still = []
        for i, [sample] in zip(thinking, samples, strict=True):
            out, done_before = outs[i], len(outs[i].ids)
            n_new = min(len(sample.token_ids), budget - done_before)
            all_ids = out.ids + sample.token_ids[:n_new]
            end = first_prefix_containing(tokenizer, all_ids, "</think>")  # thinking's own end
            think_len = (end - 1) if end is not None else len(all_ids)  # before the closing token
            conf = out.confidences + [token_confidence(lp, args.top_j)
                                      for lp in sample.top_logprobs[:n_new]]
            ent = out.entropies + sample.entropies[:n_new]
            m = uncertainty(ent[:think_len], conf[:think_len], args.alpha, causal=True)
            fire = tti_fire_index(m, min_think=args.tti_min_think, max_think=max_think,
                                  window=args.tti_window, epsilon=args.tti_epsilon,
                                  start=done_before)
            if fire is not None:  # cut after token `fire`, force the transition to the action
                if sample.finish_reason in ("eos", "stop") or len(all_ids) >= budget:
                    out.uncut_ids = all_ids  # this call wrote the whole uncut response: logged
                keep = fire + 1 - done_before
                extend(out, sample, keep)
                out.wasted += n_new - keep
                out.ids, out.action_mask = out.ids + forced, out.action_mask + [0] * len(forced)
                out.think_tokens, out.intervened = fire + 1, True
                continue
            extend(out, sample, n_new)
            # "stop": the chunk reached </action>, with or without a </think> before it: turn over
            ended = sample.finish_reason in ("eos", "stop") or len(out.ids) >= budget
            if end is not None:  # thought to its own end; the action may already be in this chunk
                out.think_tokens = think_len
                out.finished = ended or "</action>" in tokenizer.decode(out.ids)
            elif ended:
                out.think_tokens, out.finished = len(out.ids), True
            else:
                still.append(i)
        thinking = still

    # Phase 2, the action (or the whole response without TTI): one call, stop at </action>.
    acting = [i for i, o in enumerate(outs) if not o.finished and len(o.ids) < budget]
    if acting:
        samples = generator.generate([prompts[i] + outs[i].ids for i in acting],
                                     max_new_tokens=budget - min(len(outs[i].ids) for i in acting),
                                     stop=["</action>"], seeds=[seeds[i] for i in acting],
                                     **gen_kwargs)
        for i, [sample] in zip(acting, samples, strict=True):
            extend(outs[i], sample, min(len(sample.token_ids), budget - len(outs[i].ids)))
            if not tti:  # every response comes here: where its thinking ended
                end = first_prefix_containing(tokenizer, outs[i].ids, "</think>")
                outs[i].think_tokens = (end - 1) if end is not None else len(outs[i].ids)
    return outs


# ALGORITHM: TDS, turn-level dynamical sampling (training rollouts only)
def turn_signal(m: list[float]) -> float:
    """Φ_k = geometric mean of the turn's M_t, exact zeros left out (ours: docs/t2po.md), or 0."""
    logs = [math.log(x) for x in m if x > 0]
    return math.exp(sum(logs) / len(logs)) if logs else 0.0


def tds_phis(prev: Response, cur: Response, alpha: float) -> tuple[float, float]:
    """(Φ_{k−1}, Φ_k) on one min–max scale over both turns (ours): Γ_k compares levels."""
    m = uncertainty(prev.entropies + cur.entropies, prev.confidences + cur.confidences, alpha,
                    causal=False)
    split = len(prev.entropies)
    return turn_signal(m[:split]), turn_signal(m[split:])


def tds_gamma(prev: Response | None, cur: Response, alpha: float) -> float | None:
    """Γ_k = |Φ_k − Φ_{k−1}|: how far the turn's uncertainty moved; None on the first turn."""
    if prev is None:
        return None
    phi_prev, phi = tds_phis(prev, cur, alpha)
    return abs(phi - phi_prev)


def tds_should_resample(prev: Response | None, cur: Response, args: Args) -> bool:
    """Γ_k < η → resample (k > 0); as the official code, skip a Γ of 0."""
    gamma = tds_gamma(prev, cur, args.alpha)
    return gamma is not None and 0 < gamma < args.tds_eta


# ALGORITHM: the rollout, every episode a turn at a time, a turn generated as one batch: TTI inside
# generate_turn, TDS resampling a hesitant turn (training only)
def turn_seed(args: Args, step: int, train: bool, episode: int, turn: int, attempt: int) -> int:
    """A turn's seed: training step `step`, or an evaluation after `step` updates (−1: RFT). Every
    evaluation draws the same noise, so two differ only by the weights (--lr 0's are equal)."""
    if train:
        return sample_seed(args.seed, step - 1, 1, episode, turn, attempt)
    return sample_seed(args.seed, min(step, 0), 0, episode, turn, attempt)


def rollout(generator, tokenizer, pool: EnvPool, tasks: list, groups: list, args: Args, *,
            step: int, train: bool, temperature: float, top_p: float = 1.0, top_k: int = 0,
            keys: list[int] | None = None) -> list[Episode]:
    """One episode per task; keys: the episodes' numbers in the step (their seeds), any rank's."""
    n, keys = len(tasks), keys or list(range(len(tasks)))
    if n == 0:  # a rank with no groups this step (fewer tasks than ranks)
        return []
    obs, infos = map(list, zip(*pool.reset(tasks), strict=True))
    instruction = [i.get("instruction", "") for i in infos]
    history: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    episodes = [Episode(task=tasks[i], group=groups[i], key=keys[i]) for i in range(n)]
    done = [bool(i.get("error")) for i in infos]
    prev_out: list[Response | None] = [None] * n  # the kept previous turn, for TDS's Γ_k
    for k in range(args.max_turns):
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        prompts = [encode_prompt(tokenizer, build_turn_prompt(
            instruction[i], history[i], obs[i], infos[i].get("admissible_actions") or [],
            args.history_length, args.max_obs_chars)) for i in active]
        seeds = [turn_seed(args, step, train, keys[i], k, 0) for i in active]
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, tti=args.tti)
        outs = generate_turn(generator, tokenizer, prompts, seeds, args, **sampling)
        firsts = list(outs)  # each turn's first sample, for the logs
        resamples, discarded = [0] * len(active), [[] for _ in active]
        if train and args.tds:  # TDS: same prompt, fresh seed, at most B_max times
            for attempt in range(1, args.tds_max_try + 1):
                redo = [j for j, i in enumerate(active)
                        if tds_should_resample(prev_out[i], outs[j], args)]
                if not redo:
                    break
                redo_seeds = [turn_seed(args, step, True, keys[active[j]], k, attempt)
                              for j in redo]
                new = generate_turn(generator, tokenizer, [prompts[j] for j in redo], redo_seeds,
                                    args, **sampling)
                for j, o in zip(redo, new, strict=True):
                    discarded[j].append(tokenizer.decode(outs[j].ids, skip_special_tokens=True))
                    outs[j], resamples[j] = o, resamples[j] + 1
        texts = [tokenizer.decode(o.ids, skip_special_tokens=True) for o in outs]
        admissible = [(infos[i].get("admissible_actions") or None) if args.inadmissible_invalid
                      else None for i in active]
        logs = [first_sample_log(tokenizer, prev_out[i], firsts[j], history[i], admissible[j], args)
                if train else {} for j, i in enumerate(active)]
        parsed = [parse_response(t, a) for t, a in zip(texts, admissible, strict=True)]
        acting = dict(zip(active, (action for action, _ in parsed), strict=True))
        results = pool.step([acting.get(i) for i in range(n)])  # None: the episode is over
        for j, i in enumerate(active):
            (next_obs, env_reward, env_done, info), (action, valid) = results[i], parsed[j]
            won = bool(info.get("won", False))
            outcome = won if args.reward == "success" else float(env_reward)
            out = outs[j]
            uncut_think, uncut_same = uncut_outcome(tokenizer, out, action, admissible[j])
            episodes[i].turns.append(Turn(
                prompt_ids=prompts[j], response_ids=out.ids, action_mask=out.action_mask,
                anchor=obs[i], reward=args.success_reward * outcome if env_done else 0.0,
                penalty=0.0 if valid else args.format_penalty, valid=valid,
                admissible=bool(info.get("valid_action", True)), action=action,
                observation=next_obs, think_tokens=out.think_tokens, intervened=out.intervened,
                wasted_tokens=out.wasted, resamples=resamples[j], discarded=discarded[j],
                flatness=think_flatness(out, args), uncut_think_tokens=uncut_think,
                uncut_same_action=uncut_same, **logs[j]))
            history[i].append((obs[i], action))
            obs[i], infos[i], prev_out[i] = next_obs, info, out
            if env_done or info.get("error"):
                done[i] = True
                episodes[i].won, episodes[i].score = won, float(info.get("task_score", 0.0))
    return episodes


def training_rollouts(r: run.Run, envs: Envs, args: Args, step: int) -> list[Episode]:
    """The step's tasks, --group-size episodes each (this rank's groups), TTI and TDS acting."""
    mine = step_tasks(envs.train_tasks, args, step)
    tasks = [task for _, task in mine for _ in range(args.group_size)]
    groups = [group for group, _ in mine for _ in range(args.group_size)]
    keys = [group * args.group_size + j for group, _ in mine for j in range(args.group_size)]
    episodes = rollout(r.generator, r.tokenizer, envs.pool, tasks, groups, args, step=step,
                       train=True, temperature=args.temperature, keys=keys)
    if dist.is_main() and args.out:  # rank 0's episodes, TTI's cuts and TDS's resamples marked
        run.write_transcripts(args, f"train/step_{step}", transcripts(r.tokenizer, episodes))
    return episodes


# ALGORITHM: the advantage, GiGPO's (verl-agent gigpo/core_gigpo.py, "mean_norm" default)
def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_t = Σ_{j≥t} γ^{j−t} r_j."""
    out = [0.0] * (len(rewards) + 1)  # out[T] = 0: nothing after the last turn
    for t in reversed(range(len(rewards))):
        out[t] = rewards[t] + gamma * out[t + 1]
    return out[:-1]


def group_stats(values: list[float], keys: list, singleton_mean_zero: bool) -> dict:
    """key -> (mean, unbiased std); a lone value: (0, 1) at episode level (verl-agent), or itself"""
    groups: dict = defaultdict(list)
    for k, v in zip(keys, values, strict=True):
        groups[k].append(v)
    stats = {}
    for k, g in groups.items():
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1)) if len(g) > 1 else 1.0
        stats[k] = (0.0 if singleton_mean_zero and len(g) == 1 else mean), std
    return stats


def group_normalise(values: list[float], keys: list, std_normalize: bool, singleton_mean_zero: bool,
                    stats: dict | None = None) -> list[float]:
    stats = stats if stats is not None else group_stats(values, keys, singleton_mean_zero)
    return [(v - stats[k][0]) / (stats[k][1] + 1e-6) if std_normalize else v - stats[k][0]
            for k, v in zip(keys, values, strict=True)]


def anchor_keys(episodes: list[Episode], similarity: float) -> list[tuple]:
    """(group, anchor cluster) per turn: its raw observation, or the first similar one (difflib)."""
    representatives: dict = defaultdict(list)  # group -> first observation of each cluster
    keys = []
    for ep in episodes:
        for turn in ep.turns:
            if similarity >= 1:
                keys.append((ep.group, turn.anchor))
                continue
            reps = representatives[ep.group]
            ratios = (difflib.SequenceMatcher(None, turn.anchor, rep).ratio() for rep in reps)
            cluster = next((c for c, ratio in enumerate(ratios) if ratio >= similarity), None)
            if cluster is None:
                reps.append(turn.anchor)
                cluster = len(reps) - 1
            keys.append((ep.group, cluster))
    return keys


def gigpo_advantages(episodes: list[Episode], gamma: float, omega: float, std_normalize: bool,
                     similarity: float = 1.0) -> list[list[float]]:
    """A = A_E + ω·A_S; p_t (an invalid turn's penalty) comes off its own scores after discounting:
    A_E(i,t) = (R_i − p_t) − mean over i's group of (R_j − mean_t p_t), R_i = Σ_t r_t (the paper);
    A_S(i,t) = (G_t − p_t) − mean of the same over the anchor group, G_t = Σ_{j≥t} γ^{j−t} r_j.
    std_normalize: verl-agent's mean_std_norm, (x − mean) / (std + 1e-6) over the group's turns
    (episode level: a longer trajectory weighs more, unlike the paper's trajectory mean)."""
    returns = [sum(t.reward for t in ep.turns) for ep in episodes]
    step_values, episode_values, episode_keys = [], [], []
    for r, ep in zip(returns, episodes, strict=True):
        g_t = discounted_returns([t.reward for t in ep.turns], gamma)
        step_values += [g - t.penalty for g, t in zip(g_t, ep.turns, strict=True)]
        episode_values += [r - t.penalty for t in ep.turns]
        episode_keys += [ep.group] * len(ep.turns)
    if std_normalize:  # verl-agent: mean and std over the group's turns
        a_episode = group_normalise(episode_values, episode_keys, True, singleton_mean_zero=True)
    else:  # the paper: the mean over the group's trajectories
        trajectory_scores = [r - sum(t.penalty for t in ep.turns) / max(1, len(ep.turns))
                             for r, ep in zip(returns, episodes, strict=True)]
        stats = group_stats(trajectory_scores, [ep.group for ep in episodes], True)
        a_episode = group_normalise(episode_values, episode_keys, False, True, stats)
    a_step = group_normalise(step_values, anchor_keys(episodes, similarity), std_normalize, False)
    flat = iter(a + omega * b for a, b in zip(a_episode, a_step, strict=True))
    return [[next(flat) for _ in ep.turns] for ep in episodes]


def training_samples(rollouts: list[Episode], args: Args) -> list[TrainingSample]:
    """GiGPO's A = A_E + ω·A_S on every turn; a turn with a sampled token is one training sample
    (its prompt: task, last P turns, observation), every token of it carrying the turn's A."""
    advantages = gigpo_advantages(rollouts, args.gamma, args.step_advantage_weight,
                                  args.std_normalize, args.step_similarity)
    samples = []
    for ep, turn_advantages in zip(rollouts, advantages, strict=True):
        for k, (turn, a) in enumerate(zip(ep.turns, turn_advantages, strict=True)):
            if sum(turn.action_mask) > 0:
                samples.append(TrainingSample((ep.key, k), turn.prompt_ids, turn.response_ids,
                                              turn.action_mask, [a] * len(turn.response_ids)))
    return samples


# ALGORITHM: the objective, PPO-clip with dual clip, token-mean (the authors' verl settings)
def policy_loss(logp: torch.Tensor, batch: dict[str, torch.Tensor], args: Args
                ) -> tuple[torch.Tensor, dict]:
    """Σ over the batch's sampled tokens of −min(r·A, clip(r, 1−ε, 1+ε)·A), r = π_θ/π_old, for
    A < 0 at most −c·A (dual clip, Ye et al. 2020); + β·k3 per token with --kl-coef. update divides
    it by the minibatch's token count (loss_divisor): the token-mean. Tensors (B, T-1)."""
    mask, adv = batch["action_mask"], batch["advantages"]
    ratio = torch.exp(torch.clamp(logp - batch["old_logp"], -20.0, 20.0))  # log r clamped: verl
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - args.clip_eps, 1 + args.clip_eps) * adv
    token_loss = -torch.minimum(unclipped, clipped)
    chose_clip = clipped < unclipped
    if args.dual_clip > 0:
        dual = -args.dual_clip * adv
        chose_clip = chose_clip | ((adv < 0) & (dual < token_loss))
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, dual), token_loss)
    loss = (token_loss * mask).sum()
    stats = {"clipped": float((chose_clip.float() * mask).sum())}
    if args.kl_coef > 0:
        kl = (low_var_kl(logp, batch["ref_logp"]) * mask).sum()
        loss = loss + args.kl_coef * kl
        stats["kl"] = kl.item()
    return loss, stats


def loss_divisor(minibatch: list[TrainingSample], args: Args) -> float:
    """The token-mean's divisor: the minibatch's sampled tokens, over all ranks."""
    return max(1.0, dist.all_reduce(float(sum(sum(s.action_mask) for s in minibatch))))


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
# SCAFFOLDING of T²PO's own: its metrics, evaluation, RFT's data, environments
# ==================================================================================================
def first_sample_log(tokenizer, prev: Response | None, first: Response, history: list,
                     admissible: list[str] | None, args: Args) -> dict:
    """What the logs keep of a training turn's first sample, before TDS: its Γ_k (k > 0), and
    whether it repeated the previous turn's action or was ill-formed (what TDS should catch)."""
    action, valid = parse_response(tokenizer.decode(first.ids, skip_special_tokens=True),
                                   admissible)
    gamma = tds_gamma(prev, first, args.alpha)
    return dict(gamma=gamma, first_valid=valid,
                first_repeat=None if gamma is None else action == history[-1][1])


def think_flatness(out: Response, args: Args) -> float | None:
    """The least window mean of |ΔM| past L_min in the turn's thinking (what TTI compares to ε:
    below it, TTI cuts), or None for thinking shorter than that."""
    n = out.think_tokens
    m = uncertainty(out.entropies[:n], out.confidences[:n], args.alpha, causal=True)
    first = max(args.tti_min_think - 1, args.tti_window + 1)
    return min((flatness(m, t, args.tti_window) for t in range(first, len(m))), default=None)


def uncut_outcome(tokenizer, out: Response, action: str,
                  admissible: list[str] | None) -> tuple[int | None, bool | None]:
    """A cut turn whose call wrote the uncut sample whole (the tail TTI dropped is that sample,
    same prompt and seed): (its thinking tokens, whether it acts as the cut turn); else Nones."""
    if not out.intervened or out.uncut_ids is None:
        return None, None
    end = first_prefix_containing(tokenizer, out.uncut_ids, "</think>")
    think = (end - 1) if end is not None else len(out.uncut_ids)
    text = tokenizer.decode(out.uncut_ids, skip_special_tokens=True)
    return think, parse_response(text, admissible)[0] == action


def episode_row(ep: Episode) -> dict:
    """An episode's figures for the metrics: a small record each rank sends to rank 0."""
    turns = ep.turns
    known = [t for t in turns if t.uncut_think_tokens is not None]  # cut, the uncut sample known
    return {"won": ep.won, "score": ep.score, "reward": sum(t.reward - t.penalty for t in turns),
            "turns": len(turns), "tokens": sum(len(t.response_ids) for t in turns),
            "think_tokens": sum(t.think_tokens for t in turns),
            "tti_interventions": sum(t.intervened for t in turns),
            "invalid": sum(not t.valid for t in turns),
            "inadmissible": sum(not t.admissible for t in turns),
            "tds_resamples": sum(t.resamples for t in turns),
            "tds_resampled_turns": sum(t.resamples > 0 for t in turns),
            "tti_wasted_tokens": sum(t.wasted_tokens for t in turns),
            "tti_uncut_known": len(known),
            "tti_uncut_think_tokens": sum(t.uncut_think_tokens for t in known),
            "tti_cut_think_tokens": sum(t.think_tokens for t in known),
            "tti_same_action": sum(bool(t.uncut_same_action) for t in known),
            "tds_picked_repeats": sum(bool(t.first_repeat) for t in turns if t.resamples),
            "tds_kept_repeats": sum(bool(t.first_repeat) for t in turns if not t.resamples),
            "tds_picked_invalid": sum(t.first_valid is False for t in turns if t.resamples),
            "tds_kept_invalid": sum(t.first_valid is False and t.gamma is not None
                                    for t in turns if not t.resamples),
            "gammas": [t.gamma for t in turns if t.gamma is not None],
            "flatness": [t.flatness for t in turns if t.flatness is not None]}


def episode_metrics(rows: list[dict], prefix: str = "") -> dict:
    """Means over episodes (success, score, reward) and over turns (tokens, TTI, format), sums."""
    won, score, reward = ((np.array([row[k] for row in rows], dtype=float) for k in
                           ("won", "score", "reward")) if rows else ([0.0],) * 3)
    reported = ("tds_resamples", "tti_wasted_tokens", "tds_resampled_turns", "tti_uncut_known",
                "tti_same_action", "tti_uncut_think_tokens", "tti_cut_think_tokens",
                "tds_picked_repeats", "tds_kept_repeats", "tds_picked_invalid", "tds_kept_invalid")
    counted = ("turns", "tokens", "think_tokens", "tti_interventions", "invalid", "inadmissible",
               *reported)  # reported: logged as the step's sums
    total = {k: sum(row[k] for row in rows) for k in counted}
    turns = max(1, total["turns"])
    per_turn = {"tokens_per_turn": "tokens", "think_tokens_per_turn": "think_tokens",
                "tti_interventions": "tti_interventions", "format_error_rate": "invalid",
                "inadmissible_rate": "inadmissible"}
    out = {"rollouts": len(rows), "success_rate": float(np.mean(won)),
           "score": float(np.mean(score)), "reward_mean": float(np.mean(reward)),
           "turns_per_episode": total["turns"] / max(1, len(rows)),
           **{name: total[key] / turns for name, key in per_turn.items()},
           **{key: total[key] for key in reported}, **signal_quantiles(rows)}
    return {prefix + k: v for k, v in out.items()}


def signal_quantiles(rows: list[dict]) -> dict:
    """Γ_k's quantiles over the turns it was measured on (training, k > 0; tds_eligible of them:
    the turns TDS may resample), and the thinking flatness's (ε's scale): η and ε's rule."""
    gammas = [g for row in rows for g in row["gammas"]]
    flat = [f for row in rows for f in row["flatness"]]
    out = {"tds_eligible": len(gammas)}
    if gammas:
        out.update(tds_gamma_p25=float(np.quantile(gammas, 0.25)),
                   tds_gamma_p50=float(np.quantile(gammas, 0.5)))
    if flat:
        out.update(tti_flatness_p25=float(np.quantile(flat, 0.25)),
                   tti_flatness_p50=float(np.quantile(flat, 0.5)))
    return out


def rollout_metrics(rollouts: list[Episode], samples: list[TrainingSample], args: Args) -> dict:
    """The step's episodes over all ranks; num_tokens: the tokens the policy sampled (trained)."""
    rows = [row for part in dist.all_gather_object([episode_row(ep) for ep in rollouts])
            for row in part]
    num_tokens = dist.all_reduce(sum(sum(s.action_mask) for s in samples))
    return {**episode_metrics(rows), "num_tokens": int(num_tokens)}


def mechanism_summary(lines: list[dict], args: Args) -> str:
    """The run's last line on T²PO's own mechanisms, over the RL steps this process ran: the
    training turns TTI cut, the thinking tokens that saved against the same samples uncut (known
    where the cut's own call wrote the whole sample) and whether those acted alike; the turns TDS
    resampled of those it may resample (k > 0)."""
    steps = [line for line in lines if "rollouts" in line]
    if not steps:
        return "T²PO: no RL step ran"

    def total(key: str) -> int:
        return sum(int(line.get(key, 0)) for line in steps)

    turns = sum(round(line["rollouts"] * line["turns_per_episode"]) for line in steps)
    cut = sum(round(line["tti_interventions"] * line["rollouts"] * line["turns_per_episode"])
              for line in steps)
    uncut, known = total("tti_uncut_think_tokens"), total("tti_uncut_known")
    saved = uncut - total("tti_cut_think_tokens")
    eligible, picked = total("tds_eligible"), total("tds_resampled_turns")
    return (f"T²PO, {len(steps)} steps: TTI cut {cut} of {turns} training turns "
            f"({cut / max(turns, 1):.0%}); on the {known} cuts whose uncut sample is known it "
            f"saved {saved} of {uncut} thinking tokens ({saved / max(uncut, 1):.0%}), the same "
            f"action in {total('tti_same_action')}; TDS resampled {picked} of {eligible} turns "
            f"it may ({picked / max(eligible, 1):.0%}), whose first samples repeated the last "
            f"action in {total('tds_picked_repeats')}, against {total('tds_kept_repeats')} of "
            f"the {eligible - picked} it kept (TTI {'on' if args.tti else 'off'}, TDS "
            f"{'on' if args.tds else 'off'})")


def turn_mark(turn: Turn) -> str:
    """What the mechanisms did to a turn, in words, for its transcript ("" if nothing)."""
    marks = []
    if turn.intervened:
        uncut = ("" if turn.uncut_think_tokens is None else
                 f" (uncut: {turn.uncut_think_tokens}, "
                 f"{'the same' if turn.uncut_same_action else 'another'} action)")
        marks.append(f"TTI cut the thinking after {turn.think_tokens} tokens{uncut}")
    if turn.resamples:
        marks.append(f"TDS resampled it {turn.resamples}x (Γ {turn.gamma:.3f})")
    return "; ".join(marks)


def transcripts(tokenizer, episodes: list[Episode]) -> list[dict]:
    """Episodes as text for <out>/transcripts/: each turn's prompt, response, action, reply, and
    `mark` (TTI's cut, TDS's resampling; `discarded`: the samples TDS threw away)."""
    decode = tokenizer.decode
    return [dict(task=ep.task, won=ep.won, score=ep.score, reward=sum(t.reward for t in ep.turns),
                 turns=[dict(prompt=decode(t.prompt_ids), response=decode(t.response_ids),
                             action=t.action, observation=t.observation, reward=t.reward,
                             valid=t.valid, mark=turn_mark(t), discarded=t.discarded)
                        for t in ep.turns])
            for ep in episodes]


def evaluate(r: run.Run, pool: EnvPool, tasks: list, args: Args, step: int, stage: str,
             prefix: str = "eval/") -> dict:
    """One episode per task (held-out, or the probe/ tasks), TTI on, TDS off, after `step`
    updates; its transcripts in <out>/transcripts/<stage>.jsonl."""
    t0 = time.time()
    episodes = rollout(r.generator, r.tokenizer, pool, tasks, list(range(len(tasks))), args,
                       step=step, train=False, temperature=args.eval_temperature,
                       top_p=args.eval_top_p, top_k=args.eval_top_k)
    m = {**episode_metrics([episode_row(ep) for ep in episodes], prefix),
         prefix + "time_s": time.time() - t0}
    run.write_transcripts(args, stage, transcripts(r.tokenizer, episodes))
    who = "held-out" if prefix == "eval/" else prefix[:-1]
    run.say(f"[{stage}] {who} success {m[prefix + 'success_rate']:.3f}  score "
            f"{m[prefix + 'score']:.3f}  tokens/turn {m[prefix + 'tokens_per_turn']:.1f}  "
            f"invalid {m[prefix + 'format_error_rate']:.2f}")
    return m


def overthought(action: str, reason: str) -> str:
    """--expert-thoughts overthink: the decision first, then words that add nothing to it; what the
    paper calls overthinking, and TTI is meant to cut once M_t flattens after the decision."""
    return (f"I {action}. {reason} I have weighed it once more and I am sure: the next command is "
            f"{action}, and nothing else needs doing first.")


def expert_episodes(env, tasks: list, args: Args) -> list[Episode]:
    """Replay the env's scripted expert (expert_action, expert_thought) in the policy's prompts."""
    episodes = []
    for task in tasks:
        obs, info = env.reset(task)
        episode, history = Episode(task=task, group=0), []
        for _ in range(args.max_turns):
            action = env.expert_action()
            prompt = build_turn_prompt(info.get("instruction", ""), history, obs,
                                       info.get("admissible_actions") or [], args.history_length,
                                       args.max_obs_chars)
            thought = env.expert_thought(action, long=args.expert_thoughts == "long")
            if args.expert_thoughts == "overthink":
                thought = overthought(action, thought)
            text = f"<think>{thought}</think>\n<action>{action}</action>"
            next_obs, _, done, info = env.step(action)
            episode.turns.append(ExpertTurn(prompt=prompt, text=text))
            history.append((obs, action))
            obs, episode.won = next_obs, bool(info.get("won", False))
            if done:
                break
        episodes.append(episode)
    return episodes


def rft_keep(episodes: list[Episode]) -> list:
    """RFT's filter: the turns of the episodes that won with every turn well formed."""
    return [t for ep in episodes if ep.won and all(t.valid for t in ep.turns) for t in ep.turns]


def sampled_demonstrations(r: run.Run, envs: Envs, args: Args) -> tuple[list[Episode], list]:
    """Rejection sampling: --cold-start-episodes episodes of the policy, the ranks sharing them;
    (every rank's episodes, the turns rft_keep keeps), the same on every rank."""
    episodes, kept, per_rank = [], [], args.group_size  # episodes per rank per round
    pool = EnvPool(args.env, per_rank, **envs.options)
    for round_ in range(math.ceil(args.cold_start_episodes / (per_rank * dist.world_size()))):
        first = round_ * dist.world_size() * per_rank
        ids = dist.shard(list(range(first, first + dist.world_size() * per_rank)))
        tasks = [envs.train_tasks[i % len(envs.train_tasks)] for i in ids]
        eps = rollout(r.generator, r.tokenizer, pool, tasks, ids, args, step=-1, train=False,
                      temperature=args.temperature, keys=ids)
        turns = [(t.prompt_ids, t.response_ids, t.action_mask) for t in rft_keep(eps)]
        for part_wins, part_turns in dist.all_gather_object(([e.won for e in eps], turns)):
            episodes += part_wins
            kept += part_turns
    return episodes, kept


def demonstrations(r: run.Run, envs: Envs, args: Args, rng: np.random.Generator
                   ) -> tuple[list[TrainingSample], int, int]:
    """RFT, the paper's cold start: the turns of successful, well-formed trajectories of the env's
    scripted expert (or sampled from the policy: --cold-start-source sample), a sample each;
    (samples, episodes won, episodes played)."""
    has_expert = hasattr(envs.env, "expert_action")  # build_envs checked it has expert_thought too
    source = args.cold_start_source.replace("auto", "expert" if has_expert else "sample")
    if source == "sample":
        wins, turns = sampled_demonstrations(r, envs, args)
    else:
        n = min(args.cold_start_episodes, len(envs.train_tasks))
        picks = rng.choice(len(envs.train_tasks), n, replace=False)
        episodes = expert_episodes(envs.env, [envs.train_tasks[i] for i in picks], args)
        wins, eos, turns = [ep.won for ep in episodes], [r.tokenizer.eos_token_id], []
        for turn in rft_keep(episodes):
            ids = r.tokenizer(turn.text, add_special_tokens=False)["input_ids"] + eos
            turns.append((encode_prompt(r.tokenizer, turn.prompt), ids, [1] * len(ids)))
    samples = [TrainingSample((i,), prompt, response, mask, [0.0] * len(response))
               for i, (prompt, response, mask) in enumerate(turns)]
    return samples, sum(wins), len(wins)


def build_envs(args: Args) -> Envs:
    """The env, its tasks and pools, before the model loads: each rank plays whole groups, rank 0
    the held-out (and probe) tasks."""
    env, options, train_tasks, eval_tasks = run.make_env(args)
    if hasattr(env, "expert_action") or (args.cold_start and args.cold_start_source == "expert"):
        require(env, "expert_action", "expert_thought", script="t2po.py", name=args.env,
                why="RFT replays the env's scripted expert, a reason for each action")
    if args.epochs > 0:
        args.steps = max(1, args.epochs * len(train_tasks) // args.tasks_per_step)
        run.say(f"--epochs {args.epochs}: {args.steps} steps of {args.tasks_per_step} / "
                f"{len(train_tasks)} tasks")
    my_groups = len(dist.shard(range(args.tasks_per_step)))
    pool = EnvPool(args.env, my_groups * args.group_size, **options)
    main = dist.is_main()
    eval_pool = EnvPool(args.env, len(eval_tasks), **options) if main else None
    probe = main and args.probe_tasks > 0
    probe_pool = EnvPool(args.env, args.probe_tasks, **options) if probe else None
    return Envs(env, options, train_tasks, eval_tasks, pool, eval_pool, probe_pool)


def turn_prompts(env, tasks: list, args: Args) -> list[str]:
    """--dry-run: the expert's turn prompts on `tasks`, else first turns with a full history."""
    if hasattr(env, "expert_action"):
        return [t.prompt for ep in expert_episodes(env, tasks, args) for t in ep.turns]
    return [build_turn_prompt(info.get("instruction", ""), [(obs, "")] * args.history_length, obs,
                              info.get("admissible_actions") or [], args.history_length,
                              args.max_obs_chars)
            for obs, info in map(env.reset, tasks)]


def planned_sequence(args: Args) -> tuple[int, str]:
    """--dry-run's longest training sequence: a turn's prompt from the env's own, + the response."""
    return run.planned_length(args, turn_prompts, args.max_new_tokens)


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
