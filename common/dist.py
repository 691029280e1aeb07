"""torchrun helpers. Every function is a no-op (or the trivial answer) in a plain single process.

How the scripts use them, so that one optimizer step means the same thing on 1, 2 or 8 ranks:
- `shard(tasks)`: each rank rolls out whole groups (all K rollouts of a task live on one rank, so group
  advantages need no communication);
- `all_reduce(n_tokens)`: the loss divisor is the global count, not the rank's;
- `all_reduce(n_microbatches, "max")`: every rank runs the same number of backward passes (ranks with
  fewer pad with zero-weight ones), because DDP's gradient all-reduce is a collective per backward;
- `wrap(model, strategy)`: DDP (or FSDP2) averages gradients over ranks, so losses are multiplied by
  `world_size()` to turn that average back into the global sum;
- `rank_groups(n)`: the groups of n consecutive ranks that share one tensor-parallel vLLM engine
  (--rollout-tp); before each collective of all ranks here, the ranks of such a group first finish the
  generation rounds a partner still asks for (`before_collectives`, common.generation.GroupGenerator).
"""

import atexit
import datetime
import functools
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn


def is_distributed() -> bool:
    # torchrun with several ranks, not merely an initialised default group: vLLM's in-process engine
    # initialises a one-rank group of its own in a plain single process.
    return int(os.environ.get("WORLD_SIZE", 1)) > 1 and dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def init(timeout_s: float = 1800) -> str:
    """Join the torchrun process group (on GPUs nccl for CUDA tensors and gloo for CPU ones; gloo on a CPU)
    and return this rank's device.

    Without torchrun's environment (WORLD_SIZE unset or 1) nothing is initialised. `timeout_s` bounds how
    long a collective waits for a rank that will never come (a rollout slower than that is a bug)."""
    device = f"cuda:{local_rank()}" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not is_distributed():
        # On GPUs both: nccl for CUDA tensors, gloo for the CPU ones (all_reduce of a Python number, loss
        # statistics); "nccl" alone fails on those with "No backend type associated with device type cpu".
        dist.init_process_group("cpu:gloo,cuda:nccl" if device != "cpu" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return device


# What runs before each collective of all ranks below: the drain of this rank's tensor-parallel engine
# group (common.generation.GroupGenerator), so that no rank waits in a collective of all ranks while a
# partner of its group waits for it in a generation round. Set up by make_generator, emptied by cleanup.
_BEFORE_COLLECTIVES: list = []


def before_collectives(hook) -> None:
    """Run `hook()` before each collective of all ranks made through this module."""
    _BEFORE_COLLECTIVES.append(hook)


def _settle() -> None:
    for hook in _BEFORE_COLLECTIVES:
        hook()


def rank_groups(size: int) -> tuple:
    """(this rank's group, its ranks): the world cut into groups of `size` consecutive ranks (0..size-1,
    size..2·size-1, ...), as vLLM lays out the tensor-parallel groups of an external_launcher engine. A
    gloo group: it exchanges Python objects. Every rank calls it (making a group is a collective)."""
    if world_size() % size:
        raise ValueError(f"--rollout-tp {size} does not divide the {world_size()} ranks")
    groups = [list(range(g, g + size)) for g in range(0, world_size(), size)]
    mine, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return mine, groups[rank() // size]


def rank_seed(seed: int) -> int:
    """Per-rank seed: ranks sample different rollouts, and the run is reproducible from `seed`.
    Model initialisation must use the plain `seed` (identical weights on every rank)."""
    return seed + 1000 * rank()


def shard(items: list) -> list:
    """This rank's share, round-robin: rank r of W gets items[r::W]. Pass whole groups (task ids, not
    rollouts). Ranks may get one item more or fewer; counts are balanced later by `all_reduce`."""
    return list(items)[rank()::world_size()]


def all_reduce(value, op: str = "sum"):
    """Sum / max / min of a number or tensor over ranks; returns the same type (a new tensor)."""
    if not is_distributed():
        return value
    _settle()
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        dist.all_reduce(out, op=ops[op])
        return out
    out = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(out, op=ops[op])
    return type(value)(out.item()) if isinstance(value, (int, float)) else out.item()


def same_count(micro_batches: list, filler) -> list[tuple[object, float]]:
    """(micro-batch, weight) pairs, as many on every rank: each backward under DDP is a collective (the
    gradient all-reduce) and each forward under FSDP2 too, so a rank with fewer micro-batches runs zero-weight
    ones on `filler` (its loss is multiplied by 0). One process: the micro-batches, weight 1."""
    n = all_reduce(len(micro_batches), "max")
    return [(m, 1.0) for m in micro_batches] + [(filler, 0.0)] * (n - len(micro_batches))


def all_gather_object(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...]; [obj] in a single process."""
    if not is_distributed():
        return [obj]
    _settle()
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s obj on every rank (e.g. the main rank's eval result or a resume step)."""
    if not is_distributed():
        return obj
    _settle()
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def card_bytes(model: nn.Module) -> int | None:
    """Memory of the GPU the model is on; None off the GPU."""
    device = next(model.parameters()).device
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def choose_strategy(model: nn.Module, strategy: str = "auto") -> str:
    """"auto": FSDP2 when over a billion parameters train (a replica of weights, gradients and AdamW
    states is 16 bytes/param: 64 GB for 4B), or when a replica of the model's weights in bf16 would take
    more than a quarter of the GPU (LoRA on a frozen 32B base: 61 GiB of an 80 GiB card); DDP otherwise.
    The rule is common.plan.auto_strategy, which --dry-run applies too."""
    if strategy != "auto":
        return strategy
    from common.plan import auto_strategy

    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return auto_strategy(params, trainable, card_bytes(model))


def wrap(model: nn.Module, strategy: str = "auto") -> nn.Module:
    """Wrap the policy for data-parallel training: "auto" | "none" | "ddp" | "fsdp2".

    DDP keeps a full replica per rank and all-reduces gradients (right for LoRA and small models); FSDP2
    (`fully_shard` per decoder layer, then the root) shards parameters, gradients and optimizer states
    (right for full fine-tuning of billion-parameter models). Both average gradients over ranks.
    A single process is returned unwrapped."""
    strategy = choose_strategy(model, strategy)
    if not is_distributed() or strategy == "none":
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        on_gpu = next(model.parameters()).is_cuda
        return DistributedDataParallel(model, device_ids=[local_rank()] if on_gpu else None)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        on_gpu = next(model.parameters()).is_cuda
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu \
            else MixedPrecisionPolicy()
        for module in model.modules():  # one shard group per decoder layer: gathered just in time
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    raise ValueError(f"unknown parallel strategy {strategy!r}; choose none, ddp or fsdp2")


def grad_scale() -> int:
    """Factor that turns DDP/FSDP2's gradient average over ranks into the sum of per-rank losses that
    were each divided by the global count."""
    return world_size()


def barrier() -> None:
    if is_distributed():
        _settle()
        dist.barrier()


# The world group, kept until the process ends (`finish` exits without destroying it). Otherwise DDP's
# reducer, freed when main() returns, holds its last reference: ~ProcessGroupGloo joins gloo's worker
# thread while the main thread holds the GIL, and the worker, dropping the barrier's work, waits for the
# GIL: both wait forever (py-spy on a rank of arpo's 8-rank test that hung in 1 of 3 tries).
_OUTLIVE_MAIN: list = []


def cleanup() -> None:
    """Leave the process group. vLLM's engine (the vllm backend) built its groups on it: they go first,
    or vLLM's exit-time shutdown fails on the destroyed group with a traceback after the run."""
    if is_distributed():
        _settle()  # a partner of this rank's engine group may still generate
    _BEFORE_COLLECTIVES.clear()
    if is_distributed():
        _OUTLIVE_MAIN.append(dist.group.WORLD)  # before vLLM's clean-up destroys it too
    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None and vllm_groups.model_parallel_is_initialized():
        vllm_groups.cleanup_dist_env_and_memory()  # also destroys the default group
    if is_distributed():
        dist.barrier()  # no rank tears the group down while another still talks to it
        dist.destroy_process_group()


def finish() -> None:
    """End this rank's process as a finished run (exit code 0): atexit handlers run and output is flushed,
    but the interpreter does not shut down.

    Why: gloo's worker thread drops a collective's work (and the tensors Python gave it) only after it has
    told the main thread the collective is done. If the main thread has meanwhile reached interpreter
    shutdown, dropping those tensors asks for the GIL, Python ends the thread, and the C++ runtime aborts the
    rank with "terminate called without an active exception" (SIGABRT) after a run that succeeded
    (torch 2.13: 9 runs in 30 of tests/dist_scripts/collectives.py with both ranks on one core; core dump:
    ~AsyncBarrierWork -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit). Exiting here leaves no
    shutdown for that thread to race with."""
    atexit._run_exitfuncs()  # what a normal exit would run: logging, multiprocessing children, vLLM
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def entrypoint(main):
    """Decorate a script's main(): an exception on any rank prints `[rank r] ...` with its traceback and
    ends that process at once (os._exit), so torchrun stops the other ranks instead of leaving them
    blocked in a collective until the timeout. A rank that finishes ends through `finish`. In a single
    process the decorator changes nothing."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
            return main(*args, **kwargs)
        try:
            main(*args, **kwargs)
        except BaseException as e:  # SystemExit too: a clean error message on one rank stops all
            code = 1
            if isinstance(e, SystemExit) and (e.code is None or isinstance(e.code, int)):
                code = e.code or 0  # sys.exit() and sys.exit(0) are successes
            if code == 0:
                finish()
            if isinstance(e, SystemExit) and isinstance(e.code, str):  # a user error: its one line only
                print(f"[rank {rank()}] {e.code}", file=sys.stderr)
            elif not isinstance(e, SystemExit):  # not argparse's exit(2), whose message rank 0 printed
                print(f"[rank {rank()}] {type(e).__name__}: {e}", file=sys.stderr)
                traceback.print_exc()
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(code)
        finish()  # a finished rank ends without interpreter shutdown (see `finish`)
    return run


def is_sharded(model: nn.Module) -> bool:
    """True when the model's parameters are FSDP2 shards (DTensors after `fully_shard`)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (an all-gather: every rank must call it), else `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def full_weights(model: nn.Module):
    """Yield (base-model name, full weight with LoRA merged) one parameter at a time, for pushing the policy
    into an inference engine: at most one full parameter (plus its LoRA delta) exists at a time besides the
    model, never a second copy of the whole model.

    FSDP2: each tensor is all-gathered only when the consumer asks for it, so every rank must consume the
    whole iterator in the same order (each step is a collective). Equal to common.models.merged_state_dict.
    """
    from common.models import _is_peft, unwrap

    model = unwrap(model)
    base, lora = model, {}
    if _is_peft(model):
        from peft.tuners.lora import LoraLayer

        base = model.get_base_model()
        lora = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    sharded = is_sharded(model)
    for key, value in base.state_dict().items():  # FSDP2: DTensor shards, nothing gathered yet
        if "lora_" in key:
            continue
        weight = full_tensor(value.detach())
        module = lora.get(key.removesuffix(".base_layer.weight"))
        if key.endswith(".base_layer.weight") and module is not None and not (module.merged or
                                                                            module.disable_adapters):
            for adapter in module.active_adapters:
                if adapter not in module.lora_A:
                    continue
                if sharded:  # W + B A * alpha/r (peft's get_delta_weight, nn.Linear case)
                    b_ = full_tensor(module.lora_B[adapter].weight)  # (out, r)
                    a_ = full_tensor(module.lora_A[adapter].weight)  # (r, in)
                    delta = b_ @ a_ * module.scaling[adapter]
                else:
                    delta = module.get_delta_weight(adapter)
                weight = weight + delta.to(weight.dtype)
        yield key.replace(".base_layer.", "."), weight
