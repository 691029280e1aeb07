"""benchmarks/bench_attention.py on small segments: every kernel timed or its refusal reported."""

import torch

from benchmarks import bench_attention


def test_every_kernel_is_timed_or_reports_why_not(capsys):
    rows = bench_attention.main(["--shapes", "8x5,6x0", "--repeats", "1", "--threads", "1"])
    kinds = {(r["dtype"], r["shape"], r["kernel"]) for r in rows}
    assert kinds == {(d, s, k) for d in ("torch.bfloat16", "torch.float32") for s in ("8x5", "6x0")
                     for k in ("sdpa", "math", "split", "flex")}
    for r in rows:
        assert r.get("error") or r["ms"] > 0
    exact = [r for r in rows if r["dtype"] == "torch.float32" and "max_diff" in r]
    assert exact and all(r["max_diff"] < 1e-5 for r in exact)  # the same attention, fp32 rounding
    assert "| sdpa |" in capsys.readouterr().out


def test_split_attention_is_the_masked_attention_and_its_gradients():
    """The split's merge by log-sum-exp and its per-part backward, against autograd through SDPA
    with the segment's mask (computed here, not by the benchmark)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 4, 8, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 7, 8, generator=g).requires_grad_() for _ in range(2))
    grad = torch.randn(1, 2, 4, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # 3 ancestors, then causal
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(grad)
    with torch.no_grad():
        got = bench_attention.split_attention(q, k, v, grad, 3, 8 ** -0.5)
    for a, b in zip(got, (out, q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
