"""Run under `torchrun --nproc-per-node 2`: loop.py's own training-sample and update functions under DDP on
fixed rollouts.

Two iterations on the tiny model (float64), K = 3 rollouts per task, two agent turns each. Iteration 1:
3 tasks, so rank 0 plays tasks 0 and 2 and rank 1 task 1, whose returns are all equal (every rollout
filtered: rank 1 holds nothing to train on and runs only zero-weight passes). Iteration 2: one task, so
rank 1 has no rollout at all. The 5 kept rollouts of iteration 1 (task 0 loses the one with A = 0) are a
global permutation split into ceil(5 / 4) = 2 balanced minibatches of 3 and 2 (loop.update since 1e3f13f),
one rollout per micro-batch, so the ranks own different numbers of micro-batches. After each iteration
rank 0 records whether every parameter is bit-identical across ranks and saves the parameters to argv[1];
tests/test_loop.py runs the same functions in one process on the whole list (`train(shard=False)`).
"""

import random
import sys

import numpy as np
import torch
from worker import ranks_agree, save_ranked

import loop
from common import dist
from common.models import TINY_MODEL, load_policy

# plain SGD and no clipping: AdamW and a clipped norm would hide a wrongly scaled gradient (both are invariant
# to a constant factor); SGD moves the weights by exactly lr * gradient
ARGS = loop.Args(group_size=3, minibatch_size=4, micro_batch_size=1, ppo_epochs=2, max_grad_norm=1e9)
LR = 0.2
RETURNS = {1: [[1.0, 0.0, 0.5], [0.5, 0.5, 0.5], [0.0, 1.0, 1.0]], 2: [[0.25, 1.0, 0.0]]}  # per task


def task_rollouts(iteration: int, group: int, vocab: int) -> list[loop.Rollout]:
    """One task's K rollouts: a prompt, then two agent turns separated by an environment reply."""
    out = []
    for k, ret in enumerate(RETURNS[iteration][group]):
        rng = random.Random(f"{iteration}:{group}:{k}")
        r = loop.Rollout(task=group, group=group, sample=k, reward=ret)
        r.add([rng.randrange(vocab) for _ in range(rng.randint(4, 7))], generated=False)  # prompt
        r.prompt_length = len(r.ids)
        r.add([rng.randrange(vocab) for _ in range(rng.randint(2, 4))], generated=True)  # turn 1
        r.add([rng.randrange(vocab) for _ in range(3)], generated=False)  # environment reply
        r.add([rng.randrange(vocab) for _ in range(rng.randint(1, 3))], generated=True)  # turn 2
        r.turns = 2
        out.append(r)
    return out


def train(shard: bool) -> tuple[list[list[torch.Tensor]], list[bool]]:
    """Parameters after each iteration, and whether the ranks agreed bit for bit after it."""
    model, tokenizer = load_policy(TINY_MODEL, dtype="float64")
    model.eval()
    policy = dist.wrap(model, "ddp") if shard else model
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    params, agree = [], []
    for iteration, groups in RETURNS.items():
        mine = dist.shard(list(range(len(groups)))) if shard else list(range(len(groups)))
        rollouts = [r for g in mine for r in task_rollouts(iteration, g, len(tokenizer))]
        # as main() does: advantage within groups and the |A| filter (training_samples), then the update,
        # which computes pi_old itself; the same seed on every rank (the global permutation)
        samples = loop.training_samples(rollouts, ARGS)
        stats = loop.update(policy, optimizer, samples, ARGS, np.random.default_rng(iteration))
        assert stats["gradient_steps"] == {1: 4, 2: 2}[iteration], stats  # ceil(kept / 4) x 2 epochs
        params.append([p.detach().clone() for p in model.parameters()])
        agree.append(ranks_agree(params[-1]))
    return params, agree


if __name__ == "__main__":
    save_ranked(train, sys.argv[1])
