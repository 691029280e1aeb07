"""The shared tail of the worker scripts that train under torchrun: check that the ranks agree bit for
bit, and let rank 0 save what the test compares with one process (tests/torchrun_util.py)."""

import torch

from common import dist


def ranks_agree(params: list[torch.Tensor]) -> bool:
    """Every tensor equal on all ranks: its elementwise max over ranks equals its min."""
    return all(torch.equal(dist.all_reduce(p, "max"), dist.all_reduce(p, "min")) for p in params)


@dist.entrypoint
def save_ranked(train, out_path: str) -> None:
    """train(shard=True) -> (parameters after each step, ranks agreed after each step); rank 0 saves both."""
    dist.init(timeout_s=120)
    params, agree = train(shard=True)
    if dist.is_main():
        torch.save({"params": params, "agree": agree, "world": dist.world_size()}, out_path)
    dist.cleanup()
