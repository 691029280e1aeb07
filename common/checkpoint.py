"""Atomic checkpoints and --resume.

<out>/checkpoints/step_<N>/ holds weights/ (LoRA adapter or full model, as save_weights writes them),
optimizer.pt, state.pt (step, RNG states, extra) and args.json. It is written into a temp folder and then
renamed: a rename is atomic, so a run killed mid-write leaves only a `.tmp-*` folder, which is ignored and
later removed, and the last complete checkpoint is never touched.

Under torchrun call both functions on every rank: rank 0 writes (weights are replicated under DDP) and
the others wait for it; every rank reads the same files, so a checkpoint written by N ranks resumes on M.
FSDP2 (`fully_shard`) models are gathered into full state dicts on every rank (rank 0 keeps them, on the
CPU) and written in the same format, so a checkpoint does not depend on how it was sharded. The optimizer
state is keyed by parameter name, not position, for the same reason.
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
from common.models import _is_peft, _read_safetensors, load_weights, save_weights, unwrap


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
    full_weights, optim_state = _full_states(model, optimizer)  # FSDP2: a collective, so on every rank
    if not dist.is_main():
        dist.barrier()  # wait until rank 0 has written it
        return final
    try:
        _write_checkpoint(out_dir, final, step, model, full_weights, optim_state, args, extra, keep)
    finally:
        dist.barrier()
    return final


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _full_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict]:
    """(full model state dict or None when the model is not sharded, optimizer state keyed by name).

    FSDP2: gathered with torch.distributed.checkpoint's state-dict API, full tensors on rank 0's CPU
    (empty dicts elsewhere). An optimizer without state (no step yet) is saved as it is: the API would
    create its state with a zero-lr step, which changes Adam's step count."""
    if not dist.is_sharded(model):
        return None, _by_name(model, optimizer, optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if _is_peft(unwrap(model)):  # only the adapter is saved: gather just it, one tensor at a time
        weights = {}
        for name, p in unwrap(model).named_parameters():
            if "lora_" in name:
                full = dist.full_tensor(p.detach())  # a collective: every rank, same order
                if dist.is_main():
                    weights[name] = full.cpu()
    else:
        weights = get_model_state_dict(model, options=_options(cpu_offload=True))
    if not optimizer.state:
        return weights, _by_name(model, optimizer, optimizer.state_dict())
    return weights, get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str] | None:
    """Names of the optimizer's parameters in its own order (the positions optimizer.state_dict() uses);
    the same names torch.distributed.checkpoint uses (DDP's `module.` stripped). None when the optimizer
    also holds parameters that are not the model's."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [names[id(p)] for p in params] if all(id(p) in names for p in params) else None


def _is_named(state: dict) -> bool:
    return any(isinstance(k, str) for k in state["state"]) or any(
        isinstance(p, str) for g in state["param_groups"] for p in g["params"])


def _by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """optimizer.state_dict() format -> the same with parameter names in place of positions (left
    positional when the optimizer holds parameters outside the model: resumable by the same layout only)."""
    names = _param_names(model, optimizer)
    if _is_named(state) or names is None:
        return state
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def _by_position(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Named optimizer state -> optimizer.state_dict() format for this optimizer's parameter order."""
    if not _is_named(state):
        return state
    names = _param_names(model, optimizer) or []
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"optimizer state in the checkpoint is for parameters this model does not train: "
                         f"{unknown[:3]}")
    groups, start = [], 0
    for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True):
        groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def _write_checkpoint(out_dir: str, final: str, step: int, model: nn.Module, full_weights: dict | None,
                      optim_state: dict, args, extra: dict | None, keep: int) -> None:
    folder = os.path.dirname(final)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):  # leftovers of runs killed mid-write
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=folder)
    try:
        if full_weights is None:
            save_weights(model, os.path.join(tmp, "weights"))
        else:  # the same files save_weights writes (adapter or full model), from the gathered tensors
            if getattr(unwrap(model).config, "tie_word_embeddings", False):
                full_weights.pop("lm_head.weight", None)  # the embedding, gathered a second time
            unwrap(model).save_pretrained(os.path.join(tmp, "weights"), state_dict=full_weights)
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
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
    sharded = dist.is_sharded(model)
    if sharded:
        _load_sharded_weights(model, os.path.join(path, "weights"))
    else:
        load_weights(model, os.path.join(path, "weights"))
    if optimizer is not None:
        saved = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
        if sharded and saved["state"]:  # every rank keeps its shard of each full tensor
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, _by_name(model, optimizer, saved), options=_options())
        else:
            optimizer.load_state_dict(_by_position(model, optimizer, saved))
    # our own file; weights_only=False because the RNG states hold numpy arrays
    state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    set_rng_states(state["rng"])
    with open(os.path.join(path, "args.json")) as f:
        args = json.load(f)
    return {"step": state["step"], "extra": state["extra"], "args": args, "path": path}


def _load_sharded_weights(model: nn.Module, path: str) -> None:
    """load_weights for an FSDP2 model: every rank reads the full tensors and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model = unwrap(model)
    if _is_peft(model):
        from peft.utils import load_peft_weights

        adapter = model.active_adapter
        names = {k.replace(f".{adapter}.", "."): k for k in model.state_dict() if "lora_" in k}
        saved = load_peft_weights(path, device="cpu")  # names without the adapter name
        if set(saved) != set(names):
            differ = sorted(set(saved) ^ set(names))[:3]
            raise ValueError(f"adapter in {path} does not fit the model: {differ}")
        state = {names[k]: v for k, v in saved.items()}
    else:
        state = _read_safetensors(path, "model.safetensors", "model.safetensors.index.json")
    missing, unexpected = set_model_state_dict(model, state, options=_options(strict=False))
    if not _is_peft(model):
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(missing) - tied)
        if missing or unexpected:
            raise ValueError(f"weights in {path} do not fit the model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
