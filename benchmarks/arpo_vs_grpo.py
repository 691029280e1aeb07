"""ARPO vs trajectory-level GRPO at the same rollout budget: the same script, seed, questions and M, only
`--rollout` differs. Both arms start from one shared cold-start model (arpo.py's scripted-expert SFT, run
once and saved), so the comparison is about the RL stage alone. Prints reward, tool calls and forks per
question (mean over training steps, with the standard error over steps; "written" counts the calls in the
M responses, "run" counts a fork's shared prefix once, as executed) and held-out success.

    python benchmarks/arpo_vs_grpo.py                           # cold start, then both arms in turn
    python benchmarks/arpo_vs_grpo.py --arm arpo                # one arm (the cold start is reused if saved)
    python benchmarks/arpo_vs_grpo.py --arm table               # only print the table of finished arms
    python benchmarks/arpo_vs_grpo.py --steps 4 --max-minutes 10   # any arpo.py flag is passed to both arms
"""

import argparse
import json
import math
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import arpo  # noqa: E402
from common.models import load_policy  # noqa: E402
from envs.base import make_env  # noqa: E402


def cold_start_model(flags: list[str], folder: str) -> None:
    """arpo.py's cold start (same seed, same demonstrations), saved as a model folder both arms load."""
    if os.path.exists(os.path.join(folder, "config.json")):
        print(f"[benchmark] reusing the cold-start model in {folder}")
        return
    args = arpo.apply_preset(arpo.parse_args(arpo.Args, flags), flags)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    env = make_env(args.env, seed=args.seed, **arpo.env_options(args))  # e.g. --search-topk, as arpo.py
    model, tokenizer = load_policy(args.model)
    arpo.run_cold_start(model, tokenizer, env, env.tasks("train"), args, random.Random(args.seed))
    model.save_pretrained(folder + ".tmp")
    tokenizer.save_pretrained(folder + ".tmp")
    os.replace(folder + ".tmp", folder)


def mean_se(values: list[float]) -> str:
    """mean ± standard error over training steps (steps are the independent units: fresh questions)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return f"{m:.3f}"
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{m:.3f} ± {sd / math.sqrt(len(values)):.3f}"


def train_column(out: str, key: str) -> list[float]:
    return [x[key] for x in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "reward_mean" in x]


def summary(out: str, steps: int) -> dict:
    """Training figures over the first `steps` steps (both arms ran them); held-out after the arm's end."""
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    train = [x for x in lines if "reward_mean" in x][:steps]
    evals = [x for x in lines if "eval/success_rate" in x]
    col = lambda key: [x[key] for x in train]  # noqa: E731
    return {"steps (questions x M rollouts each)": f"{len(train)} ({train[0]['rollouts']} rollouts/step)",
            "train reward": mean_se(col("reward_mean")),
            "train format-error rate": mean_se(col("format_error_rate")),
            "python calls written / question": mean_se(col("tool_calls/python_per_question")),
            "search calls written / question": mean_se(col("tool_calls/search_per_question")),
            "tool calls run / question": mean_se(col("tool_calls/executed_per_question")),
            "forks / question": mean_se(col("forks_per_question")),
            "policy tokens / step": mean_se(col("num_tokens")),
            "held-out success before -> after": f"{evals[0]['eval/success_rate']:.3f} -> "
                                                f"{evals[-1]['eval/success_rate']:.3f}",
            "held-out reward before -> after": f"{evals[0]['eval/reward_mean']:.3f} -> "
                                               f"{evals[-1]['eval/reward_mean']:.3f}",
            "wall time (s)": f"{train[-1]['time_s']:.0f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=["both", "arpo", "global", "table"], default="both")
    parser.add_argument("--root", default="runs/arpo_vs_grpo", help="cold-start model and one folder per arm")
    ours, flags = parser.parse_known_args()
    folder = os.path.join(ours.root, "cold_start_model")
    arms = {"both": ["arpo", "global"], "table": []}.get(ours.arm, [ours.arm])
    if arms:
        cold_start_model(flags, folder)
    for rollout in arms:
        out = os.path.join(ours.root, rollout)
        shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (metrics.jsonl appends)
        arpo.main([*flags, "--model", folder, "--no-cold-start", "--rollout", rollout, "--out", out])
    done = [r for r in ("arpo", "global") if os.path.exists(os.path.join(ours.root, r, "metrics.jsonl"))]
    if len(done) < 2:
        return
    steps = min(len(train_column(os.path.join(ours.root, r), "reward_mean")) for r in done)
    rows = {r: summary(os.path.join(ours.root, r), steps) for r in done}
    print("\n| | ARPO (`--rollout arpo`) | GRPO (`--rollout global`) |\n|---|---|---|")
    for key in rows["arpo"]:
        print(f"| {key} | {rows['arpo'][key]} | {rows['global'][key]} |")
    # step s trains on the same questions in both arms: the per-step difference cancels question difficulty
    print("\npaired by step (ARPO - GRPO, mean ± SE over steps):")
    for key in ("reward_mean", "tool_calls/executed_per_question", "num_tokens"):
        a, g = (train_column(os.path.join(ours.root, r), key)[:steps] for r in ("arpo", "global"))
        print(f"  {key}: {mean_se([x - y for x, y in zip(a, g, strict=True)])}")


if __name__ == "__main__":
    main()
