import json
import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torchrun_util import DIST_SCRIPTS, load_script, torchrun

from common.checkpoint import load_checkpoint, save_checkpoint
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
        if str(path).endswith("state.pt"):
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


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 2])
def test_fsdp2_checkpoint_from_two_ranks_resumes_in_one_process_and_back(tmp_path, lora_rank):
    script = load_script(os.path.join(DIST_SCRIPTS, "fsdp2_checkpoint.py"))
    # a checkpoint written by ONE process, which the 2 FSDP2 ranks resume first
    model = script.make(lora_rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    script.train_step(model, optimizer, [0, 1, 2, 3], 4 * 11, 1)
    save_checkpoint(str(tmp_path / "single"), 1, model, optimizer, Args())

    proc = torchrun(os.path.join(DIST_SCRIPTS, "fsdp2_checkpoint.py"), str(tmp_path), str(lora_rank),
                    str(tmp_path / "single"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    from_one = torch.load(tmp_path / "from_one.pt")  # what the 2 ranks hold after resuming, gathered
    assert from_one["step"] == 1
    assert all(torch.equal(from_one["params"][n], p) for n, p in model.named_parameters())
    _assert_same_optimizer(from_one["optim"], _optimizer_by_name(model, optimizer))

    # the 2-rank FSDP2 checkpoint resumes in one plain process: identical parameters and AdamW state
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

    # and the resumed process's next step on the whole batch is the 2-rank step on half batches each
    script.train_step(model2, optimizer2, [0, 1, 2, 3], 4 * 11, 1)
    after = torch.load(tmp_path / "next.pt")
    for n, p in model2.named_parameters():
        torch.testing.assert_close(p.detach(), after[n], atol=1e-5, rtol=0)
    moved = [n for n in after if not torch.equal(after[n], reference["params"][n])]
    assert moved and (not lora_rank or all("lora_" in n for n in moved))  # LoRA: the frozen base stays
