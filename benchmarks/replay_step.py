"""Replay one RL step of a finished t2po.py run from its checkpoint, at several learning rates, and show what
greedy decoding answers after each update: which step size breaks the policy, and on which episodes.

    python benchmarks/replay_step.py RUN --step 0 --lrs 0,1e-5,5e-6,2e-6

RUN is a t2po.py run folder holding checkpoints/step_<step> (a run saves step 0, after its cold start). The
step's rollout is drawn as the run drew it (same seed, same tasks), so its loss and grad_norm match the run's
metrics.jsonl line for step+1. Then, from the same weights and optimizer state each time, one update at each
lr, and plain greedy answers (no TTI) to --prompts of the step's turn prompts. The run folder is only read:
the replay resumes from a copy in a temporary folder.
"""
import argparse
import copy
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import t2po  # noqa: E402
from common import run  # noqa: E402


def replay_args(run_dir: str, out: str, threads: int) -> t2po.Args:
    """The run's own Args (its args.json), resuming from `out` (whose args.json gets the new --threads, which
    --resume would otherwise report as a changed arg)."""
    with open(os.path.join(run_dir, "args.json")) as f:
        saved = json.load(f)
    with open(os.path.join(out, "args.json"), "w") as f:
        json.dump({**saved, "threads": threads}, f, indent=2)
    names = {f.name for f in dataclasses.fields(t2po.Args)}
    args = t2po.Args(**{k: v for k, v in saved.items() if k in names})
    args.out, args.resume, args.threads = out, True, threads
    torch.set_num_threads(threads)
    return args


def greedy_answers(r, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
    answers = []
    with torch.no_grad():
        for p in prompts:
            ids = r.model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=r.tokenizer.eos_token_id)
            answers.append(r.tokenizer.decode(ids[0, len(p):], skip_special_tokens=True))
    return answers


def main(argv: list[str] | None = None) -> dict[float, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a t2po.py run folder with checkpoints/step_<step>")
    parser.add_argument("--step", type=int, default=0, help="the checkpoint to start from (replays step+1)")
    parser.add_argument("--lrs", default="0,1e-5", help="comma-separated learning rates, one update each")
    parser.add_argument("--prompts", type=int, default=8, help="turn prompts of the step to answer greedily")
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args(argv)
    ckpt = os.path.join(a.run_dir, "checkpoints", f"step_{a.step}")
    if not os.path.isdir(ckpt):
        raise SystemExit(f"replay_step.py: no checkpoint {ckpt}")
    lrs = [float(x) for x in a.lrs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ckpt, os.path.join(tmp, "checkpoints", f"step_{a.step}"))
        args = replay_args(a.run_dir, tmp, a.threads)
        envs = t2po.build_envs(args)
        r = run.setup(args)
        step = a.step + 1  # the update after the checkpoint, drawn as t2po.main draws it
        episodes = t2po.training_rollouts(r, envs, args, step)
        advantages = t2po.gigpo_advantages(episodes, args.gamma, args.step_advantage_weight,
                                           args.std_normalize, args.step_similarity)  # as training_samples
        print(f"step {step}: each episode's turns, the action as written and its advantage")
        for ep, adv in zip(episodes, advantages, strict=True):
            turns = [(r.tokenizer.decode(t.response_ids).rsplit("</think>", 1)[-1].strip(), round(x, 2))
                     for t, x in zip(ep.turns, adv, strict=True)]
            print(f"  won={ep.won!s:5} {turns}")
        samples = t2po.training_samples(episodes, args)
        prompts = [s.prompt_ids for s in samples[::max(1, len(samples) // a.prompts)]][:a.prompts]
        results = {}
        weights, opt_state = copy.deepcopy(r.model.state_dict()), copy.deepcopy(r.optimizer.state_dict())
        for lr in lrs:
            r.model.load_state_dict(weights)
            r.optimizer.load_state_dict(opt_state)
            for group in r.optimizer.param_groups:
                group["lr"] = lr
            update_rng = t2po.step_rng(args.seed, step)  # as t2po.main: the same order on every rank
            with run.precision(args):
                copies = [dataclasses.replace(s) for s in samples]
                result = t2po.update(r.policy, r.optimizer, copies, args, update_rng, r.reference)
            results[lr] = result
            answers = greedy_answers(r, prompts, args.max_new_tokens)
            print(f"lr {lr:g}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()))
            for x in answers:
                action, valid = t2po.parse_response(x)
                print(f"    {x[-70:]!r} -> {action!r}{'' if valid else ' (malformed)'}")
        r.logger.close()
    return results


if __name__ == "__main__":
    main()
