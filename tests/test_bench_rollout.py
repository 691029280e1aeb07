"""benchmarks/bench_rollout.py on the tiny model: every engine plays the step, every pass is timed."""

from benchmarks import bench_rollout


def test_each_hf_engine_plays_the_same_step(capsys):
    rows = bench_rollout.main([
        "--model", "tiny-random", "--setting", "default", "--engines", "hf", "hf-cache", "hf-bf16",
        "--repeats", "1", "--threads", "1",
        "--flags", "--tasks-per-step 1 --group-size 2 --max-new-tokens 6 --max-turns 2 --tti-chunk 3"])
    assert [r["engine"] for r in rows] == ["hf", "hf-cache", "hf-bf16"]
    assert all(r["seconds"] > 0 and r["turns"] >= 2 and r["tokens"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert all(f"| {name} |" in printed for name in ("hf", "hf-cache", "hf-bf16"))


def test_passes_cover_both_precisions_kernels_and_packed_weights():
    rows = bench_rollout.main(["--model", "tiny-random", "--passes", "--batch", "2", "--cache", "8",
                               "--threads", "1"])
    assert [(r["dtype"][6:], r["attention"], r["packed"], r["cache"]) for r in rows] == [
        ("float32", "sdpa", "no", "dynamic"), ("float32", "eager", "no", "dynamic"),
        ("float32", "grouped_eager", "no", "dynamic"), ("bfloat16", "sdpa", "no", "dynamic"),
        ("bfloat16", "eager", "no", "dynamic"), ("bfloat16", "grouped_eager", "no", "dynamic"),
        ("bfloat16", "grouped_eager", "each", "dynamic"),
        ("bfloat16", "grouped_eager", "shared", "dynamic"),
        ("bfloat16", "grouped_eager", "shared", "reserved")]
    assert all(r["prefill_s"] > 0 and r["decode_ms"] > 0 for r in rows)
