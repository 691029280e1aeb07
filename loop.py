"""LOOP: leave-one-out PPO for long-horizon interactive agents.

Chen et al., "Reinforcement Learning for Long-Horizon Interactive LLM Agents", arXiv 2502.01600;
official code github.com/apple/ml-loop (read for details; nothing copied). Equations: docs/loop.md.

Per iteration: B tasks x K rollouts, each ONE token sequence (system, task, the agent's turns, the
environment's replies) in which only the model's tokens are trained. A rollout's advantage is its
return minus the mean return of its task's other K-1 (no std division); |A| < 0.01 is dropped. A
per-token PPO-clipped objective (clip range [1/(1+eps), 1+eps]) is averaged within each trajectory,
every minibatch is divided by the constant minibatch size, and two epochs of reshuffled minibatches
reuse the batch. No critic, no reference model, no KL term: one copy of the LLM in memory.

Read top to bottom: the arguments; the ALGORITHM (the rollout as one sequence, the leave-one-out
advantage, the clipped objective); then the SCAFFOLDING that arpo.py and t2po.py share word for
word (the training record, the update, evaluation, the cold start, main). `python loop.py` is the
CPU default; `python loop.py --env appworld` the paper's settings (GPU, vLLM, torchrun; --dry-run
prints the memory plan per rank). Ours, not the paper's: the cold start (SFT on scripted-expert
episodes), so that a 135M model on a CPU starts from groups that sometimes disagree.
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from common import cli, dist, run
from common.cli import opt
from common.generation import chat_ids, eos_token_ids
from common.logprobs import token_logprobs
from common.models import unwrap
from envs.base import EnvPool

# ==================================================================================================
# ARGUMENTS
# ==================================================================================================
Preset = Literal["auto", "none", "textworld", "appworld"]


@dataclass
class Args(run.RunArgs):
    """LOOP (Chen et al. 2025): leave-one-out PPO for long-horizon LLM agents; docs/loop.md."""

    preset: Preset = opt("run", "auto", "fills each flag not given (PRESETS): textworld (ours, "
                         "CPU); appworld, the paper's (GPU)")
    # the shared flags (common/run.py) where LOOP's default differs
    max_turns: int = 2
    lora_rank: int = 16  # paper: 16
    lr: float = 2e-4  # constant; paper: 5e-5
    cold_start_epochs: int = 2
    cold_start_lr: float = 2e-4
    steps: int = 5
    save_every: int = 1
    minibatch_size: int = 4  # M, rollouts per gradient step; paper: 32
    ppo_epochs: int = 2  # paper: 2
    kl_threshold: float = 20.0  # ml-loop abandons an iteration past it
    clip_eps: float = opt("algorithm", 0.1, "PPO epsilon; clip range [1/(1+eps), 1+eps]", gt=0)
    adv_threshold: float = opt("algorithm", 0.01, "drop rollouts with |advantage| below this", ge=0)
    importance_weight: Literal["token", "turn", "trajectory"] = opt(
        "algorithm", "token", "ratio per token | turn | trajectory (paper ablation)")
    std_normalize: bool = opt("algorithm", False, "divide advantages by the group std (ablation)")
    eval_max_turns: int = opt("environment", 0, "agent turns at evaluation (0 = max-turns)", ge=0)
    max_env_tokens: int = opt("environment", 256, "env output cut to this many tokens", ge=1)
    max_seq_len: int = opt("rollout", 2048, "an episode's token cap (it ends, truncated)", ge=1)


# Per-env values of flags the command line leaves alone (one literal, never updated); appworld: the
# paper's and ml-loop's (docs/loop.md marks ours)
PRESETS: dict[str, dict] = {
    # TextWorld coin collector level 4, the CPU default: 32 held-out games whose 9 walkthroughs
    # never occur in training (t2po.py's split); 16 expert episodes, then 10 LOOP steps of 8 x 4
    "textworld": dict(
        env_options='{"level": 4, "train_games": 16, "eval_games": 32, "holdout": "walkthrough"}',
        max_turns=4, max_new_tokens=6, tasks_per_step=8, group_size=4, steps=10,
        cold_start_episodes=16, eval_tasks=32, base_eval=False),
    "appworld": dict(model="Qwen/Qwen2.5-32B-Instruct", lora_rank=16, lora_alpha=32, lr=5e-5,
                     max_turns=40, eval_max_turns=50, max_new_tokens=1500, max_env_tokens=3000,
                     max_seq_len=32768, group_size=6, tasks_per_step=40, minibatch_size=32,
                     micro_batch_size=1, steps=200, dtype="bfloat16", gradient_checkpointing=True,
                     eval_every=10, eval_tasks=57, cold_start=False, rollout_tp=8),
}
REPORTED = "eval/reward_mean"  # the held-out figure the last line gives beside the successes


def check_args(args: Args) -> None:
    """The rule between LOOP's flags (each flag's own bounds are declared with it)."""
    if args.max_seq_len <= args.max_new_tokens:
        raise cli.bad_flag("loop.py", "max_seq_len", args.max_seq_len, "must be > --max-new-tokens "
                           f"({args.max_new_tokens}): an episode holds its prompt and a turn")


SYSTEM_PROMPT = ("You are an agent in a text environment. Each turn, reply with exactly one action "
                 "and nothing else; when actions are listed, copy one of them.")


# ==================================================================================================
# ALGORITHM (LOOP, arXiv 2502.01600)
# ==================================================================================================
# ALGORITHM: the rollout, one growing token sequence per episode (only the model's tokens train)
@dataclass
class Rollout:
    task: object
    group: int  # index of its task in the step's list (the same on every rank): its LOO group
    sample: int = 0  # which of the group's K rollouts; (group, sample) names a rollout on any rank
    ids: list[int] = field(default_factory=list)  # the whole interaction
    action_mask: list[int] = field(default_factory=list)  # 1 where the model made the token
    prompt_length: int = 0  # tokens before the first turn: system prompt, task, observation
    actions: list[str] = field(default_factory=list)  # the text sent to the environment, per turn
    reward: float = 0.0
    won: bool = False
    turns: int = 0
    done: bool = False
    truncated: bool = False
    env_error: str | None = None  # what ended the episode when the env failed (EnvPool's info)

    def add(self, ids: list[int], generated: bool) -> None:
        self.ids += ids
        self.action_mask += [int(generated)] * len(ids)


def chat_pieces(tokenizer) -> tuple[str, str, str]:
    """Text the chat template puts after an assistant message and around a user message, found by
    rendering a conversation with marker contents (so any template that appends turns works)."""
    a_mark, u_mark = "\x00ASSISTANT\x00", "\x00USER\x00"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": a_mark}]
    one = tokenizer.apply_chat_template(msgs, tokenize=False)
    with_user = msgs + [{"role": "user", "content": u_mark}]
    two = tokenizer.apply_chat_template(with_user, tokenize=False, add_generation_prompt=True)
    if not two.startswith(one):
        raise SystemExit("loop.py: this model's chat template rewrites earlier turns; "
                         "LOOP needs one growing token sequence per episode.")
    assistant_end = one[one.index(a_mark) + len(a_mark):]
    user_prefix, user_suffix = two[len(one):].split(u_mark)
    return assistant_end, user_prefix, user_suffix


def with_actions(obs: str, info: dict) -> str:
    """Show the admissible actions where the env lists them (WebShop, ALFWorld, TextWorld)."""
    actions = info.get("admissible_actions")
    return f"{obs}\nAvailable actions: {', '.join(actions)}" if actions else obs


def turn_pieces(tokenizer, eos_ids: set[int]) -> dict[str, list[int]]:
    """Token ids of the chat template's glue between turns (see chat_pieces)."""
    assistant_end, user_prefix, user_suffix = chat_pieces(tokenizer)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    end_ids = encode(assistant_end)
    # The template ends a turn with an EOS id: where the model sampled an EOS, that token stands in
    # its place and is trained (sampled_end); an expert's turn is written with the template's own.
    trained_end = end_ids[:1] if end_ids[:1] and end_ids[0] in eos_ids else []
    return {"end": end_ids, "trained_end": trained_end, "prefix": encode(user_prefix),
            "suffix": encode(user_suffix)}


def sampled_end(sample, pieces: dict) -> list[int]:
    """The end-of-turn token the model sampled, as an action: whichever EOS id it drew (Qwen2.5 has
    two, <|im_end|> and <|endoftext|>; ml-loop trains the stop token that was sampled). Nothing when
    the turn was cut by the token limit, or when the template does not end a turn with an EOS id."""
    if sample.finish_reason != "eos" or not pieces["trained_end"]:
        return []
    stop_id = getattr(sample, "stop_token_id", None)
    return [stop_id if stop_id is not None else pieces["trained_end"][0]]


def first_prompt_ids(tokenizer, obs: str, info: dict) -> list[int]:
    """System prompt and the task's first observation (with the instruction if it lacks it)."""
    instruction = info.get("instruction", "")
    first = obs if not instruction or instruction in obs else f"{instruction}\n\n{obs}"
    msgs = [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": with_actions(first, info)}]
    return chat_ids(tokenizer, msgs)  # a task that spells a special token gets text, not it


def env_reply_ids(tokenizer, pieces: dict, obs: str, info: dict, max_env_tokens: int) -> list[int]:
    """The environment's reply as a user turn, cut to max_env_tokens (output truncation). Text only:
    a reply that spells a special token (code's output printing `<|im_end|>`) stays text, so it
    cannot end the turn or forge the agent's."""
    reply = tokenizer(with_actions(obs, info), add_special_tokens=False,
                      split_special_tokens=True)["input_ids"]
    reply = reply[:max_env_tokens]
    return pieces["prefix"] + reply + pieces["suffix"]


def model_eos_ids(tokenizer, model) -> set[int]:
    """Every id the model may end a turn with (its generation config's and its config's EOS)."""
    generation_eos = eos_token_ids(tokenizer, model.generation_config)
    return generation_eos | eos_token_ids(tokenizer, model.config)


def rollout(generator, tokenizer, pool: EnvPool, tasks: list[tuple[int, object]], group_size: int,
            args: Args, *, step: int, train: bool, temperature: float, max_turns: int,
            eos_ids: set[int]) -> list[Rollout]:
    """Play the (group, task) pairs x group_size episodes in lock-step, one growing token sequence
    each. A sequence never exceeds --max-seq-len: a turn starts only with room for --max-new-tokens
    and the template's end-of-turn glue; a reply leaving no such room ends the episode (truncated).
    Each turn's seed comes from the rollout's (group, sample), whatever rank plays it."""
    pieces = turn_pieces(tokenizer, eos_ids)
    turn_room = args.max_new_tokens + len(pieces["end"])  # most tokens one agent turn adds
    episodes = [Rollout(task=task, group=group, sample=k)
                for group, task in tasks for k in range(group_size)]
    if not episodes:  # a rank with no groups this step (fewer tasks than ranks)
        return []
    for ep, (obs, info) in zip(episodes, pool.reset([ep.task for ep in episodes]), strict=True):
        ep.add(first_prompt_ids(tokenizer, obs, info), generated=False)
        ep.prompt_length = len(ep.ids)
        ep.env_error = info.get("error")
        ep.done = ep.env_error is not None  # the environment failed at reset: nothing to play
        if len(ep.ids) + turn_room > args.max_seq_len:
            raise SystemExit(
                f"loop.py: --max-seq-len {args.max_seq_len} leaves no room for one turn: the first "
                f"prompt of task {ep.task!r} has {len(ep.ids)} tokens, a turn up to {turn_room} "
                f"(--max-new-tokens {args.max_new_tokens} and the end of turn)")
    for turn in range(max_turns):
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not live:
            break
        seeds = [sample_seed(args.seed, step, int(train), episodes[i].group, episodes[i].sample,
                             turn) for i in live]
        samples = generator.generate([episodes[i].ids for i in live], n=1,
                                     max_new_tokens=args.max_new_tokens, temperature=temperature,
                                     seeds=seeds)
        actions: list[str | None] = [None] * len(episodes)
        for i, [s] in zip(live, samples, strict=True):
            ep = episodes[i]
            ep.add(list(s.token_ids), generated=True)
            # Old log-probs are recomputed, so the model's own EOS is trained like any other token
            # (the agent learns when to stop); a turn cut by the token limit is closed as context.
            closed = sampled_end(s, pieces)
            ep.add(closed, generated=True)
            ep.add(pieces["end"][len(closed):], generated=False)
            ep.turns = turn + 1
            actions[i] = tokenizer.decode(s.token_ids, skip_special_tokens=True)  # env parses
            ep.actions.append(actions[i])
        for i, result in enumerate(pool.step(actions)):
            if result is None:
                continue
            obs, reward, done, info = result
            ep = episodes[i]
            ep.reward += float(reward)
            ep.won = bool(info.get("won", False))
            ep.env_error = info.get("error")  # EnvPool: the step raised or timed out (then done)
            ep.done = done or turn == max_turns - 1
            if not ep.done:  # the environment's reply is context, never trained
                reply = env_reply_ids(tokenizer, pieces, obs, info, args.max_env_tokens)
                if len(ep.ids) + len(reply) + turn_room > args.max_seq_len:
                    ep.done = ep.truncated = True  # the reply and a next turn would not fit
                else:
                    ep.add(reply, generated=False)
    return episodes


def training_rollouts(r: run.Run, envs: Envs, args: Args, step: int) -> list[Rollout]:
    """The step's B tasks (this rank's groups), K episodes each, at --temperature."""
    return rollout(r.generator, r.tokenizer, envs.pool, step_tasks(envs.train_tasks, args, step),
                   args.group_size, args, step=step, train=True, temperature=args.temperature,
                   max_turns=args.max_turns, eos_ids=model_eos_ids(r.tokenizer, r.model))


# ALGORITHM: the advantage, leave-one-out (Sec. 3), and the |A| filter
def leave_one_out_advantages(returns: list[float], std_normalize: bool = False) -> list[float]:
    """A_k = R_k - 1/(K-1) sum_{j != k} R_j over the K rollouts actually collected for one task."""
    k = len(returns)
    if k < 2:
        return [0.0] * k  # no baseline without a second rollout: no signal
    total = sum(returns)
    adv = [r - (total - r) / (k - 1) for r in returns]
    if std_normalize:  # GRPO-like ablation (paper: worse, 61.9 vs 71.3 TGC)
        mean = total / k
        std = math.sqrt(sum((r - mean) ** 2 for r in returns) / k)
        adv = [a / max(std, 1e-7) for a in adv]
    return adv


def keep_mask(advantages: list[float], threshold: float) -> list[bool]:
    """Rollouts with |A| < threshold carry no signal and are dropped (ml-loop abs_adv_threshold)."""
    return [abs(a) >= threshold for a in advantages]


def group_advantages(rollouts: list[Rollout], std_normalize: bool) -> list[float]:
    """Leave-one-out advantage of each rollout within its task's group (groups never span ranks).
    A rollout whose environment failed is left out of its group, as ml-loop leaves out rollouts it
    did not complete (its 0 says nothing about the policy): advantage 0, keep_rollouts drops it."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        if r.env_error is None:
            groups.setdefault(r.group, []).append(i)
    adv = [0.0] * len(rollouts)
    for idx in groups.values():
        group_adv = leave_one_out_advantages([rollouts[i].reward for i in idx], std_normalize)
        for i, a in zip(idx, group_adv, strict=True):
            adv[i] = a
    return adv


def keep_rollouts(rollouts: list[Rollout], advantages: list[float], threshold: float) -> list[bool]:
    """keep_mask, and never a rollout whose environment failed (even at --adv-threshold 0)."""
    keep = keep_mask(advantages, threshold)
    return [k and r.env_error is None for r, k in zip(rollouts, keep, strict=True)]


def training_samples(rollouts: list[Rollout], args: Args) -> list[TrainingSample]:
    """Each kept rollout is one training sample: its first prompt, then everything after it, the
    model's tokens trained, every one of them carrying the rollout's A_k."""
    advantages = group_advantages(rollouts, args.std_normalize)
    keep = keep_rollouts(rollouts, advantages, args.adv_threshold)
    samples = []
    for r, a, kept in zip(rollouts, advantages, keep, strict=True):
        if kept:
            mask = r.action_mask[r.prompt_length:]
            samples.append(TrainingSample((r.group, r.sample), r.ids[:r.prompt_length],
                                          r.ids[r.prompt_length:], mask, [a] * len(mask)))
    return samples


# ALGORITHM: the objective (Sec. 3), per-token PPO averaged within each trajectory, / M
def unit_log_ratios(log_ratio: torch.Tensor, action_mask: torch.Tensor, level: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group token log-ratios into the units that carry one importance weight each.

    log_ratio, action_mask: (N, T). Returns (log ratio per unit, action tokens per unit), both
    (N, U): token -> U = T (each action token its own weight); turn -> U = turns, a turn being a
    run of action tokens (the sum of its token log-ratios: its likelihood ratio's log); trajectory
    -> U = 1 (the whole rollout). A unit with 0 tokens is none."""
    mask = action_mask.to(log_ratio.dtype)
    if level == "token":
        return log_ratio * mask, mask
    if level == "turn":
        starts = mask * (1 - torch.nn.functional.pad(mask[:, :-1], (1, 0)))  # a turn's first token
        turn_ids = (starts.cumsum(1) - 1).clamp(min=0).long()  # (N, T); masked tokens add 0
        n_units = int(turn_ids.max().item()) + 1
        zeros = log_ratio.new_zeros(log_ratio.shape[0], n_units)  # (N, U)
        sums = zeros.scatter_add(1, turn_ids, log_ratio * mask)
        return sums, zeros.scatter_add(1, turn_ids, mask)
    if level == "trajectory":
        return (log_ratio * mask).sum(1, keepdim=True), mask.sum(1, keepdim=True)
    raise ValueError(f"--importance-weight must be token, turn or trajectory, not {level!r}")


def policy_loss(logp: torch.Tensor, batch: dict[str, torch.Tensor], args: Args
                ) -> tuple[torch.Tensor, dict]:
    """−Σ_i 1/|u(x_i)| Σ_u min(r_u A_i, clip(r_u, 1/(1+ε), 1+ε) A_i) over the batch's rollouts i,
    u their importance units (tokens; --importance-weight turn, trajectory), r_u = π_θ/π_old of
    the unit; update divides it by the constant M (loss_divisor). With --kl-coef (an ablation) each
    rollout also pays β times its mean k3 per action token. Tensors (B, T-1)."""
    mask = batch["action_mask"]
    log_ratio = logp - batch["old_logp"]  # (B, T-1)
    unit_lr, unit_tokens = unit_log_ratios(log_ratio, mask, args.importance_weight)  # (B, U)
    ratio = torch.exp(torch.clamp(unit_lr, -20.0, 20.0))  # log r clamped, as verl clamps a token's
    first = mask.argmax(1, keepdim=True)  # (B, 1) a rollout's first action token holds its A_i
    adv = batch["advantages"].gather(1, first)  # (B, 1): every unit of rollout i gets A_i
    lo, hi = 1.0 / (1.0 + args.clip_eps), 1.0 + args.clip_eps  # symmetric in log space
    unclipped, clipped = ratio * adv, torch.clamp(ratio, lo, hi) * adv
    objective = torch.minimum(unclipped, clipped)  # (B, U), PPO's pessimistic bound
    units = (unit_tokens > 0).to(ratio.dtype)
    per_rollout = (objective * units).sum(1) / units.sum(1).clamp(min=1)  # (B,) mean over units
    stats = {"clipped": float(((unclipped > clipped) * unit_tokens).sum())}  # in tokens
    if args.kl_coef > 0:  # the KL to π_ref per action token, averaged over the trajectory likewise
        kl = (low_var_kl(logp, batch["ref_logp"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
        per_rollout = per_rollout - args.kl_coef * kl
        stats["kl"] = kl.sum().item()
    return -per_rollout.sum(), stats


def loss_divisor(minibatch: list[TrainingSample], args: Args) -> float:
    """The constant M, not the rollouts kept (ml-loop): filtered minibatches are not re-weighted."""
    return float(args.minibatch_size)


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
# SCAFFOLDING of LOOP's own: its metrics, evaluation, the expert's episodes, environments
# ==================================================================================================
def rollout_metrics(rollouts: list[Rollout], samples: list[TrainingSample], args: Args) -> dict:
    """The step's rollouts, summed over ranks; one console line when environments failed."""
    n = dist.all_reduce(len(rollouts))

    def total(values) -> float:  # over every rank's rollouts
        return dist.all_reduce(float(sum(values)))

    sampled, turns = total(sum(r.action_mask) for r in rollouts), total(r.turns for r in rollouts)
    kept_groups = dist.all_gather_object(sorted({s.origin[0] for s in samples}))
    out = {"rollouts": n, "reward_mean": total(r.reward for r in rollouts) / n,
           "success_rate": total(r.won for r in rollouts) / n,
           "num_tokens": int(sampled), "tokens_per_turn": sampled / max(turns, 1.0),
           "sequence_tokens": int(total(len(r.ids) for r in rollouts)),
           "turns_per_episode": turns / n,
           "truncated_fraction": total(r.truncated for r in rollouts) / n,
           "env_errors": int(total(r.env_error is not None for r in rollouts)),
           "filtered_fraction": 1.0 - dist.all_reduce(len(samples)) / n,
           "groups_with_signal": sum(len(part) for part in kept_groups)}
    if out["env_errors"]:  # the same on every rank: each sends its first error to rank 0's line
        first = next((r.env_error for r in rollouts if r.env_error is not None), None)
        warn_env_errors("a training step", out["env_errors"], n, dist.all_gather_object(first))
    return out


def mechanism_summary(lines: list[dict], args: Args) -> str:
    """The run's last line on LOOP's own mechanisms, over the RL steps this process ran: the
    groups the |A| filter left a gradient, the per-token clip, the KL monitor."""
    steps = [line for line in lines if "rollouts" in line]
    if not steps:
        return "LOOP: no RL step ran"
    rollouts = sum(line["rollouts"] for line in steps)
    dropped = sum(round(line["filtered_fraction"] * line["rollouts"]) for line in steps)
    groups = sum(line["groups_with_signal"] for line in steps)
    trained = [line for line in steps if line["gradient_steps"] > 0]
    clip = np.mean([line["clip_fraction"] for line in trained]) if trained else 0.0
    k1 = max((line["kl_k1"] for line in trained), default=0.0)
    abandoned = sum(int(line["abandoned"]) for line in steps)
    return (f"LOOP, {len(steps)} steps: {groups} of {len(steps) * args.tasks_per_step} task "
            f"groups carried a gradient (the |A| filter dropped {dropped} of {rollouts} rollouts); "
            f"clip fraction {clip:.3f} (mean of the {len(trained)} steps that trained); KL k1 max "
            f"{k1:.3f}, {abandoned} updates abandoned (k1 > {args.kl_threshold:g})")


def warn_env_errors(where: str, n_errors: int, n: int, firsts: list) -> None:
    """One console line when episodes ended by an env error (their 0 is not the policy's)."""
    first = next((e for e in firsts if e), None)
    if n_errors and dist.is_main():
        tqdm.write(f"loop.py: {where}: {n_errors} of {n} episodes ended by an environment error "
                   f"(first: {first})", file=sys.stderr)


def evaluate(r: run.Run, pool: EnvPool, tasks: list, args: Args, step: int, stage: str,
             prefix: str = "eval/") -> dict:
    """Greedy decoding (paper, ml-loop: temperature 0), one episode per task (held-out, or the
    probe/ tasks) after `step` updates; its transcripts in <out>/transcripts/<stage>.jsonl."""
    eps = rollout(r.generator, r.tokenizer, pool, list(enumerate(tasks)), 1, args, step=step,
                  train=False, temperature=0.0, max_turns=args.eval_max_turns or args.max_turns,
                  eos_ids=model_eos_ids(r.tokenizer, r.model))
    run.write_transcripts(args, stage, [
        run.transcript(r.tokenizer, e.ids, e.action_mask, e.actions, task=e.task, won=e.won,
                       reward=e.reward) for e in eps])
    errors = [e.env_error for e in eps if e.env_error is not None]
    warn_env_errors(f"evaluation {stage}", len(errors), len(eps), errors[:1])
    return {prefix + "success_rate": sum(e.won for e in eps) / len(eps),
            prefix + "reward_mean": sum(e.reward for e in eps) / len(eps),
            prefix + "env_errors": len(errors), prefix + "rollouts": len(eps)}


def expert_rollouts(env, tokenizer, tasks: list, args: Args, eos_ids: set[int]) -> list[Rollout]:
    """The environment's scripted expert (`env.expert_action()`) playing `tasks`, written as the
    policy's own episodes are (same prompt, glue and truncation); only the expert's actions are
    masked in. Episodes not won within --max-turns, or before --max-seq-len cuts, are dropped."""
    pieces = turn_pieces(tokenizer, eos_ids)
    turn_room = args.max_new_tokens + len(pieces["end"])  # as in rollout
    demos = []
    for task in tasks:
        obs, info = env.reset(task)
        ep = Rollout(task=task, group=0)
        ep.add(first_prompt_ids(tokenizer, obs, info), generated=False)
        ep.prompt_length = len(ep.ids)
        for turn in range(args.max_turns):
            action = env.expert_action()
            ep.add(tokenizer(action, add_special_tokens=False)["input_ids"] + pieces["trained_end"],
                   generated=True)
            ep.add(pieces["end"][len(pieces["trained_end"]):], generated=False)
            ep.actions.append(action)
            obs, reward, done, info = env.step(action)
            ep.reward += float(reward)
            ep.won, ep.turns = bool(info.get("won", False)), turn + 1
            if done:
                break
            reply = env_reply_ids(tokenizer, pieces, obs, info, args.max_env_tokens)
            if len(ep.ids) + len(reply) + turn_room > args.max_seq_len:
                break  # a policy's episode would be truncated here: not won
            ep.add(reply, generated=False)
        if ep.won and len(ep.ids) <= args.max_seq_len:
            demos.append(ep)
    return demos


def demonstrations(r: run.Run, envs: Envs, args: Args, rng: np.random.Generator
                   ) -> tuple[list[TrainingSample], int, int]:
    """The cold start's data (ours): the scripted expert's winning episodes on
    --cold-start-episodes training tasks, each one sample as a rollout is; (samples, won,
    played)."""
    if args.cold_start_episodes == 0 or not hasattr(envs.env, "expert_action"):
        return [], 0, 0
    n = min(args.cold_start_episodes, len(envs.train_tasks))
    picks = rng.choice(len(envs.train_tasks), n, replace=False)
    demos = expert_rollouts(envs.env, r.tokenizer, [envs.train_tasks[i] for i in picks], args,
                            model_eos_ids(r.tokenizer, r.model))
    samples = []
    for i, d in enumerate(demos):
        response = d.ids[d.prompt_length:]
        samples.append(TrainingSample((i,), d.ids[:d.prompt_length], response,
                                      d.action_mask[d.prompt_length:], [0.0] * len(response)))
    return samples, len(demos), n


def build_envs(args: Args) -> Envs:
    """The environment, its tasks and pools, before the model loads (a bad --env: one line)."""
    env, options, train_tasks, eval_tasks = run.make_env(args)
    if hasattr(env, "game_file"):  # TextWorld compiles a game on first use: not in a step
        for task in train_tasks + eval_tasks:
            env.game_file(task)
    my_groups = len(dist.shard(range(args.tasks_per_step)))
    pool = EnvPool(args.env, my_groups * args.group_size, **options)
    main = dist.is_main()
    eval_pool = EnvPool(args.env, len(eval_tasks), **options) if main else None
    probe = main and args.probe_tasks > 0
    probe_pool = EnvPool(args.env, args.probe_tasks, **options) if probe else None
    return Envs(env, options, train_tasks, eval_tasks, pool, eval_pool, probe_pool)


def planned_sequence(args: Args) -> tuple[int, str]:
    """--dry-run's longest training sequence: a whole episode."""
    return args.max_seq_len, "--max-seq-len (the whole episode)"


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
