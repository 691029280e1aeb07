"""LOOP: leave-one-out PPO for long-horizon interactive agents.

Chen et al., "Reinforcement Learning for Long-Horizon Interactive LLM Agents", arXiv 2502.01600;
official code github.com/apple/ml-loop (read for details; nothing copied). Equations: docs/loop.md.

Per iteration: B tasks x K rollouts, each ONE token sequence (system, task, the agent's turns, the
environment's replies) in which only the model's tokens are trained. A rollout's advantage is its
return minus the mean return of its task's other K-1 (no std division); |A| < 0.01 is dropped. A
per-token PPO-clipped objective (clip range [1/(1+eps), 1+eps]) is averaged within each trajectory,
every minibatch is divided by the constant minibatch size, and two epochs of reshuffled minibatches
reuse the batch. No critic, no reference model, no KL term: one copy of the LLM in memory.

Run: `python loop.py` (the CPU default), `python loop.py --env appworld` (the paper's settings: GPU,
vLLM, torchrun; --dry-run prints the memory plan per rank). Ours, not the paper's: an optional cold
start (SFT on scripted-expert episodes) so that a 135M model on a CPU starts from groups that
sometimes disagree.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from tqdm import tqdm

from common import dist, logprobs, models, run
from common.cli import opt
from common.generation import eos_token_ids
from envs.base import EnvPool


@dataclass
class Args(run.RunArgs):
    """LOOP (Chen et al. 2025): leave-one-out PPO for long-horizon LLM agents; docs/loop.md."""

    preset: Literal["auto", "none", "textworld", "appworld"] = "auto"  # the names of PRESETS
    max_turns: int = 2
    lora_rank: int = 16  # paper: 16
    lr: float = 2e-4  # constant; paper: 5e-5
    cold_start_epochs: int = 2
    cold_start_lr: float = 2e-4
    steps: int = 5
    save_every: int = 1
    minibatch_size: int = opt("optimisation", 4, "rollouts per gradient step: the divisor M", ge=1)
    epochs: int = opt("optimisation", 2, "passes over an iteration's rollouts (reuse)", ge=1)
    clip_eps: float = opt("algorithm", 0.1, "PPO epsilon; clip range [1/(1+eps), 1+eps]", gt=0)
    adv_threshold: float = opt("algorithm", 0.01, "drop rollouts with |advantage| below this", ge=0)
    importance_weight: Literal["token", "turn", "trajectory"] = opt(
        "algorithm", "token", "ratio per token | turn | trajectory (paper ablation)")
    std_normalize: bool = opt("algorithm", False, "divide advantages by the group std (ablation)")
    kl_threshold: float = opt("algorithm", 20.0, "abandon an iteration whose k1 KL is above", gt=0)
    eval_max_turns: int = opt("environment", 0, "agent turns at evaluation (0 = max-turns)", ge=0)
    max_env_tokens: int = opt("environment", 256, "env output cut to this many tokens", ge=1)
    max_seq_len: int = opt("rollout", 2048, "an episode's token cap (it ends, truncated)", ge=1)


# Per-env values of flags the command line leaves alone (one literal, never updated); appworld: the
# paper's and ml-loop's (docs/loop.md marks ours)
PRESETS: dict[str, dict] = {
    # TextWorld coin collector level 2 (walk to the next room, take the coin): the CPU default
    "textworld": dict(env_options='{"level": 2, "train_games": 16, "eval_games": 8}', max_turns=3,
                      max_new_tokens=6),
    "appworld": dict(model="Qwen/Qwen2.5-32B-Instruct", lora_rank=16, lora_alpha=32, lr=5e-5,
                     max_turns=40, eval_max_turns=50, max_new_tokens=1500, max_env_tokens=3000,
                     max_seq_len=32768, group_size=6, tasks_per_step=40, minibatch_size=32,
                     micro_batch_size=1, steps=200, dtype="bfloat16", gradient_checkpointing=True,
                     eval_every=10, eval_tasks=57, cold_start=False),
}

SYSTEM_PROMPT = ("You are an agent in a text environment. Each turn, reply with exactly one action "
                 "and nothing else; when actions are listed, copy one of them.")


# Advantage (Sec. 3): the leave-one-out baseline
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


# Objective (Sec. 3): per-token PPO
def unit_log_ratios(log_ratio: torch.Tensor, action_mask: torch.Tensor, turn_ids: torch.Tensor,
                    level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Group token log-ratios into the units that carry one importance weight each.

    log_ratio, action_mask, turn_ids: (N, T). Returns (log ratio per unit, unit mask), both (N, U):
    token -> U = T (each action token its own weight); turn -> U = number of turns (the sum of a
    turn's token log-ratios: its likelihood ratio's log); trajectory -> U = 1 (whole rollout)."""
    mask = action_mask.to(log_ratio.dtype)
    if level == "token":
        return log_ratio * mask, action_mask.bool()
    if level == "turn":
        n_units = int(turn_ids.max().item()) + 1 if action_mask.any() else 1
        idx = turn_ids.clamp(min=0)  # (N, T); masked tokens add 0 anywhere
        zeros = log_ratio.new_zeros(log_ratio.shape[0], n_units)  # (N, U)
        sums = zeros.scatter_add(1, idx, log_ratio * mask)
        counts = zeros.scatter_add(1, idx, mask)
        return sums, counts > 0
    if level == "trajectory":
        return (log_ratio * mask).sum(1, keepdim=True), action_mask.bool().any(1, keepdim=True)
    raise ValueError(f"--importance-weight must be token, turn or trajectory, not {level!r}")


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) (Schulman 2020), verl's `low_var_kl`:
    e^x - x - 1, x = ref_logp - logp, clamped to [-10, 10]; x first to [-20, 20] (as verl now does:
    no value changes, but an overflowing exp gives no NaN gradient). LOOP's paper names no estimator
    for its KL ablation; ml-loop has no reference model (its `rloo_kl_lambda` shifts advantages)."""
    x = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1, min=-10.0, max=10.0)


def loop_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, action_mask: torch.Tensor,
              advantages: torch.Tensor, turn_ids: torch.Tensor, *, clip_eps: float,
              level: str = "token", ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
              ) -> tuple[torch.Tensor, dict]:
    """LOOP surrogate loss SUMMED over a (micro-)batch of N rollouts; `update` divides it by M.

    new_logp, old_logp, ref_logp, action_mask, turn_ids: (N, T) per target token; advantages: (N,).
    Returns -sum_i [ 1/|u(x_i)| sum_{u} min(r_u A_i, clip(r_u, 1/(1+eps), 1+eps) A_i) ], u the
    importance units; L = its sum over the minibatch / M, the constant minibatch size."""
    log_ratio = new_logp - old_logp.detach()  # (N, T)
    unit_lr, unit_mask = unit_log_ratios(log_ratio, action_mask, turn_ids, level)  # (N, U)
    ratio = torch.exp(unit_lr)
    adv = advantages.to(ratio.dtype)[:, None]  # (N, 1): every token of rollout i gets A_i
    lo, hi = 1.0 / (1.0 + clip_eps), 1.0 + clip_eps  # symmetric in log space
    unclipped, clipped = ratio * adv, torch.clamp(ratio, lo, hi) * adv
    objective = torch.minimum(unclipped, clipped)  # (N, U), PPO pessimistic bound
    units = unit_mask.to(ratio.dtype)
    n_units = units.sum(1).clamp(min=1)
    per_rollout = (objective * units).sum(1) / n_units  # (N,) average within the trajectory
    if kl_coef > 0:  # ablation: the KL to pi_ref per token, averaged over the trajectory likewise
        tok = action_mask.to(ratio.dtype)
        k3 = low_var_kl(new_logp, ref_logp) * tok
        per_rollout = per_rollout - kl_coef * k3.sum(1) / tok.sum(1).clamp(min=1)
    loss_sum = -per_rollout.sum()  # update divides it by M
    with torch.no_grad():
        tok_mask = action_mask.bool()
        tok_ratio = torch.exp(log_ratio)[tok_mask]
        traj_lr = (log_ratio * action_mask.to(log_ratio.dtype)).sum(1)  # (N,) log p/p_old
        stats = {
            "clipped": float(((unclipped > clipped) & unit_mask).sum()),  # min took the clip
            "units": float(unit_mask.sum()),
            "ratio_sum": float(tok_ratio.sum()), "tokens": float(tok_mask.sum()),
            "ratio_min": float(tok_ratio.min()) if tok_ratio.numel() else 1.0,
            "ratio_max": float(tok_ratio.max()) if tok_ratio.numel() else 1.0,
            # KL(pi_old || pi_theta) from samples of pi_old, per trajectory (ml-loop's estimators):
            "k1_sum": float((-traj_lr).sum()),  # k1 = -log r; k3 = r - 1 - log r
            "k3_sum": float((torch.expm1(traj_lr.clamp(max=50.0)) - traj_lr).sum()),
            "rollouts": float(log_ratio.shape[0]),
        }
    return loss_sum, stats


# Rollout: one token sequence per episode
@dataclass
class Rollout:
    task: object
    group: int  # index of its task in the iteration's global task list (the same on every rank)
    sample: int = 0  # which of the group's K rollouts; (group, sample) names a rollout on any rank
    ids: list[int] = field(default_factory=list)  # the whole interaction
    action_mask: list[bool] = field(default_factory=list)  # True where the model made the token
    turn_ids: list[int] = field(default_factory=list)  # agent turn of a generated token, else -1
    actions: list[str] = field(default_factory=list)  # the text sent to the environment, per turn
    reward: float = 0.0
    won: bool = False
    turns: int = 0
    done: bool = False
    truncated: bool = False
    env_error: str | None = None  # what ended the episode when the env failed (EnvPool's info)
    old_logp: list[float] | None = None  # recomputed by the training model before the update
    ref_logp: list[float] | None = None

    def add(self, ids: list[int], generated: bool, turn: int = -1) -> None:
        self.ids += ids
        self.action_mask += [generated] * len(ids)
        self.turn_ids += [turn if generated else -1] * len(ids)


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
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
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
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def env_reply_ids(tokenizer, pieces: dict, obs: str, info: dict, max_env_tokens: int) -> list[int]:
    """The environment's reply as a user turn, cut to max_env_tokens (output truncation)."""
    reply = tokenizer(with_actions(obs, info), add_special_tokens=False)["input_ids"]
    reply = reply[:max_env_tokens]
    return pieces["prefix"] + reply + pieces["suffix"]


def rollout(generator, tokenizer, pool: EnvPool, tasks: list, group_size: int, args: Args, *,
            temperature: float, max_turns: int, seed: int, eos_ids: set[int]) -> list[Rollout]:
    """Play len(tasks) x group_size episodes in lock-step, one growing token sequence each. A
    sequence never exceeds --max-seq-len: a turn starts only with room for --max-new-tokens and the
    template's end-of-turn glue: a reply leaving no such room ends the episode (truncated)."""
    pieces = turn_pieces(tokenizer, eos_ids)
    turn_room = args.max_new_tokens + len(pieces["end"])  # most tokens one agent turn adds
    episodes = [Rollout(task=t, group=g, sample=k)
                for g, t in enumerate(tasks) for k in range(group_size)]
    for ep, (obs, info) in zip(episodes, pool.reset([ep.task for ep in episodes]), strict=True):
        ep.add(first_prompt_ids(tokenizer, obs, info), generated=False)
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
        samples = generator.generate([episodes[i].ids for i in live], n=1,
                                     max_new_tokens=args.max_new_tokens, temperature=temperature,
                                     seeds=[seed * 100_003 + i for i in live])
        actions: list[str | None] = [None] * len(episodes)
        for i, [s] in zip(live, samples, strict=True):
            ep = episodes[i]
            ep.add(list(s.token_ids), generated=True, turn=turn)
            # Old log-probs are recomputed, so the model's own EOS is trained like any other token
            # (the agent learns when to stop); a turn cut by the token limit is closed as context.
            closed = sampled_end(s, pieces)
            ep.add(closed, generated=True, turn=turn)
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


def step_rng(seed: int, step: int) -> torch.Generator:
    """The randomness of step `step` (1-based) from the seed and the step alone: a resume continues
    exactly. With --seed it picks the step's tasks and orders the minibatches; with the rank's seed
    (dist.rank_seed) it seeds the rank's sampling. Keyed on step - 1, as runs always were."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step - 1)


def training_rollouts(r: run.Run, pool: EnvPool, train_tasks: list, args: Args, step: int,
                      eos_ids: set[int]) -> list[Rollout]:
    """The iteration's B tasks x K rollouts at --temperature. The task list is the same on every
    rank; each rank plays its share of the groups (whole groups) with its own sampling seed."""
    draw = random.Random(step_rng(args.seed, step).initial_seed())  # the same tasks on every rank
    tasks = draw.sample(train_tasks, args.tasks_per_step)
    mine = dist.shard(list(enumerate(tasks)))  # (global group index, task)
    if not mine:
        return []
    rollouts = rollout(r.generator, r.tokenizer, pool, [t for _, t in mine], args.group_size, args,
                       temperature=args.temperature, max_turns=args.max_turns,
                       seed=step_rng(dist.rank_seed(args.seed), step).initial_seed(),
                       eos_ids=eos_ids)
    for x in rollouts:
        x.group = mine[x.group][0]
    return rollouts


def build_batch(batch: list[Rollout], pad_id: int, device=None) -> dict[str, torch.Tensor]:
    """Right-pad rollouts. input_ids/attention_mask: (N, T); per-target tensors: (N, T-1)."""
    t = max(len(r.ids) for r in batch)
    # built on the policy's device: on a GPU the forward refuses inputs left on the CPU
    pad = lambda xs, v, n: torch.tensor([list(x) + [v] * (n - len(x)) for x in xs], device=device)
    out = {"input_ids": pad([r.ids for r in batch], pad_id, t),  # (N, T)
           "attention_mask": pad([[1] * len(r.ids) for r in batch], 0, t),  # (N, T)
           # target t+1 is predicted at position t, so the masks are shifted by one
           "action_mask": pad([r.action_mask[1:] for r in batch], False, t - 1),  # (N, T-1)
           "turn_ids": pad([r.turn_ids[1:] for r in batch], -1, t - 1)}  # (N, T-1)
    for key in ("old_logp", "ref_logp"):
        if all(getattr(r, key) is not None for r in batch):
            out[key] = pad([getattr(r, key) for r in batch], 0.0, t - 1)  # (N, T-1)
    return out


def action_logprobs(model, b: dict[str, torch.Tensor], temperature: float = 1.0,
                    share_prefixes: bool = True) -> torch.Tensor:
    """log pi(x_t | x_<t) at the action targets, (N, T-1), zero elsewhere, under softmax(logits /
    temp), the rollouts' sampling distribution (ml-loop); the vocabulary projection runs on action
    tokens only, a prefix rollouts share (their task's prompt) once (--share-prefixes)."""
    return logprobs.token_logprobs(model, b["input_ids"], b["attention_mask"],
                                   target_mask=b["action_mask"], temperature=temperature,
                                   chunk_size=1024, share_prefixes=share_prefixes)


def dummy_batch(pad_id: int, device) -> dict[str, torch.Tensor]:
    """Two tokens, one of them an "action": a zero-weight pass for a rank with nothing to do."""
    r = Rollout(task=None, group=-1, ids=[pad_id, pad_id], action_mask=[False, True],
                turn_ids=[-1, 0], old_logp=[0.0], ref_logp=[0.0])
    return build_batch([r], pad_id, device)


@torch.no_grad()
def recompute_logprobs(model, rollouts: list[Rollout], pad_id: int, micro: int, key: str,
                       temperature: float = 1.0, share_prefixes: bool = True) -> None:
    """pi_old(x_t | x_<t) under the training model at the sampling temperature; as many forward
    passes on every rank (dist.same_count: FSDP's forward is a collective)."""
    chunks = [rollouts[i: i + micro] for i in range(0, len(rollouts), micro)]
    for chunk, weight in dist.same_count(chunks, None):
        if not weight:
            action_logprobs(model, dummy_batch(pad_id, model.device))
            continue
        batch = build_batch(chunk, pad_id, model.device)
        lp = action_logprobs(model, batch, temperature, share_prefixes)  # (n, T-1)
        for r, row in zip(chunk, lp, strict=True):
            setattr(r, key, row[: len(r.ids) - 1].tolist())


def reference_logprobs(model, reference, rollouts: list[Rollout], pad_id: int, args: Args) -> None:
    """log pi_ref (KL ablation): `reference`, a frozen copy, or `model` with its LoRA off."""
    micro, temp, share = args.micro_batch_size, args.temperature, args.share_prefixes
    if reference is not None:
        return recompute_logprobs(reference, rollouts, pad_id, micro, "ref_logp", temp, share)
    with models.unwrap(model).disable_adapter():
        recompute_logprobs(model, rollouts, pad_id, micro, "ref_logp", temp, share)


# Update: epochs of minibatches
def merge_stats(acc: dict, st: dict) -> dict:
    """Sum the counters of loop_loss's stats; keep the extremes of the ratio."""
    for k, v in st.items():
        acc[k] = v if k not in acc else min(acc[k], v) if k == "ratio_min" else (
            max(acc[k], v) if k == "ratio_max" else acc[k] + v)
    return acc


# loop_loss's counters before any micro-batch: every rank reduces the same keys
EMPTY_STATS = {"clipped": 0.0, "units": 0.0, "ratio_sum": 0.0, "tokens": 0.0, "k1_sum": 0.0,
               "k3_sum": 0.0, "rollouts": 0.0, "ratio_min": math.inf, "ratio_max": -math.inf}


def global_stats(st: dict) -> dict:
    """loop_loss's counters summed over ranks, the ratio's extremes reduced."""
    sums = [k for k in EMPTY_STATS if k not in ("ratio_min", "ratio_max")]
    total = dist.all_reduce(torch.tensor([st[k] for k in sums], dtype=torch.float64))
    return {**dict(zip(sums, total.tolist(), strict=True)),
            "ratio_min": dist.all_reduce(st["ratio_min"], "min"),
            "ratio_max": dist.all_reduce(st["ratio_max"], "max")}


def update(policy, optimizer, rollouts: list[Rollout], advantages: list[float], pad_id: int,
           args: Args, rng: torch.Generator, reference=None) -> dict:
    """pi_old's log-probs (pi_ref's too with --kl-coef), then epochs of reshuffled minibatches over
    the GLOBAL batch; the iteration is abandoned if KL explodes.

    Under torchrun each rank holds its own rollouts. All ranks shuffle the same global list (sorted
    by (group, sample): independent of how groups were dealt out), take the same minibatch and each
    computes the part it owns. The loss keeps the constant divisor (the global minibatch size) times
    dist.grad_scale() (DDP averages over ranks): one step is the same on 1, 2 or 8 ranks."""
    t0, model = time.time(), models.unwrap(policy)  # the no-grad passes skip the DDP wrapper
    # pi_old under the training model at the sampling temperature, before the first step (Sec. 3)
    recompute_logprobs(model, rollouts, pad_id, args.micro_batch_size, "old_logp", args.temperature,
                       args.share_prefixes)
    if args.kl_coef > 0:  # the KL ablation's pi_ref
        reference_logprobs(model, reference, rollouts, pad_id, args)
    time_logprobs = time.time() - t0
    device = next(policy.parameters()).device
    mine = {(r.group, r.sample): i for i, r in enumerate(rollouts)}
    everyone = sorted(k for keys in dist.all_gather_object(list(mine)) for k in keys)  # global
    totals = dict(EMPTY_STATS)
    losses, grad_norms, abandoned = [], [], False
    policy.train()  # transformers' gradient checkpointing acts only in train mode
    size, micro_size = args.minibatch_size, args.micro_batch_size
    for _ in range(args.epochs):
        order = torch.randperm(len(everyone), generator=rng).tolist()
        for start in range(0, len(order), size):
            mb = [mine[everyone[j]] for j in order[start: start + size] if everyone[j] in mine]
            micro = [mb[m: m + micro_size] for m in range(0, len(mb), micro_size)]
            mb_stats, mb_loss = dict(EMPTY_STATS), 0.0
            # DDP all-reduces gradients at every backward: every rank runs the same number of them
            for rows, weight in dist.same_count(micro, None):
                if not weight:  # zero-weight pass
                    (action_logprobs(policy, dummy_batch(pad_id, device)).sum() * 0.0).backward()
                    continue
                b = build_batch([rollouts[i] for i in rows], pad_id, device)
                new_logp = action_logprobs(policy, b, args.temperature, args.share_prefixes)
                adv = torch.tensor([advantages[i] for i in rows], device=device)  # (n,)
                loss_sum, st = loop_loss(new_logp, b["old_logp"], b["action_mask"], adv,
                                         b["turn_ids"], clip_eps=args.clip_eps,
                                         level=args.importance_weight,
                                         ref_logp=b.get("ref_logp"), kl_coef=args.kl_coef)
                loss = loss_sum / args.minibatch_size  # the constant M, not the rollouts kept
                (loss * dist.grad_scale()).backward()
                mb_loss += loss.item()
                merge_stats(mb_stats, st)
            mb_loss = dist.all_reduce(mb_loss)  # sum of the ranks' shares = the minibatch's loss
            mb_stats = global_stats(mb_stats)
            k1 = mb_stats["k1_sum"] / max(mb_stats["rollouts"], 1.0)
            if not math.isfinite(mb_loss) or abs(k1) > args.kl_threshold:  # ml-loop: stop
                optimizer.zero_grad(set_to_none=True)
                abandoned = True
                break
            norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            grad_norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(mb_loss)
            merge_stats(totals, mb_stats)
        if abandoned:
            break
    policy.eval()
    n, any_tokens = max(totals["rollouts"], 1.0), totals["tokens"] > 0
    return {"loss": sum(losses) / max(len(losses), 1),
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "gradient_steps": len(losses),
            "clip_fraction": totals["clipped"] / max(totals["units"], 1.0),
            "ratio_mean": totals["ratio_sum"] / max(totals["tokens"], 1.0),
            "ratio_min": totals["ratio_min"] if any_tokens else 1.0,
            "ratio_max": totals["ratio_max"] if any_tokens else 1.0,
            "kl_k1": totals["k1_sum"] / n, "kl_k3": totals["k3_sum"] / n,
            "abandoned": float(abandoned), "time_logprobs_s": time_logprobs}


def rollout_metrics(rollouts: list[Rollout], n_kept: int, step: int) -> dict:
    """The iteration's rollouts, summed over ranks; one console line when environments failed."""
    n, total = dist.all_reduce(len(rollouts)), lambda xs: dist.all_reduce(float(sum(xs)))
    sampled, turns = total(sum(r.action_mask) for r in rollouts), total(r.turns for r in rollouts)
    out = {"rollouts": n, "reward_mean": total(r.reward for r in rollouts) / n,
           "success_rate": total(r.won for r in rollouts) / n,
           "num_tokens": int(sampled), "tokens_per_turn": sampled / max(turns, 1.0),
           "sequence_tokens": int(total(len(r.ids) for r in rollouts)),
           "turns_per_episode": turns / n,
           "truncated_fraction": total(r.truncated for r in rollouts) / n,
           "env_errors": int(total(r.env_error is not None for r in rollouts)),
           "filtered_fraction": 1.0 - n_kept / n}
    if out["env_errors"]:  # the same on every rank: each sends its first error to rank 0's line
        first = next((r.env_error for r in rollouts if r.env_error is not None), None)
        warn_env_errors(f"step {step}", out["env_errors"], n, dist.all_gather_object(first))
    return out


def evaluate(generator, tokenizer, pool: EnvPool, tasks: list, args: Args, eos_ids: set,
             stage: str) -> dict:
    """Greedy decoding on held-out tasks (paper, ml-loop: temperature 0); transcripts in <out>."""
    eps = rollout(generator, tokenizer, pool, tasks, 1, args, temperature=0.0,
                  max_turns=args.eval_max_turns or args.max_turns, seed=args.seed, eos_ids=eos_ids)
    run.write_transcripts(args, stage, [
        run.transcript(tokenizer, e.ids, e.action_mask, e.actions, task=e.task, won=e.won,
                       reward=e.reward) for e in eps])
    errors = [e.env_error for e in eps if e.env_error is not None]
    warn_env_errors("held-out evaluation", len(errors), len(eps), errors[:1])
    return {"eval/success_rate": sum(e.won for e in eps) / len(eps),
            "eval/reward_mean": sum(e.reward for e in eps) / len(eps),
            "eval/env_errors": len(errors)}


def warn_env_errors(where: str, n_errors: int, n: int, firsts: list) -> None:
    """One console line when episodes ended by an env error (their 0 is not the policy's)."""
    first = next((e for e in firsts if e), None)
    if n_errors and dist.is_main():
        tqdm.write(f"loop.py: {where}: {n_errors} of {n} episodes ended by an environment error "
                   f"(first: {first})", file=sys.stderr)


def model_eos_ids(tokenizer, model) -> set[int]:
    """Every id the model may end a turn with (its generation config's and its config's EOS)."""
    generation_eos = eos_token_ids(tokenizer, model.generation_config)
    return generation_eos | eos_token_ids(tokenizer, model.config)


# Cold start (ours; not in the paper)
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
        for turn in range(args.max_turns):
            action = env.expert_action()
            ep.add(tokenizer(action, add_special_tokens=False)["input_ids"] + pieces["trained_end"],
                   generated=True, turn=turn)
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


def cold_start(r: run.Run, env, train_tasks: list, args: Args) -> dict:
    """SFT (run.sft: the mean negative log-likelihood of the expert's action tokens) on a few
    scripted-expert episodes, so RL starts from groups that sometimes disagree ({}: no expert)."""
    if args.cold_start_episodes == 0 or not hasattr(env, "expert_action"):
        return {}
    t0, pad_id = time.time(), r.tokenizer.pad_token_id
    n_picks = min(args.cold_start_episodes, len(train_tasks))
    picks = random.Random(args.seed).sample(train_tasks, n_picks)
    demos = expert_rollouts(env, r.tokenizer, picks, args, model_eos_ids(r.tokenizer, r.model))

    def log_likelihood(rows: list[int]) -> tuple[torch.Tensor, float]:  # zero off the action tokens
        batch = build_batch([demos[i] for i in rows], pad_id, r.device)
        logp = action_logprobs(r.policy, batch, share_prefixes=args.share_prefixes)
        return logp.sum(), float(batch["action_mask"].sum())

    rng = torch.Generator().manual_seed(args.seed)
    loss = run.sft(r.policy, len(demos), log_likelihood, lr=args.cold_start_lr,
                   epochs=args.cold_start_epochs, weight_decay=args.weight_decay,
                   max_grad_norm=args.max_grad_norm,
                   micro_batch_size=args.micro_batch_size,
                   permute=lambda n: torch.randperm(n, generator=rng).tolist())
    r.generator.update_weights(r.model)
    return {"cold_start/episodes": len(demos), "cold_start/loss": loss,
            "cold_start/time_s": time.time() - t0}


@dataclass
class Envs:
    env: object  # the environment itself: its expert, for the cold start
    train_tasks: list
    eval_tasks: list
    pool: EnvPool  # this rank's training episodes: its share of the B tasks, K rollouts each
    eval_pool: EnvPool | None  # rank 0 evaluates


def build_envs(args: Args) -> Envs:
    """The environment, its task lists and pools, before the model loads (a bad --env: one line)."""
    env, options, train_tasks, eval_tasks = run.make_env(args)
    if hasattr(env, "game_file"):  # TextWorld compiles a game on first use: not in a step
        for task in train_tasks + eval_tasks:
            env.game_file(task)
    # each rank plays whole groups: its share of the B tasks (dist.shard), K rollouts each
    my_tasks = len(dist.shard(range(args.tasks_per_step)))
    pool = EnvPool(args.env, my_tasks * args.group_size, **options)
    eval_pool = EnvPool(args.env, len(eval_tasks), **options) if dist.is_main() else None
    return Envs(env, train_tasks, eval_tasks, pool, eval_pool)


@dist.entrypoint
def main(argv: list[str] | None = None) -> dict:
    args = run.parse(Args, argv, PRESETS)
    if args.dry_run:
        return run.dry_run(args, args.max_seq_len, "--max-seq-len (the whole episode)",
                           chunk_size=1024)
    envs = build_envs(args)  # before the model: a bad --env costs no load
    r = run.setup(args, desc="loop")
    pad_id, eos_ids = r.tokenizer.pad_token_id, model_eos_ids(r.tokenizer, r.model)
    held_out = lambda stage: run.on_main(lambda: evaluate(r.generator, r.tokenizer, envs.eval_pool,
                                                          envs.eval_tasks, args, eos_ids, stage))
    if "base" not in r.extra:  # a resumed run has done it
        r.extra["base"] = held_out("base")
        r.logger.log({"step": 0, **r.extra["base"]})
    if args.cold_start and "cold_start" not in r.extra:
        if log := cold_start(r, envs.env, envs.train_tasks, args):  # {}: --env has no expert
            run.cold_started_reference(r, args)  # --kl-coef: the KL is to the policy RL starts from
            r.extra["cold_start"] = held_out("cold_start")
            r.logger.log({"step": 0, **log, **{k.replace("eval/", "eval_cold_start/"): v
                                               for k, v in r.extra["cold_start"].items()}})
    line, t_rl = {}, time.time()  # time_s: since RL started (a resumed run: since it resumed)
    for step in range(r.start_step + 1, args.steps + 1):
        t0 = time.time()
        # 1. rollout: B tasks x K episodes at --temperature from the current policy
        rollouts = training_rollouts(r, envs.pool, envs.train_tasks, args, step, eos_ids)
        r.generator.sleep()  # vLLM on GPU: free its memory for training; update_weights wakes it
        t1 = time.time()
        # 2. leave-one-out advantages within each group; drop |A| < threshold and failed rollouts
        advantages = group_advantages(rollouts, args.std_normalize)
        keep = keep_rollouts(rollouts, advantages, args.adv_threshold)
        kept = [x for x, k in zip(rollouts, keep, strict=True) if k]
        kept_adv = [a for a, k in zip(advantages, keep, strict=True) if k]
        n_kept = dist.all_reduce(len(kept))
        # 3. update: old log-probs (and the reference's, for the KL ablation) under the training
        # model, then epochs of reshuffled minibatches (the same shuffle on every rank)
        trained = {"loss": 0.0, "gradient_steps": 0, "time_logprobs_s": 0.0}
        if n_kept:  # the same on every rank
            trained = update(r.policy, r.optimizer, kept, kept_adv, pad_id, args,
                             step_rng(args.seed, step), r.reference)
            r.generator.update_weights(r.model)
        t2 = time.time()  # the step's end: to the end of the update, as arpo and t2po
        line = {"step": step, **rollout_metrics(rollouts, n_kept, step), **trained,
                "time_rollout_s": t1 - t0, "time_update_s": t2 - t1 - trained["time_logprobs_s"],
                "time_s": t2 - t_rl, "step_time_s": t2 - t0}
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            line.update({**held_out(f"step_{step}"), "time_eval_s": time.time() - t2})
        r.logger.log(line)
        if step % args.save_every == 0 or step == args.steps:
            run.save(r, args, step)
    r.extra["rl"] = held_out("rl")
    r.logger.log({"step": args.steps, **r.extra["rl"]})
    r.logger.close()
    run.report(args, r.extra, len(envs.eval_tasks))
    dist.cleanup()
    return {**line, **r.extra["rl"]}


if __name__ == "__main__":
    main()
