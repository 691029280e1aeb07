"""Learning curves of one or several run folders in one PNG: `python -m common.plot RUN [RUN ...] [-o FILE]`.

Reads each run's metrics.jsonl (training rows: `reward_mean`, `success_rate`, ...; evaluation rows:
`eval/success_rate`; the cold start's `eval_cold_start/success_rate` at step 0; a fixed probe set of training
tasks' `probe/success_rate`, drawn dashed beside the held-out points) and draws one panel per
quantity, one line per run, labelled by the run folder's name. A panel no run has the keys for is left out.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable

import numpy as np


def _key(name: str):
    return lambda row: row.get(name)


def _tokens_per_turn(row: dict) -> float | None:
    """tokens_per_turn where logged; older loop.py runs (committed results) logged action_tokens and
    turns_mean instead."""
    if "tokens_per_turn" in row:
        return row["tokens_per_turn"]
    if {"action_tokens", "rollouts", "turns_mean"} <= row.keys() and row["rollouts"] * row["turns_mean"] > 0:
        return row["action_tokens"] / (row["rollouts"] * row["turns_mean"])
    return None


def _step_seconds(row: dict) -> float | None:
    """Seconds one training step took: step_time_s (every script logs it now; time_s counts from the start of
    RL), else time_s, which runs committed before step_time_s existed logged per step."""
    return row.get("step_time_s", row.get("time_s"))


# (title, how a training row gives the value or None). Rows lacking a key are skipped, not drawn as zero.
TRAIN_PANELS: list[tuple[str, Callable[[dict], float | None]]] = [
    ("training reward (reward_mean)", _key("reward_mean")),
    ("training success (success_rate)", _key("success_rate")),
    ("generated tokens per turn", _tokens_per_turn),
    ("seconds per step", _step_seconds),
    ("of which rollout (time_rollout_s)", _key("time_rollout_s")),
]


def read_metrics(run: str) -> list[dict]:
    """The rows of <run>/metrics.jsonl (or of `run` itself when it is the file); a line cut short by a kill
    is skipped."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int | float):
                rows.append(row)
    return rows


def _is_train(row: dict) -> bool:
    return "reward_mean" in row or "success_rate" in row


def train_series(rows: list[dict], value) -> tuple[list, list]:
    """(steps, values) of the training rows that give a value."""
    points = [(r["step"], value(r)) for r in rows if _is_train(r)]
    points = [(s, v) for s, v in points if isinstance(v, int | float) and np.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def eval_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """Held-out success: 'base' (step-0 eval/ row), 'cold start' (eval_cold_start/ row) and the curve 'RL'
    from the policy RL starts from (the cold start's when there is one) through every later eval/ row."""
    base = [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r and r["step"] == 0]
    cold_key = "eval_cold_start/success_rate"
    cold = [(r["step"], r[cold_key]) for r in rows if cold_key in r]
    later = [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r and r["step"] > 0]
    out = {}
    if base:
        out["base"] = ([base[-1][0]], [base[-1][1]])
    if cold:
        out["cold start"] = ([cold[-1][0]], [cold[-1][1]])
    start = (cold or base)[-1:]
    if later:
        curve = start + later
        out["RL"] = ([s for s, _ in curve], [v for _, v in curve])
    return out


def probe_series(rows: list[dict]) -> tuple[list, list]:
    """(steps, success) on the fixed probe set of training tasks (t2po.py --probe-tasks)."""
    points = [(r["step"], r["probe/success_rate"]) for r in rows if "probe/success_rate" in r]
    return [s for s, _ in points], [v for _, v in points]


def run_labels(runs: list[str]) -> list[str]:
    """Each run folder's name; the whole path where two names clash."""
    names = [os.path.basename(os.path.normpath(r)) for r in runs]
    return [n if names.count(n) == 1 else os.path.normpath(r) for n, r in zip(names, runs, strict=True)]


def plot_runs(runs: list[str], out: str) -> list[str]:
    """Draw the runs' curves into the PNG `out`; returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    data = [read_metrics(r) for r in runs]
    labels = run_labels(runs)
    panels = [(title, value) for title, value in TRAIN_PANELS
              if any(train_series(rows, value)[0] for rows in data)]
    has_eval = any(eval_series(rows) or probe_series(rows)[0] for rows in data)
    titles = [t for t, _ in panels[:2]] + (["held-out success"] if has_eval else []) \
        + [t for t, _ in panels[2:]]
    if not titles:
        raise ValueError("no run has training or evaluation rows in its metrics.jsonl")
    cols = min(3, len(titles))
    rows_n = (len(titles) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    value_of = dict(panels)
    for ax, title in zip(axes.flat, titles, strict=False):
        for i, (rows, label) in enumerate(zip(data, labels, strict=True)):
            color = colors[i % len(colors)]
            if title in value_of:
                steps, values = train_series(rows, value_of[title])
                if steps:
                    ax.plot(steps, values, marker=".", color=color, label=label)
                continue
            ev, probe = eval_series(rows), probe_series(rows)
            if probe[0]:
                ax.plot(*probe, ls="--", marker=".", color=color, label=f"{label}: probe (training tasks)")
            if "RL" in ev:
                ax.plot(*ev["RL"], marker="o", color=color, label=label)
            if "base" in ev:
                ax.plot(*ev["base"], marker="s", mfc="none", ls="none", color=color,
                        label=f"{label}: base" if "RL" not in ev else None)
            if "cold start" in ev:
                ax.plot(*ev["cold start"], marker="^", ls="none", color=color,
                        label=f"{label}: cold start" if "RL" not in ev else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if title.startswith("held-out"):
            ax.set_ylim(-0.05, 1.05)
            ax.text(0.02, 0.97, "□ base  △ cold start  -- probe", transform=ax.transAxes, va="top",
                    fontsize=8)
    for ax in list(axes.flat)[len(titles):]:
        ax.axis("off")
    seen = {}  # one legend for the figure: each label once
    for ax in axes.flat:
        for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(n, h)
    handles, names = list(seen.values()), list(seen)
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * ((len(names) - 1) // 4), 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return titles


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folder (holding metrics.jsonl)")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    for run in args.runs:
        path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
        if not os.path.isfile(path):
            raise SystemExit(f"common.plot: RUN {run}: no metrics.jsonl there")
    try:
        titles = plot_runs(args.runs, args.output)
    except ValueError as e:
        raise SystemExit(f"common.plot: {e}") from None
    except OSError as e:
        raise SystemExit(f"common.plot: -o {args.output}: cannot write there ({e.strerror or e})") from None
    print(f"wrote {args.output}: {len(args.runs)} run(s); panels: {', '.join(titles)}", file=sys.stderr)


if __name__ == "__main__":
    main()
