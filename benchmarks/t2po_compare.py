"""Compare finished t2po.py runs (e.g. T²PO vs the GiGPO baseline at the same budget) from their metrics.

    python t2po.py --out runs/t2po
    python t2po.py --no-tti --no-tds --out runs/gigpo
    python benchmarks/t2po_compare.py runs/t2po runs/gigpo

Per run: held-out success / score / tokens per turn after RL (the last eval line), and over the RL steps'
training rollouts: mean tokens and thinking tokens per turn, TTI interventions (fraction of turns), TDS
resamples, training success, and the RL time."""

import json
import sys


def summarise_run(out: str) -> dict:
    lines = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    train = [line for line in lines if "reward_mean" in line]
    final = [line for line in lines if "eval/success_rate" in line][-1]
    mean = lambda key: sum(line[key] for line in train) / max(1, len(train))
    return {
        "run": out, "eval_success": final["eval/success_rate"], "eval_score": final["eval/score"],
        "eval_tokens_per_turn": final["eval/tokens_per_turn"],
        "eval_think_tokens_per_turn": final["eval/think_tokens_per_turn"],
        "train_tokens_per_turn": mean("tokens_per_turn"),
        "train_think_tokens_per_turn": mean("think_tokens_per_turn"),
        "train_tti_interventions": mean("tti_interventions"), "train_tds_resamples": mean("tds_resamples"),
        "train_success": mean("success_rate"), "rl_time_s": train[-1]["time_s"] if train else 0.0,
    }


def main(runs: list[str]) -> None:
    if not runs:
        raise SystemExit("usage: python benchmarks/t2po_compare.py RUN_DIR [RUN_DIR ...]")
    rows = [summarise_run(r) for r in runs]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
