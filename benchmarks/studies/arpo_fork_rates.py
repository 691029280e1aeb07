"""How often ARPO's branch rule forks per tool call under the two step-entropy estimators (`--entropy
topk`, the authors', and `--entropy exact`, ours), on the same rollouts of the packaged model.

arpo.py's cold start (the scripted-expert SFT that makes SmolLM2-135M write tool calls) runs once and is
saved under --root; then the cold-started policy rolls out `--questions` training questions with ARPO
(M, N, Z, beta, tau, k as given; no update). At every tool result the probe segment's step entropy is
computed under both estimators from the same tokens (the sampled token's top-10 log-probs and the exact
entropy), so each decision gets a paired dH_topk and dH_exact, and the fork probability each implies,
P = clip(1 - tau + beta * dH, 0, 1) (alpha ~ U(0, 1), docs/arpo.md). Printed: the number of decisions,
the dH quantiles, the mean fork probability per tool result under each estimator, and the forks the run
actually made (under the estimator it ran with, `--entropy`).

    python benchmarks/studies/arpo_fork_rates.py --threads 1                      # 8 questions, M = 4, N = 2
    python benchmarks/studies/arpo_fork_rates.py --threads 1 --questions 4 --json out.json
"""

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import arpo  # noqa: E402
from common import run  # noqa: E402
from common.generation import make_generator  # noqa: E402
from common.models import load_policy  # noqa: E402


def cold_start_model(args: arpo.Args, folder: str) -> None:
    """arpo.py's cold start (same seed, same demonstrations), saved as a model folder."""
    if os.path.exists(os.path.join(folder, "config.json")):
        print(f"[benchmark] reusing the cold-start model in {folder}")
        return
    torch.manual_seed(args.seed)
    envs = arpo.build_envs(args)  # e.g. --search-topk, as arpo.py
    model, tokenizer = load_policy(args.model)
    no_engine = SimpleNamespace(update_weights=lambda model: None)  # the model is saved, not sampled
    arpo.cold_start(SimpleNamespace(model=model, policy=model, tokenizer=tokenizer, generator=no_engine,
                                    device="cpu"), envs, args)
    model.save_pretrained(folder + ".tmp")
    tokenizer.save_pretrained(folder + ".tmp")
    os.replace(folder + ".tmp", folder)


class KeepExactEntropies:
    """The generator, asked for the top-10 log-probs, with each Sample's exact entropies kept aside
    (arpo's segments carry the estimator's terms in `entropies`)."""

    def __init__(self, generator):
        self.generator = generator

    def generate(self, prompts, **kw):
        out = self.generator.generate(prompts, **{**kw, "logprobs_k": arpo.ENTROPY_TOPK})
        for group in out:
            for s in group:
                s.exact_entropies = list(s.entropies)
                s.topk_terms = [arpo.topk_token_entropy(top, lp)
                                for top, lp in zip(s.top_logprobs, s.logprobs, strict=True)]
        return out


def record_decisions(decisions: list[dict], k: int, vocab_size: int):
    """Wrap adaptive_rollout's generate_segments: before the rollout reads a segment, note the step entropy
    of a first segment (H_initial, both estimators, kept on the rollout and inherited by its forks) and
    the paired dH of a probe segment (the k tokens after a tool result)."""
    def wrap(generate_segments):
        def wrapped(rollouts, budgets):
            segments = generate_segments(rollouts, budgets)
            for r, seg in zip(rollouts, segments, strict=True):
                n = len(seg.entropies)  # the segment as the rollout sees it (cut to its budget)
                h = {"topk": arpo.step_entropy(seg.topk_terms[:n], k, vocab_size, "topk"),
                     "exact": arpo.step_entropy(seg.exact_entropies[:n], k, vocab_size, "exact")}
                if r.h_initial is None:
                    r.bench_h0 = h
                elif r.probe:
                    decisions.append({est: h[est] - r.bench_h0[est] for est in h})
            return segments
        return wrapped
    return wrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/arpo_fork_rates", help="the saved cold-start model")
    parser.add_argument("--questions", type=int, default=8, help="training questions rolled out")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    ours, flags = parser.parse_known_args()
    folder = os.path.join(ours.root, "cold_start_model")
    args = run.parse(arpo.Args, flags, arpo.PRESETS, arpo.check_args)  # any arpo.py flag; sets --threads
    cold_start_model(args, folder)
    env = arpo.build_envs(args).env
    model, tokenizer = load_policy(folder)
    generator = KeepExactEntropies(make_generator(args.backend, model, tokenizer, folder))
    tasks = env.tasks("train")[:ours.questions]
    decisions: list[dict] = []
    real_rollout, wrap = arpo.adaptive_rollout, record_decisions(decisions, args.branch_k, len(tokenizer))
    arpo.adaptive_rollout = lambda *a, generate_segments, **kw: real_rollout(
        *a, generate_segments=wrap(generate_segments), **kw)
    try:  # the questions as one training step plays them (step 1's seeds and fork draws)
        rollouts = arpo.play(SimpleNamespace(generator=generator, tokenizer=tokenizer), env, tasks,
                             list(range(len(tasks))), args, 1, train=True)
    finally:
        arpo.adaptive_rollout = real_rollout
    forks = sum(r.parent is not None for r in rollouts)
    # the recorder's dH under the run's estimator is the rollout's own (a fork starts with an empty list)
    own = sorted(d for r in rollouts for d in r.delta_h)
    assert np.allclose(sorted(d[args.entropy] for d in decisions), own, rtol=0, atol=1e-9), "recorder off"
    result = {"command": "python benchmarks/studies/arpo_fork_rates.py " + " ".join(sys.argv[1:]),
              "questions": len(tasks), "rollouts": len(rollouts), "tool_results_probed": len(decisions),
              "tool_calls_run": sum(r.tool_calls[t] - r.shared_calls[t]
                                    for r in rollouts for t in arpo.TOOL_TAGS),
              "forks_made": forks, "run_estimator": args.entropy, "beta": args.beta, "tau": args.tau}
    for est in ("topk", "exact"):
        dh = np.array([d[est] for d in decisions])
        if not len(dh):
            continue
        p = np.clip(1 - args.tau + args.beta * dh, 0, 1)
        q = np.quantile(dh, [0.1, 0.5, 0.9])
        result[est] = {"dH_p10": float(q[0]), "dH_p50": float(q[1]), "dH_p90": float(q[2]),
                       "fork_probability_per_tool_result": float(p.mean()),
                       "always_forks": float((p >= 1).mean()), "never_forks": float((p <= 0).mean())}
    print(json.dumps(result, indent=2))
    if ours.json:
        with open(ours.json, "w") as f:
            json.dump(result, f, indent=2)
    if decisions:
        print(f"\n{len(decisions)} tool results probed; forks made (--entropy {args.entropy}): {forks}")
        print("| estimator | dH p10 / p50 / p90 | mean P(fork) per tool result | P = 1 | P = 0 |")
        print("|---|---|---|---|---|")
        for est in ("topk", "exact"):
            r = result[est]
            print(f"| {est} | {r['dH_p10']:.2f} / {r['dH_p50']:.2f} / {r['dH_p90']:.2f} | "
                  f"{r['fork_probability_per_tool_result']:.2f} | {r['always_forks']:.2f} | "
                  f"{r['never_forks']:.2f} |")


if __name__ == "__main__":
    main()
