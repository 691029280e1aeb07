"""What every script does the same way and no paper describes: the flags the three share (`RunArgs`),
parsing with preset and bounds (`parse`), the environment (`make_env`), the run's set-up (`setup`: torchrun,
run folder, seeds, model, generator, DDP/FSDP2, optimizer, resume, logger), the memory plan (`dry_run`),
evaluation on rank 0 (`on_main`), the cold start's supervised fine-tuning (`sft`) and checkpoints (`save`).

A script's `main()` reads: parse -> envs -> setup -> base eval -> cold start -> for step: rollout; advantages;
update; log -> final eval. Nothing here touches the algorithm: rollouts, signals, advantages and losses stay
in the scripts.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

from common import checkpoint, cli, dist, models
from common.cli import opt
from common.generation import HFGenerator, make_generator, resolve_backend
from common.metrics import MetricsLogger
from envs.base import make_env as registry_env


@dataclass
class RunArgs:
    """The flags every script shares, declared once; a script's `Args(RunArgs)` adds its algorithm's own and
    re-declares a shared one only to give it the script's default (`steps: int = 5`)."""

    preset: str = opt("run", "auto", "settings filled into every flag not given (the script's PRESETS); "
                      "auto: the one named after --env; none: the defaults")
    env: str = opt("environment", "textworld", "environment name from envs/ (registry)")
    env_options: str = opt("environment", "{}", "JSON keyword arguments for the environment, e.g. "
                           "'{\"level\": 2}'")
    max_turns: int = opt("environment", 3, "agent turns per episode", ge=1)
    model: str = opt("model", models.DEFAULT_MODEL, "HF id, local folder, random:<shape> or tiny-random; "
                     "default: the packaged SmolLM2-135M-Instruct")
    lora_rank: int = opt("model", 0, "LoRA rank; 0 = full fine-tune", ge=0)
    lora_alpha: int = opt("model", 32, "LoRA alpha", gt=0)
    dtype: Literal["float32", "bfloat16"] = opt("model", "float32", "training dtype: float32 | bfloat16")
    autocast: Literal["off", "bf16", "auto"] = opt(
        "model", "off", "bf16 matmuls in training (weights, gradients, AdamW stay fp32: verl's mixed "
        "precision), HF rollouts from a bf16 copy (ours); auto: GPU or CPU with native bf16")
    gradient_checkpointing: bool = opt("model", False, "recompute activations in backward (long sequences; "
                                       "docs/scaling.md)")
    backend: Literal["auto", "hf", "vllm"] = opt("rollout", "auto", "generation engine: auto = vLLM when "
                                                 "installed and on a GPU, else hf")
    group_size: int = opt("rollout", 4, "rollouts per task (the group of the group-relative advantage)", ge=2,
                          why="a group-relative advantage needs a second rollout")
    tasks_per_step: int = opt("rollout", 2, "tasks per iteration", ge=1)
    temperature: float = opt("rollout", 1.0, "sampling temperature of training rollouts (the loss's "
                             "log-probs are computed at it too)", gt=0)
    max_new_tokens: int = opt("rollout", 16, "token limit per agent turn (ARPO: per response)", ge=1)
    kl_coef: float = opt("algorithm", 0.0, "KL penalty to the policy RL starts from: after the cold start, "
                         "else --model (with LoRA: the base model, adapter off); 0 = off", ge=0)
    cold_start: bool = opt("cold start", True, "supervised fine-tuning on successful expert episodes before "
                           "RL (ours on the CPU: a 135M model never writes a valid action zero-shot)")
    cold_start_episodes: int = opt("cold start", 8, "episodes collected for the cold start; 0 = off", ge=0)
    cold_start_epochs: int = opt("cold start", 1, "SFT passes over the cold start's episodes", ge=0)
    cold_start_lr: float = opt("cold start", 1e-4, "SFT learning rate (AdamW)", ge=0)
    lr: float = opt("optimisation", 1e-5, "AdamW learning rate of RL (0: a no-update control)", ge=0)
    weight_decay: float = opt("optimisation", 0.01, "AdamW weight decay (RL and SFT)", ge=0)
    max_grad_norm: float = opt("optimisation", 1.0, "gradient-norm clip", gt=0)
    minibatch_size: int = opt("optimisation", 32, "training samples per optimizer step (LOOP: rollouts, its "
                              "constant divisor M; ARPO: responses; T²PO: turns)", ge=1)
    ppo_epochs: int = opt("optimisation", 1, "passes over a step's samples, reshuffled each time (PPO's "
                          "reuse of a batch)", ge=1)
    micro_batch_size: int = opt("optimisation", 4, "sequences per forward/backward pass (memory only)", ge=1)
    share_prefixes: bool = opt("optimisation", True, "ours: compute once each prefix that sequences of a "
                               "micro-batch share (a group's prompt, the system prompt), and in HF "
                               "rollouts reuse the KV of what earlier calls fed (TTI's chunks, TDS's "
                               "resamples); exact up to float rounding; --no-share-prefixes: all in full")
    kl_threshold: float = opt("algorithm", 0.0, "abandon the rest of a step's update once a minibatch's k1 "
                              "estimate of KL(π_old ‖ π) per sample passes this (ml-loop: 20); 0 = off", ge=0)
    steps: int = opt("run", 4, "RL iterations", ge=1)
    max_minutes: float = opt("run", 0.0, "stop training early when the next step and the final evaluation "
                             "would overrun this (0 = off)", ge=0)
    base_eval: bool = opt("run", True, "held-out evaluation of --model before training")
    probe_tasks: int = opt("run", 0, "the first N training tasks, played like the held-out ones after the "
                           "cold start and each RL step: a learning curve on fixed tasks (ours)", ge=0)
    eval_every: int = opt("run", 0, "also evaluate held-out tasks every N steps (0: before and after only)",
                          ge=0)
    eval_tasks: int = opt("run", 8, "held-out tasks per evaluation", ge=1)
    save_every: int = opt("run", 4, "checkpoint every N steps (and at the end)", ge=1)
    out: str = opt("run", "", "run folder: args.json, metrics.jsonl, checkpoints/ (default: a new "
                   "runs/<script>-<time>; an existing one needs --resume)")
    resume: bool = opt("run", False, "continue from the last checkpoint in --out")
    report_to: Literal["none", "tensorboard", "wandb"] = opt(
        "run", "none", "also log to TensorBoard (<out>/tensorboard) or Weights & Biases (pip install wandb)")
    seed: int = opt("run", 0, "everything is reproducible from it", ge=0, lt=2**31,
                    why="the range every RNG of the run accepts")
    threads: int = opt("run", 0, "torch CPU threads (0: torch's default; 1 is faster on a CPU shared with "
                       "other jobs)", ge=0)
    parallel: Literal["auto", "none", "ddp", "fsdp2"] = opt(
        "torchrun", "auto", "auto = FSDP2 (weights, gradients, AdamW and a LoRA's frozen base sharded) when "
        "over 1B params train or a bf16 replica of the model would take over a quarter of the GPU, else "
        "DDP (FSDP2 needs --backend vllm)")
    rollout_tp: int = opt("torchrun", 1, "ranks per vLLM engine: each group of N consecutive ranks is one "
                          "tensor-parallel engine that generates the union of their prompts, each rank "
                          "keeping its own (a model too large for one GPU; needs --backend vllm)", ge=1)
    dry_run: bool = opt("torchrun", False, "print the per-rank memory plan for --model and the world size, "
                        "then exit (no weights loaded)")


def script_name(args) -> str:
    """`loop.py`, `arpo.py`, `t2po.py`: the file that declared the Args (also when run as __main__)."""
    return os.path.basename(getattr(sys.modules[type(args).__module__], "__file__", "") or "run")


def say(*text, **kwargs) -> None:
    """print, on rank 0 only, flushed."""
    if dist.is_main():
        print(*text, **kwargs, flush=True)


def parse(cls: type, argv: list[str] | None, presets: dict, check: Callable | None = None, *,
          overridden_by: dict | None = None):
    """Command line -> Args: the preset filled into every flag not given, then the bounds declared with each
    flag, the rule between shared flags and the script's own `check` (rules between its flags); a bad value
    ends in one line before anything loads. Sets --threads."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = cli.apply_preset(cli.parse_args(cls, argv), argv, presets, overridden_by=overridden_by)
    cli.check_bounds(args, script_name(args))
    if not (args.base_eval or args.cold_start):  # both shared flags: the rule holds in every script
        raise SystemExit(f"{script_name(args)}: with --no-base-eval and --no-cold-start nothing "
                         "precedes RL: give --base-eval, or keep the cold start")
    if check is not None:
        check(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return args


def check_torchrun(args) -> None:
    """--rollout-tp against this run's ranks and backend: one line, before anything loads (the world size
    is known once torchrun has started the ranks, so not at parse time)."""
    script, tp, world = script_name(args), args.rollout_tp, dist.world_size()
    if world % tp:
        raise cli.bad_flag(script, "rollout_tp", tp, f"must divide the number of ranks ({world} here): run "
                           f"under torchrun --nproc-per-node {tp} (or a multiple), or pass --rollout-tp 1")
    if tp > 1 and args.backend == "hf":
        raise cli.bad_flag(script, "rollout_tp", tp, "needs --backend vllm (the HF backend has no "
                           "tensor-parallel engine)")


def dry_run(args, seq_len: int, why: str, **plan) -> dict:
    """--dry-run: the per-rank memory plan of --model at this world size, from its shape (no weights).
    seq_len: the longest sequence the script trains on, `why` its arithmetic. The HF backend decodes all of
    a rank's episodes at once (its task groups x --group-size; rank 0 also every held-out task)."""
    from common.plan import print_plan
    check_torchrun(args)
    held = args.eval_tasks * getattr(args, "eval_samples", 1)  # arpo.py: responses per held-out question
    rows = max(-(-args.tasks_per_step // dist.world_size()) * args.group_size, held)
    if dist.is_main():
        print(f"sequence {seq_len} tokens: {why}\nrollout rows {rows} = max(ceil({args.tasks_per_step} "
              f"tasks / {dist.world_size()} ranks) * group {args.group_size}, {held} held-out responses "
              "on rank 0)")
        try:  # the engine decodes in bf16 on a GPU and sleeps while the policy trains
            print_plan(args.model, dist.world_size(), args.lora_rank, max_seq_len=seq_len,
                       micro_batch=args.micro_batch_size, backend=args.backend, strategy=args.parallel,
                       dtype=args.dtype, gradient_checkpointing=args.gradient_checkpointing, vllm_sleeps=True,
                       vllm_dtype="bfloat16", rollout_rows=rows, rollout_tp=args.rollout_tp, **plan)
        except ValueError as e:  # a model whose shape is not known offline
            raise SystemExit(f"{script_name(args)}: {e}") from None
    return {}


def planned_length(args, prompts_of: Callable, response_tokens: int) -> tuple[int, str]:
    """--dry-run's sequence from the env's real prompts: the longest of prompts_of(env, 16 training tasks,
    args), at 2 characters a token (an over-count: SmolLM2's tokenizer gives 2.4-3.3 on the toy, textworld
    and webshop-lite prompts), + 32 chat-template tokens + the response; (tokens, that arithmetic). Where
    the env's package is not installed: 4096 prompt tokens."""
    try:
        env, _, tasks, _ = make_env(args, prepare=False)  # the first 16 games only, not all of them
    except SystemExit as e:
        why = f"4096 prompt tokens assumed ({str(e).splitlines()[0]})"
        return 4096 + response_tokens, f"{why} + {response_tokens} response"
    prompts = prompts_of(env, tasks[:16], args)
    chars = max(map(len, prompts))
    return -(-chars // 2) + 32 + response_tokens, (f"the longest of {len(prompts)} turn prompts, {chars} "
                                                   f"chars / 2 + 32 chat-template tokens + {response_tokens} "
                                                   "response")


def make_env(args, prepare: bool = True, **options):
    """(env, the options every copy of it gets, train tasks, held-out tasks). --env-options wins over the
    script's `options`; the run's seed goes to an env that takes one. A missing package or data set, an
    unknown name or option, or more tasks per step than the env has: one line, before the model loads.
    prepare: the env's one-off work per task (TextWorld generates its games) now, not in a timed reset."""
    script = script_name(args)
    try:
        given = json.loads(args.env_options)
        if not isinstance(given, dict):
            raise ValueError("--env-options must be a JSON object")
        options = {"seed": args.seed, **options, **given}
        try:
            env = registry_env(args.env, **options)
        except TypeError as e:
            if "'seed'" not in str(e) or "seed" in given:
                raise
            options.pop("seed")  # TextWorld, ALFWorld: the tasks are the games
            env = registry_env(args.env, **options)
        train_tasks, eval_tasks = env.tasks("train"), env.tasks("eval")[:args.eval_tasks]
        if prepare and hasattr(env, "prepare"):
            env.prepare(train_tasks + eval_tasks)
    except (ValueError, TypeError, ImportError, RuntimeError, OSError) as e:
        extra = f" --env-options {args.env_options!r}" if args.env_options.strip() != "{}" else ""
        raise SystemExit(f"{script}: --env {args.env!r}{extra}: {e}") from None
    if args.tasks_per_step > len(train_tasks):
        raise cli.bad_flag(script, "tasks_per_step", args.tasks_per_step,
                           f"--env {args.env!r} has only {len(train_tasks)} training tasks")
    return env, options, train_tasks, eval_tasks


@dataclass
class Run:
    """What `setup` builds: `model` generates and is saved; `policy` (it under DDP/FSDP2) trains."""

    model: torch.nn.Module
    policy: torch.nn.Module
    tokenizer: object
    generator: object
    optimizer: torch.optim.Optimizer
    reference: torch.nn.Module | None  # the KL's frozen copy (None: LoRA before a cold start, adapter off)
    logger: MetricsLogger
    start_step: int  # the step a resumed run continues after (0: a new run)
    extra: dict  # what a checkpoint keeps besides weights: held-out results of the stages done
    device: str


def setup(args) -> Run:
    """torchrun, the run folder (args.json), the seeds, policy + tokenizer, generator, DDP/FSDP2, AdamW,
    --resume and the metrics logger. Every rank calls it; only rank 0 writes."""
    script = script_name(args)
    device = dist.init()
    check_torchrun(args)
    if args.rollout_tp > 1 and resolve_backend(args.backend) != "vllm":
        raise cli.bad_flag(script, "rollout_tp", args.rollout_tp, "needs the vllm backend, which --backend "
                           f"{args.backend} does not pick here (vLLM installed and a GPU; or --backend vllm)")
    args.out = checkpoint.prepare_run_dir(script, args)  # writes args.json; before the model loads
    random.seed(args.seed)  # the plain seed: the same initial model and cold start on every rank
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    try:
        model, tokenizer = models.load_policy(args.model, dtype=args.dtype, device=device,
                                              lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                                              gradient_checkpointing=args.gradient_checkpointing)
    except (ValueError, RuntimeError) as e:  # model not found offline, ...
        raise SystemExit(f"{script}: {e}") from None
    model.eval()  # no dropout: recomputed log-probs equal the sampler's policy
    fsdp2 = dist.world_size() > 1 and dist.choose_strategy(model, args.parallel) == "fsdp2"
    if fsdp2 and resolve_backend(args.backend) == "hf":
        # an FSDP2 forward gathers parameters collectively; ranks decoding different lengths would hang
        raise SystemExit(f"{script}: --parallel fsdp2 needs --backend vllm (HF generation on sharded weights "
                         "would deadlock); use --parallel ddp or --lora-rank > 0")
    if fsdp2 and args.kl_coef > 0 and args.lora_rank > 0 and args.cold_start:  # see cold_started_reference
        raise SystemExit(f"{script}: --kl-coef after a cold start with LoRA needs --parallel ddp (its "
                         "reference, the cold-started adapter, is a copy of the model, which FSDP2 shards)")
    reference = None
    if args.kl_coef > 0 and args.lora_rank == 0:  # the initial policy, frozen, before any update
        reference = frozen_copy(model)
    # training forward/backward; generation reads `model`. Sharded before the engine starts: a 32B base
    # and a vLLM share do not fit one card together, its shard and the share do.
    policy = dist.wrap(model, args.parallel)
    bf16 = bf16_training(args)
    try:
        generator = make_generator(args.backend, model, tokenizer, models.resolve_model_path(args.model),
                                   share_prefixes=args.share_prefixes, bf16=bf16, rollout_tp=args.rollout_tp)
    except (ValueError, RuntimeError) as e:  # vLLM missing, ...
        raise SystemExit(f"{script}: {e}") from None
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    state = checkpoint.load_checkpoint(args.out, model, optimizer) if args.resume else None  # every rank
    if state is not None:
        generator.update_weights(model)
        say(f"{script}: resumed from step {state['step']}")
    if state is not None and args.kl_coef > 0 and "cold_start" in stage_results(state["extra"] or {}):
        reference = reference if reference is not None else frozen_copy(model)
        if not checkpoint.load_reference(args.out, reference):
            raise SystemExit(f"{script}: --resume: {args.out} has no reference/ (the policy after the cold "
                             "start, --kl-coef's reference); start a new run")
    if args.autocast != "off":
        say(f"--autocast {args.autocast}: training passes in {'bf16' if bf16_training(args) else 'fp32'}"
            + (", HF rollouts from a bf16 copy" if isinstance(generator, HFGenerator) and bf16 else ""))
    desc = script_name(args).removesuffix(".py")  # the progress bar's name
    logger = MetricsLogger(args.out, args.steps, desc, initial_step=state["step"] if state else None,
                           report_to=args.report_to, config=asdict(args), enabled=dist.is_main())
    return Run(model=model, policy=policy, tokenizer=tokenizer, generator=generator, optimizer=optimizer,
               reference=reference, logger=logger, start_step=state["step"] if state else 0,
               extra=stage_results((state or {}).get("extra") or {}), device=device)


@functools.cache
def native_bf16() -> tuple[str, ...]:
    """This CPU's native bf16 instruction sets (x86 AVX512-BF16, AMX), empty where torch emulates bf16,
    slower than fp32."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return ()
    return tuple(sorted({f for f in flags if f in ("avx512_bf16", "amx_bf16")}))


def bf16_training(args) -> bool:
    """--autocast resolved: bf16, or auto on a GPU or on a CPU with native bf16."""
    auto = args.autocast == "auto" and (torch.cuda.is_available() or bool(native_bf16()))
    return args.autocast == "bf16" or auto


def precision(args) -> torch.autocast:
    """The training passes' precision (--autocast): bf16 matmuls under torch.autocast, or fp32. On this
    project's 2-core CPU (AVX512-BF16) bf16 trains 1.9x faster; log-probs move by ~0.04 nats
    (benchmarks/bench_precision.py). No cast cache: the context spans optimizer steps, and a cached bf16
    copy of a weight would keep the weight as it was before them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device, dtype=torch.bfloat16, enabled=bf16_training(args), cache_enabled=False)


# the held-out results a checkpoint keeps, by stage; the names checkpoints written before 2026-12 used
STAGES = ("base", "cold_start", "rl")
_OLD_STAGE_NAMES = {"eval_before": "base", "eval_cold_start": "cold_start", "rft": "cold_start"}


def stage_results(extra: dict) -> dict:
    """A checkpoint's `extra` with the stage names of STAGES (older checkpoints: loop's and t2po's names)."""
    return {_OLD_STAGE_NAMES.get(k, k): v for k, v in extra.items()}


def on_main(evaluate: Callable[[], dict]) -> dict:
    """Run `evaluate` on rank 0 (held-out episodes); the other ranks wait for its result."""
    return dist.broadcast_object(evaluate() if dist.is_main() else None)


def write_transcripts(args, stage: str, episodes: list[dict]) -> None:
    """An evaluation's episodes as text, one JSON line each, in <out>/transcripts/<stage>.jsonl (rank 0,
    which evaluates): what the agent saw and did (prompt, response, action, observation, reward)."""
    path = os.path.join(args.out, "transcripts", f"{stage.replace(' ', '_')}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)  # a stage may name a subfolder: train/step_1
    with open(path, "w") as f:
        f.writelines(json.dumps(ep, default=str) + "\n" for ep in episodes)


def transcript(tokenizer, ids: list[int], generated: list, actions: list | None = None, **fields) -> dict:
    """An episode kept as one token sequence, as text: `fields`, the prompt (the context before the model's
    first token), then per run of model tokens (generated 1) a turn: its text, its action (if given) and the
    context after it, the environment's reply."""
    pairs = zip(ids, generated, strict=True)
    runs = [(bool(g), [t for t, _ in grp]) for g, grp in itertools.groupby(pairs, lambda x: x[1])]
    if runs and runs[0][0]:
        runs.insert(0, (False, []))
    turns = [dict(response=tokenizer.decode(runs[i][1]), **({"action": actions[i // 2]} if actions else {}),
                  observation=tokenizer.decode(runs[i + 1][1]) if i + 1 < len(runs) else "")
             for i in range(1, len(runs), 2)]
    return dict(fields, prompt=tokenizer.decode(runs[0][1]) if runs else "", turns=turns)


def show_transcripts(args, stages: list[str], width: int = 90) -> None:
    """Print one held-out episode as each stage played it (e.g. before and after RL): the first whose outcome
    differs between the stages (else the first), its actions, the environment's replies, the outcome. The
    full text is in <out>/transcripts/."""
    paths = [os.path.join(args.out, "transcripts", f"{stage}.jsonl") for stage in stages]
    if not dist.is_main() or not all(os.path.isfile(p) for p in paths):
        return
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append([json.loads(line) for line in f])
    outcomes = zip(*([bool(ep.get("won")) for ep in eps] for eps in runs), strict=False)  # per episode
    index = next((i for i, won in enumerate(outcomes) if len(set(won)) > 1), 0)
    for stage, episodes in zip(stages, runs, strict=True):
        if index >= len(episodes):
            continue
        ep = episodes[index]
        print(f"--- held-out episode {index} ({ep.get('task', '')!s:.60}), {stage}: "
              f"{'won' if ep.get('won') else 'lost'}, reward {ep.get('reward', 0):g}")
        for k, turn in enumerate(ep["turns"]):
            reply = " ".join(re.sub(r"<\|[^|]*\|>", " ", str(turn.get("observation", ""))).split())
            action = str(turn.get("action") or turn.get("response", "")).strip()
            mark = f"  [{turn['mark']}]" if turn.get("mark") else ""
            print(f"  {k + 1}. {action!r:.{width // 2}} -> {reply:.{width}}{mark}")
    sys.stdout.flush()


def report(args, extra: dict, n_tasks: int, also: str = "", t_begin: float | None = None) -> None:
    """A run's last words: a held-out episode before RL (after the cold start, if any) and after it, then each
    stage's held-out successes as counts, and `also` (a second eval/ key) per stage."""
    show_transcripts(args, ["cold_start" if "cold_start" in extra else "base", "rl"])
    stages = [s for s in STAGES if s in extra]  # a resumed run: from its checkpoint
    say(f"held-out success ({n_tasks} tasks): " + " -> ".join(
        f"{s} {round(extra[s]['eval/success_rate'] * n_tasks, 2):g}/{n_tasks}" for s in stages)
        + (f"  | {also.removeprefix('eval/')}: " + " -> ".join(f"{s} {extra[s][also]:.3f}" for s in stages)
           if also else "") + (f"  ({(time.time() - t_begin) / 60:.1f} min)" if t_begin else ""))
    if "base" not in stages and not getattr(args, "base_eval", True):
        say("base model not evaluated (--no-base-eval; --base-eval runs it)")


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that no update reaches: --kl-coef's reference."""
    return copy.deepcopy(model).requires_grad_(False).eval()


def cold_started_reference(run: Run, args) -> None:
    """After an in-script cold start, --kl-coef's reference is the policy RL starts from, not --model: the
    papers' RL starts from their SFT/RFT checkpoint, which is its own reference. A frozen copy (with LoRA
    too, where the adapter-off base model would pull back to before the cold start), also written to
    <out>/reference/ for --resume. Every rank calls it."""
    if args.kl_coef <= 0:
        return
    if run.reference is None:  # LoRA (never sharded here: setup refuses it under FSDP2)
        run.reference = frozen_copy(run.model)
    frozen = dict(run.reference.named_parameters())
    with torch.no_grad():
        for name, p in run.model.named_parameters():  # FSDP2: gathered one parameter at a time
            frozen[name].copy_(dist.full_tensor(p))
    checkpoint.save_reference(args.out, run.reference)


def save(run: Run, args, step: int) -> None:
    """An atomic checkpoint of weights, optimizer, RNG states and `run.extra`; every rank calls it."""
    checkpoint.save_checkpoint(args.out, step, run.model, run.optimizer, args, extra=run.extra)


def sft(policy, n_samples: int, log_likelihood: Callable[[list[int]], tuple[torch.Tensor, float]], *,
        lr: float, weight_decay: float, max_grad_norm: float, epochs: int, micro_batch_size: int,
        permute: Callable[[int], list[int]]) -> float:
    """Supervised fine-tuning (the cold start): minimise the mean negative log-likelihood of the trained
    tokens, one AdamW step per micro-batch of `micro_batch_size` samples, `epochs` passes in the order
    `permute(n)` gives. `log_likelihood(rows)` returns (the sum of log pi over the trained tokens of those
    samples, their number). Returns the last epoch's mean loss.

    Under torchrun every rank holds the same samples in the same order and takes its share of each
    micro-batch; the loss divides by the micro-batch's global token count, so a step is the one a single
    process takes. A rank left without a sample runs a zero-weight pass (DDP waits for its backward)."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=weight_decay)
    policy.train()
    losses: list[float] = []
    for _ in range(epochs):
        order, losses = permute(n_samples), []
        for i in range(0, len(order), micro_batch_size):
            rows = dist.shard(order[i:i + micro_batch_size])
            weight = 1.0 if rows else 0.0
            total, n_tokens = log_likelihood(rows or order[i:i + 1])
            loss = -total * weight / max(1.0, dist.all_reduce(n_tokens * weight))
            (loss * dist.grad_scale()).backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(dist.all_reduce(loss.item()))
    policy.eval()
    return sum(losses) / len(losses) if losses else float("nan")
