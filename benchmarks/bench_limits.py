"""One RL step of t2po.py against this machine's limits: tokens processed vs distinct, and each part's rate
as a fraction of the measured peak (prefill and update: GFLOP/s of matmul; decode: GB/s of weight reads).

    .venv/bin/python -m benchmarks.bench_limits --setting default --threads 2 --repeats 3 --json limits.json
    .venv/bin/python -m benchmarks.bench_limits --setting level4 --threads 2 --repeats 3

1. Limits, measured: GFLOP/s of a 4096x576x1536 matmul (`--peak-shape`; SmolLM2's hidden x MLP width) in
   fp32 and in bf16 tensors, and the memory read bandwidth (summing a 1 GB fp32 tensor); medians.
2. The work: t2po.training_rollouts itself plays the step (`--setting default`: PRESETS["textworld"], the
   default run; `level4`: the level-4 arm of docs/results/t2po.md, benchmarks/compare.py LEVEL4: since
   85df69e the same step as `default`, kept so that older numbers repeat) with `--model` on the HF generator:
   the policy's sampled responses, TTI and TDS, its parsed actions sent to the env, step 1's seeds.
   `--model smollm2` is the base model, which acts worse than the cold-started policy a real step 1 starts
   from (`--model runs/X/checkpoints/step_0/weights` plays that one). Every model forward of the rollout is
   recorded: a prefill reads many tokens a row, a decode one. Then the turn samples are built
   as t2po's update sees them (training_samples: GiGPO's advantages, one TrainingSample per turn).
3. Per part:
   prefill: the rollout's prefill passes replayed (identical rows of a call deduplicated, left padding, as the
     generator does them; in the rollout's precision: a bf16 copy where --autocast resolves to bf16, else
     fp32); processed = the positions they compute (padding too),
     distinct = the distinct prefixes of all their rows (prefix_forest's nodes: what a prefix cache computes).
     With the prefix cache (t2po's --share-prefixes, the default) a pass behind reused KV computes only the
     new tokens; it is timed as it ran in the rollout, not replayed. --flags --no-share-prefixes: without.
   decode: the rollout's own one-token passes; the forward's median time at their median batch and cache
     length, GB/s = the weights' bytes / that time; and the whole decode step (the generator's wall time
     less its prefills, per pass: sampling, entropies, stop checks too).
   update: one forward+backward of token_logprobs over the turn samples in t2po's micro-batches
     (t2po.microbatches, build_batch, action_logprobs; --micro-batch-size of the preset, under
     run.precision: bf16 autocast where native), --no-share-prefixes and --share-prefixes. π_old's extra
     no-grad forward (more samples than --minibatch-size) and AdamW are not included.
   --profile: one more shared-prefix forward+backward under torch.profiler, its self CPU time
     split into matmuls (aten::mm, addmm, bmm, oneDNN linear), attention (SDPA's kernels, forward
     and backward) and the rest (casts, elementwise layers, gradient accumulation, Python), each
     also as a share of the profiled time (the profiler's own overhead included).
   FLOPs: c·N·tokens (N: the weights without the embeddings; c = 2 forward, 6 forward+backward) plus the
   vocabulary projection c·V·d on the tokens that get logits (a prefill row's last; the update's action
   tokens) plus attention as computed, 2c·layers·q_width per (query, key) product, masked or not (a
   padded row of T: T x T; a packed forest since d9f1af4: each segment's queries x its keys).
   "on processed" counts that; "on distinct" counts c·N·distinct only (the useful work).
   Fractions are of the bf16 matmul peak where the CPU has native bf16 (the aims' limit), else of fp32.
Aims (the issue): prefill and update >= 50% of the bf16 peak, a decode pass >= 4x today's, distinct /
processed >= 0.9.
"""

import json
import os
import shlex
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import t2po
from common import run
from common.cli import parse_args
from common.generation import HFGenerator, new_cache
from common.logprobs import prefix_forest
from common.models import DEFAULT_MODEL, load_policy

SETTINGS = {
    "default": ["--preset", "textworld"],
    "level4": ["--preset", "textworld", "--env-options", '{"level": 4, "train_games": 16, "eval_games": '
               '32, "holdout": "walkthrough"}', "--tasks-per-step", "4", "--group-size", "4",
               "--max-turns", "4", "--temperature", "1.0", "--inadmissible-invalid"],
}


@dataclass
class Args:
    setting: str = field(default="default", metadata={"help": "default (t2po's textworld preset) or level4"})
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "policy: name or folder"})
    flags: str = field(default="", metadata={"help": "extra t2po.py flags, e.g. '--group-size 2'"})
    repeats: int = field(default=3, metadata={"help": "timed repeats of each replayed part (medians)"})
    threads: int = field(default=0, metadata={"help": "torch threads; 0 = torch default"})
    peak_shape: str = field(default="4096,576,1536", metadata={"help": "M,K,N of the peak matmul"})
    bandwidth_mb: int = field(default=1000, metadata={"help": "MB of fp32 summed for the bandwidth"})
    json: str = field(default="", metadata={"help": "also write the results to this JSON file"})
    profile: bool = field(default=False, metadata={
        "help": "also split one more shared-prefix update by kernel (torch.profiler, self CPU "
                "time): matmuls, attention, the rest"})


def median_time(fn, repeats: int) -> float:
    """Median wall seconds of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine_limits(shape: str, bandwidth_mb: int, repeats: int = 10) -> dict:
    """GFLOP/s of one M x K x N matmul in fp32 and bf16, and GB/s of reading an fp32 tensor."""
    m, k, n = map(int, shape.split(","))
    out = {"threads": torch.get_num_threads(), "native_bf16": list(run.native_bf16()), "peak_shape": shape,
           "load_average_1min": os.getloadavg()[0]}  # other jobs on the machine lower every rate
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out[f"{name}_gflops"] = 2 * m * k * n / median_time(lambda: a @ b, repeats) / 1e9  # noqa: B023
    x = torch.ones(bandwidth_mb * 250_000)  # fp32: 4 bytes each
    out["bandwidth_gbs"] = x.numel() * 4 / median_time(x.sum, max(3, repeats // 2)) / 1e9
    return out


def distinct_tokens(rows: list[list[int]]) -> int:
    """The distinct prefixes among `rows`: the nodes of their prefix tree (a token shared by several rows'
    prefixes counts once)."""
    if not rows:
        return 0
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    node_of = prefix_forest(ids, mask).node_of
    return int(torch.unique(node_of[node_of >= 0]).numel())


class Shape:
    """FLOPs of a model's passes (module docstring): N, V·d, layers x attention width."""

    def __init__(self, model):
        emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        total = sum(p.numel() for p in model.parameters())  # a tied lm_head counts once
        self.n = total - emb_in.numel() - (0 if emb_out is emb_in else emb_out.numel())
        self.head = emb_out.numel()
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.attn = c.num_hidden_layers * c.num_attention_heads * head_dim
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def flops(self, c: int, tokens: int, head_tokens: int, pairs: int) -> float:
        """`pairs`: the (query, key) products attention computes, masked or not."""
        return c * (self.n * tokens + self.head * head_tokens + 2 * self.attn * pairs)


def play_step(model, tokenizer, args) -> tuple[list, dict]:
    """t2po's rollout of step 1, every model forward recorded; its turn samples."""
    envs = t2po.build_envs(args)
    bf16 = run.bf16_training(args)  # t2po's --autocast: HF rollouts from a bf16 copy too
    generator = HFGenerator(model, tokenizer, prefix_cache=args.share_prefixes,
                            dtype=torch.bfloat16 if bf16 else None)
    sampler = generator.sampling_model()  # the model that generates: the policy or its bf16 copy
    rec = {"prefill": [], "decode": [], "generate_s": 0.0, "prefill_s": 0.0, "rows": None,
           "sampler": sampler, "dtype": "bf16" if bf16 else "fp32"}
    forward, generate, decode = sampler.forward, generator.generate, generator.decode

    def recorded_forward(*a, **kw):
        # behind KV an earlier call left (not replayed), not in an empty cache (new_cache's)
        cache = kw["past_key_values"]
        cached = cache is not None and cache.get_seq_length() > 0
        t = time.perf_counter()
        out = forward(*a, **kw)
        seconds, ids = time.perf_counter() - t, kw["input_ids"]
        if rec["rows"] is not None:  # a decode call's first pass: the prefill
            rec["prefill"].append({"kw": None if cached else {k: kw[k].clone() for k in (
                "input_ids", "attention_mask", "position_ids")}, "seconds": seconds,
                "processed": ids.numel(), "keys": kw["attention_mask"].shape[1],
                "rows": list(dict.fromkeys(map(tuple, rec["rows"])))})
            rec["prefill_s"] += seconds
            rec["rows"] = None
        else:  # a decode pass: its time, batch and cache length
            rec["decode"].append((seconds, ids.shape[0], kw["attention_mask"].shape[1]))
        return out

    def recorded_decode(rows, *a, **kw):
        rec["rows"] = rows
        return decode(rows, *a, **kw)

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            rec["generate_s"] += time.perf_counter() - t

    sampler.forward, generator.generate, generator.decode = recorded_forward, timed_generate, recorded_decode
    try:  # step 1's episodes, as t2po.main plays them (only the generator and tokenizer of a Run are read)
        episodes = t2po.training_rollouts(SimpleNamespace(generator=generator, tokenizer=tokenizer), envs,
                                          args, 1)
    finally:
        del sampler.forward
    return t2po.training_samples(episodes, args), rec


def prefill_part(model, shape: Shape, rec: dict, repeats: int) -> dict:
    """Prefills from scratch are replayed (medians); those behind reused KV (the prefix cache) count
    their one time in the rollout: replaying them would mean keeping every call's cache."""
    calls = rec["prefill"]
    fresh = [c["kw"] for c in calls if c["kw"] is not None]

    @torch.inference_mode()
    def replay():
        for kw in fresh:  # into the cache the generator starts from
            model(**kw, past_key_values=new_cache(model), use_cache=True, logits_to_keep=1)

    rows = [list(r) for c in calls for r in c["rows"]]  # the full rows (prompt so far) asked for
    processed = sum(c["processed"] for c in calls)
    seconds = (median_time(replay, repeats) if fresh else 0.0) + sum(
        c["seconds"] for c in calls if c["kw"] is None)
    attention = sum(2 * shape.attn * c["processed"] * c["keys"] for c in calls)  # queries x keys
    return {"processed": processed, "distinct": distinct_tokens(rows), "seconds": seconds,
            "calls": len(calls), "cached_calls": len(calls) - len(fresh),
            "real_tokens": sum(map(len, rows)),
            "flops": 2 * (shape.n * processed + shape.head * len(rows)) + 2 * attention}


KERNEL_KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
                "attention": ("scaled_dot_product",)}


def by_kernel(fn) -> dict:
    """Self CPU seconds of `fn`'s ops by KERNEL_KINDS (a name containing one of a kind's strings),
    the rest as "other", and "total"."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out = dict.fromkeys([*KERNEL_KINDS, "other"], 0.0)
    for event in prof.key_averages():
        kind = next((k for k, names in KERNEL_KINDS.items() if any(n in event.key for n in names)),
                    "other")
        out[kind] += event.self_cpu_time_total / 1e6
    out["total"] = sum(out.values())
    return out


def update_part(model, shape: Shape, samples: list, args, share: bool, repeats: int,
                profile: bool = False) -> dict:
    micro = [t2po.build_batch(part) for part, _ in t2po.microbatches(samples, args.micro_batch_size, share)]

    def forward_backward():
        model.zero_grad(set_to_none=True)
        with run.precision(args):
            for batch in micro:
                logp = t2po.action_logprobs(model, batch, args.temperature, share)  # (B, T-1)
                (logp * batch["action_mask"]).sum().backward()  # (B, T-1) each sample's mask

    model.train()
    seconds = median_time(forward_backward, repeats)
    kernels = by_kernel(forward_backward) if profile else None
    model.eval()
    processed, pairs = 0, 0
    for batch in micro:  # the positions token_logprobs computes: padded rows, or the packed forest's
        ids = batch["input_ids"]
        processed += ids.numel()
        if not share:
            pairs += ids.shape[0] * ids.shape[1] ** 2  # each padded row's T x T
            continue
        forest = prefix_forest(ids, batch["attention_mask"])
        processed += forest.input_ids.numel() - ids.numel()
        for segments in forest.segments:  # per segment: its queries x (its ancestors + itself)
            pairs += sum((s.end - s.start) * (b - a) for s in segments for a, b in s.spans)
    head = int(sum(b["targets"].sum() for b in micro))  # the distinct rows' action tokens get logits
    rows = list(dict.fromkeys(tuple(t.prompt_ids + t.response_ids) for t in samples))
    return {"processed": processed, "distinct": distinct_tokens([list(r) for r in rows]),
            "seconds": seconds, "micro_batches": len(micro), "samples": len(samples),
            "flops": shape.flops(6, processed, head, pairs), "attention_pairs": pairs,
            **({"kernels_s": kernels} if kernels else {})}


def table(parts: dict, limits: dict, shape: Shape) -> str:
    bf16 = bool(limits["native_bf16"])
    peak = limits["bf16_gflops" if bf16 else "fp32_gflops"]
    limit = f"{'bf16' if bf16 else 'fp32'} matmul {peak:.0f} GFLOP/s"
    lines = ["| part | processed tokens | distinct tokens | distinct / processed | time s | rate on "
             "processed | rate on distinct | limit | % of limit (processed) | % (distinct) |",
             "|" + "---|" * 10]
    for name, p in parts.items():
        if "gbs" in p:
            lines.append(f"| {name} | {p['processed']} | - | - | {p['seconds']:.4f} | {p['gbs']:.1f} GB/s "
                         f"| - | read {limits['bandwidth_gbs']:.1f} GB/s | {100 * p['fraction']:.1f} | - |")
            continue
        mult = 2 if name.startswith("prefill") else 6
        p["gflops"] = p["flops"] / p["seconds"] / 1e9
        p["gflops_distinct"] = mult * shape.n * p["distinct"] / p["seconds"] / 1e9
        p["fraction"], p["fraction_distinct"] = p["gflops"] / peak, p["gflops_distinct"] / peak
        lines.append(f"| {name} | {p['processed']} | {p['distinct']} | {p['distinct'] / p['processed']:.2f} "
                     f"| {p['seconds']:.2f} | {p['gflops']:.1f} GFLOP/s | {p['gflops_distinct']:.1f} GFLOP/s "
                     f"| {limit} | {100 * p['fraction']:.1f} | {100 * p['fraction_distinct']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(Args, argv)
    if args.setting not in SETTINGS:
        raise SystemExit(f"bench_limits: --setting {args.setting!r}: choose {' or '.join(SETTINGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    argv = [*SETTINGS[args.setting], "--model", args.model, *shlex.split(args.flags)]
    step_args = run.parse(t2po.Args, argv, t2po.PRESETS, t2po.check_args)
    limits = machine_limits(args.peak_shape, args.bandwidth_mb)
    torch.manual_seed(step_args.seed)
    model, tokenizer = load_policy(args.model, gradient_checkpointing=step_args.gradient_checkpointing)
    model.eval()
    shape = Shape(model)
    samples, rec = play_step(model, tokenizer, step_args)
    cache = "on" if step_args.share_prefixes else "off"
    parts = {f"prefill (rollout, {rec['dtype']}; prefix cache {cache})": prefill_part(
        rec["sampler"], shape, rec, args.repeats)}
    times, batches, caches = zip(*rec["decode"], strict=True) if rec["decode"] else ((1.0,), (0,), (0,))
    forward_s = statistics.median(times)
    step_s = (rec["generate_s"] - rec["prefill_s"]) / max(1, len(rec["decode"]))
    at = f"batch {statistics.median(batches):.0f}, cache {statistics.median(caches):.0f}"
    for name, seconds in ((f"decode forward ({at})", forward_s), ("decode step (+ sampling)", step_s)):
        gbs = Shape(rec["sampler"]).weight_bytes / seconds / 1e9  # bf16 copy: half the bytes
        parts[name] = {"processed": sum(batches), "seconds": seconds, "gbs": gbs,
                       "fraction": gbs / limits["bandwidth_gbs"], "passes": len(rec["decode"])}
    for share in (False, True):
        name = f"update, {'shared prefixes' if share else 'unpacked'} ({step_args.autocast} autocast: " \
               f"{'bf16' if run.bf16_training(step_args) else 'fp32'})"
        parts[name] = update_part(model, shape, samples, step_args, share, args.repeats,
                                  profile=args.profile and share)
    print(f"\n{args.model} --setting {args.setting} {args.flags}: {step_args.tasks_per_step} tasks x "
          f"{step_args.group_size}, {len(samples)} turn samples; threads {limits['threads']}, native bf16: "
          f"{', '.join(limits['native_bf16']) or 'none'}; matmul {limits['peak_shape']}: fp32 "
          f"{limits['fp32_gflops']:.1f}, bf16 {limits['bf16_gflops']:.1f} GFLOP/s; read bandwidth "
          f"{limits['bandwidth_gbs']:.1f} GB/s; N = {shape.n / 1e6:.1f}M weights without embeddings, "
          f"{shape.weight_bytes / 1e6:.0f} MB of weights; medians of {args.repeats}; load average "
          f"{limits['load_average_1min']:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(table(parts, limits, shape))
    for name, p in parts.items():
        if "kernels_s" in p:
            k = p["kernels_s"]
            print(f"{name}, by kernel (profiled, {k['total']:.1f} s): " + ", ".join(
                f"{kind} {k[kind]:.1f} s ({100 * k[kind] / k['total']:.0f}%)"
                for kind in (*KERNEL_KINDS, "other")))
    result = {"args": vars(args), "limits": limits, "parts": parts, "n_nonembedding": shape.n}
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)
    return result


if __name__ == "__main__":
    main()
