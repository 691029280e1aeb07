"""The update's attention on this CPU: one prefix-forest segment's forward+backward, per kernel.

    .venv/bin/python -m benchmarks.bench_attention --threads 2

A segment (common/logprobs.py: forest_attention) is L new tokens attending to A ancestors and,
causally, to themselves: keys A + L, heads 9, head dim 64 (SmolLM2-135M after repeat_kv). Per shape
and dtype, medians of forward+backward, alternating:
  sdpa: what the update runs, SDPA with the segment's boolean mask (the CPU flash kernel);
  math: scores as matmuls, the softmax in fp32, autograd's backward (keeps the score matrices);
  split: the flash kernel twice, the ancestors unmasked and the chain causal, merged by their
    log-sum-exps; backward by the flash kernel's backward op on each part, given the merged output
    and log-sum-exp (exact: a part's gradient needs only the whole softmax's output and normaliser);
  flex: torch's flex_attention with a block mask, compiled (reports the error where it cannot run).
GFLOP/s count 4·d·heads per (query, key) pair, masked or not, ×3 for forward+backward; the bf16
matmul peak is bench_limits' (a 4096x576x1536 matmul).
"""

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks.bench_limits import machine_limits
from common.cli import parse_args

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class Args:
    shapes: str = field(default="260x180,100x400,440x0",
                        metadata={"help": "LxA,...: new tokens x ancestors"})
    repeats: int = field(default=20, metadata={"help": "timed repeats of each kernel (medians)"})
    threads: int = field(default=0, metadata={"help": "torch threads; 0 = torch default"})


def segment_mask(length: int, ancestors: int) -> torch.Tensor:
    mask = torch.ones(length, ancestors + length, dtype=torch.bool)  # (L, A + L)
    mask[:, ancestors:] = torch.ones(length, length, dtype=torch.bool).tril()
    return mask


def split_attention(q, k, v, grad, ancestors: int, scale: float):
    """Forward and backward of the ancestors and the chain apart, merged by log-sum-exp."""
    parts = [(k[:, :, ancestors:], v[:, :, ancestors:], True)]  # the chain: causal
    if ancestors:
        parts.insert(0, (k[:, :, :ancestors], v[:, :, :ancestors], False))  # its ancestors: all
    outs = [FLASH(q, pk, pv, 0.0, causal, scale=scale) for pk, pv, causal in parts]  # (out, lse)
    lse = outs[0][1] if len(outs) == 1 else torch.logaddexp(outs[0][1], outs[1][1])  # (1, H, L)
    out = sum(o.float() * (part_lse - lse).exp()[..., None] for o, part_lse in outs).to(q.dtype)
    grads = [FLASH_BACKWARD(grad, q, pk, pv, out, lse, 0.0, causal, scale=scale)
             for pk, pv, causal in parts]
    dq = sum(g[0] for g in grads)
    return out, dq, torch.cat([g[1] for g in grads], 2), torch.cat([g[2] for g in grads], 2)


def kernels(length: int, ancestors: int, dtype: torch.dtype, heads: int = 9, dim: int = 64) -> dict:
    """Per kernel: a function running forward+backward, and its largest difference from sdpa's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, dim, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, heads, ancestors + length, dim, generator=g).to(dtype).requires_grad_()
            for _ in range(2))
    grad = torch.randn(1, heads, length, dim, generator=g).to(dtype)
    mask, scale = segment_mask(length, ancestors), dim ** -0.5
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)

    def backward(out):
        q.grad = k.grad = v.grad = None
        out.backward(grad)
        return out, q.grad, k.grad, v.grad

    def sdpa():
        return backward(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))

    def math():
        scores = (q @ k.transpose(-1, -2)) * scale + additive  # (1, H, L, A + L)
        return backward(scores.float().softmax(-1).to(dtype) @ v)

    def split():
        with torch.no_grad():
            return split_attention(q, k, v, grad, ancestors, scale)

    out = {"sdpa": sdpa, "math": math, "split": split}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def visible(b, h, query, key):
            return key <= query + ancestors

        block_mask = create_block_mask(visible, 1, 1, length, ancestors + length, device="cpu")
        compiled = torch.compile(flex_attention)

        def flex():
            return backward(compiled(q, k, v, block_mask=block_mask, scale=scale))

        flex()
        out["flex"] = flex
    except Exception as e:  # noqa: BLE001 - reported, the others still run
        out["flex"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(Args, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = machine_limits("4096,576,1536", 100)["bf16_gflops"]
    rows = []
    print(f"bf16 matmul peak {peak:.0f} GFLOP/s, threads {torch.get_num_threads()}\n"
          "| dtype | L x A | kernel | fwd+bwd ms | GFLOP/s | of the bf16 peak "
          "| max diff from sdpa |\n|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for shape in args.shapes.split(","):
            length, ancestors = map(int, shape.split("x"))
            runs = kernels(length, ancestors, dtype)
            timed = {name: fn for name, fn in runs.items() if callable(fn)}
            want = timed["sdpa"]()
            diff = {name: max((a - b).abs().max().item() for a, b in zip(fn(), want, strict=True))
                    for name, fn in timed.items()}  # output and the three gradients
            times = {name: [] for name in timed}
            for _ in range(args.repeats):  # alternating: load drifts hit every kernel
                for name, fn in timed.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            flops = 3 * 4 * 64 * 9 * length * (ancestors + length)
            for name, result in runs.items():
                if not callable(result):
                    print(f"| {str(dtype)[6:]} | {shape} | {name} | - | - | - | {result} |")
                    rows.append({"dtype": str(dtype), "shape": shape, "kernel": name,
                                 "error": result})
                    continue
                ms = 1e3 * statistics.median(times[name])
                rate = flops / ms / 1e6
                print(f"| {str(dtype)[6:]} | {shape} | {name} | {ms:.2f} | {rate:.0f} | "
                      f"{100 * rate / peak:.0f}% | {diff[name]:.1e} |")
                rows.append({"dtype": str(dtype), "shape": shape, "kernel": name, "ms": ms,
                             "gflops": rate, "max_diff": diff[name]})
    return rows


if __name__ == "__main__":
    main()
