"""One RL step of t2po.py's default run, timed part by part, old code against new, side by side.

    .venv/bin/python t2po.py --steps 1 --out runs/cold    # base eval, RFT cold start (checkpoint 0), ...
    .venv/bin/python -m benchmarks.bench_step --run runs/cold --baseline dbf9999 --repeats 2 --threads 1

From the run's step-0 checkpoint (the cold-start policy), each side plays that run's first RL step, rollout
then update, in its own process: `--baseline` is t2po.py and common/ at that commit (`git archive` into a
temporary folder), the other side is this working tree. The sides alternate (A B B A ...) so that drifts
in machine load hit both; medians are reported. Each side returns its times (the rollout split into the
model's prefill passes and its one-token decode passes), its work (episodes, turn samples, the tokens
generated and the tokens the update reads) and its parameter change Δθ. The report checks that the work was
equal (the same response tokens in every episode) and gives the relative difference of the two updates,
|Δθ_new − Δθ_old| / |Δθ_old|.
"""

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    run: str = field(default="", metadata={"help": "a t2po.py run folder with a checkpoint at step 0"})
    baseline: str = field(default="HEAD", metadata={"help": "git commit of the old code"})
    repeats: int = field(default=2, metadata={"help": "timed steps per side"})
    threads: int = field(default=1, metadata={"help": "torch threads per side"})
    flags: str = field(default="", metadata={"help": "extra t2po.py flags for both sides, e.g. "
                                             "'--temperature 1.0' (another workload)"})
    new_flags: str = field(default="", metadata={"help": "extra t2po.py flags for the new side, e.g. "
                                                 "'--autocast off' (to split a gain by its causes)"})
    keep: str = field(default="", metadata={"help": "folder to keep each side's JSON result in"})


def child(code: str, run_dir: str, threads: int, out: str, flags: str = "") -> None:
    """Play step 1 of the run with the code in `code`; write the result (times, work, Δθ) to `out`."""
    sys.path.insert(0, code)
    import torch

    import t2po
    from common import run

    torch.set_num_threads(threads)
    work = tempfile.mkdtemp(prefix="bench_step_")
    shutil.copy(os.path.join(run_dir, "args.json"), work)  # and only the cold-start checkpoint
    step_0 = os.path.join("checkpoints", "step_0")
    shutil.copytree(os.path.join(run_dir, step_0), os.path.join(work, step_0))
    saved = json.load(open(os.path.join(run_dir, "args.json")))
    argv = ["--out", work, "--resume", "--threads", str(threads), "--steps", "1",
            "--seed", str(saved["seed"]), *flags.split()]
    args = run.parse(t2po.Args, argv, t2po.PRESETS, t2po.check_args, overridden_by={"epochs": "steps"})
    envs = t2po.build_envs(args)
    # t2po.py since 1e3f13f (one skeleton: training_rollouts, training_samples), or a baseline before it
    skeleton = hasattr(t2po, "training_samples")
    r = run.setup(args) if skeleton else run.setup(args, desc="bench")
    times = {"prefill_s": 0.0, "decode_s": 0.0}
    model = r.generator.model
    forward = model.forward

    def timed_forward(*a, **kw):  # the generator's passes: a prefill reads many tokens per row, a decode one
        t = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            times["prefill_s" if kw["input_ids"].shape[1] > 1 else "decode_s"] += time.perf_counter() - t

    before = torch.cat([p.detach().flatten().clone() for p in r.policy.parameters()])
    step = 1  # the first RL step after the cold start's checkpoint
    t0 = time.perf_counter()
    model.forward = timed_forward
    if skeleton:
        episodes = t2po.training_rollouts(r, envs, args, step)
    else:  # the step as t2po.train_step played it before 1e3f13f
        picks = t2po.step_rng(args.seed, step).choice(len(envs.train_tasks), args.tasks_per_step,
                                                      replace=False)
        ids = [g * args.group_size + j for g in envs.my_groups for j in range(args.group_size)]
        groups = [i // args.group_size for i in ids]
        episodes, _ = t2po.rollout(r.generator, r.tokenizer, envs.pool,
                                   [envs.train_tasks[picks[g]] for g in groups], groups, args, step=step,
                                   train=True, temperature=args.temperature, keys=ids)
    del model.forward
    times["rollout_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    if skeleton:
        samples = t2po.training_samples(episodes, args)
    else:
        advantages = t2po.gigpo_advantages(episodes, args.gamma, args.step_advantage_weight,
                                           args.std_normalize, args.step_similarity)
        samples = t2po.turn_samples(episodes, advantages)
    result = t2po.update(r.policy, r.optimizer, samples, args, t2po.step_rng(args.seed, step),
                         r.reference)
    r.generator.update_weights(r.model)
    times["update_s"] = time.perf_counter() - t1
    times["step_s"] = time.perf_counter() - t0
    delta = torch.cat([p.detach().flatten() for p in r.policy.parameters()]) - before
    responses = hashlib.sha256(json.dumps([[t.response_ids for t in ep.turns] for ep in episodes])
                               .encode()).hexdigest()
    torch.save(delta, out + ".delta.pt")
    distinct = len({(tuple(s.prompt_ids), tuple(s.response_ids)) for s in samples})
    json.dump({**times, "responses_sha256": responses, "episodes": len(episodes), "samples": len(samples),
               "distinct_samples": distinct, "delta_norm": float(delta.norm()),
               "generated_tokens": sum(len(t.response_ids) for ep in episodes for t in ep.turns),
               "loss": result["loss"],
               "update_tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)},
              open(out, "w"))
    shutil.rmtree(work)


def export(commit: str, into: str) -> str:
    """t2po.py, common/ and envs/ at `commit`, in a fresh folder."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "t2po.py", "common", "envs"],
                             check=True, capture_output=True).stdout
    os.makedirs(into)
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def main(argv: list[str] | None = None) -> dict:
    from common.cli import parse_args

    args = parse_args(Args, argv)
    if not args.run or not os.path.isfile(os.path.join(args.run, "args.json")):
        raise SystemExit("--run: a t2po.py run folder with a step-0 checkpoint (t2po.py --steps 1 --out F)")
    import torch

    tmp = tempfile.mkdtemp(prefix="bench_step_code_")
    sides = {"old": export(args.baseline, os.path.join(tmp, "old")), "new": ROOT}
    results: dict[str, list[dict]] = {"old": [], "new": []}
    deltas = {}
    for rep in range(args.repeats):
        for side in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            out = os.path.join(tmp, f"{side}{rep}.json")
            flags = args.flags + (" " + args.new_flags if side == "new" else "")
            cmd = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from benchmarks."
                   "bench_step import child; child(*sys.argv[2:4], int(sys.argv[4]), *sys.argv[5:])",
                   ROOT, sides[side], os.path.abspath(args.run), str(args.threads), out, flags]
            subprocess.run(cmd, check=True, cwd=sides[side], capture_output=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            results[side].append(json.load(open(out)))
            deltas[side] = torch.load(out + ".delta.pt")
            times = [f"{k} {v:.1f}" for k, v in results[side][-1].items() if k.endswith("_s")]
            print(f"  {side} (repeat {rep}): " + ", ".join(times), flush=True)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        json.dump(results, open(os.path.join(args.keep, "bench_step.json"), "w"), indent=1)
    shutil.rmtree(tmp)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_s")}
           for side, rs in results.items()}
    old, new = results["old"][0], results["new"][0]
    same = old["responses_sha256"] == new["responses_sha256"]
    change = deltas["old"].norm()  # 0 when every group's rollouts scored alike (no advantage, no update)
    rel = float((deltas["new"] - deltas["old"]).norm() / change) if change > 0 else float("nan")
    print(f"t2po.py step 1 from {args.run} {args.flags}; old = {args.baseline}, new = this tree "
          f"{args.new_flags}; {args.repeats} repeats each, {args.threads} thread(s), medians (s):")
    for k, old_s in med["old"].items():
        new_s = med["new"][k]
        print(f"  {k:10s} old {old_s:7.1f}  new {new_s:7.1f}  ratio {old_s / max(new_s, 1e-9):5.2f}x")
    for k in ("episodes", "samples", "distinct_samples", "generated_tokens", "update_tokens"):
        print(f"  {k}: old {old[k]}, new {new[k]}")
    print(f"  same responses in every episode: {same}; |Δθ_new − Δθ_old| / |Δθ_old| = {rel:.4f}; "
          f"loss old {old['loss']:.5f} new {new['loss']:.5f}")
    return {"median": med, "same_responses": same, "update_rel_diff": rel}


if __name__ == "__main__":
    main()
