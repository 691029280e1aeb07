"""Run under `torchrun --nproc-per-node 2`: collectives, sharding, and one DDP / FSDP2 step on a tiny model.

Each rank trains on its shard of a fixed batch with the loss divided by the global count; the result must
equal one process training on the whole batch. Rank 0 writes what it saw to argv[1] as JSON."""

import json
import sys

import torch
from torch import nn

from common import dist


def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical init on every rank
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_global: int, scale: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = ((model(x).squeeze(-1) - y) ** 2).sum() / n_global * scale
    loss.backward()
    opt.step()
    return [p.detach().full_tensor().flatten().tolist() if hasattr(p, "full_tensor") else
            p.detach().flatten().tolist() for p in model.parameters()]


@dist.entrypoint
def main(out_path: str, strategy: str) -> None:
    dist.init(timeout_s=60)
    torch.manual_seed(1)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)  # same on all ranks
    rows = dist.shard(list(range(5)))
    n_global = dist.all_reduce(len(rows))
    params = step(dist.wrap(make_model(), strategy), x[rows], y[rows], n_global, dist.grad_scale())
    gathered = dist.all_gather_object(params)
    result = {
        "shards": dist.all_gather_object(rows),
        "n_global": n_global,
        "max_rows": dist.all_reduce(len(rows), "max"),
        "tensor_sum": dist.all_reduce(torch.tensor([1.0, float(dist.rank())])).tolist(),
        "from_main": dist.broadcast_object({"r": dist.rank()}),
        "ranks_agree": all(g == gathered[0] for g in gathered),
        "params": params,
        "single_process": step(make_model(), x, y, 5, 1),
    }
    if dist.is_main():
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.cleanup()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
