"""Shared by the tests that run code under torchrun (2 or 8 ranks, gloo, on the CPU) and compare it with one
process: the launcher, the loader of a worker script, and the rank-vs-one-process parameter check."""

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_SCRIPTS = os.path.join(ROOT, "tests", "dist_scripts")
# torchrun's agent leaves a torchelastic_* folder in TMPDIR per launch: here, one folder removed at exit
TMPDIR = tempfile.mkdtemp(prefix="torchrun-tests-")
atexit.register(shutil.rmtree, TMPDIR, True)


def torchrun_command(*args: str, nproc: int = 2) -> list[str]:
    """`torchrun --nproc-per-node N` (spelled out: `--nproc` is ambiguous on Python 3.11)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
            *args]


def torchrun_env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TMPDIR=TMPDIR)


def torchrun(*args: str, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a script (its path first) and its arguments on `nproc` ranks; wait for it."""
    return subprocess.run(torchrun_command(*args, nproc=nproc), env=torchrun_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def load_script(path: str):
    """Import a worker script as a module, so the test runs its very functions in this process."""
    if DIST_SCRIPTS not in sys.path:  # the scripts import their shared tail (`worker.py`) as a sibling
        sys.path.insert(0, DIST_SCRIPTS)
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_ranks_match_one_process(ranked_path: str, script: str, start: list[torch.Tensor],
                                   steps: int = 2, atol: float = 1e-9) -> None:
    """The 2-rank run saved by `worker.save_ranked` agrees bit for bit across ranks after every step and
    equals the script's `train(shard=False)` in this process; each step moved the weights from `start`."""
    ranked = torch.load(ranked_path)
    assert ranked["world"] == 2
    assert ranked["agree"] == [True] * steps  # every parameter bit-identical on both ranks after each step
    single, _ = load_script(script).train(shard=False)  # one process, every rollout, the same functions
    for step in range(steps):
        moved = 0
        for got, want, before in zip(ranked["params"][step], single[step], start, strict=True):
            assert torch.allclose(got, want, rtol=0, atol=atol), (step, (got - want).abs().max())
            moved += int(not torch.equal(want, before))
        assert moved > 0  # the update did something to compare


def eight_ranks_then_resume(script: str, main, flags: list[str], tmp_path) -> tuple:
    """`script` for one step on 8 ranks into tmp_path/run; then its checkpoint resumed for a second step on
    2 ranks (a copy, tmp_path/two) and on one process (`main`). Both run folders must log training steps
    [1, 2]. Returns the 8-rank process, the metrics rows it wrote, and `main`'s return value."""
    out, two = tmp_path / "run", tmp_path / "two"
    path = os.path.join(ROOT, script)
    eight = torchrun(path, *flags, "--out", str(out), "--steps", "1", nproc=8)
    assert eight.returncode == 0, eight.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert (out / "checkpoints" / "step_1").is_dir()
    shutil.copytree(out, two)
    proc = torchrun(path, *flags, "--out", str(two), "--steps", "2", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = main([*flags, "--out", str(out), "--steps", "2", "--resume"])
    for run_dir in (out, two):
        assert [x["step"] for x in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if "reward_mean" in x] == [1, 2]
    return eight, lines, final
