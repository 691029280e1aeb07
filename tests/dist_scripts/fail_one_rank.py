"""Run under `torchrun --nproc-per-node 2`: rank 1 raises while rank 0 waits in a barrier. With
`dist.entrypoint` the job must end quickly with rank 1's message, not hang until the timeout."""

from common import dist


@dist.entrypoint
def main() -> None:
    dist.init(timeout_s=600)
    if dist.rank() == 1:
        raise ValueError("rank one broke on purpose")
    dist.barrier()


if __name__ == "__main__":
    main()
