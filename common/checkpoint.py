"""The run folder, atomic checkpoints and --resume.

prepare_run_dir settles <out> before the model loads: one folder per run, never reused without --resume.

<out>/checkpoints/step_<N>/ holds weights/ (LoRA adapter or full model, as save_weights writes them, with
the tokenizer beside them; an adapter's base_model_name_or_path is the --model the user gave: a Hugging
Face folder another machine loads; `python -m common.export` merges it), optimizer.pt, state.pt (step, RNG
states, extra) and args.json. It is written into a temp folder and then renamed: a rename is atomic, so a
run killed mid-write leaves only a `.tmp-*` folder, which is ignored and later removed, and the last
complete checkpoint is never touched. A checkpoint whose files were cut short anyway (a full disk, a crash
before they reached the disk) is named and skipped on resume.

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
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

from common import dist, metrics
from common.models import (
    DEFAULT_ALIASES,
    DEFAULT_MODEL,
    _is_peft,
    _read_safetensors,
    load_weights,
    resolve_model_path,
    save_weights,
    unwrap,
)


def prepare_run_dir(script: str, args) -> str:
    """The run folder for args.out, settled before the model loads; returns its path (the same on every rank).

    No --out: a new runs/<script>-<time>. An existing non-empty --out is refused without --resume (a second
    run would interleave its metrics with the first's and replace its checkpoints); with --resume a folder
    another script wrote is refused, else the differences from the saved args.json are printed, or that
    there is no checkpoint to resume. Writes args.json, with "script": the script's name. Any problem ends
    the run with one line naming --out (or --report-to, whose package must be installed)."""
    outcome = _prepare_run_dir(script, args) if dist.is_main() else None
    out, message = dist.broadcast_object(outcome)
    if out is None:
        raise SystemExit(message)
    if message and dist.is_main():
        print(message, flush=True)
    return out


def _prepare_run_dir(script: str, args) -> tuple[str | None, str]:
    """(run folder, a line to print) or (None, why the run cannot start)."""
    out, resume = args.out, args.resume
    problem = metrics.missing_package(getattr(args, "report_to", "none"))
    if problem:
        return None, f"{script}: {problem}"
    try:
        if not out:
            if resume:
                return None, f"{script}: --resume needs --out, the run folder to continue"
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = _new_run_dir(os.path.join("runs", f"{script.removesuffix('.py')}-{stamp}"))
        elif os.path.isdir(out) and os.listdir(out) and not resume:
            return None, (f"{script}: --out {out} already holds a run; pass --resume to continue it, "
                          "or another --out")
        saved = os.path.join(out, "args.json")
        writer = _writer(saved) if resume else None
        if writer not in (None, script):  # its checkpoint would not fit this script's model or state
            return None, (f"{script}: --resume: --out {out} holds a {writer} run; resume it with {writer}, "
                          "or pass another --out")
        os.makedirs(out, exist_ok=True)
        message = "" if args.out else f"{script}: run folder {out}"
        if resume and not _checkpoints(out):
            message = f"{script}: --resume: no checkpoint in {out}; starting fresh"
        elif resume:
            message = _args_changes(script, saved, _args_dict(args))
        now = {**_args_dict(args), "out": out, "script": script}
        tmp = saved + ".tmp"
        with open(tmp, "w") as f:
            json.dump(now, f, indent=2, default=str)
        os.replace(tmp, saved)
    except OSError as e:
        return None, f"{script}: --out {out}: cannot write there ({e.strerror or e})"
    return out, message


def _new_run_dir(base: str) -> str:
    """Create base, or base-2, base-3, ... when a run started in the same second."""
    for n in range(1, 1000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}-*: 999 runs started in one second")


# A key only that script's args have: names the writer of an args.json saved before it recorded "script".
_OWN_KEY = {"importance_weight": "loop.py", "branch_k": "arpo.py", "tti": "t2po.py"}


def _writer(saved_path: str) -> str | None:
    """The script that wrote the run folder's args.json, or None when the file cannot tell (unreadable,
    absent, or no key of one script only)."""
    try:
        with open(saved_path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None  # _args_changes says it cannot compare
    if not isinstance(saved, dict):
        return None
    if "script" in saved:
        return str(saved["script"])
    writers = {script for key, script in _OWN_KEY.items() if key in saved}
    return writers.pop() if len(writers) == 1 else None


def _args_changes(script: str, saved_path: str, now: dict) -> str:
    """One line listing the args that differ from the saved args.json ('' when none do)."""
    try:
        with open(saved_path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        return f"{script}: --resume: cannot compare with {saved_path} ({type(e).__name__}); continuing"
    now = json.loads(json.dumps(now, default=str))  # tuples -> lists, as the saved file holds them
    missing = object()
    changed = [f"{k} {saved.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}"
               for k in sorted(saved.keys() | now.keys()) if k not in ("resume", "out", "script")
               and saved.get(k, missing) != now.get(k, missing)]
    if not changed:
        return ""
    return f"{script}: --resume with args that differ from {saved_path}: " + ", ".join(changed)


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
    """Write <out>/checkpoints/step_<step>/ atomically, keep the newest `keep`; returns its path.

    A write the OS refuses (a full disk) ends the run on every rank with one line naming the step, the
    reason and the previous checkpoint, which is left as it was."""
    folder = os.path.join(out_dir, "checkpoints")
    final = os.path.join(folder, f"step_{step}")
    full_weights, optim_state = _full_states(model, optimizer)  # FSDP2: a collective, so on every rank
    problem = None
    if dist.is_main():
        try:
            _write_checkpoint(out_dir, final, step, model, full_weights, optim_state, args, extra, keep)
        except Exception as e:
            reason = _write_failure(e)
            if reason is None:
                raise  # not the disk: a bug, whose traceback is wanted
            problem = _not_saved(out_dir, step, reason)
        finally:
            # on every path, as the other ranks wait here for rank 0 to have written; they learn the outcome
            problem = dist.broadcast_object(problem)
    else:
        problem = dist.broadcast_object(None)
    if problem:
        raise SystemExit(problem)
    return final


def _write_failure(error: BaseException) -> str | None:
    """The OS's reason (e.g. "No space left on device") when `error` or one it was raised from is a failed
    system call, else None. torch.save raises a RuntimeError with the file object's OSError as its context;
    safetensors (Rust) only names the errno in its message."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.strerror or os.strerror(e.errno)
        match = re.search(r"\(os error (\d+)\)", str(e))
        if match:
            return os.strerror(int(match.group(1)))
        e = e.__cause__ or e.__context__
    return None


def _not_saved(out_dir: str, step: int, reason: str) -> str:
    """The line that ends a run whose checkpoint of `step` could not be written."""
    kept = _checkpoints(out_dir)
    todo = "free space (or fix the folder), then rerun"
    then = (f"the previous one, {os.path.basename(kept[-1][1])}, is intact: {todo} with --resume to "
            "continue from it") if kept else f"there is no earlier one: {todo}"
    return f"step {step}: cannot save the checkpoint in {out_dir}/checkpoints ({reason}); {then}"


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
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

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
        _loadable_anywhere(os.path.join(tmp, "weights"), model, args)
        _torch_save(optim_state, os.path.join(tmp, "optimizer.pt"))
        _torch_save({"step": step, "extra": extra, "rng": rng_states()}, os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump(_args_dict(args), f, indent=1, default=str)
        _put_in_place(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, path in _checkpoints(out_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _torch_save(obj, path: str) -> None:
    # through a Python file object: a failed write (a full disk) then reaches the RuntimeError torch raises
    # as an OSError with its errno; given a path, torch writes in C++ and the reason is lost
    with open(path, "wb") as f:
        torch.save(obj, f)


def _put_in_place(tmp: str, final: str) -> None:
    """Rename the written folder `tmp` to `final`; one there already (the same step saved again after a
    resume, a cold start run again) is replaced, and put back if the rename fails."""
    if not os.path.isdir(final):
        os.rename(tmp, final)
        return
    parked = tempfile.mkdtemp(prefix=f".tmp-old-{os.path.basename(final)}-", dir=os.path.dirname(final))
    os.rename(final, os.path.join(parked, "old"))
    try:
        os.rename(tmp, final)
    except OSError:
        os.rename(os.path.join(parked, "old"), final)
        raise
    finally:
        shutil.rmtree(parked, ignore_errors=True)


def save_reference(out_dir: str, model: nn.Module) -> None:
    """<out>/reference/: the KL reference's weights (adapter or full), atomically, for --resume; rank 0."""
    if not dist.is_main():
        return
    tmp = tempfile.mkdtemp(prefix=".tmp-reference-", dir=out_dir)
    try:
        save_weights(model, tmp)
        _put_in_place(tmp, os.path.join(out_dir, "reference"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_reference(out_dir: str, model: nn.Module) -> bool:
    """Load <out>/reference/ (save_reference) into `model`; False when the run saved none."""
    path = os.path.join(out_dir, "reference")
    if not os.path.isdir(path):
        return False
    load_weights(model, path)
    return True


def public_model_id(given: str) -> str:
    """The --model a user gave, as another machine can resolve it: the packaged default's aliases are its hub
    id (its weights are the packaged Q4_1 gguf de-quantised, close to but not equal to the hub's: an export
    holds the exact ones); a local folder its absolute path; anything else as given."""
    if given in DEFAULT_ALIASES:
        return DEFAULT_MODEL
    return os.path.abspath(given) if os.path.isdir(given) else given


def _loadable_anywhere(weights: str, model: nn.Module, args) -> None:
    """Make weights/ a folder another machine can load: the tokenizer beside the weights, and a LoRA
    adapter's base model named by the id the user gave (peft writes the local folder it loaded from,
    e.g. ~/.cache/agentic-rl/..., which exists only here)."""
    from transformers import AutoTokenizer

    base = unwrap(model)
    base = base.get_base_model() if _is_peft(base) else base
    given = _args_dict(args).get("model")
    source = getattr(base, "name_or_path", "")  # the folder it was loaded from (models.resolve_model_path)
    if not os.path.isdir(source) and given:
        source = resolve_model_path(given)
    if os.path.isdir(source):  # a model built in code (tests) has no tokenizer to save
        AutoTokenizer.from_pretrained(source).save_pretrained(weights)  # as published (not left-padded)
    adapter = os.path.join(weights, "adapter_config.json")
    if not (given and os.path.isfile(adapter)):
        return
    with open(adapter) as f:
        config = json.load(f)
    local, config["base_model_name_or_path"] = config.get("base_model_name_or_path"), public_model_id(given)
    with open(adapter, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    card = os.path.join(weights, "README.md")  # peft's model card names the base too
    if local and os.path.isfile(card):
        with open(card) as f:
            text = f.read()
        with open(card, "w") as f:
            f.write(text.replace(local, config["base_model_name_or_path"]))


def load_checkpoint(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    """Restore weights, optimizer and RNG states from the newest readable checkpoint in <out>; the optimizer's
    hyperparameters (lr, weight decay, betas) stay this run's, as given now.

    Every file of a checkpoint is read before anything is restored; one that is missing or truncated (a
    full disk, a crash before the data reached the disk) makes it unreadable: one line names the file,
    the checkpoint is renamed `step_<N>.unreadable` (`.unreadable-2`, ... when that name is taken; so it is
    neither resumed nor counted as one of the kept ones) and the previous one is tried. Returns {"step",
    "extra", "args", "path"}, or None when there is no readable checkpoint (the run starts fresh).
    """
    found, loaded, bad = _checkpoints(out_dir), None, []
    while found and loaded is None:
        step, path = found.pop()
        try:
            loaded = _read_files(path, optimizer is not None)
        except _Unreadable as e:
            bad.append(path)
            if dist.is_main():
                then = f"resuming from {os.path.basename(found[-1][1])}" if found else "starting fresh"
                print(f"checkpoint {path} is unreadable ({e}); {then}", file=sys.stderr, flush=True)
    dist.barrier()  # every rank has read the files before rank 0 renames the bad ones
    if dist.is_main():
        for folder in bad:  # an earlier unreadable copy of the same step is kept too
            os.rename(folder, metrics.free_path(folder, ".unreadable"))
    if loaded is None:
        return None
    sharded = dist.is_sharded(model)
    if sharded:
        _load_sharded_weights(model, os.path.join(path, "weights"))
    else:
        load_weights(model, os.path.join(path, "weights"))
    saved = loaded["optimizer"]
    if optimizer is not None:
        # torch restores the saved groups' lr, betas, ... too: keep this run's (a --resume with another --lr
        # prints the change, so it must also train at it)
        flags = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        if sharded and saved["state"]:  # every rank keeps its shard of each full tensor
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, _by_name(model, optimizer, saved), options=_options())
        else:
            optimizer.load_state_dict(_by_position(model, optimizer, saved))
        for group, given in zip(optimizer.param_groups, flags, strict=True):
            group.update(given)
    set_rng_states(loaded["state"]["rng"])
    return {"step": loaded["state"]["step"], "extra": loaded["state"]["extra"], "args": loaded["args"],
            "path": path}


class _Unreadable(Exception):
    pass


def _read_files(path: str, with_optimizer: bool) -> dict:
    """Every file of the checkpoint at `path` read or checked, nothing restored; _Unreadable names the
    first missing or truncated one."""
    from safetensors import safe_open

    def read(name, load):
        try:
            return load(os.path.join(path, name))
        except Exception as e:  # noqa: BLE001 -- any failure to read a file makes the checkpoint unusable
            reason = f"{type(e).__name__}: {e}".splitlines()[0][:160]
            raise _Unreadable(f"{name}: {reason}") from None

    weights = os.path.join(path, "weights")
    tensors = sorted(n for n in os.listdir(weights) if n.endswith(".safetensors")) \
        if os.path.isdir(weights) else []
    if not tensors:
        raise _Unreadable("weights/: no .safetensors file")
    for name in tensors:  # the header must describe the whole file: a truncated one fails here, cheaply
        read(os.path.join("weights", name), lambda f: safe_open(f, "pt").keys())

    def read_json(f):
        with open(f) as fh:
            return json.load(fh)

    # our own file; weights_only=False because the RNG states hold numpy arrays
    state = read("state.pt", lambda f: torch.load(f, weights_only=False))
    if not (isinstance(state, dict) and {"step", "extra", "rng"} <= state.keys()):
        raise _Unreadable("state.pt: not a checkpoint state")
    return {"state": state, "args": read("args.json", read_json),
            "optimizer": read("optimizer.pt", lambda f: torch.load(f, weights_only=True))
            if with_optimizer else None}


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
