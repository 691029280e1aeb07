"""t2po.update on a fixed list of turn samples, under `torchrun --nproc-per-node 2` or as one process.

Each rank takes its whole groups (`dist.shard`) and trains the DDP-wrapped tiny model for 2 iterations on
them. After each iteration the ranks' parameters are compared (elementwise max == min over ranks) and rank
0 saves them to <out>/step<k>.pt, so the test can compare a 2-rank run with one process that trained on the
whole list. 3 groups on 2 ranks: rank 0 holds 2 groups and rank 1 one, so rank 1 runs zero-weight padding
micro-batches. float64 so that the only difference, the order of the sums, stays far below the tolerance.
Usage: python t2po_update.py OUT_DIR   (or under torchrun)."""

import dataclasses
import os
import sys

import numpy as np
import torch
from worker import ranks_agree

import t2po
from common import dist
from common.models import load_policy


def fixed_groups() -> list[list[t2po.TrainingSample]]:
    """Three GiGPO groups of 2, 3 and 4 turn samples with fixed tokens and advantages (origin: (group,
    sample), the same on every rank); in each second sample the first response token is a forced one (mask
    0)."""
    g = torch.Generator().manual_seed(0)
    groups = []
    for group in range(3):
        samples = []
        for i in range(2 + group):
            prompt = torch.randint(100, 5000, (3 + i,), generator=g).tolist()
            response = torch.randint(100, 5000, (2 + (i * 3 + group) % 4,), generator=g).tolist()
            mask = [0 if (i == 1 and j == 0) else 1 for j in range(len(response))]
            advantage = (-1.0) ** i * (0.5 + 0.25 * group)
            samples.append(t2po.TrainingSample((group, i), prompt, response, mask,
                                               [advantage] * len(response)))
        groups.append(samples)
    return groups


@dist.entrypoint
def main(out: str) -> None:
    dist.init(timeout_s=120)
    torch.manual_seed(0)
    model, _ = load_policy("tiny-random", dtype="float64")  # the same weights on every rank
    policy = dist.wrap(model, "ddp")
    args = t2po.Args(minibatch_size=64, micro_batch_size=2, lr=1e-3, clip_eps=0.2, max_grad_norm=1.0)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0)
    mine = [s for group in dist.shard(fixed_groups()) for s in group]
    for it in range(2):
        samples = [dataclasses.replace(s) for s in mine]
        # the same shuffle on every rank: update permutes the global list of samples
        stats = t2po.update(policy, optimizer, samples, args, np.random.default_rng(it))
        tokens = t2po.loss_divisor(samples, args)  # the token-mean's divisor: every rank's policy tokens
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        agree = ranks_agree([flat])
        if dist.is_main():
            torch.save({"params": flat, "agree": agree, "stats": stats, "world": dist.world_size(),
                        "local_samples": len(mine), "tokens": tokens}, os.path.join(out, f"step{it}.pt"))
    dist.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
