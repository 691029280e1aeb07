"""Run under `torchrun --nproc-per-node 2`: arpo.py's own update (`update`) under DDP on fixed rollouts.

Two iterations on the tiny model (float64). Each rank takes its shard of the step's questions (whole
groups, `dist.shard`), builds its batch with the script's advantage (hard attribution, forks included) and
runs `update` through `dist.wrap(model, "ddp")`. Iteration 1: 3 questions, so rank 0 has two (three
micro-batches) and rank 1 one (two micro-batches, padded with a zero-weight one), and rank 1's question has
equal rewards (zero advantage: its micro-batches are skipped only when both ranks skip). Iteration 2: one
question, so rank 1 has no rollout at all. After each step rank 0 records whether every parameter is
bit-identical across ranks and saves the parameters to argv[1]; tests/test_arpo.py runs the same update in
one process on the whole list (`train(..., shard=False)`) and compares.
"""

import random
import sys

import torch
from worker import ranks_agree, save_ranked

import arpo
from common import dist
from common.models import TINY_MODEL, load_policy

# plain SGD and no clipping: AdamW and a clipped norm would hide a wrongly scaled gradient (both are invariant
# to a constant factor), SGD moves the weights by exactly lr * gradient
ARGS = arpo.Args(micro_batch_size=2, minibatches=1, lr=0.5, attribution="hard", max_grad_norm=1e9)
QUESTIONS = {1: 3, 2: 1}  # iteration -> questions in the step


def question_rollouts(iteration: int, q: int, vocab: int
                      ) -> tuple[list[int], list[arpo.Rollout], list[float]]:
    """One question's group: two global rollouts and a fork of the first after its (masked) result block."""
    rng = random.Random(f"{iteration}:{q}")
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]

    def rollout(n: int) -> arpo.Rollout:
        mask = [1, 1, 0, 0] + [1] * (n - 4)  # 2 policy tokens, a 2-token result, then policy tokens
        return arpo.Rollout(0, response_ids=[rng.randrange(vocab) for _ in range(n)], action_mask=mask,
                            old_logprobs=[0.0] * n)

    first, second = rollout(rng.randint(5, 9)), rollout(rng.randint(5, 9))
    child = arpo.fork(first, 0, 4)
    child.response_ids += [rng.randrange(vocab) for _ in range(3)]
    child.action_mask += [1, 1, 1]
    child.old_logprobs += [0.0] * 3
    rewards = [0.0, 0.0, 0.0] if (iteration, q) == (1, 1) else [1.0, -1.0, 0.5]
    return prompt, [first, second, child], rewards


def batch_for(iteration: int, questions: list[int], vocab: int, pad_id: int) -> dict:
    """The batch a rank builds from its questions, as main() does: local question and parent indices."""
    prompts, rollouts, rewards = [], [], []
    for local_q, q in enumerate(questions):
        prompt, group, group_rewards = question_rollouts(iteration, q, vocab)
        for r in group:
            r.question = local_q
            r.parent = None if r.parent is None else r.parent + len(rollouts)
        prompts.append(prompt)
        rollouts += group
        rewards += group_rewards
    advantages = arpo.batch_advantages(rollouts, rewards, ARGS.attribution)
    return arpo.build_batch(prompts, rollouts, advantages, pad_id)


def train(shard: bool) -> tuple[list[list[torch.Tensor]], list[bool]]:
    """Parameters after each iteration, and whether the ranks agreed bit for bit after it."""
    model, tokenizer = load_policy(TINY_MODEL, dtype="float64")
    policy = dist.wrap(model, "ddp") if shard else model
    optimizer = torch.optim.SGD(policy.parameters(), lr=ARGS.lr)
    params, agree = [], []
    for iteration, n in QUESTIONS.items():
        questions = dist.shard(list(range(n))) if shard else list(range(n))
        batch = batch_for(iteration, questions, len(tokenizer), tokenizer.pad_token_id)
        arpo.update(policy, optimizer, batch, ARGS, random.Random(iteration))
        params.append([p.detach().clone() for p in model.parameters()])
        agree.append(ranks_agree(params[-1]))
    return params, agree


if __name__ == "__main__":
    save_ranked(train, sys.argv[1])
