"""T²PO, Token- and Turn-level Policy Optimization (ICML 2026, arXiv 2605.02178): GiGPO (verl-agent)
plus TTI, which forces `</think>\\n<action>` once the thinking's uncertainty M_t has flattened out,
and TDS (training only), which resamples a turn whose uncertainty Φ_k barely differs from the
previous turn's; RFT first. `--no-tti --no-tds`: GiGPO; and `--step-advantage-weight 0`: GRPO.
Read beside docs/t2po.md: the equations next to their lines, the commands, the runs.
"""

from __future__ import annotations

import difflib
import math
import re
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from common import cli, dist, run
from common.cli import opt
from common.generation import first_prefix_containing
from common.logprobs import token_logprobs
from common.models import unwrap
from common.run import RunArgs
from envs.base import EnvPool, require

Preset = Literal["auto", "none", "textworld", "webshop-lite", "webshop", "alfworld", "search"]


@dataclass
class Args(RunArgs):
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
    epochs: int = opt("run", 0, "> 0: --steps from this many epochs of the tasks (search: 1)", ge=0)
    autocast: Literal["off", "bf16", "auto"] = opt(
        "model", "off", "bf16 matmuls in training (weights, gradients, AdamW stay fp32: verl's "
        "mixed precision), HF rollouts from a bf16 copy (ours); auto: GPU or CPU with native bf16")
    history_length: int = opt("environment", 2, "P: past turns in the prompt (2; search 4)", ge=0)
    max_obs_chars: int = opt("environment", 200, "observation chars kept in prompts", ge=1)
    eval_temperature: float = opt("run", 0.0, "0 = greedy; paper's val sampling: 0.6", ge=0)
    eval_top_p: float = opt("run", 1.0, "paper's val sampling: 0.95", gt=0, le=1)
    eval_top_k: int = opt("run", 0, "paper's val sampling: 20", ge=0)
    base_eval: bool = opt("run", True, "held-out evaluation of --model before training")
    probe_tasks: int = opt("run", 0, "the first N training tasks, played like the held-out ones "
                           "after the cold start and each RL step: a learning curve (ours)", ge=0)
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
    minibatch_size: int = opt("optimisation", 32, "turns per optimizer step", ge=1)
    cold_start_source: Literal["auto", "expert", "sample"] = opt(
        "cold start", "auto", "RFT's successful trajectories: from the env's scripted expert where "
        "it has one (auto), else rejection sampling from the policy (sample)")
    expert_thoughts: Literal["short", "long"] = opt(
        "cold start", "short", "RFT's expert thoughts (ours): one short reason, or TextWorld's ~40 "
        "tokens for TTI to cut (long; needs --max-new-tokens 96)")


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
    "textworld": dict(steps=8, lr=5e-6, temperature=0.7, base_eval=False, autocast="auto",
        env_options='{"level": 4, "train_games": 16, "eval_games": 32, "holdout": "walkthrough"}',
        tasks_per_step=4, group_size=4, eval_tasks=32, max_turns=4, cold_start_episodes=4,
        cold_start_epochs=2, tds_max_try=1, inadmissible_invalid=True),
}
# the authors' RFT checkpoints, in the Hugging Face collection willhx/t2po (their scripts' MODEL)
RFT_CHECKPOINTS = {"webshop": "willhx/Qwen3-4B-rft-webshop-5",
                   "alfworld": "willhx/Qwen3-4B-rft-alfworld-e5"}


def check_args(args: Args) -> None:
    """Rules between flags (each flag's bounds are declared with it); the paper presets' warning."""
    if 0 < args.dual_clip <= 1:
        raise cli.bad_flag("t2po.py", "dual_clip", args.dual_clip, "must be > 1 (or 0 = off)")
    if not (args.base_eval or args.cold_start):
        raise SystemExit("t2po.py: --no-base-eval needs the cold start (else nothing precedes RL)")
    if args.expert_thoughts == "long" and args.env != "textworld":
        raise cli.bad_flag("t2po.py", "expert_thoughts", args.expert_thoughts, "long thoughts "
                           f"quote TextWorld's task sentences, which --env {args.env!r} lacks")
    paper = args.preset in ("webshop", "alfworld", "search")
    if paper and args.model != RFT_CHECKPOINTS.get(args.preset):
        checkpoint = RFT_CHECKPOINTS.get(args.preset, "huggingface.co/collections/willhx/t2po")
        run.say(f"WARNING: the {args.preset} preset starts from {args.model}, NOT from the paper's "
                f"RFT checkpoint ({checkpoint}); its numbers are not comparable to the paper's")


# Records. A turn is also a training sample: prompt -> response, trained on its action_mask.
@dataclass
class Turn:
    prompt_ids: list[int]  # the turn's prompt (task, last P turns, observation), chat template on
    response_ids: list[int]  # the sampled tokens, and TTI's forced `</think>\n<action>` if it fired
    action_mask: list[int]  # per response token: 1 = the policy sampled it, 0 = forced by TTI
    anchor: str = ""  # the raw observation the turn acted on: GiGPO's anchor state
    reward: float = 0.0  # r_t: success_reward × outcome on the episode's last turn, else 0
    penalty: float = 0.0  # p_t: --format-penalty if the turn was ill-formed, else 0
    valid: bool = True  # well formed (and admissible, with --inadmissible-invalid)
    action: str = ""  # what the environment was sent
    observation: str = ""  # what it answered
    advantage: float = 0.0  # A = A_E + ω·A_S (turn_samples)
    old_logp: torch.Tensor | None = None  # (len(prompt) + len(response) − 1,): π_old, in update
    ref_logp: torch.Tensor | None = None  # the same under the reference (--kl-coef), in update


@dataclass
class Episode:
    task: object
    group: int  # index of its task in the step's list (on every rank): GiGPO's group
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
    return TURN_TEMPLATE.format(task=task, history=lines, step=len(history) + 1,
                                observation=observation[:max_obs_chars], actions=actions)


def encode_prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


# Uncertainty signal (paper Sec. 3.1)
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


# TTI: token-level thinking intervention
FORCED_TEXT = "</think>\n<action>"  # the paper forces `</think>`, `\n`, `<action>`


def tti_fire_index(m: list[float], *, min_think: int, max_think: int, window: int, epsilon: float,
                   start: int = 0) -> int | None:
    """First t ≥ start to cut after: t+1 = L_max, or t+1 ≥ L_min and mean_{t−N..t} |ΔM_s| < ε."""
    for t in range(start, len(m)):
        if t + 1 >= max_think:
            return t
        if t + 1 >= min_think and t >= window + 1:
            deltas = [abs(m[s] - m[s - 1]) for s in range(t - window, t + 1)]
            if sum(deltas) / len(deltas) < epsilon:
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


# TDS: turn-level dynamical sampling (training rollouts only)
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


def tds_should_resample(prev: Response | None, cur: Response, args: Args) -> bool:
    """Γ_k = |Φ_k − Φ_{k−1}| < η → resample (k > 0); as the official code, skip a Γ of 0."""
    if prev is None:
        return False
    phi_prev, phi = tds_phis(prev, cur, args.alpha)
    return 0 < abs(phi - phi_prev) < args.tds_eta


# GiGPO advantage (verl-agent gigpo/core_gigpo.py, "mean_norm" default)
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


# Rollout: every episode of a batch advances one turn at a time; a turn is generated as one batch.
def turn_seed(seed: int, step: int, train: bool, episode: int, turn: int, attempt: int = 0) -> int:
    """A turn's seed: train step `step`, or an eval after `step` updates (−1: RFT); TDS attempt."""
    key = [seed, step - 1 if train else step, int(train), episode, turn, attempt]  # train: 0-based
    return int(np.random.SeedSequence([k % 2**32 for k in key]).generate_state(1)[0] % 2**31)


def rollout(generator, tokenizer, pool: EnvPool, tasks: list, groups: list, args: Args, *,
            step: int, train: bool, temperature: float, top_p: float = 1.0, top_k: int = 0,
            keys: list[int] | None = None) -> tuple[list[Episode], dict]:
    """(episodes, counters); keys: global episode ids, so an episode's seeds ignore the rank."""
    n, keys, stats = len(tasks), keys or list(range(len(tasks))), defaultdict(float)
    if n == 0:  # a rank with no groups this step (fewer tasks than ranks)
        return [], stats
    obs, infos = map(list, zip(*pool.reset(tasks), strict=True))
    instruction = [i.get("instruction", "") for i in infos]
    history: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    episodes = [Episode(task=tasks[i], group=groups[i]) for i in range(n)]
    done = [bool(i.get("error")) for i in infos]
    prev_out: list[Response | None] = [None] * n  # the kept previous turn, for TDS's Γ_k
    for k in range(args.max_turns):
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        prompts = [encode_prompt(tokenizer, build_turn_prompt(
            instruction[i], history[i], obs[i], infos[i].get("admissible_actions") or [],
            args.history_length, args.max_obs_chars)) for i in active]
        seeds = [turn_seed(args.seed, step, train, keys[i], k) for i in active]
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, tti=args.tti)
        outs = generate_turn(generator, tokenizer, prompts, seeds, args, **sampling)
        resamples = [0] * len(active)
        if train and args.tds:  # TDS: same prompt, fresh seed, at most B_max times
            for attempt in range(1, args.tds_max_try + 1):
                redo = [j for j, i in enumerate(active)
                        if tds_should_resample(prev_out[i], outs[j], args)]
                if not redo:
                    break
                redo_seeds = [turn_seed(args.seed, step, True, keys[active[j]], k, attempt)
                              for j in redo]
                new = generate_turn(generator, tokenizer, [prompts[j] for j in redo], redo_seeds,
                                    args, **sampling)
                for j, o in zip(redo, new, strict=True):
                    outs[j], resamples[j] = o, resamples[j] + 1
        texts = [tokenizer.decode(o.ids, skip_special_tokens=True) for o in outs]
        admissible = [(infos[i].get("admissible_actions") or None) if args.inadmissible_invalid
                      else None for i in active]
        parsed = [parse_response(t, a) for t, a in zip(texts, admissible, strict=True)]
        acting = dict(zip(active, (action for action, _ in parsed), strict=True))
        results = pool.step([acting.get(i) for i in range(n)])  # None: the episode is over
        for j, i in enumerate(active):
            (next_obs, env_reward, env_done, info), (action, valid) = results[i], parsed[j]
            won = bool(info.get("won", False))
            outcome = won if args.reward == "success" else float(env_reward)
            episodes[i].turns.append(Turn(
                prompt_ids=prompts[j], response_ids=outs[j].ids, action_mask=outs[j].action_mask,
                anchor=obs[i], reward=args.success_reward * outcome if env_done else 0.0,
                penalty=0.0 if valid else args.format_penalty, valid=valid, action=action,
                observation=next_obs))
            for key, x in dict(turns=1, tokens=len(outs[j].ids), tti_wasted_tokens=outs[j].wasted,
                               think_tokens=outs[j].think_tokens, tds_resamples=resamples[j],
                               tti_interventions=outs[j].intervened, invalid=not valid,
                               inadmissible=not info.get("valid_action", True)).items():
                stats[key] += x
            history[i].append((obs[i], action))
            obs[i], infos[i], prev_out[i] = next_obs, info, outs[j]
            if env_done or info.get("error"):
                done[i] = True
                episodes[i].won, episodes[i].score = won, float(info.get("task_score", 0.0))
    return episodes, stats


def rollout_metrics(episodes: list[Episode], stats: dict, prefix: str = "",
                    gather: bool = False) -> dict:
    rows = [(ep.won, ep.score, sum(t.reward - t.penalty for t in ep.turns)) for ep in episodes]
    if gather:  # every rank's rows; their counters summed in rank order
        parts = dist.all_gather_object((rows, dict(stats)))
        rows, stats = [r for part, _ in parts for r in part], defaultdict(float)
        for key, value in ((k, v) for _, part in parts for k, v in part.items()):
            stats[key] += value
    won, score, reward = ((np.array(x, dtype=float) for x in zip(*rows, strict=True)) if rows
                          else ([0.0],) * 3)
    turns = max(1.0, stats["turns"])
    per_turn = {"tokens_per_turn": "tokens", "think_tokens_per_turn": "think_tokens",
                "tti_interventions": "tti_interventions", "format_error_rate": "invalid",
                "inadmissible_rate": "inadmissible"}
    out = {"rollouts": len(rows), "success_rate": float(np.mean(won)),
           "score": float(np.mean(score)), "reward_mean": float(np.mean(reward)),
           "turns_per_episode": stats["turns"] / max(1, len(rows)),
           **{name: stats[key] / turns for name, key in per_turn.items()},
           "tds_resamples": stats["tds_resamples"], "tti_wasted_tokens": stats["tti_wasted_tokens"]}
    return {prefix + k: v for k, v in out.items()}


def evaluate(generator, tokenizer, pool: EnvPool, tasks: list, args: Args, step: int,
             stage: str = "", prefix: str = "eval/") -> dict:
    """One held-out (or probe/) episode per task, TTI on, TDS off; stage: the transcripts' name."""
    t0 = time.time()
    episodes, stats = rollout(generator, tokenizer, pool, tasks, list(range(len(tasks))), args,
                              step=step, train=False, temperature=args.eval_temperature,
                              top_p=args.eval_top_p, top_k=args.eval_top_k)
    m = {**rollout_metrics(episodes, stats, prefix=prefix), prefix + "time_s": time.time() - t0}
    if stage:  # the episodes as text (prompt, response, action, observation, reward per turn)
        run.write_transcripts(args, stage, [dict(
            task=ep.task, won=ep.won, score=ep.score, reward=sum(t.reward for t in ep.turns),
            turns=[dict(prompt=tokenizer.decode(t.prompt_ids), response=tokenizer.decode(
                t.response_ids), action=t.action, observation=t.observation, reward=t.reward,
                valid=t.valid) for t in ep.turns]) for ep in episodes])
        who = "held-out" if prefix == "eval/" else prefix[:-1]
        run.say(f"[{stage}] {who} success {m[prefix + 'success_rate']:.3f}  score "
                f"{m[prefix + 'score']:.3f}  tokens/turn {m[prefix + 'tokens_per_turn']:.1f}  "
                f"invalid {m[prefix + 'format_error_rate']:.2f}")
    return m


# Cold start: rejection-sampling fine-tuning (RFT) on successful, well-formed trajectories.
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
    return [t for ep in episodes if ep.won and all(t.valid for t in ep.turns) for t in ep.turns]


def sampled_rft_turns(generator, tokenizer, options: dict, train_tasks: list,
                      args: Args) -> tuple[list[bool], list[Turn]]:
    """Rejection sampling: ranks split the episodes, each keeps all wins; (each won, kept turns)."""
    wins, turns, per_rank = [], [], args.group_size  # episodes per rank per round
    pool = EnvPool(args.env, per_rank, **options)
    for r in range(math.ceil(args.cold_start_episodes / (per_rank * dist.world_size()))):
        first = r * dist.world_size() * per_rank
        ids = dist.shard(list(range(first, first + dist.world_size() * per_rank)))
        tasks = [train_tasks[i % len(train_tasks)] for i in ids]
        eps, _ = rollout(generator, tokenizer, pool, tasks, ids, args, step=-1, train=False,
                         temperature=args.temperature, keys=ids)
        kept = [Turn(t.prompt_ids, t.response_ids, t.action_mask) for t in rft_keep(eps)]
        for part_wins, part_turns in dist.all_gather_object(([e.won for e in eps], kept)):
            wins += part_wins
            turns += part_turns
    return wins, turns


def cold_start(r: run.Run, env, options: dict, train_tasks: list, args: Args, rng=None) -> dict:
    """RFT: SFT (mean NLL, forced tokens masked) on the expert's or the policy's rft_keep turns."""
    t0 = time.time()
    rng = rng or np.random.default_rng(args.seed)  # the plain seed: the same data on every rank
    has_expert = hasattr(env, "expert_action")  # build_envs checked it has expert_thought too
    source = args.cold_start_source.replace("auto", "expert" if has_expert else "sample")
    if source == "expert":
        n = min(args.cold_start_episodes, len(train_tasks))
        picks = rng.choice(len(train_tasks), n, replace=False)
        episodes = expert_episodes(env, [train_tasks[i] for i in picks], args)
        wins, eos = [ep.won for ep in episodes], [r.tokenizer.eos_token_id]
        responses = [(t, r.tokenizer(t.text, add_special_tokens=False)["input_ids"] + eos)
                     for t in rft_keep(episodes)]
        turns = [Turn(encode_prompt(r.tokenizer, t.prompt), x, [1] * len(x)) for t, x in responses]
    else:
        wins, turns = sampled_rft_turns(r.generator, r.tokenizer, options, train_tasks, args)
    run.say(f"[rft] {len(turns)} turns kept from {sum(wins)}/{len(wins)} successful episodes "
            f"({source})")
    if not turns:
        return {}
    log_likelihood = lambda rows: sft_log_likelihood(r.policy, [turns[i] for i in rows],
                                                     args.share_prefixes)
    with run.precision(args):
        loss = run.sft(r.policy, len(turns), log_likelihood, lr=args.cold_start_lr,
                       weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                       epochs=args.cold_start_epochs, micro_batch_size=args.micro_batch_size,
                       permute=lambda n: rng.permutation(n).tolist())
    r.generator.update_weights(r.model)
    run.say(f"[rft] SFT loss {loss:.3f}  ({time.time() - t0:.0f}s)")
    return {"cold_start/episodes": sum(wins), "cold_start/samples": len(turns),
            "cold_start/loss": loss, "cold_start/time_s": time.time() - t0}


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                  action_mask: torch.Tensor, clip_eps: float,
                  dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_tokens −min(r·A, clip(r, 1−ε, 1+ε)·A), r = π_θ/π_old (the caller divides by #tokens),
    and the clipped-token count; dual_clip c > 1 (Ye et al. 2020, verl): for A < 0 at most −c·A."""
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    token_loss = -torch.minimum(unclipped, clipped)
    if dual_clip > 0:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -dual_clip * adv), token_loss)
    n_clipped = ((clipped < unclipped).float() * action_mask).sum()
    return (token_loss * action_mask).sum(), n_clipped


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 KL(π_θ || π_ref): e^x − x − 1, x = log π_ref − log π_θ; clamped ±10 (verl)."""
    log_ratio = ref_logp - logp
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


def turn_key(turn: Turn) -> tuple:
    return tuple(turn.prompt_ids), tuple(turn.response_ids), tuple(turn.action_mask)


def build_batch(turns: list[Turn], device=None) -> dict[str, torch.Tensor]:
    """Distinct turns (a repeat runs once), prompt + response padded: input_ids, attention_mask
    (U, T); action_mask (U, T-1), 1 where target t+1 was sampled; rows (B,): each turn's row."""
    keys = [turn_key(t) for t in turns]
    distinct = list(dict.fromkeys(keys))
    unique = [turns[keys.index(k)] for k in distinct]
    seqs = [t.prompt_ids + t.response_ids for t in unique]
    masks = [[0] * len(t.prompt_ids) + t.action_mask for t in unique]
    pad = lambda rows, dtype: pad_sequence([torch.tensor(r, dtype=dtype, device=device)
                                            for r in rows], batch_first=True)  # (U, T), zeros after

    return {"input_ids": pad(seqs, torch.long),
            "attention_mask": pad([[1] * len(s) for s in seqs], torch.long),
            "action_mask": pad(masks, torch.float32)[:, 1:],  # logp[:, t] scores token t+1
            "rows": torch.tensor([distinct.index(k) for k in keys], device=device)}


def action_logprobs(model, batch: dict[str, torch.Tensor], temperature: float,
                    share_prefixes: bool = True) -> torch.Tensor:
    """(B, T-1) log-probs of the action tokens (0 elsewhere); shared prefixes run once if asked."""
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                          temperature=temperature, target_mask=batch["action_mask"],
                          share_prefixes=share_prefixes)  # (U, T-1)
    return logp[batch["rows"]]


def microbatches(turns: list[Turn], size: int, share_prefixes: bool = False
                 ) -> list[tuple[list[Turn], float]]:
    """(turns, weight) micro-batches of ≤ size distinct turns and their copies, as many per rank."""
    filler = turns[:1] or [Turn([0], [0], [1])]  # weight 0: keeps every rank's backward connected
    copies = defaultdict(list)
    for t in turns:
        copies[turn_key(t)].append(t)
    length = lambda k: len(k[0]) + len(k[1])
    distinct = sorted(copies) if share_prefixes else sorted(copies, key=length)  # prefix order
    return dist.same_count([[t for k in distinct[b:b + size] for t in copies[k]]
                            for b in range(0, len(distinct), size)], filler)


def sft_log_likelihood(policy, turns: list[Turn], share_prefixes: bool
                       ) -> tuple[torch.Tensor, float]:
    """RFT's SFT term: Σ log π over the turns' policy tokens (forced ones masked); their count."""
    batch = build_batch(turns, next(policy.parameters()).device)
    action_mask = batch["action_mask"][batch["rows"]]  # (B, T-1)
    logp = action_logprobs(policy, batch, 1.0, share_prefixes)  # (B, T-1)
    return (logp * action_mask).sum(), float(action_mask.sum())


@torch.no_grad()
def policy_logprobs(model, turns: list[Turn], args: Args, key: str,
                    adapter_off: bool = False) -> None:
    """turn.<key> = its (len(ids) − 1,) log-probs under `model`; adapter_off: LoRA's base model."""
    for batch, _ in microbatches(turns, args.micro_batch_size, args.share_prefixes):
        with unwrap(model).disable_adapter() if adapter_off else nullcontext():
            logp = action_logprobs(model, build_batch(batch, next(model.parameters()).device),
                                   args.temperature, args.share_prefixes)
        for t, row in zip(batch, logp, strict=True):
            setattr(t, key, row[:len(t.prompt_ids) + len(t.response_ids) - 1])


def turn_samples(episodes: list[Episode], advantages: list[list[float]]) -> list[Turn]:
    """One training sample per turn with a policy token: a copy with its advantage."""
    return [replace(turn, advantage=a)
            for ep, adv in zip(episodes, advantages, strict=True)
            for turn, a in zip(ep.turns, adv, strict=True) if sum(turn.action_mask) > 0]


def stacked(turns: list[Turn], key: str) -> torch.Tensor:
    return pad_sequence([getattr(t, key) for t in turns], batch_first=True)  # (B, T-1) as logp


def update(policy, optimizer, samples: list[Turn], args: Args, rng: np.random.Generator,
           reference=None) -> dict:
    """One epoch of PPO-clip, an optimizer step per minibatch, token-mean; the minibatch count and
    the token divisor are global (`samples` are this rank's), so 1 or 8 ranks take the same step."""
    n_minibatches = max(1, math.ceil(dist.all_reduce(len(samples)) / args.minibatch_size))
    parts = np.array_split(rng.permutation(len(samples)), n_minibatches)  # as many on every rank
    # π_old: the first minibatch's is its own forward, detached (no dropout); the later ones' now.
    if n_minibatches > 1:
        policy_logprobs(policy, [samples[i] for part in parts[1:] for i in part], args, "old_logp")
    if args.kl_coef > 0:
        policy_logprobs(reference if reference is not None else policy, samples, args, "ref_logp",
                        adapter_off=reference is None)
    policy.train()
    device = next(policy.parameters()).device
    totals = defaultdict(float)
    for index, part in enumerate(parts):
        minibatch = [samples[i] for i in part]
        n_tokens = float(sum(sum(s.action_mask) for s in minibatch))
        n_tokens = max(1.0, dist.all_reduce(n_tokens))  # the global count
        optimizer.zero_grad()
        for turns, weight in microbatches(minibatch, args.micro_batch_size, args.share_prefixes):
            batch = build_batch(turns, device)
            logp = action_logprobs(policy, batch, args.temperature, args.share_prefixes)
            # weight 0: a placeholder (no stored log-probs), zero loss and gradient
            action_mask = batch["action_mask"][batch["rows"]] * weight  # (B, T-1)
            old = stacked(turns, "old_logp") if index > 0 and weight else logp.detach()
            adv = torch.tensor([s.advantage for s in turns], device=logp.device)[:, None]  # (B, 1)
            loss, n_clipped = ppo_clip_loss(logp, old, adv, action_mask, args.clip_eps,
                                            args.dual_clip)
            if args.kl_coef > 0:  # token-mean of the per-token KL estimate
                ref = stacked(turns, "ref_logp") if weight else logp.detach()
                kl = (low_var_kl(logp, ref) * action_mask).sum()
                loss = loss + args.kl_coef * kl
                totals["kl"] += kl.item()
            (loss / n_tokens * dist.grad_scale()).backward()
            totals["loss"] += loss.item()
            totals["clipped"] += n_clipped.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        totals["grad_norm"] += float(grad_norm)
        optimizer.step()
        totals["tokens"] += n_tokens
    policy.eval()
    tokens = totals["tokens"]
    loss, clipped, kl = (dist.all_reduce(totals[k]) for k in ("loss", "clipped", "kl"))  # shares
    out = {"loss": loss / tokens, "clip_fraction": clipped / tokens,
           "grad_norm": totals["grad_norm"] / n_minibatches, "num_tokens": int(tokens)}
    return {**out, "kl": kl / tokens} if args.kl_coef > 0 else out


@dataclass
class Envs:
    env: object  # the environment itself: the scripted expert, --dry-run's prompts
    train_tasks: list
    eval_tasks: list
    options: dict  # the environment's options, for more pools (RFT's sampling)
    my_groups: list[int]  # this rank's task groups of a step (indices into the step's tasks)
    pool: EnvPool  # this rank's training episodes: len(my_groups) × group_size
    eval_pool: EnvPool | None  # rank 0: the held-out tasks
    probe_pool: EnvPool | None  # rank 0, with --probe-tasks: the first training tasks


def build_envs(args: Args) -> Envs:
    """The env, tasks and pools, before the model loads: each rank whole groups; rank 0 held-out."""
    env, options, train_tasks, eval_tasks = run.make_env(args)
    if hasattr(env, "expert_action") or (args.cold_start and args.cold_start_source == "expert"):
        require(env, "expert_action", "expert_thought", script="t2po.py", name=args.env,
                why="RFT replays the env's scripted expert, a reason for each action")
    if args.epochs > 0:
        args.steps = max(1, args.epochs * len(train_tasks) // args.tasks_per_step)
        run.say(f"--epochs {args.epochs}: {args.steps} steps of {args.tasks_per_step} / "
                f"{len(train_tasks)} tasks")
    my_groups = dist.shard(list(range(args.tasks_per_step)))
    main_pool = lambda n: EnvPool(args.env, n, **options) if n and dist.is_main() else None
    return Envs(env, train_tasks, eval_tasks, options, my_groups,
                pool=EnvPool(args.env, len(my_groups) * args.group_size, **options),
                eval_pool=main_pool(len(eval_tasks)), probe_pool=main_pool(args.probe_tasks))


def turn_prompts(env, tasks: list, args: Args) -> list[str]:
    """--dry-run: the expert's turn prompts on `tasks`, else first turns with a full history."""
    if hasattr(env, "expert_action"):
        return [t.prompt for ep in expert_episodes(env, tasks, args) for t in ep.turns]
    return [build_turn_prompt(info.get("instruction", ""), [(obs, "")] * args.history_length, obs,
                              info.get("admissible_actions") or [], args.history_length,
                              args.max_obs_chars)
            for obs, info in map(env.reset, tasks)]


def step_rng(seed: int, step: int) -> np.random.Generator:
    """Step `step`'s randomness, from the seed and the step alone: a resume continues exactly."""
    return np.random.default_rng([seed, step - 1])  # keyed on the 0-based index, as before


def train_step(r: run.Run, envs: Envs, args: Args, step: int) -> dict:
    """1. rollout: G episodes per task, T²PO's TTI and TDS inside, whole groups per rank; 2. GiGPO
    advantages, episode and step level; 3. PPO-clip update, one sample per turn. Its metrics."""
    t0 = time.time()
    picks = step_rng(args.seed, step).choice(len(envs.train_tasks), args.tasks_per_step,
                                             replace=False)  # the same on every rank
    ids = [g * args.group_size + j for g in envs.my_groups for j in range(args.group_size)]
    groups = [i // args.group_size for i in ids]  # ids: global, as the groups
    tasks = [envs.train_tasks[picks[g]] for g in groups]
    episodes, stats = rollout(r.generator, r.tokenizer, envs.pool, tasks, groups, args, step=step,
                              train=True, temperature=args.temperature, keys=ids)
    t_rollout = time.time() - t0
    r.generator.sleep()  # vLLM on GPU: free its memory for training; update_weights wakes it
    advantages = gigpo_advantages(episodes, args.gamma, args.step_advantage_weight,
                                  args.std_normalize, args.step_similarity)
    samples = turn_samples(episodes, advantages)
    with run.precision(args):  # bf16 matmuls where the hardware has them (--autocast)
        result = update(r.policy, r.optimizer, samples, args,
                        step_rng(dist.rank_seed(args.seed), step), r.reference)
    r.generator.update_weights(r.model)  # each rank's own generator samples from the new policy
    return {**rollout_metrics(episodes, stats, gather=True), **result,
            "step_time_s": time.time() - t0, "time_rollout_s": t_rollout,
            "time_update_s": time.time() - t0 - t_rollout}  # update: and the weight push


@dist.entrypoint
def main(argv: list[str] | None = None) -> dict:
    t_begin = time.time()
    args = run.parse(Args, argv, PRESETS, check_args, overridden_by={"epochs": "steps"})
    if args.dry_run:
        return run.dry_run(args, *run.planned_length(args, turn_prompts, args.max_new_tokens))
    envs = build_envs(args)
    r = run.setup(args, desc="t2po" if (args.tti or args.tds) else "gigpo")
    held_out = lambda stage, step: run.on_main(lambda: evaluate(
        r.generator, r.tokenizer, envs.eval_pool, envs.eval_tasks, args, step, stage))
    probe = lambda step: run.on_main(lambda: evaluate(  # fixed training tasks: a learning curve
        r.generator, r.tokenizer, envs.probe_pool, envs.train_tasks[:args.probe_tasks], args, step,
        f"probe_step_{step}", prefix="probe/")) if args.probe_tasks else {}
    # skipped before the cold start (--no-base-eval): not done later, on a resumed trained policy
    if "base" not in r.extra and "cold_start" not in r.extra and args.base_eval:
        r.extra["base"] = held_out("base", 0)
        r.logger.log({"step": 0, **r.extra["base"], **({} if args.cold_start else probe(0))})
    if args.cold_start and "cold_start" not in r.extra:  # RFT
        log = cold_start(r, envs.env, envs.options, envs.train_tasks, args)
        run.cold_started_reference(r, args)  # --kl-coef: the KL is to the policy RL starts from
        r.extra["cold_start"] = held_out("cold_start", 0)
        held = {k.replace("eval/", "eval_cold_start/"): v for k, v in r.extra["cold_start"].items()}
        r.logger.log({"step": 0, **log, **probe(0), **held})
        run.save(r, args, 0)
    t_rl = time.time()  # time_s: seconds since RL started (a resumed run: since it resumed)
    for step in range(r.start_step + 1, args.steps + 1):
        line = {"step": step, **train_step(r, envs, args, step), "time_s": time.time() - t_rl,
                **probe(step)}
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            line.update(held_out(f"step_{step}", step))
        r.logger.log(line)
        if step % args.save_every == 0 or step == args.steps:
            run.save(r, args, step)
    r.extra["rl"] = held_out("rl", args.steps)
    r.logger.log({"step": args.steps, **r.extra["rl"]})
    r.logger.close()
    run.report(args, r.extra, len(envs.eval_tasks), also="eval/score", t_begin=t_begin)
    dist.cleanup()
    return r.extra


if __name__ == "__main__":
    main()
