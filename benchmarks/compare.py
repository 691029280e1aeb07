"""Each paper's claim against its baseline, one flag apart, over several seeds: run, then report.

    python benchmarks/compare.py run t2po --seeds 0 1 2            # T²PO vs GiGPO (--no-tti --no-tds)
    python benchmarks/compare.py run arpo --seeds 0 1 2 -- --steps 4 --max-minutes 0
    python benchmarks/compare.py run loop --seeds 0 1 2 -- --steps 3
    python benchmarks/compare.py report t2po arpo loop             # table + PNG curves into docs/figures

`run` plays every (arm, seed) one after another on one thread (OMP_NUM_THREADS=1; on a 2-core machine
run at most two `run`s at once: torch beside another busy process slows far more than 2x), into
runs/compare/<algo>/<arm>-s<seed>/, the script's own run folder (args.json, metrics.jsonl). A finished run
gets a `done` file and is skipped next time, so `run` can be stopped and restarted; an unfinished folder
is started over. Arguments after `--` go to every run of both arms. `report` reads only those folders,
so the figures can be redrawn without re-running.
"""

import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# arm name -> the flags that make it; the first arm is the paper's method, the others its baselines
ARMS = {
    "t2po": {"t2po": [], "gigpo": ["--no-tti", "--no-tds"]},
    "arpo": {"arpo": [], "grpo": ["--rollout", "global"]},
    "loop": {"token": [], "turn": ["--importance-weight", "turn"],
             "trajectory": ["--importance-weight", "trajectory"]},
}


def run_folder(root: str, algo: str, arm: str, seed: int) -> str:
    return os.path.join(root, algo, f"{arm}-s{seed}")


def run(algo: str, seeds: list[int], extra: list[str], root: str) -> None:
    for seed in seeds:  # seed-major: an interrupted sweep still has every arm for the seeds it finished
        for arm, flags in ARMS[algo].items():
            out = run_folder(root, algo, arm, seed)
            if os.path.exists(os.path.join(out, "done")):
                continue
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, os.path.join(ROOT, f"{algo}.py"), "--seed", str(seed),
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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="play every arm and seed of one algorithm")
    p_run.add_argument("algo", choices=sorted(ARMS))
    p_run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p_run.add_argument("--root", default=os.path.join(ROOT, "runs", "compare"))
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.algo, args.seeds, extra, args.root)


if __name__ == "__main__":
    main()
