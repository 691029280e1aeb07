import json
import os
import time

import pytest
import torch.multiprocessing as mp
from torchrun_util import DIST_SCRIPTS, torchrun

from common import dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_single_process_is_trivial(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert dist.init() == "cpu"  # no torchrun environment: nothing initialised
    assert not dist.is_distributed()
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (0, 1, True)
    assert dist.rank_seed(7) == 7
    assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
    dist.barrier()
    dist.cleanup()


def _worker(local_rank: int, port: int, results) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert dist.init() == "cpu"
    gathered = dist.all_gather_object({"rank": dist.rank(), "seed": dist.rank_seed(5)})
    dist.barrier()
    results[local_rank] = (dist.is_main(), dist.world_size(), gathered)
    dist.cleanup()
    dist.finish()  # as a script's rank ends (dist.entrypoint): no interpreter shutdown to race gloo's worker


@pytest.mark.slow
def test_two_ranks_over_gloo():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(port, results), nprocs=2, join=True)
    expected = [{"rank": 0, "seed": 5}, {"rank": 1, "seed": 1005}]
    assert results[0] == (True, 2, expected)
    assert results[1] == (False, 2, expected)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_step_equals_single_process(tmp_path, strategy):
    out = tmp_path / "result.json"
    proc = torchrun(os.path.join(DIST_SCRIPTS, "collectives.py"), str(out), strategy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shards"] == [[0, 2, 4], [1, 3]]  # whole items, round-robin
    assert (result["n_global"], result["max_rows"]) == (5, 3)
    assert result["tensor_sum"] == [2.0, 1.0]  # [1 + 1, 0 + 1]
    assert result["from_main"] == {"r": 0}
    assert result["ranks_agree"]
    # loss / global count on each rank, gradients averaged then scaled by W == one process, whole batch
    for got, want in zip(result["params"], result["single_process"], strict=True):
        assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["loop", "arpo", "t2po"])
def test_eight_ranks_update_equals_single_process(tmp_path, script):
    """World size 8 (issue 26): each script's own update on fixed rollouts of 3, 8 and 12 task groups (5 ranks
    without a group; one each; 4 ranks with two), through DDP and then FSDP2 (tests/dist_scripts/
    eight_ranks.py). After every update all 8 ranks hold bit-identical parameters, equal to one process that
    trained on every group with the same functions (float64; the sums' order differs: atol 1e-12)."""
    import subprocess

    import torch
    from torchrun_util import load_script, torchrun_command, torchrun_env

    path = os.path.join(DIST_SCRIPTS, "eight_ranks.py")
    proc = subprocess.Popen(torchrun_command(path, script, str(tmp_path / "ranks.pt"), nproc=8),
                            env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = load_script(path)
    one, _ = worker.train(script, None)  # meanwhile, one process on every group
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in worker.load_policy(worker.TINY_MODEL,
                                                                         dtype="float64")[0].parameters()])
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    ranks = torch.load(tmp_path / "ranks.pt")
    assert ranks["world"] == 8
    for strategy in ("ddp", "fsdp2"):
        params, agree = ranks[strategy]
        assert agree == [True, True, True], strategy  # every rank identical after each update
        for k, (got, want) in enumerate(zip(params, one, strict=True)):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (strategy, k, (got - want).abs().max())
    assert all(not torch.equal(a, b) for a, b in zip(one, [start, *one[:-1]], strict=True))  # each moved


@pytest.mark.slow
def test_one_failing_rank_stops_all_with_its_message():
    start = time.monotonic()
    # rank 0 waits in a barrier with a 600 s timeout
    proc = torchrun(os.path.join(DIST_SCRIPTS, "fail_one_rank.py"))
    assert proc.returncode != 0
    assert "[rank 1] ValueError: rank one broke on purpose" in proc.stderr
    assert 'raise ValueError("rank one broke on purpose")' in proc.stderr  # a bug: its traceback helps
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_a_user_error_on_one_rank_is_its_one_line_without_a_traceback():
    proc = torchrun(os.path.join(DIST_SCRIPTS, "fail_one_rank.py"), "exit")
    assert proc.returncode != 0
    assert "[rank 1] script.py: --flag 0: must be >= 1" in proc.stderr
    # rank 1 printed no traceback (it would quote its source line); rank 0, cut off in its barrier, does
    assert 'sys.exit("script.py' not in proc.stderr, proc.stderr[-2000:]


def test_full_weights_of_an_unsharded_model_are_its_merged_weights():
    import inspect

    import torch

    from common.models import TINY_MODEL, load_policy, merged_state_dict

    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    with torch.no_grad():  # a non-zero LoRA delta, so merging matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    assert not dist.is_sharded(model)
    weights = dist.full_weights(model)
    assert inspect.isgenerator(weights)  # consumed lazily, one tensor at a time
    got, want = dict(weights), merged_state_dict(model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)


def test_on_gpus_cpu_tensors_have_a_backend_too(monkeypatch):
    """Under torchrun on GPUs the scripts all-reduce CPU numbers (loss statistics, counts) beside CUDA
    tensors: the process group must carry gloo for CPU tensors as well as nccl (nccl alone fails with
    'No backend type associated with device type cpu'). No GPU here: CUDA is faked up to the group's
    creation, whose arguments are recorded."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist.dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(dist, "is_distributed", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.init() == "cuda:1"
    assert calls == ["cpu:gloo,cuda:nccl"]


FINISHING_SCRIPT = """
import atexit, sys
from common import dist

class Finalized:
    def __del__(self):  # runs during interpreter shutdown, which a finished rank must not enter
        print("interpreter shutdown", flush=True)

keep = Finalized()
atexit.register(lambda: print("atexit ran"))  # unflushed: finish() must flush it

@dist.entrypoint
def main(how):
    print("main ran")
    if how == "exit0":
        sys.exit(0)
    if how == "exit":
        sys.exit()

main(sys.argv[1])
print("after main")
"""


@pytest.mark.parametrize("how", ["return", "exit0", "exit"])
def test_a_finished_rank_ends_without_interpreter_shutdown(tmp_path, how):
    """A rank that finished must not reach interpreter shutdown, where gloo's worker thread, still dropping
    the last collective's tensors, asks for the GIL and the rank aborts (dist.finish). No process group is
    needed to see the exit path: WORLD_SIZE=2 alone selects it."""
    import subprocess
    import sys

    script = tmp_path / "finishing.py"
    script.write_text(FINISHING_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE="2", RANK="0")
    proc = subprocess.run([sys.executable, str(script), how], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["main", "ran", "atexit", "ran"]  # no "after main", no shutdown
    assert proc.stderr == ""


def test_in_a_single_process_a_finished_main_returns_and_python_shuts_down_as_usual(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "finishing.py"
    script.write_text(FINISHING_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, str(script), "return"], env=dict(env, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["main ran", "after main", "atexit ran", "interpreter shutdown"]
