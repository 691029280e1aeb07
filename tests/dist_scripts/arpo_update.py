"""Run under `torchrun --nproc-per-node 2`: arpo.py's own training samples and update under DDP on fixed
rollouts.

Two iterations on the tiny model (float64). Each rank takes its shard of the step's questions (whole
groups, `dist.shard`), makes its training samples with the script's advantage (`training_samples`, hard
attribution, forks included) and runs `update` through `dist.wrap(model, "ddp")`. Iteration 1: 3
questions (9 responses), so rank 0 has two (6 samples) and rank 1 one (3 samples), and rank 1's question
has equal rewards (zero advantage: a micro-batch is skipped only when every rank's is); --minibatch-size
5 splits a global permutation of the 9 responses, the same on every rank, into 2 balanced minibatches of
5 and 4 (arpo.update since 1e3f13f; the second minibatch's pi_old is computed before the first step), so
each rank trains its own part of each, 2 samples per micro-batch, a rank with fewer micro-batches padding
with zero-weight ones. Iteration 2: one question (3 responses, one minibatch), so rank 1 has no rollout
at all. After each step rank 0 records whether every parameter is bit-identical across ranks and saves
the parameters to argv[1]; tests/test_arpo.py runs the same functions in one process on the whole list
(`train(shard=False)`) and compares.
"""

import random
import sys

import numpy as np
import torch
from worker import ranks_agree, save_ranked

import arpo
from common import dist
from common.models import TINY_MODEL, load_policy

# plain SGD and no clipping: AdamW and a clipped norm would hide a wrongly scaled gradient (both are invariant
# to a constant factor), SGD moves the weights by exactly lr * gradient
ARGS = arpo.Args(micro_batch_size=2, minibatch_size=5, lr=0.5, attribution="hard", max_grad_norm=1e9)
QUESTIONS = {1: 3, 2: 1}  # iteration -> questions in the step
GRADIENT_STEPS = {1: 2, 2: 1}  # ceil(3 responses x questions / --minibatch-size 5)


def question_rollouts(iteration: int, q: int, vocab: int) -> tuple[list[int], list[arpo.Rollout]]:
    """One question's group, scored: two global rollouts and a fork of the first after its (masked) result
    block."""
    rng = random.Random(f"{iteration}:{q}")
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]

    def rollout(n: int, index: int) -> arpo.Rollout:
        mask = [1, 1, 0, 0] + [1] * (n - 4)  # 2 policy tokens, a 2-token result, then policy tokens
        return arpo.Rollout(0, index=index, response_ids=[rng.randrange(vocab) for _ in range(n)],
                            action_mask=mask)

    first, second = rollout(rng.randint(5, 9), 0), rollout(rng.randint(5, 9), 1)
    child = arpo.fork(first, 0, 4, 2)
    child.response_ids += [rng.randrange(vocab) for _ in range(3)]
    child.action_mask += [1, 1, 1]
    rewards = [0.0, 0.0, 0.0] if (iteration, q) == (1, 1) else [1.0, -1.0, 0.5]
    group = [first, second, child]
    for r, reward in zip(group, rewards, strict=True):
        r.reward = reward
    return prompt, group


def batch_for(iteration: int, questions: list[int], vocab: int) -> list[arpo.TrainingSample]:
    """The training samples a rank makes from its questions, as main() does: `play` leaves each rollout
    its rank-local question and parent indices, its global group (the question's number in the step),
    the question's prompt and its reward; `training_samples` turns them into samples."""
    rollouts = []
    for local_q, q in enumerate(questions):
        prompt, group = question_rollouts(iteration, q, vocab)
        for r in group:
            r.question, r.group, r.prompt_ids = local_q, q, prompt
            r.parent = None if r.parent is None else r.parent + len(rollouts)
        rollouts += group
    return arpo.training_samples(rollouts, ARGS)


def train(shard: bool) -> tuple[list[list[torch.Tensor]], list[bool]]:
    """Parameters after each iteration, and whether the ranks agreed bit for bit after it."""
    model, tokenizer = load_policy(TINY_MODEL, dtype="float64")
    policy = dist.wrap(model, "ddp") if shard else model
    optimizer = torch.optim.SGD(policy.parameters(), lr=ARGS.lr)
    params, agree = [], []
    for iteration, n in QUESTIONS.items():
        questions = dist.shard(list(range(n))) if shard else list(range(n))
        samples = batch_for(iteration, questions, len(tokenizer))
        # the same generator on every rank: the global permutation into minibatches
        stats = arpo.update(policy, optimizer, samples, ARGS, np.random.default_rng(iteration))
        assert stats["gradient_steps"] == GRADIENT_STEPS[iteration], stats
        params.append([p.detach().clone() for p in model.parameters()])
        agree.append(ranks_agree(params[-1]))
    return params, agree


if __name__ == "__main__":
    save_ranked(train, sys.argv[1])
