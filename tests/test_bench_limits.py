"""benchmarks/bench_limits.py: the distinct-prefix count, and one tiny step's table of parts."""

import json

from benchmarks import bench_limits


def test_distinct_tokens_counts_each_prefix_once():
    # prefixes: [1] [1 2] [1 2 3] [1 2 4] [5]; the repeated row and the shared [1 2] add nothing
    assert bench_limits.distinct_tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5]]) == 5
    # the same token after different prefixes is a different prefix
    assert bench_limits.distinct_tokens([[1, 3], [2, 3]]) == 4
    assert bench_limits.distinct_tokens([]) == 0


def test_a_tiny_step_reports_every_part(tmp_path, capsys):
    out = tmp_path / "limits.json"
    # one task, a group of 4 identical first prompts: the update's unpacked rows repeat the prompt
    result = bench_limits.main([
        "--model", "tiny-random", "--repeats", "1", "--threads", "1", "--peak-shape", "128,64,64",
        "--bandwidth-mb", "8", "--json", str(out), "--profile",
        "--flags", "--tasks-per-step 1 --group-size 4 --max-new-tokens 6 --max-turns 1 --no-tds --no-tti"])
    printed = capsys.readouterr().out
    parts = result["parts"]
    names = ["prefill (rollout, ", "decode step (+ sampling)", "update, unpacked",
             "update, shared prefixes"]
    for name in names:
        assert any(p.startswith(name) for p in parts), name
        assert any(line.startswith(f"| {name}") for line in printed.splitlines()), name
    assert any(p.startswith("decode forward (batch 4, cache ") for p in parts)
    limits = result["limits"]
    assert limits["fp32_gflops"] > 0 and limits["bf16_gflops"] > 0 and limits["bandwidth_gbs"] > 0
    compute = {n: p for n, p in parts.items() if "gflops" in p}
    assert len(compute) == 3
    for p in compute.values():
        assert 0 < p["distinct"] <= p["processed"] and p["seconds"] > 0 and p["gflops"] > 0
    unpacked = next(p for n, p in parts.items() if n.startswith("update, unpacked"))
    shared = next(p for n, p in parts.items() if n.startswith("update, shared"))
    prefill = next(p for n, p in parts.items() if n.startswith("prefill (rollout, "))
    # 4 turn samples with one prompt: unpacked runs the prompt 4 times, packed once
    assert unpacked["samples"] == 4 and unpacked["distinct"] < unpacked["processed"]
    assert unpacked["distinct"] == shared["distinct"] == shared["processed"] < unpacked["processed"]
    # attention as computed: the prompt's pairs once, each response's against the prompt and itself
    assert 0 < shared["attention_pairs"] < unpacked["attention_pairs"]
    # the generator prefills the group's one prompt once: no repeat, but the first row counts all
    assert prefill["calls"] == 1 and prefill["distinct"] == prefill["processed"] == prefill["real_tokens"]
    assert json.loads(out.read_text())["parts"].keys() == parts.keys()
    # --profile: the shared update's time by kernel, each kind present, summing to the total
    kernels = shared["kernels_s"]
    assert all(kernels[kind] > 0 for kind in ("matmul", "attention", "other"))
    kinds = kernels["matmul"] + kernels["attention"] + kernels["other"]
    assert abs(kinds - kernels["total"]) < 1e-9
    assert "kernels_s" not in unpacked
    assert any(line.startswith("update, shared prefixes") and "by kernel" in line
               for line in printed.splitlines())


def test_with_tti_the_prefix_cache_prefills_each_chunk_behind_the_kv_before_it(capsys):
    """TTI continues each response in chunks of --tti-chunk tokens: with the prefix cache every chunk
    after the first feeds only what the cached KV lacks; without it each re-prefills its whole row."""
    flags = ("--tasks-per-step 1 --group-size 2 --max-new-tokens 12 --tti-chunk 4 --tti-min-think 100 "
             "--max-turns 1 --no-tds")
    base = ["--model", "tiny-random", "--repeats", "1", "--threads", "1", "--peak-shape", "64,64,64",
            "--bandwidth-mb", "8"]
    with_cache = bench_limits.main([*base, "--flags", flags])["parts"]
    without = bench_limits.main([*base, "--flags", flags + " --no-share-prefixes"])["parts"]
    on = next(p for n, p in with_cache.items() if n.endswith("prefix cache on)"))
    off = next(p for n, p in without.items() if n.endswith("prefix cache off)"))
    assert on["calls"] == off["calls"] > 1 and on["cached_calls"] == on["calls"] - 1
    assert off["cached_calls"] == 0
    assert on["processed"] < off["processed"] and on["distinct"] == off["distinct"]
