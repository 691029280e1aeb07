import errno
import importlib
import json
import os
import random
import re
import resource
import signal
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torchrun_util import DIST_SCRIPTS, load_script, torchrun

from common.checkpoint import load_checkpoint, prepare_run_dir, save_checkpoint
from common.models import TINY_MODEL, load_policy, merged_state_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IDS = torch.tensor([[1, 504, 3458, 28, 1028, 2]])  # (1, 6)


@dataclass
class Args:
    lr: float = 1e-3
    env: str = "toy"


def train_step(model, optimizer) -> None:
    loss = model(input_ids=IDS, labels=IDS).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora_rank", [2, 0])
def test_resume_restores_weights_optimizer_and_rng(tmp_path, lora_rank):
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL, lora_rank=lora_rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        train_step(model, optimizer)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = save_checkpoint(str(tmp_path), 2, model, optimizer, Args(), extra={"best": 0.5})
    assert os.path.basename(path) == "step_2"
    saved = trainable(model)
    expected_draws = draws()
    train_step(model, optimizer)  # the uninterrupted run's next step
    expected_next = trainable(model)

    # a fresh process: new model and optimizer, RNGs elsewhere
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    model2, _ = load_policy(TINY_MODEL, lora_rank=lora_rank)
    optimizer2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=1e-2)
    state = load_checkpoint(str(tmp_path), model2, optimizer2)
    assert state["step"] == 2 and state["extra"] == {"best": 0.5}
    assert state["args"] == {"lr": 1e-3, "env": "toy"}
    restored = trainable(model2)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert optimizer2.state_dict()["state"][0]["step"] == 2
    assert draws() == expected_draws
    train_step(model2, optimizer2)  # resumed run: same next step exactly (AdamW moments restored too)
    resumed_next = trainable(model2)
    assert all(torch.equal(resumed_next[k], expected_next[k]) for k in expected_next)


def test_keeps_last_two_and_survives_a_kill_mid_write(tmp_path, monkeypatch):
    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in (1, 2, 3):
        train_step(model, optimizer)
        save_checkpoint(str(tmp_path), step, model, optimizer, {"seed": step})
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["step_2", "step_3"]
    good = trainable(model)

    # kill mid-write #1: a previous process died leaving a half-written temp folder
    stale = folder / ".tmp-step_4-dead"
    (stale / "weights").mkdir(parents=True)
    (stale / "optimizer.pt").write_bytes(b"\x00garbage")
    # kill mid-write #2: this process crashes while writing step 5
    train_step(model, optimizer)
    real_save = torch.save

    def crash_on_state(obj, path, *a, **k):
        if str(getattr(path, "name", path)).endswith("state.pt"):  # a path, or the file opened on it
            raise KeyboardInterrupt("killed")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", crash_on_state)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 5, model, optimizer, {"seed": 5})
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".tmp-step_4")) == ["step_2", "step_3"]

    fresh, _ = load_policy(TINY_MODEL, lora_rank=2)
    opt = torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
    state = load_checkpoint(str(tmp_path), fresh, opt)
    assert state["step"] == 3 and state["args"] == {"seed": 3}
    restored = trainable(fresh)
    assert all(torch.equal(restored[k], good[k]) for k in good)

    save_checkpoint(str(tmp_path), 6, model, optimizer, {"seed": 6})  # next save clears the debris
    assert sorted(os.listdir(folder)) == ["step_3", "step_6"]
    assert json.loads((folder / "step_6" / "args.json").read_text()) == {"seed": 6}


def test_no_checkpoint_returns_none(tmp_path):
    assert load_checkpoint(str(tmp_path), torch.nn.Linear(1, 1), None) is None


def _optimizer_by_name(model, optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in optimizer.state.items()}


def _assert_same_optimizer(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(got) > 0
    for name in want:
        assert got[name].keys() == want[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(got[name][k], want[name][k]) for k in want[name]), name


def test_resume_trains_at_the_lr_given_now_with_the_saved_moments(tmp_path):
    # torch's load_state_dict would also restore the checkpoint's lr: `--resume --lr 0` would then train
    model, _ = load_policy(TINY_MODEL, lora_rank=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_step(model, optimizer)
    save_checkpoint(str(tmp_path), 1, model, optimizer, Args())
    model2, _ = load_policy(TINY_MODEL, lora_rank=0)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.0, weight_decay=0.0)
    load_checkpoint(str(tmp_path), model2, optimizer2)
    assert [(g["lr"], g["weight_decay"]) for g in optimizer2.param_groups] == [(0.0, 0.0)]
    assert optimizer2.state_dict()["state"][0]["step"] == 1  # the moments are the checkpoint's
    before = trainable(model2)
    train_step(model2, optimizer2)
    assert all(torch.equal(p, before[n]) for n, p in trainable(model2).items())  # lr 0: nothing moves


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank,nproc", [(0, 2), (2, 2), (0, 8)])
def test_fsdp2_checkpoint_from_n_ranks_resumes_in_one_process_and_back(tmp_path, lora_rank, nproc):
    # nproc 8: 4 rows of data on 8 ranks, so ranks 4-7 hold no row (issue 26)
    script = load_script(os.path.join(DIST_SCRIPTS, "fsdp2_checkpoint.py"))
    # a checkpoint written by ONE process, which the FSDP2 ranks resume first
    model = script.make(lora_rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    script.train_step(model, optimizer, [0, 1, 2, 3], 4 * 11, 1)
    save_checkpoint(str(tmp_path / "single"), 1, model, optimizer, Args())

    proc = torchrun(os.path.join(DIST_SCRIPTS, "fsdp2_checkpoint.py"), str(tmp_path), str(lora_rank),
                    str(tmp_path / "single"), nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]

    from_one = torch.load(tmp_path / "from_one.pt")  # what the ranks hold after resuming, gathered
    assert from_one["step"] == 1
    assert all(torch.equal(from_one["params"][n], p) for n, p in model.named_parameters())
    _assert_same_optimizer(from_one["optim"], _optimizer_by_name(model, optimizer))

    # the N-rank FSDP2 checkpoint resumes in one plain process: identical parameters and AdamW state
    reference = torch.load(tmp_path / "reference.pt")  # gathered by the ranks with DTensor.full_tensor()
    torch.manual_seed(5)
    model2, _ = load_policy(TINY_MODEL, lora_rank=lora_rank)
    optimizer2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=1e-2)
    state = load_checkpoint(str(tmp_path / "run"), model2, optimizer2)
    assert state["step"] == 2 and state["args"] == {"lora_rank": lora_rank}
    params = dict(model2.named_parameters())
    assert params.keys() == reference["params"].keys()
    assert all(torch.equal(params[n], reference["params"][n]) for n in params)
    _assert_same_optimizer(_optimizer_by_name(model2, optimizer2), reference["optim"])

    # the FSDP2 weight iterator (one parameter gathered at a time) gave exactly the merged weights
    pushed = torch.load(tmp_path / "full_weights.pt")
    merged = merged_state_dict(model2)
    assert pushed.keys() == merged.keys()
    assert all(torch.equal(pushed[k], merged[k]) for k in merged)

    # and the resumed process's next step on the whole batch is the N-rank step on shards of it
    script.train_step(model2, optimizer2, [0, 1, 2, 3], 4 * 11, 1)
    after = torch.load(tmp_path / "next.pt")
    for n, p in model2.named_parameters():
        torch.testing.assert_close(p.detach(), after[n], atol=1e-5, rtol=0)
    moved = [n for n in after if not torch.equal(after[n], reference["params"][n])]
    assert moved and (not lora_rank or all("lora_" in n for n in moved))  # LoRA: the frozen base stays


# ---------------------------------------------------------------- unreadable checkpoints, the run folder

def _two_checkpoints(tmp_path):
    """step_1 and step_2 of a LoRA model; returns (model, optimizer, step 1's trainable weights)."""
    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_step(model, optimizer)
    save_checkpoint(str(tmp_path), 1, model, optimizer, {"seed": 1})
    at_step_1 = trainable(model)
    train_step(model, optimizer)
    save_checkpoint(str(tmp_path), 2, model, optimizer, {"seed": 2})
    return model, optimizer, at_step_1


@pytest.mark.parametrize("name", ["weights/adapter_model.safetensors", "optimizer.pt", "state.pt",
                                  "args.json"])
@pytest.mark.parametrize("keep", [0.5, 0])  # cut in half; empty (written, never flushed to the disk)
def test_truncated_checkpoint_is_named_and_the_previous_one_resumed(tmp_path, capsys, name, keep):
    model, optimizer, at_step_1 = _two_checkpoints(tmp_path)
    bad = tmp_path / "checkpoints" / "step_2" / name
    bad.write_bytes(bad.read_bytes()[:int(keep * bad.stat().st_size)])
    state = load_checkpoint(str(tmp_path), model, optimizer)
    assert state["step"] == 1 and state["args"] == {"seed": 1}
    restored = trainable(model)
    assert all(torch.equal(restored[k], at_step_1[k]) for k in at_step_1)
    err = [line for line in capsys.readouterr().err.splitlines() if "unreadable" in line]  # not tqdm's
    assert len(err) == 1 and f"step_2 is unreadable ({name}: " in err[0] and "resuming from step_1" in err[0]
    # set aside: not resumed again, not counted among the two kept, and the file stays for a post-mortem
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1", "step_2.unreadable"]


def test_no_readable_checkpoint_starts_fresh_and_restores_nothing(tmp_path, capsys):
    model, optimizer, _ = _two_checkpoints(tmp_path)
    for step in (1, 2):
        (tmp_path / "checkpoints" / f"step_{step}" / "state.pt").write_bytes(b"")
    before = trainable(model)
    assert load_checkpoint(str(tmp_path), model, optimizer) is None
    after = trainable(model)  # every file is read before anything is restored
    assert all(torch.equal(after[k], before[k]) for k in before)
    err = [line for line in capsys.readouterr().err.splitlines() if "unreadable" in line]
    assert len(err) == 2 and "step_1 is unreadable (state.pt" in err[-1]
    assert err[-1].endswith("; starting fresh")


def test_an_unreadable_checkpoint_is_set_aside_beside_an_earlier_unreadable_one(tmp_path, capsys):
    """step_2 found unreadable twice (written again after the first resume): both copies are kept for a
    post-mortem, and neither is resumed nor counted among the two checkpoints kept."""
    model, optimizer, _ = _two_checkpoints(tmp_path)
    folder = tmp_path / "checkpoints"
    (folder / "step_2" / "state.pt").write_bytes(b"")
    assert load_checkpoint(str(tmp_path), model, optimizer)["step"] == 1
    save_checkpoint(str(tmp_path), 2, model, optimizer, {"seed": 2})  # the resumed run redoes step 2
    optimizer_pt = folder / "step_2" / "optimizer.pt"
    optimizer_pt.write_bytes(optimizer_pt.read_bytes()[:100])
    assert load_checkpoint(str(tmp_path), model, optimizer)["step"] == 1
    assert sorted(os.listdir(folder)) == ["step_1", "step_2.unreadable", "step_2.unreadable-2"]
    assert (folder / "step_2.unreadable" / "state.pt").stat().st_size == 0  # the first copy, as it was
    assert (folder / "step_2.unreadable-2" / "optimizer.pt").stat().st_size == 100
    for step in (3, 4):
        save_checkpoint(str(tmp_path), step, model, optimizer, {"seed": step})
    assert sorted(os.listdir(folder)) == ["step_2.unreadable", "step_2.unreadable-2", "step_3", "step_4"]
    assert load_checkpoint(str(tmp_path), model, optimizer)["step"] == 4


def _args(**kw):
    return SimpleNamespace(**{"out": "", "resume": False, "steps": 2, "lr": 1e-3, **kw})


def test_default_run_folder_is_a_new_one_per_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first, second = prepare_run_dir("loop.py", _args()), prepare_run_dir("loop.py", _args())
    assert first != second and first.startswith("runs/loop-") and second.startswith("runs/loop-")
    assert re.fullmatch(r"runs/loop-\d{8}-\d{6}(-\d+)?", first), first
    for run in (first, second):
        assert json.loads((tmp_path / run / "args.json").read_text())["out"] == run
    assert f"run folder {first}" in capsys.readouterr().out


def test_existing_run_folder_is_refused_without_resume(tmp_path):
    out = tmp_path / "run"
    prepare_run_dir("arpo.py", _args(out=str(out)))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit) as exc:
        prepare_run_dir("arpo.py", _args(out=str(out), steps=3))
    assert str(exc.value) == (f"arpo.py: --out {out} already holds a run; pass --resume to continue it, "
                              "or another --out")
    assert json.loads((out / "args.json").read_text())["steps"] == 2  # nothing of the first run touched
    prepare_run_dir("arpo.py", _args(out=str(tmp_path / "empty")))
    assert prepare_run_dir("arpo.py", _args(out=str(tmp_path / "empty-too"))) == str(tmp_path / "empty-too")


def test_resume_prints_changed_args_or_that_it_starts_fresh(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert prepare_run_dir("t2po.py", _args(out=out, resume=True)) == out  # no folder yet
    assert capsys.readouterr().out.strip() == f"t2po.py: --resume: no checkpoint in {out}; starting fresh"
    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    save_checkpoint(out, 2, model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    capsys.readouterr()
    prepare_run_dir("t2po.py", _args(out=out, resume=True))
    assert capsys.readouterr().out == ""  # same args: nothing to say
    prepare_run_dir("t2po.py", _args(out=out, resume=True, steps=4, lr=2e-3))
    assert capsys.readouterr().out.strip() == (
        f"t2po.py: --resume with args that differ from {out}/args.json: lr 0.001 -> 0.002, steps 2 -> 4")
    assert json.loads(open(f"{out}/args.json").read())["steps"] == 4  # the args of the latest invocation
    with pytest.raises(SystemExit, match=r"^loop.py: --resume needs --out"):
        prepare_run_dir("loop.py", _args(resume=True))


@pytest.mark.parametrize("resume", [False, True])
def test_unwritable_run_folder_is_one_line(tmp_path, resume):
    (tmp_path / "file").write_text("")  # a folder under a regular file cannot be made, even by root
    out = tmp_path / "file" / "run"
    with pytest.raises(SystemExit) as exc:
        prepare_run_dir("loop.py", _args(out=str(out), resume=resume))
    assert str(exc.value) == f"loop.py: --out {out}: cannot write there (Not a directory)"


@pytest.mark.parametrize("writer, legacy", [
    ("loop.py", None),  # args.json written by prepare_run_dir records the script
    ("loop.py", {"importance_weight": "token"}),  # one written before it did: a key only that script has
    ("arpo.py", {"branch_k": 20}),
    ("t2po.py", {"tti": True}),
])
def test_resume_refuses_a_run_folder_another_script_wrote_before_writing_anything(tmp_path, writer, legacy):
    out = tmp_path / "run"
    if legacy is None:
        prepare_run_dir(writer, _args(out=str(out)))
        assert json.loads((out / "args.json").read_text())["script"] == writer
    else:
        out.mkdir()
        (out / "args.json").write_text(json.dumps({"out": str(out), "steps": 2, **legacy}))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = (out / "args.json").read_bytes()
    other = "arpo.py" if writer == "t2po.py" else "t2po.py"
    with pytest.raises(SystemExit) as exc:
        prepare_run_dir(other, _args(out=str(out), resume=True))
    assert str(exc.value) == (f"{other}: --resume: --out {out} holds a {writer} run; "
                              f"resume it with {writer}, or pass another --out")
    assert (out / "args.json").read_bytes() == before  # nothing written
    assert sorted(os.listdir(out)) == ["args.json", "metrics.jsonl"]
    assert prepare_run_dir(writer, _args(out=str(out), resume=True)) == str(out)  # its own script may
    assert json.loads((out / "args.json").read_text())["script"] == writer


def test_resume_over_an_unreadable_args_json_continues_as_before(tmp_path, capsys):
    out = tmp_path / "run"
    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    save_checkpoint(str(out), 2, model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    (out / "args.json").write_text("{not json")
    capsys.readouterr()
    assert prepare_run_dir("arpo.py", _args(out=str(out), resume=True)) == str(out)
    assert capsys.readouterr().out.strip() == (
        f"arpo.py: --resume: cannot compare with {out}/args.json (JSONDecodeError); continuing")
    assert json.loads((out / "args.json").read_text())["script"] == "arpo.py"


SCRIPT_ARGV = ["--env", "toy", "--model", "tiny-random"]


@pytest.mark.parametrize("script", ["loop", "arpo", "t2po"])
def test_each_script_checks_the_run_folder_before_loading_the_model(tmp_path, monkeypatch, script):
    from common import models

    module = importlib.import_module(script)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_policy", no_model)  # loop.py calls models.load_policy
    monkeypatch.setattr(module, "load_policy", no_model, raising=False)  # arpo.py, t2po.py import it
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=rf"^{script}.py: --out .*/file/run: cannot write there"):
        module.main([*SCRIPT_ARGV, "--out", str(tmp_path / "file" / "run")])
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit, match=rf"^{script}.py: --out .*/used already holds a run; pass --resume"):
        module.main([*SCRIPT_ARGV, "--out", str(tmp_path / "used")])
    assert (tmp_path / "used" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, as find_spec sees it
    with pytest.raises(SystemExit, match=rf"^{script}.py: --report-to wandb: wandb is not installed"):
        module.main([*SCRIPT_ARGV, "--report-to", "wandb", "--out", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- a write that fails: the disk is full

def _files(folder) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


def _one_line_and_step_1_intact(tmp_path, exc, reason: str, step_1: dict) -> None:
    assert str(exc.value) == (
        f"step 2: cannot save the checkpoint in {tmp_path}/checkpoints ({reason}); the previous one, step_1, "
        "is intact: free space (or fix the folder), then rerun with --resume to continue from it")
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["step_1"]  # no .tmp-* folder left behind
    assert _files(folder / "step_1") == step_1


@pytest.mark.parametrize("fails", ["torch.save", "save_weights"])
def test_a_full_disk_while_saving_is_one_line_and_the_previous_checkpoint_stays(tmp_path, monkeypatch,
                                                                                 fails):
    from common import checkpoint

    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_step(model, optimizer)
    save_checkpoint(str(tmp_path), 1, model, optimizer, {"seed": 1})
    step_1 = _files(tmp_path / "checkpoints" / "step_1")
    train_step(model, optimizer)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fails == "torch.save":
        monkeypatch.setattr(checkpoint.torch, "save", full)
    else:
        monkeypatch.setattr(checkpoint, "save_weights", full)
    with pytest.raises(SystemExit) as exc:
        save_checkpoint(str(tmp_path), 2, model, optimizer, {"seed": 2})
    _one_line_and_step_1_intact(tmp_path, exc, "No space left on device", step_1)


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
@pytest.mark.parametrize("target", ["weights/model.safetensors", "optimizer.pt"])
def test_a_real_failed_write_is_one_line_too(tmp_path, target):
    """Not a stand-in: the OS refuses the write (a file-size limit, as a full disk would), so what torch and
    safetensors really raise is what is read: the reason comes out, not their traceback."""
    model, _ = load_policy(TINY_MODEL, lora_rank=0)  # full weights: big enough to limit one file
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer)
    save_checkpoint(str(tmp_path), 1, model, optimizer, {"seed": 1})
    step_1 = _files(tmp_path / "checkpoints" / "step_1")
    limit = len(step_1[target]) - 1  # the target cannot be written whole; the files before it can
    assert all(len(step_1[name]) <= limit for name in step_1 if name not in (target, "optimizer.pt"))
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.getsignal(signal.SIGXFSZ)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write(), not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        with pytest.raises(SystemExit) as exc:
            save_checkpoint(str(tmp_path), 2, model, optimizer, {"seed": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    _one_line_and_step_1_intact(tmp_path, exc, "File too large", step_1)


def test_a_failed_replace_of_the_same_step_puts_the_old_one_back(tmp_path, monkeypatch):
    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    save_checkpoint(str(tmp_path), 1, model, optimizer, {"seed": 1})
    step_1 = _files(tmp_path / "checkpoints" / "step_1")
    real_rename = os.rename

    def full(src, dst):  # the new step_1 cannot take the old one's place
        if os.path.basename(src).startswith(".tmp-step_1-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", full)
    with pytest.raises(SystemExit) as exc:
        save_checkpoint(str(tmp_path), 1, model, optimizer, {"seed": 2})
    assert str(exc.value).startswith(f"step 1: cannot save the checkpoint in {tmp_path}/checkpoints "
                                     "(No space left on device); the previous one, step_1, is intact")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]
    assert _files(tmp_path / "checkpoints" / "step_1") == step_1


def test_saving_the_same_step_or_reference_again_replaces_it_and_leaves_nothing_else(tmp_path):
    from common.checkpoint import load_reference, save_reference

    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    save_checkpoint(str(tmp_path), 1, model, optimizer, {"seed": 1})
    save_reference(str(tmp_path), model)
    first = _files(tmp_path / "reference")
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    save_checkpoint(str(tmp_path), 1, model, optimizer, {"seed": 2})  # a resumed run saving step 1 again
    save_reference(str(tmp_path), model)  # a cold start run again
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]
    assert json.load(open(tmp_path / "checkpoints" / "step_1" / "args.json"))["seed"] == 2
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert _files(tmp_path / "reference") != first
    loaded, _ = load_policy(TINY_MODEL, lora_rank=2)
    assert load_reference(str(tmp_path), loaded)
    trained = dict(model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in loaded.named_parameters() if p.requires_grad)


@pytest.mark.slow
def test_killed_and_resumed_run_logs_each_step_once(tmp_path, monkeypatch, capsys):
    """The reported case: --save-every 2, killed in step 4 after step 3 was logged; the resumed run
    redoes step 3 from the step-2 checkpoint, and metrics.jsonl holds it once. The first run is itself
    a --resume on an empty --out, which says it starts fresh."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import loop

    out = tmp_path / "run"
    argv = [*SCRIPT_ARGV, "--lora-rank", "0", "--group-size", "2", "--tasks-per-step", "1",
            "--max-turns", "2", "--max-new-tokens", "3", "--minibatch-size", "2", "--micro-batch-size", "2",
            "--eval-tasks", "1", "--cold-start-episodes", "0", "--steps", "4", "--save-every", "2",
            "--report-to", "tensorboard", "--out", str(out), "--resume"]
    real, calls = loop.group_advantages, []

    def killed_in_step_4(*a, **k):  # once per step
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(loop, "group_advantages", killed_in_step_4)
    with pytest.raises(KeyboardInterrupt):
        loop.main(argv)
    assert f"loop.py: --resume: no checkpoint in {out}; starting fresh" in capsys.readouterr().out
    monkeypatch.setattr(loop, "group_advantages", real)

    def train_steps():
        return [row["step"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "reward_mean" in row]

    assert train_steps() == [1, 2, 3] and sorted(os.listdir(out / "checkpoints")) == ["step_2"]
    loop.main(argv)
    assert train_steps() == [1, 2, 3, 4]
    events = EventAccumulator(str(out / "tensorboard"))  # the redone steps replaced there too
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
