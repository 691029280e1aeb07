"""fp32 vs bf16 autocast for the training forward+backward, side by side in one run, and what bf16 changes.

    .venv/bin/python -m benchmarks.bench_precision --model smollm2 --batch 8 --seq 400 --repeats 3

Both run the scripts' path, token_logprobs(model, ids, mask) -> sum -> backward, on the same fp32 weights:
once in fp32, once under torch.autocast(bfloat16) (matmuls in bf16, weights and gradients fp32). They
alternate within each repeat so machine load drifts affect both alike; medians are reported. Then the
log-probs and the gradients of the two are compared (bf16 keeps 8 bits of mantissa). Whether the CPU has
native bf16 (AVX512-BF16 or AMX) is printed: elsewhere bf16 is emulated and slower.
"""

import statistics
import time
from dataclasses import dataclass, field

import torch

from common.cli import parse_args
from common.logprobs import token_logprobs
from common.models import DEFAULT_MODEL, load_policy
from common.run import native_bf16


@dataclass
class Args:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model name or folder"})
    batch: int = field(default=8, metadata={"help": "sequences per batch"})
    seq: int = field(default=400, metadata={"help": "tokens per sequence"})
    repeats: int = field(default=3, metadata={"help": "timed repeats of each (after one warm-up)"})
    threads: int = field(default=0, metadata={"help": "torch threads; 0 = torch default"})
    seed: int = 0


def step(model, ids, mask, bf16: bool) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """(wall seconds, the (B, T-1) log-probs, the gradients) of one forward+backward."""
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logp = token_logprobs(model, ids, mask)  # (B, T-1)
    logp.float().sum().backward()
    return time.perf_counter() - t, logp.detach().float(), [p.grad.clone() for p in model.parameters()]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(Args, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_policy(args.model)  # fp32 weights, as the scripts train; random token ids below
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, len(tok), (args.batch, args.seq), generator=gen)  # (B, T)
    mask = torch.ones_like(ids)
    times, last = {False: [], True: []}, {}
    for r in range(args.repeats + 1):
        for bf16 in ((False, True) if r % 2 == 0 else (True, False)):
            seconds, logp, grads = step(model, ids, mask, bf16)
            if r > 0:  # repeat 0 is the warm-up
                times[bf16].append(seconds)
            last[bf16] = (logp, grads)
    tokens = args.batch * args.seq
    rate = {bf16: tokens / statistics.median(ts) for bf16, ts in times.items()}
    (lp32, g32), (lp16, g16) = last[False], last[True]
    grad_err = torch.stack([(a - b).norm() for a, b in zip(g32, g16, strict=True)]).norm() / \
        torch.stack([a.norm() for a in g32]).norm()
    print(f"{args.model} cpu batch {args.batch} x {args.seq} tokens, threads {torch.get_num_threads()}, "
          f"{args.repeats} repeats (medians); native bf16: {', '.join(native_bf16()) or 'none'}")
    print(f"  fp32:          {rate[False]:8.1f} tok/s  (s: {', '.join(f'{t:.2f}' for t in times[False])})")
    print(f"  bf16 autocast: {rate[True]:8.1f} tok/s  (s: {', '.join(f'{t:.2f}' for t in times[True])})")
    diff = (lp32 - lp16).abs()
    print(f"  speed-up {rate[True] / rate[False]:.2f}x; log-prob |diff| mean {diff.mean():.4f}, max "
          f"{diff.max():.3f}; gradient relative error {grad_err:.3f}")
    return {"fp32": rate[False], "bf16": rate[True], "speedup": rate[True] / rate[False],
            "logp_mean_abs_diff": float(diff.mean()), "grad_rel_err": float(grad_err)}


if __name__ == "__main__":
    main()
