"""Data-parallel step time: one optimizer step on a fixed GLOBAL batch with 1 rank vs 2 ranks (torchrun).

    .venv/bin/python -m benchmarks.bench_dist --model smollm2 --global-batch 4 --seq 64 --repeats 5

Without torchrun's environment this runs itself three times and prints the comparison:
  1 rank x 1 thread, 1 rank x 2 threads (both cores to one process), 2 ranks x 1 thread (DDP, gloo);
under `torchrun --nproc-per-node N` it measures one configuration. A step is forward + backward + AdamW on
the rank's share of the batch, with the loss divided by the global token count (as the scripts do), so
the same global batch costs the same compute whichever the world size. Median over `repeats` timed steps
after one warm-up. It also times a bare gloo all-reduce of all trainable gradients, DDP's communication.

Wall time only means something on an otherwise idle machine. Each rank's CPU time per step is reported
too: on a shared machine it still shows the work per rank, and 1x1 CPU / (slowest rank's CPU) is the
speed-up 2 idle cores would give if nothing else limited it.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from common import dist
from common.cli import parse_args
from common.models import DEFAULT_MODEL, load_policy


@dataclass
class Args:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model name or folder"})
    global_batch: int = field(default=4, metadata={"help": "sequences per optimizer step, all ranks"})
    seq: int = field(default=64, metadata={"help": "tokens per sequence"})
    lora_rank: int = field(default=0, metadata={"help": "0 = full fine-tune"})
    parallel: str = field(default="ddp", metadata={"help": "ddp | fsdp2 (under torchrun)"})
    repeats: int = field(default=5, metadata={"help": "timed steps (after one warm-up)"})
    threads: int = field(default=1, metadata={"help": "torch threads per rank"})
    out: str = field(default="", metadata={"help": "rank 0 writes its result here as JSON"})


def step(model, optimizer, ids: torch.Tensor, n_tokens: int) -> None:
    logits = model(input_ids=ids).logits[:, :-1].float()  # (b, T-1, V)
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    (nll / n_tokens * dist.grad_scale()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args: Args) -> dict:
    torch.set_num_threads(args.threads)
    dist.init()
    torch.manual_seed(0)
    model, tok = load_policy(args.model, lora_rank=args.lora_rank)
    policy = dist.wrap(model, args.parallel)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (args.global_batch, args.seq), generator=gen)  # (B, T), same everywhere
    rows = dist.shard(list(range(args.global_batch)))
    n_tokens = args.global_batch * (args.seq - 1)
    times, cpu = [], []
    for i in range(args.repeats + 1):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        step(policy, optimizer, ids[rows], n_tokens)
        cpu_s = time.process_time() - cpu_start  # this rank's own work (threads summed), waits excluded
        dist.barrier()
        if i:  # the first step is a warm-up (allocations, AdamW state)
            times.append(time.perf_counter() - start)
            cpu.append(dist.all_reduce(cpu_s, "max"))
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reduce_s = []
    if dist.is_distributed():
        grads = torch.zeros(n_trainable)  # (N,): what DDP all-reduces per step (in buckets)
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            torch.distributed.all_reduce(grads)
            reduce_s.append(time.perf_counter() - start)
    result = {"world_size": dist.world_size(), "threads": args.threads, "step_s": statistics.median(times),
              "steps_s": times, "cpu_s": statistics.median(cpu), "trainable": n_trainable,
              "all_reduce_s": statistics.median(reduce_s) if reduce_s else 0.0}
    if dist.is_main() and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.cleanup()
    return result


def run(nproc: int, threads: int, argv: list[str]) -> dict:
    out = f"/tmp/bench_dist_{os.getpid()}_{nproc}_{threads}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           "-m", "benchmarks.bench_dist", *argv, "--threads", str(threads), "--out", out]
    subprocess.run(cmd, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(Args, argv)
    if "WORLD_SIZE" in os.environ:  # a rank under torchrun; with 2 ranks it ends in dist.finish
        return dist.entrypoint(measure)(args)
    load = os.getloadavg()
    results = {"1x1": run(1, 1, argv), "1x2": run(1, 2, argv), "2x1": run(2, 1, argv)}
    base = results["1x1"]["step_s"]
    cpu_base = results["1x1"]["cpu_s"]
    print(f"load average at start {load[0]:.2f}; model {args.model}, global batch {args.global_batch} x "
          f"{args.seq} tokens, {results['1x1']['trainable']:,} trainable parameters")
    labels = {"1x1": "1 rank x 1 thread", "1x2": "1 rank x 2 threads", "2x1": "2 ranks x 1 thread"}
    for key, label in labels.items():
        r = results[key]
        extra = f", gloo all-reduce of all grads {r['all_reduce_s']:.3f} s" if r["all_reduce_s"] else ""
        print(f"{label:20s} step {r['step_s']:.3f} s wall (median of {len(r['steps_s'])}), speed-up vs 1x1 "
              f"{base / r['step_s']:.2f}; CPU of the slowest rank {r['cpu_s']:.3f} s, 1x1 CPU / it "
              f"{cpu_base / r['cpu_s']:.2f}{extra}")
    return results


if __name__ == "__main__":
    main()
