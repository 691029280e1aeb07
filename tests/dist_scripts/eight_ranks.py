"""Run under `torchrun --nproc-per-node 8`: one script's own update functions on fixed rollouts of 3, 8 and
12 task groups (fewer groups than ranks, one per rank, and a count that is not a multiple of 8: 4 ranks
get two groups), first through DDP, then through FSDP2, from the same initial weights.

The data are the 2-rank workers' (loop_update, arpo_update, t2po_update) with more groups, made into
training samples by each script's own `training_samples` (t2po's: fixed samples) and trained by its
`update` with the same np.random.Generator on every rank (update permutes the global sample list).
float64, plain SGD for loop and arpo (a wrongly scaled gradient shows), AdamW for t2po as its worker.
After each update every rank gathers the full parameters (FSDP2: an all-gather) and rank 0 records
whether they are bit-identical on all ranks; rank 0 saves {strategy: (parameters after each update,
agreed)} to OUT.
`train(script, None)` runs the same functions in one process on every group (the test's reference).
Usage: torchrun --nproc-per-node 8 eight_ranks.py SCRIPT OUT."""

import dataclasses
import sys

import loop_update
import numpy as np
import torch
import worker
from arpo_update import batch_for
from loop_update import task_rollouts

import arpo
import loop
import t2po
from common import dist
from common.models import TINY_MODEL, load_policy

GROUPS = [3, 8, 12]  # task groups per update: < 8 ranks, = 8, not a multiple of 8


def loop_returns(n: int, iteration: int) -> list[list[float]]:
    # three rollouts per task; every third task has equal returns (all filtered: its rank trains nothing)
    return [[0.5] * 3 if g % 3 == 1 else [(g + k * (iteration + 1)) % 4 / 3 for k in range(3)]
            for g in range(n)]


def t2po_groups(n: int, iteration: int) -> list[list[t2po.TrainingSample]]:
    """t2po_update.fixed_groups for n groups: 2-4 turn samples each, a forced token in every second."""
    g = torch.Generator().manual_seed(100 * iteration + n)
    groups = []
    for group in range(n):
        samples = []
        for i in range(2 + group % 3):
            prompt = torch.randint(100, 5000, (3 + i,), generator=g).tolist()
            response = torch.randint(100, 5000, (2 + (i * 3 + group) % 4,), generator=g).tolist()
            advantage = (-1.0) ** i * (0.5 + 0.25 * (group % 4))
            samples.append(t2po.TrainingSample(
                (group, i), prompt, response, [0 if (i == 1 and j == 0) else 1 for j in range(len(response))],
                [advantage] * len(response)))
        groups.append(samples)
    return groups


def update(script: str, model, policy, optimizer, tokenizer, groups: list[int], iteration: int) -> None:
    """One update of `script` on the task groups `groups` (this rank's share), as its main() does: the
    script's training samples, then its update with the same generator on every rank."""
    rng = np.random.default_rng(iteration)
    if script == "loop":
        loop_update.RETURNS = {iteration: loop_returns(GROUPS[iteration], iteration)}
        rollouts = [r for g in groups for r in task_rollouts(iteration, g, len(tokenizer))]
        args = loop_update.ARGS
        samples = loop.training_samples(rollouts, args)  # leave-one-out advantage, the |A| filter
        loop.update(policy, optimizer, samples, args, rng)
    elif script == "arpo":
        samples = batch_for(10 + iteration, groups, len(tokenizer))  # arpo.training_samples, hard attribution
        # share_prefixes off here: how rows are dealt to ranks changes which rows pack together, a
        # rounding that Adam's first step amplifies to ~1e-9; packing is tested in test_shared_prefixes.
        # One minibatch (--minibatches 1 before 1e3f13f): 36 responses at most, --minibatch-size 256
        args = arpo.Args(micro_batch_size=2, minibatch_size=256, lr=0.5, attribution="hard",
                         max_grad_norm=1e9, share_prefixes=False)
        arpo.update(policy, optimizer, samples, args, rng)
    else:
        everything = t2po_groups(GROUPS[iteration], iteration)
        samples = [dataclasses.replace(s) for g in groups for s in everything[g]]
        args = t2po.Args(minibatch_size=256, micro_batch_size=2, lr=1e-3, clip_eps=0.2, max_grad_norm=1.0,
                         share_prefixes=False)  # as arpo's, above
        t2po.update(policy, optimizer, samples, args, rng)


def train(script: str, strategy: str | None) -> tuple[list[torch.Tensor], list[bool]]:
    """Full parameters after each update and whether every rank held them bit for bit; strategy None: one
    process, every group."""
    torch.manual_seed(0)
    model, tokenizer = load_policy(TINY_MODEL, dtype="float64")
    model.eval()
    policy = dist.wrap(model, strategy) if strategy else model
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0) if script == "t2po" else \
        torch.optim.SGD(params, lr=0.5 if script == "arpo" else loop_update.LR)
    after, agree = [], []
    for iteration, n in enumerate(GROUPS):
        groups = dist.shard(list(range(n))) if strategy else list(range(n))
        update(script, model, policy, optimizer, tokenizer, groups, iteration)
        flat = torch.cat([dist.full_tensor(p.detach()).flatten() for p in model.parameters()])
        after.append(flat)
        agree.append(worker.ranks_agree([flat]) if strategy else True)
    return after, agree


@dist.entrypoint
def main(script: str, out: str) -> None:
    dist.init(timeout_s=300)
    result = {strategy: train(script, strategy) for strategy in ("ddp", "fsdp2")}
    if dist.is_main():
        torch.save({"world": dist.world_size(), **result}, out)
    dist.cleanup()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
