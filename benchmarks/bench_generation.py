"""Generation tokens/s, side by side in one run: raw `model.generate` vs our HF backend, raw
`vllm.LLM.generate` vs our vLLM backend, at several batch sizes.

    .venv/bin/python benchmarks/bench_generation.py                       # SmolLM2-135M fp32, batch 8 and 32
    .venv/bin/python benchmarks/bench_generation.py --backends raw-hf hf  # HF only

Each configuration samples at temperature 1 from distinct chat prompts, `--new-tokens` per row (rows may
end earlier at eos; tokens/s counts the tokens each engine actually generated, eos included). Raw and
ours alternate within each repeat so that machine load hits both alike; the median over repeats is
reported. The vLLM pair shares one engine (ours wraps it), with the prefix cache reset before every run.
Goals: ours HF >= raw HF; ours vLLM >= 0.95 x raw vLLM.
"""

import argparse
import os
import statistics
import time

import torch

from common.generation import make_generator
from common.models import DEFAULT_MODEL, load_policy, resolve_model_path

TOPICS = ["a lighthouse keeper", "a lost robot", "the first city on Mars", "a dragon who hates gold",
          "a chess match", "a time-travelling cat", "an underwater library", "a desert caravan"]


def chat_prompts(tokenizer, batch: int) -> list[list[int]]:
    msgs = [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]} (version {i})."
            for i in range(batch)]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for m in msgs]


def timed(fn) -> tuple[float, int]:
    t = time.perf_counter()
    n_tokens = fn()
    return time.perf_counter() - t, n_tokens


def raw_hf(model, tokenizer, prompts, new_tokens) -> int:
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")  # left padded
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    gen = out[:, batch["input_ids"].shape[1]:]  # (B, N); after eos the row is padded
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    n = 0
    for row in gen.tolist():
        n += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return n


def ours(gen, prompts, new_tokens) -> int:
    out = gen.generate(prompts, n=1, max_new_tokens=new_tokens, temperature=1.0)
    return sum(len(s.token_ids) + (s.finish_reason == "eos") for o in out for s in o)


def raw_vllm(llm, prompts, new_tokens) -> int:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=new_tokens)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


def bench_pair(name_a, fn_a, name_b, fn_b, repeats, reset=None) -> dict[str, float]:
    speeds = {name_a: [], name_b: []}
    for _ in range(repeats):
        for name, fn in ((name_a, fn_a), (name_b, fn_b)):
            if reset:
                reset()
            seconds, n_tokens = timed(fn)
            speeds[name].append(n_tokens / seconds)
            print(f"  {name}: {n_tokens} tokens in {seconds:.1f} s", flush=True)
    return {k: statistics.median(v) for k, v in speeds.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=["raw-hf", "hf", "raw-vllm", "vllm"])
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM without torch.compile, as our backend runs on CPU (without it: compiled)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch and vLLM (0: their defaults); 1 is steadier when shared")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    torch.manual_seed(0)
    model, tokenizer = load_policy(args.model, dtype=args.dtype)
    model.eval()
    print(f"model {args.model}, {args.dtype}, {args.new_tokens} new tokens, median of {args.repeats}; "
          f"{torch.get_num_threads()} torch threads; load average at start {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    rows = {}
    if {"raw-hf", "hf"} & set(args.backends):  # HF first: vLLM binds this process's threads when it starts
        gen = make_generator("hf", model, tokenizer)
        for b in args.batch_sizes:
            prompts = chat_prompts(tokenizer, b)
            ours(gen, prompts, 4), raw_hf(model, tokenizer, prompts, 4)  # warm-up
            rows[b] = bench_pair("raw-hf", lambda p=prompts: raw_hf(model, tokenizer, p, args.new_tokens),
                                 "hf", lambda p=prompts: ours(gen, p, args.new_tokens), args.repeats)
            print(b, rows[b], flush=True)
    if {"raw-vllm", "vllm"} & set(args.backends):
        t = time.perf_counter()
        gen = make_generator("vllm", model, tokenizer, resolve_model_path(args.model), dtype=args.dtype,
                             enforce_eager=args.enforce_eager)
        print(f"vLLM engine start {time.perf_counter() - t:.0f} s", flush=True)
        for b in args.batch_sizes:
            prompts = chat_prompts(tokenizer, b)
            ours(gen, prompts, 4), raw_vllm(gen.llm, prompts, 4)  # warm-up
            rows.setdefault(b, {}).update(bench_pair(
                "raw-vllm", lambda p=prompts: raw_vllm(gen.llm, p, args.new_tokens),
                "vllm", lambda p=prompts: ours(gen, p, args.new_tokens), args.repeats,
                reset=gen.llm.reset_prefix_cache))
            print(b, rows[b], flush=True)
    names = [n for n in ["raw-hf", "hf", "raw-vllm", "vllm"] if n in args.backends]
    print("\n| batch | " + " | ".join(f"{n} tok/s" for n in names) + " | hf / raw-hf | vllm / raw-vllm |")
    print("|---" * (len(names) + 3) + "|")
    for b, r in rows.items():
        pairs = [("hf", "raw-hf"), ("vllm", "raw-vllm")]
        ratios = [f"{r[a] / r[c]:.2f}" if a in r and c in r else "-" for a, c in pairs]
        print(f"| {b} | " + " | ".join([f"{r.get(n, float('nan')):.1f}" for n in names] + ratios) + " |")


if __name__ == "__main__":
    main()
