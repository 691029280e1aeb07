"""Atomic checkpoints and --resume.

<out>/checkpoints/step_<N>/ holds weights/ (LoRA adapter or full model, as save_weights writes them),
optimizer.pt, state.pt (step, RNG states, extra) and args.json. It is written into a temp folder and then
renamed: a rename is atomic, so a run killed mid-write leaves only a `.tmp-*` folder, which is ignored and
later removed, and the last complete checkpoint is never touched.

Under torchrun call both functions on every rank: rank 0 writes (weights are replicated under DDP) and
the others wait for it; every rank reads the same files, so a checkpoint written by N ranks resumes on M.
"""

import dataclasses
import json
import os
import random
import shutil
import tempfile

import numpy as np
import torch
from torch import nn

from common import dist
from common.models import load_weights, save_weights


def _checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints as (step, path), oldest first."""
    folder = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        if name.startswith("step_") and name[5:].isdigit():
            found.append((int(name[5:]), os.path.join(folder, name)))
    return sorted(found)


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _args_dict(args) -> dict:
    if dataclasses.is_dataclass(args):
        return dataclasses.asdict(args)
    return dict(args) if isinstance(args, dict) else dict(vars(args))


def save_checkpoint(out_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, args,
                    extra: dict | None = None, keep: int = 2) -> str:
    """Write <out>/checkpoints/step_<step>/ atomically, keep the newest `keep`; returns its path."""
    folder = os.path.join(out_dir, "checkpoints")
    final = os.path.join(folder, f"step_{step}")
    if not dist.is_main():
        dist.barrier()  # wait until rank 0 has written it
        return final
    try:
        _write_checkpoint(out_dir, final, step, model, optimizer, args, extra, keep)
    finally:
        dist.barrier()
    return final


def _write_checkpoint(out_dir: str, final: str, step: int, model: nn.Module,
                      optimizer: torch.optim.Optimizer, args, extra: dict | None, keep: int) -> None:
    folder = os.path.dirname(final)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):  # leftovers of runs killed mid-write
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=folder)
    try:
        save_weights(model, os.path.join(tmp, "weights"))
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save({"step": step, "extra": extra, "rng": rng_states()}, os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump(_args_dict(args), f, indent=1, default=str)
        if os.path.isdir(final):  # the same step saved again (e.g. after a resume): replace it
            old = tempfile.mkdtemp(prefix=f".tmp-old-step_{step}-", dir=folder)
            os.rename(final, os.path.join(old, "ckpt"))
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, path in _checkpoints(out_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(folder):
        if name.startswith(".tmp-old-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def load_checkpoint(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    """Restore weights, optimizer and RNG states from the newest complete checkpoint in <out>.

    Returns {"step", "extra", "args", "path"}, or None when there is no checkpoint.
    """
    found = _checkpoints(out_dir)
    if not found:
        return None
    step, path = found[-1]
    load_weights(model, os.path.join(path, "weights"))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    # our own file; weights_only=False because the RNG states hold numpy arrays
    state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    set_rng_states(state["rng"])
    with open(os.path.join(path, "args.json")) as f:
        args = json.load(f)
    return {"step": state["step"], "extra": state["extra"], "args": args, "path": path}
