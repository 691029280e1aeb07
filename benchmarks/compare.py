"""Each paper's claim against its baseline, one flag apart, over several seeds: run, then report.

    python benchmarks/compare.py run t2po --seeds 0 1 2            # T²PO vs GiGPO (--no-tti --no-tds)
    python benchmarks/compare.py run arpo --seeds 0 1 2 -- --steps 4 --max-minutes 0
    python benchmarks/compare.py run loop --seeds 0 1 2 -- --steps 3
    python benchmarks/compare.py report t2po arpo loop             # table + PNG curves into docs/figures
    python benchmarks/compare.py run demo --arms rl lr0 --seeds 0 1 2 3 4   # the default run, its --lr 0

`run` plays every (arm, seed) one after another on one thread (OMP_NUM_THREADS=1; on a 2-core machine
run at most two `run`s at once: torch beside another busy process slows far more than 2x), into
runs/compare/<algo>/<arm>-s<seed>/, the script's own run folder (args.json, metrics.jsonl). A finished run
gets a `done` file and is skipped next time, so `run` can be stopped and restarted; an unfinished folder
is started over. Arguments after `--` go to every run of both arms. `--arms` plays only some arms, e.g. the
method's seeds in one `run` and the baseline's in another, side by side.

`report` reads only the finished folders (no re-running), so it can be redrawn at any time. Per algorithm
it prints a markdown table (and writes it to --markdown): per arm the mean over seeds ± the 95% Student t
half-width (n−1 dof), then the paired difference method − baseline over the seeds both arms finished (same
seed: same tasks, same cold start), with its 95% interval and a verdict: "within noise" when the interval
contains 0. Metrics marked ↓ are better lower (the papers claim fewer tokens per turn for T²PO's thinking
cut, about half the tool calls for ARPO). "Before RL" is the held-out evaluation of the policy RL starts
from (after the cold start; the base model's without one): the same for every arm of a seed. It draws
<figures>/compare_<algo>.png: the training curves (mean over seeds per step, shaded 95% band) and held-out
success before and after RL per arm, with the command and the commit in the footer.

`demo` is not a paper's claim but the default run's (`python t2po.py`, what `make demo` plays): does RL add
to the cold start? Its arms are that run (`rl`: level 4 since 2026-12-04), a no-update control (`lr0`:
`--lr 0`, the same rollouts, no weight moves), and the level-4 study's arms (docs/results/t2po.md), with a
probe set of 8 training tasks for 4 RL steps and without it for 8. It
adds, per arm, the held-out games won after RL minus before it (paired within each run), the share of
seeds where that is > 0, and the same gain on the probe set; and, per run, the held-out games won per
walkthrough (games that share one mostly win or lose together). `loop-demo` is the same for `python loop.py`
(arms `rl` and `lr0`, the same figures).
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from collections import defaultdict

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.plot import probe_series, read_metrics, train_series  # noqa: E402

# level 4 (docs/results/t2po.md): 4 tasks x 4 rollouts at T 1.0, lr 5e-6, a 4-episode cold start, 4 turns
LEVEL4 = ["--temperature", "1.0", "--lr", "5e-6", "--tasks-per-step", "4", "--group-size", "4",
          "--cold-start-episodes", "4", "--max-turns", "4"]
# arm name -> the flags that make it; the first arm is the paper's method, the others its baselines.
# Only the arms a results page cites; the others live in git history (docs/results/README.md).
ARMS = {
    "t2po": {"t2po": [], "gigpo": ["--no-tti", "--no-tds"]},
    "arpo": {"arpo": [], "grpo": ["--rollout", "global"], "lr0": ["--lr", "0"]},
    "loop": {"token": [], "turn": ["--importance-weight", "turn"],
             "trajectory": ["--importance-weight", "trajectory"]},
    "demo": {"rl": [], "lr0": ["--lr", "0"],  # make demo's run (the textworld preset), its control
             "gigpo": ["--no-tti", "--no-tds"],  # the paper's baseline from the same cold start
             # a refused action counts invalid (the official ALFWorld projection's rule): without it a
             # step with no win rewarded the empty action `<action></action>` until every turn was one
             "t1-4x4-lr5e-6-cs4-mt4-inv": ["--probe-tasks", "8", *LEVEL4, "--inadmissible-invalid"],
             # the same for 8 steps without the probe (its 9 evaluations would cost ~12 min a run)
             "t1-4x4-lr5e-6-cs4-mt4-inv-st8": [*LEVEL4, "--inadmissible-invalid", "--steps", "8"]},
    "loop-demo": {"rl": [], "lr0": ["--lr", "0"]},  # python loop.py (its textworld preset), its control
}
SCRIPT = {"demo": "t2po", "loop-demo": "loop"}  # the script an experiment runs, if not its name
DEFAULT_RUNS = ("demo", "loop-demo")  # a script's default run: per-walkthrough wins in the report


def run_folder(root: str, algo: str, arm: str, seed: int) -> str:
    return os.path.join(root, algo, f"{arm}-s{seed}")


def run(algo: str, seeds: list[int], extra: list[str], root: str, arms: list[str] | None = None) -> None:
    unknown = sorted(set(arms or []) - set(ARMS[algo]))
    if unknown:
        raise SystemExit(f"compare.py run {algo}: unknown arm {unknown[0]!r}; "
                         f"choose from {', '.join(ARMS[algo])}")
    for seed in seeds:  # seed-major: an interrupted sweep still has every arm for the seeds it finished
        for arm, flags in ARMS[algo].items():
            if arms and arm not in arms:
                continue
            out = run_folder(root, algo, arm, seed)
            if os.path.exists(os.path.join(out, "done")):
                continue
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, os.path.join(ROOT, f"{SCRIPT.get(algo, algo)}.py"), "--seed", str(seed),
                   "--out", out, *flags, *extra]
            print(" ".join(cmd), flush=True)
            log = os.path.join(os.path.dirname(out), f"{arm}-s{seed}.log")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(log, "w") as f:
                rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
            if rc != 0:
                raise SystemExit(f"compare.py: {' '.join(cmd)} failed (rc {rc}); see {log}")
            open(os.path.join(out, "done"), "w").close()


# t_{0.975, dof}: the two-sided 95% quantile of Student's t, dof 1..30 (no scipy here); past 30 the 30's
# value, slightly wide (the normal's is 1.960)
T975 = [math.nan, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052,
        2.048, 2.045, 2.042]


def interval(values: list[float]) -> tuple[float, float, int]:
    """(mean, 95% half-width t_{0.975,n-1}·s/√n, n); the half-width is nan below two values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = float(np.mean(values))
    if n < 2:
        return mean, math.nan, n
    return mean, T975[min(n - 1, 30)] * float(np.std(values, ddof=1)) / math.sqrt(n), n


def verdict(diffs: list[float], direction: int) -> str:
    """Plain words for the paired differences method − baseline; direction -1: lower is better, 0:
    neither (a mechanism's measure, e.g. the clip fraction)."""
    mean, half, n = interval(diffs)
    if n < 2:
        return "too few seeds"
    if mean - half <= 0 <= mean + half:
        return "within noise"
    if direction == 0:
        return "method higher" if mean > 0 else "method lower"
    return "method better" if (mean > 0) == (direction > 0) else "baseline better"


def last(key: str):
    """The value in the last row that has `key`: for eval/ keys, the held-out evaluation after RL."""
    return lambda rows: next((r[key] for r in reversed(rows) if key in r), None)


def before_rl(name: str):
    """Held-out `name` of the policy RL starts from: after the cold start, else the base model's."""
    def get(rows):
        cold = last(f"eval_cold_start/{name}")(rows)
        base = next((r[f"eval/{name}"] for r in rows if f"eval/{name}" in r), None)
        return cold if cold is not None else base
    return get


def held_out_gain(rows) -> float | None:
    """Held-out games (responses) won after RL minus before it (after the cold start), in one run."""
    before, after = before_rl("success_rate")(rows), last("eval/success_rate")(rows)
    n = last("eval/rollouts")(rows)
    return None if None in (before, after, n) else round((after - before) * n)


def rl_gained(rows) -> float | None:
    """1 when RL won more held-out games than the cold start, else 0."""
    gain = held_out_gain(rows)
    return None if gain is None else float(gain > 0)


def probe_gain(rows) -> float | None:
    """Success on the fixed probe set of training tasks (t2po.py --probe-tasks): last step minus step 0."""
    probe = probe_series(rows)[1]
    return probe[-1] - probe[0] if len(probe) > 1 else None


def train_mean(key: str):
    """Mean of a training metric over the RL steps (eval rows have only eval/ keys)."""
    def get(rows):
        values = train_series(rows, lambda r: r.get(key))[1]
        return float(np.mean(values)) if values else None
    return get


def trained_mean(key: str):
    """Mean of a training metric over the RL steps that took a gradient step (LOOP's filter can drop
    a whole step, whose clip fraction is 0 for want of tokens, not because nothing clipped)."""
    def get(rows):
        values = [r[key] for r in rows if r.get("gradient_steps", 0) > 0 and key in r]
        return float(np.mean(values)) if values else None
    return get


def train_last(key: str):
    return lambda rows: (train_series(rows, lambda r: r.get(key))[1] or [None])[-1]


HELD_OUT = [("held-out success, before RL", before_rl("success_rate"), 1),
            ("held-out success, after RL", last("eval/success_rate"), 1),
            ("held-out reward, after RL", last("eval/reward_mean"), 1)]
# algorithm -> (row label, value of one run's metrics rows, +1 higher is better / -1 lower is better)
METRICS = {
    "t2po": HELD_OUT[:2] + [
        ("training success, mean over steps", train_mean("success_rate"), 1),
        ("training success, last step", train_last("success_rate"), 1),
        ("tokens per turn, training (mean over steps) ↓", train_mean("tokens_per_turn"), -1),
        ("tokens per turn, held-out after RL ↓", last("eval/tokens_per_turn"), -1)],
    "arpo": [
        ("training reward, mean over steps", train_mean("reward_mean"), 1),
        ("training reward, last step", train_last("reward_mean"), 1),
        ("tool calls run per question, training (mean over steps) ↓",
         train_mean("tool_calls/executed_per_question"), -1),
        ("tool calls per question, held-out after RL ↓", last("eval/tool_calls_per_question"), -1),
        ("policy tokens per step (mean over steps) ↓", train_mean("num_tokens"), -1),
        *HELD_OUT,
        ("held-out responses won, after − before RL (one a question when greedy)", held_out_gain,
         1),
        ("seconds of RL (time_s at the last step) ↓", train_last("time_s"), -1)],
    "loop": HELD_OUT + [
        ("held-out games won, after − before RL", held_out_gain, 1),
        ("training reward, mean over steps", train_mean("reward_mean"), 1),
        ("training reward, last step", train_last("reward_mean"), 1),
        ("clip fraction, mean over the steps that trained", trained_mean("clip_fraction"), 0),
        ("task groups that carried a gradient, mean over steps", train_mean("groups_with_signal"), 1)],
}
METRICS["demo"] = HELD_OUT[:2] + [
    ("held-out games won, after − before RL", held_out_gain, 1),
    ("share of seeds where RL won more held-out games", rl_gained, 1),
    ("probe success (training tasks), after − before RL", probe_gain, 1),
    ("training success, mean over steps", train_mean("success_rate"), 1),
    ("thinking tokens per turn, training (mean over steps) ↓", train_mean("think_tokens_per_turn"),
     -1),
    ("rollout seconds per step (mean) ↓", train_mean("time_rollout_s"), -1),
    ("seconds of RL (time_s at the last step) ↓", train_last("time_s"), -1)]
METRICS["loop-demo"] = METRICS["demo"]
# algorithm -> the training metrics drawn as curves
CURVES = {"demo": ["probe/success_rate", "success_rate"], "loop-demo": ["success_rate"],
          "t2po": ["success_rate", "tokens_per_turn"],
          "arpo": ["reward_mean", "tool_calls/executed_per_question"],
          "loop": ["reward_mean", "success_rate"]}


def read_runs(root: str, algo: str) -> tuple[dict[str, dict[int, list[dict]]], int]:
    """{arm: {seed: metrics rows}} of the finished run folders (those with a `done` file), and how many
    unfinished folders were left out."""
    runs, unfinished = defaultdict(dict), 0
    folder = os.path.join(root, algo)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        arm, _, seed = name.rpartition("-s")
        if arm not in ARMS[algo] or not seed.isdigit() or not os.path.isdir(os.path.join(folder, name)):
            continue
        if os.path.exists(os.path.join(folder, name, "done")):
            runs[arm][int(seed)] = with_eval_counts(os.path.join(folder, name))
        else:
            unfinished += 1
    return dict(runs), unfinished


def with_eval_counts(folder: str) -> list[dict]:
    """A run's metrics rows; a held-out row without its response count (loop.py logged none before
    eval/rollouts, 2026-12-06; arpo.py logs none) takes it from the run's args.json: --eval-tasks
    x --eval-samples (arpo.py's sampled responses a question; 1 where absent)."""
    rows = read_metrics(folder)
    path = os.path.join(folder, "args.json")
    if os.path.exists(path):
        with open(path) as f:
            given = json.load(f)
        n = given.get("eval_tasks") and given["eval_tasks"] * given.get("eval_samples", 1)
        for row in rows:
            for key in [k for k in row if k.endswith("success_rate") and k.startswith("eval")]:
                row.setdefault(key.replace("success_rate", "rollouts"), n)
    return rows


def walkthrough_wins(folder: str) -> dict[str, list[int]]:
    """demo: a run's held-out games per walkthrough ("S-W": go south, go west, take coin) as [games, won
    after the cold start, won after RL], from its transcripts; {} without them. Games that share a
    walkthrough mostly succeed or fail together: the held-out set's real size is its walkthroughs."""
    from envs.textworld_env import walkthrough

    paths = [os.path.join(folder, "transcripts", f"{stage}.jsonl") for stage in ("cold_start", "rl")]
    if not all(map(os.path.exists, [*paths, os.path.join(folder, "args.json")])):
        return {}
    with open(os.path.join(folder, "args.json")) as f:
        options = json.loads(json.load(f).get("env_options") or "{}")
    wins: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for column, path in enumerate(paths, start=1):
        with open(path) as f:
            for episode in map(json.loads, f):
                commands = walkthrough(options.get("challenge", "coin_collector"), options.get("level", 1),
                                       int(episode["task"]))
                name = "-".join(c.split()[-1][0].upper() for c in commands if c.startswith("go "))
                wins[name][0] += column == 1
                wins[name][column] += bool(episode["won"])
    return dict(sorted(wins.items()))


def walkthrough_table(root: str, algo: str, runs: dict[str, dict[int, list[dict]]]) -> str:
    """demo: per arm and seed, the held-out games won per walkthrough, after the cold start → after RL;
    the runs that kept their transcripts (one seed per arm is committed)."""
    cells = {(arm, seed): wins for arm in ARMS[algo] if arm in runs for seed in sorted(runs[arm])
             if (wins := walkthrough_wins(run_folder(root, algo, arm, seed)))}
    names = sorted({name for wins in cells.values() for name in wins})
    if not names:  # no run kept its transcripts
        return ""
    lines = ["| run | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for (arm, seed), wins in cells.items():
        row = [f"{wins[n][1]} → {wins[n][2]} of {wins[n][0]}" if n in wins else "–" for n in names]
        lines.append(f"| {arm}-s{seed} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def fmt(mean: float, half: float, n: int, sign: bool = False) -> str:
    if n == 0:
        return "–"
    d = 3 if abs(mean) < 10 else 1  # success rates to 0.001, token counts to 0.1
    text = f"{mean:+.{d}f}" if sign else f"{mean:.{d}f}"
    return f"{text} ± {half:.{d}f}" if n > 1 else f"{text} (1 seed)"


def table(algo: str, runs: dict[str, dict[int, list[dict]]]) -> str:
    """The markdown table: a row per metric; per arm mean ± half-width; per baseline the paired difference."""
    arms = [a for a in ARMS[algo] if a in runs] or list(ARMS[algo])  # the arms that ran
    method, baselines = arms[0], arms[1:]
    header = ["metric"] + [f"{a} (n={len(runs.get(a, {}))})" for a in arms]
    for b in baselines:
        header += [f"{method} − {b}, paired", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, get, direction in METRICS[algo]:
        values = {a: {s: v for s, rows in runs.get(a, {}).items() if (v := get(rows)) is not None}
                  for a in arms}  # arm -> {seed: value}
        cells = [label] + [fmt(*interval(list(values[a].values()))) for a in arms]
        for b in baselines:
            seeds = sorted(values[method].keys() & values[b].keys())
            diffs = [values[method][s] - values[b][s] for s in seeds]
            cells += [fmt(*interval(diffs), sign=True), verdict(diffs, direction)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(algo: str, runs: dict[str, dict[int, list[dict]]], out: str, footer: str) -> None:
    """Training curves (mean over seeds per step, shaded 95% band) and held-out success per arm."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS[algo] if a in runs]
    def series(rows, key):  # probe/: from step 0 (the cold-start row) on
        return probe_series(rows) if key == "probe/success_rate" else train_series(rows, lambda r: r.get(key))
    keys = [k for k in CURVES[algo]  # a curve no run logged (the probe, off in make demo): no panel
            if any(series(rows, k)[0] for arm in arms for rows in runs[arm].values())]
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(5 * (len(keys) + 1), 4), squeeze=False)
    axes = axes[0]
    for ax, key in zip(axes, keys, strict=False):
        for i, arm in enumerate(arms):
            by_step = defaultdict(list)  # step -> the seeds' values
            for rows in runs[arm].values():
                for step, value in zip(*series(rows, key), strict=True):
                    by_step[step].append(value)
            steps = sorted(by_step)
            if not steps:
                continue
            mean, half, _ = np.array([interval(by_step[s]) for s in steps]).T
            ax.plot(steps, mean, marker=".", color=f"C{i}", label=f"{arm} (n={len(runs[arm])})")
            ax.fill_between(steps, mean - half, mean + half, color=f"C{i}", alpha=0.2)  # nan: no band
        if key.endswith("success_rate"):  # a rate: a few seeds' t band would otherwise set the scale
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"training {key}", fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for i, arm in enumerate(arms):
        for dx, label, (_, get, _), marker in [(-0.15, "before RL (after the cold start)", HELD_OUT[0], "^"),
                                               (0.15, "after RL", HELD_OUT[1], "o")]:
            values = [v for rows in runs[arm].values() if (v := get(rows)) is not None]
            mean, half, _ = interval(values)
            ax.errorbar(i + dx, mean, yerr=0 if math.isnan(half) else half, marker=marker, capsize=4,
                        color=f"C{i}", label=label if i == 0 else None)
            ax.plot([i + dx] * len(values), values, ".", color="grey", alpha=0.6)  # each seed
    crowded = len(arms) > 3  # long arm names would overlap
    ax.set_xticks(range(len(arms)), arms, rotation=12 if crowded else 0, fontsize=8 if crowded else None)
    ax.set_xlim(-0.5, len(arms) - 0.5)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("held-out success (mean, 95% interval; dots: seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    axes[0].legend(fontsize=8)
    versus = f" vs {', '.join(arms[1:])}" if arms[1:] else ""  # one arm alone: no "vs"
    title = f"{algo}: {arms[0]}{versus}, mean over seeds with 95% t intervals"
    fig.suptitle(textwrap.fill(title, 160))  # many arms: wrapped, not cut at the figure's edge
    fig.text(0.01, 0.01, footer, fontsize=8, color="grey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def report(algos: list[str], root: str, figures: str, markdown: str | None, command: str) -> str:
    footer = f"{command}   (commit {git_commit()})"
    parts = [f"`{footer}`"]
    for algo in algos:
        runs, unfinished = read_runs(root, algo)
        skipped = f" ({unfinished} unfinished run folder(s) left out)" if unfinished else ""
        if not runs:
            parts.append(f"### {algo}: no finished runs under {os.path.join(root, algo)}{skipped}")
            continue
        os.makedirs(figures, exist_ok=True)
        png = os.path.join(figures, f"compare_{algo}.png")
        draw(algo, runs, png, footer)
        shown = os.path.relpath(png, ROOT) if png.startswith(ROOT + os.sep) else png  # no machine paths
        parts.append(f"### {algo}{skipped}\n\n{table(algo, runs)}\n\nFigure: {shown}")
        if algo in DEFAULT_RUNS and (by_walkthrough := walkthrough_table(root, algo, runs)):
            parts.append("Held-out games won per walkthrough, after the cold start → after RL:\n\n"
                         + by_walkthrough)
    text = "\n\n".join(parts) + "\n"
    print(text, end="")
    if markdown:
        with open(markdown, "w") as f:
            f.write(text)
    return text


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    command = " ".join(["python benchmarks/compare.py", *argv])
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="play every arm and seed of one algorithm")
    p_run.add_argument("algo", choices=sorted(ARMS))
    p_run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p_run.add_argument("--root", default=os.path.join(ROOT, "runs", "compare"))
    p_run.add_argument("--arms", nargs="+", help="only these arms (default: all); two `run`s with different "
                       "arms can share the 2 cores")
    p_report = sub.add_parser("report", help="table and figures from the finished run folders")
    p_report.add_argument("algos", nargs="+", choices=sorted(ARMS))
    p_report.add_argument("--root", default=os.path.join(ROOT, "runs", "compare"))
    p_report.add_argument("--figures", default=os.path.join(ROOT, "docs", "figures"),
                          help="folder for compare_<algo>.png")
    p_report.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.algo, args.seeds, extra, args.root, args.arms)
    elif extra:
        raise SystemExit("compare.py report: arguments after -- are for `run` only")
    else:
        try:
            report(args.algos, args.root, args.figures, args.markdown, command)
        except OSError as e:  # --figures or --markdown: a folder that cannot be made or written
            raise SystemExit(f"compare.py report: cannot write {e.filename} ({e.strerror or e})") from None


if __name__ == "__main__":
    main()
