"""How often, and where, each algorithm's own mechanism acts at its script's defaults, on the packaged model
(SmolLM2-135M-Instruct). One markdown table; `--json` also writes every figure.

    OMP_NUM_THREADS=1 python benchmarks/mechanisms.py --threads 1 --json runs/mechanisms.json   # ~11 min
    OMP_NUM_THREADS=1 python benchmarks/mechanisms.py --threads 1 --quick                        # ~7 min
    python benchmarks/mechanisms.py --only arpo           # one script's mechanisms (t2po | arpo | loop)

(One thread of a shared 2-core machine; ARPO's cold start, about 2 of those minutes, is saved under --root
and reused by later runs.)

T²PO (`python t2po.py`'s setting: TextWorld level 2, the default run's RFT, then training rollouts at
T 0.7 with TTI and TDS on, B_max 1), through benchmarks/studies/t2po_tds.py's `real_turns`:
- TTI fire rate: the fraction of generated turn responses (first samples and TDS resamples) in which TTI
  cut the thinking, split into the ε rule (mean |ΔM| < ε) and the L_max cap; also per kept turn (the
  run's own `tti_interventions`).
- Thinking tokens saved: every response TTI cut is generated again with TTI off, same prompt and seed;
  sampling noise is keyed on (seed, position), so both share every token up to the cut, and the saving
  is (think tokens without TTI) − (think tokens with TTI), where think tokens are those before the
  model's own `</think>`, or all of the response when it never closes the thought. A response TTI did
  not cut is the same with TTI off (TTI is an online logits processor), so it saves nothing.
- Of the responses TTI cut, how many write the same action as their TTI-off twin; one cut response
  beside its twin (JSON only).
- TDS: turns k > 0 with 0 < Γ_k < η (resampled), and of those, how many repeat the previous turn's action;
  beside it, the repeat rate of all turns k > 0, and the probability that a repeat's Γ is below another
  turn's (TDS's premise: repeats change the turn's uncertainty least, so > 0.5).
- `--t2po-flags` measures another setting, e.g. the one where TTI's ε rule acts (docs/t2po.md):
  --t2po-flags="--expert-thoughts long --max-new-tokens 96 --tti-epsilon 0.08 --tds-eta 0.025 --seed 1"

ARPO (`python arpo.py`'s defaults, tools env, after its cold start), through
benchmarks/studies/arpo_fork_rates.py's recorder: at each tool result, ΔH under both step-entropy estimators
(topk: the authors', exact: ours) from the same tokens; the fork probability each implies per tool result,
P = clip(1 − τ + β·ΔH, 0, 1), and the forks the run made per tool call run. Then one `update` (fresh
AdamW, lr as the default) from the same rollouts, all questions in one batch, under soft attribution
(default: token-mean), `--attribution hard` (which also switches the loss to seq-mean-token-mean), and
each attribution under the other aggregation, to separate the two: the relative difference of the
(unclipped) gradients and of the parameter updates Δθ, and max |Δθ_hard − Δθ_soft|.

LOOP (`python loop.py`'s defaults: TextWorld level 4, cold start, K 4 × B 8): `loop.main` itself for
--loop-steps iterations (held-out evaluation on --loop-eval-tasks games only, to save time; it does not
touch the training rollouts' seeds), read back from its metrics.jsonl: rollouts dropped by the |A| <
threshold filter, rollouts whose environment failed, iterations the KL monitor abandoned.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "studies"))  # the one-off studies it builds on
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# T²PO


def t2po_mechanisms(tasks: int, group_size: int, threads: int, t2po_flags: tuple[str, ...] = ()) -> dict:
    import t2po_tds

    import t2po

    real_generate, real_rollout = t2po.generate_turn, t2po.rollout
    responses = []  # one per generated turn response: think tokens with TTI, and without where TTI cut
    kept_stats = {}

    def generate_turn(generator, tokenizer, prompts, seeds, args, *, tti, **kw):
        outs = real_generate(generator, tokenizer, prompts, seeds, args, tti=tti, **kw)
        if tti:
            cut = [j for j, o in enumerate(outs) if o.intervened]
            off = real_generate(generator, tokenizer, [prompts[j] for j in cut], [seeds[j] for j in cut],
                                args, tti=False, **kw) if cut else []
            without = dict(zip(cut, off, strict=True))
            max_think = args.tti_max_think or args.max_new_tokens - min(32, args.max_new_tokens // 2)
            kept_stats["epsilon"] = args.tti_epsilon

            def text(out) -> str:
                return tokenizer.decode(out.ids, skip_special_tokens=True)

            def action(out) -> str:
                return t2po_tds.response_action(tokenizer, out)

            for j, o in enumerate(outs):
                if j in without and "tti_example_cut" not in kept_stats:  # one cut, shown in the docs
                    kept_stats["tti_example_cut"] = dict(with_tti=text(o), without_tti=text(without[j]))
                responses.append(dict(think=o.think_tokens, intervened=o.intervened,
                                      same_action=j not in without or action(o) == action(without[j]),
                                      closest=t2po.think_flatness(o, args),
                                      by_cap=o.intervened and o.think_tokens >= max_think,
                                      think_without=without[j].think_tokens if j in without
                                      else o.think_tokens,
                                      same_prefix=j not in without or without[j].ids[:o.think_tokens]
                                      == o.ids[:o.think_tokens]))
        return outs

    def rollout(*a, **kw):  # the kept turns' counters (the run's own), summed over its training episodes
        episodes = real_rollout(*a, **kw)
        if kw.get("train"):
            for row in map(t2po.episode_row, episodes):
                for key in ("turns", "tti_interventions", "tti_wasted_tokens", "tds_resamples"):
                    kept_stats[key] = kept_stats.get(key, 0) + row[key]
        return episodes

    t2po.generate_turn, t2po.rollout = generate_turn, rollout
    try:
        turns = t2po_tds.real_turns(tasks, group_size, threads, t2po_flags)
    finally:
        t2po.generate_turn, t2po.rollout = real_generate, real_rollout
    tds = t2po_tds.summary(turns["records"], turns["eta"])["gamma_now"]
    n_k = len(turns["records"])
    fired = [r for r in responses if r["intervened"]]
    closest = [r["closest"] for r in responses if r["closest"] is not None]
    return {
        "episodes": tasks * group_size, "kept_turns": int(kept_stats["turns"]), "responses": len(responses),
        "tti_fire_rate": len(fired) / max(1, len(responses)),
        "tti_fired_by_epsilon_rule": sum(not r["by_cap"] for r in fired),
        "tti_fired_by_cap": sum(r["by_cap"] for r in fired),
        "tti_fire_rate_kept_turns": kept_stats["tti_interventions"] / max(1, kept_stats["turns"]),
        "tti_epsilon": kept_stats["epsilon"],
        "tti_responses_checked_by_epsilon_rule": len(closest),
        "tti_closest_window_mean_p10_p50": np.quantile(closest, [0.1, 0.5]).tolist() if closest else [],
        "think_tokens_with_tti": sum(r["think"] for r in responses),
        "think_tokens_without_tti": sum(r["think_without"] for r in responses),
        "think_tokens_saved_per_cut": float(np.mean([r["think_without"] - r["think"] for r in fired]))
        if fired else 0.0,
        "tti_cut_turns_same_tokens_with_tti_off": sum(r["same_prefix"] for r in fired),
        "tti_cut_turns_same_action_with_tti_off": sum(r["same_action"] for r in fired),
        "tti_example_cut": kept_stats.get("tti_example_cut"),
        "tti_wasted_tokens_kept_turns": int(kept_stats["tti_wasted_tokens"]),
        "tds_turns_k_gt_0": n_k, "tds_resampled": tds["resampled"],
        "tds_resample_rate": tds["resampled"] / max(1, n_k),
        "tds_resampled_repeats": tds["of_them_repeats"],
        "tds_repeat_rate_resampled": tds["of_them_repeats"] / max(1, tds["resampled"]),
        "tds_repeat_rate_all": sum(r["repeat"] for r in turns["records"]) / max(1, n_k),
        "tds_gamma_median": float(np.median([r["gamma_now"] for r in turns["records"]] or [0])),
        "tds_gamma_separation": tds["separation"],  # P(a repeat's Γ < another turn's Γ); 0.5: chance
        "tds_gamma_median_repeat_other": [tds["median_repeat"], tds["median_other"]],
        "tds_gamma_max": max((r["gamma_now"] for r in turns["records"]), default=0.0),
        "tds_eta": turns["eta"], "tds_resamples_logged": int(kept_stats["tds_resamples"]),
    }


# ---------------------------------------------------------------------------------------------------
# ARPO


def arpo_update(model, samples_of, args, attribution: str, loss_agg: str) -> tuple[dict, dict]:
    """One arpo.update from the current weights, fresh AdamW, every response in one minibatch (one optimizer
    step): (Δθ, unclipped gradient) per parameter; the weights are put back."""
    import arpo

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    grads, real_clip = {}, torch.nn.utils.clip_grad_norm_

    def clip(parameters, *a, **kw):  # the gradient arpo.update is about to clip
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return real_clip(parameters, *a, **kw)

    torch.nn.utils.clip_grad_norm_ = clip
    samples = samples_of(attribution)
    run_args = dataclasses.replace(args, attribution=attribution, loss_agg=loss_agg,
                                   minibatch_size=max(1, len(samples)))
    model.train()
    try:
        arpo.update(model, optimizer, samples, run_args, np.random.default_rng(args.seed))
    finally:
        torch.nn.utils.clip_grad_norm_ = real_clip
    delta = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    return delta, grads


def relative(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all parameters."""
    num = sum(float((a.get(n, 0) - b[n]).double().pow(2).sum()) for n in b)
    den = sum(float(b[n].double().pow(2).sum()) for n in b)
    return (num / den) ** 0.5 if den else float("nan")


def arpo_mechanisms(questions: int, threads: int, root: str) -> dict:
    from arpo_fork_rates import KeepExactEntropies, cold_start_model, record_decisions

    import arpo
    from common import run
    from common.generation import make_generator
    from common.models import load_policy

    flags = ["--threads", str(threads)] if threads else []
    folder = os.path.join(root, "arpo_cold_start_model")
    args = run.parse(arpo.Args, flags, arpo.PRESETS, arpo.check_args)
    cold_start_model(args, folder)
    env = arpo.build_envs(args).env
    model, tokenizer = load_policy(folder)
    generator = KeepExactEntropies(make_generator(args.backend, model, tokenizer, folder))
    tasks = env.tasks("train")[:questions]
    decisions: list[dict] = []
    real_rollout, wrap = arpo.adaptive_rollout, record_decisions(decisions, args.branch_k, len(tokenizer))
    arpo.adaptive_rollout = lambda *a, generate_segments, **kw: real_rollout(
        *a, generate_segments=wrap(generate_segments), **kw)
    try:  # the questions as one training step plays them (step 1's seeds and fork draws), each scored
        rollouts = arpo.play(SimpleNamespace(generator=generator, tokenizer=tokenizer), env, tasks,
                             list(range(len(tasks))), args, 1, train=True)
    finally:
        arpo.adaptive_rollout = real_rollout
    calls_run = sum(r.tool_calls[t] - r.shared_calls[t] for r in rollouts for t in arpo.TOOL_TAGS)
    forks = sum(r.parent is not None for r in rollouts)
    out = {"questions": len(tasks), "rollouts": len(rollouts), "tool_calls_run": calls_run,
           "tool_results_probed": len(decisions), "forks_made": forks, "run_estimator": args.entropy,
           "forks_per_tool_call": forks / max(1, calls_run), "beta": args.beta, "tau": args.tau}
    for est in ("topk", "exact"):
        dh = np.array([d[est] for d in decisions])
        p = np.clip(1 - args.tau + args.beta * dh, 0, 1) if len(dh) else np.zeros(0)
        out[est] = {"dH_p10_p50_p90": np.quantile(dh, [0.1, 0.5, 0.9]).tolist() if len(dh) else [],
                    "fork_probability_per_tool_result": float(p.mean()) if len(p) else 0.0}

    rewards = [r.reward for r in rollouts]
    out["reward_mean"] = float(np.mean(rewards))
    out["shared_prefix_tokens"] = sum(r.fork_point for r in rollouts if r.parent is not None)

    def samples_of(attribution: str) -> list:  # fresh TrainingSamples (the update stores pi_old on them)
        return arpo.training_samples(rollouts, dataclasses.replace(args, attribution=attribution))

    soft_adv, hard_adv = (arpo.batch_advantages(rollouts, rewards, a) for a in ("soft", "hard"))
    out["tokens_hard_advantage_differs"] = sum(
        sum(m and abs(h - s) > 1e-9 for m, h, s in zip(r.action_mask, hr, sr, strict=True))
        for r, hr, sr in zip(rollouts, hard_adv, soft_adv, strict=True))
    out["policy_tokens"] = sum(sum(r.action_mask) for r in rollouts)
    out["forked_questions_with_unequal_rewards"] = sum(
        len({rewards[i] for i, r in enumerate(rollouts) if r.question == q}) > 1
        for q in {r.question for r in rollouts if r.parent is not None})

    def compare(h: tuple[dict, dict], s: tuple[dict, dict]) -> dict:
        return {"grad_rel_diff": relative(h[1], s[1]), "update_rel_diff": relative(h[0], s[0]),
                "update_max_abs_diff": max((float((h[0][n] - s[0][n]).abs().max()) for n in s[0]),
                                           default=0.0)}

    # soft with each aggregation kept; each hard update compared, then freed (a copy of the model each)
    aggregations = ("token-mean", "seq-mean-token-mean")
    soft = {agg: arpo_update(model, samples_of, args, "soft", agg) for agg in aggregations}
    out["update"] = {"lr": args.lr}
    for agg in aggregations:  # attribution alone, under one aggregation
        hard = arpo_update(model, samples_of, args, "hard", agg)
        out["update"][f"hard_vs_soft_under_{agg}"] = compare(hard, soft[agg])
        if agg == "seq-mean-token-mean":  # what the flag changes: attribution and (auto) aggregation
            out["update"]["flag_hard_vs_soft"] = compare(hard, soft["token-mean"])
        del hard
    return out


# ---------------------------------------------------------------------------------------------------
# LOOP


def loop_mechanisms(steps: int, eval_tasks: int) -> dict:
    import loop

    out_dir = os.path.join(tempfile.mkdtemp(prefix="mechanisms-loop-"), "run")
    loop.main(["--steps", str(steps), "--eval-tasks", str(eval_tasks), "--out", out_dir])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return loop_counts([json.loads(x) for x in f])


def loop_counts(lines: list[dict]) -> dict:
    """LOOP's filter, environment failures and KL monitor over the training lines of a metrics.jsonl. A
    failed rollout has advantage 0 and is dropped too; it is counted as failed, not as a small |A|."""
    train = [x for x in lines if "filtered_fraction" in x]
    n = sum(x["rollouts"] for x in train)
    dropped = sum(round(x["filtered_fraction"] * x["rollouts"]) for x in train)
    failed = sum(x["env_errors"] for x in train)
    return {"iterations": len(train), "rollouts": n, "filtered_per_iteration":
            [x["filtered_fraction"] for x in train],
            "filtered_fraction": dropped / max(1, n),
            "dropped_small_advantage": dropped - failed, "dropped_env_failed": failed,
            "iterations_abandoned_kl": int(sum(x.get("abandoned", 0.0) for x in train)),
            "kl_k1_max": max((x.get("kl_k1", 0.0) for x in train), default=0.0),
            "truncated_fraction": sum(x["truncated_fraction"] * x["rollouts"] for x in train) / max(1, n)}


# ---------------------------------------------------------------------------------------------------


def na(x) -> str:
    """A figure, or '-' where there was nothing to compute it from."""
    return "-" if x is None else str(x)


def table(result: dict) -> str:
    rows = []
    if "t2po" in result:
        t = result["t2po"]
        rows += [
            ("T²PO", "TTI fire rate (responses)",
             f"{t['tti_fire_rate']:.2f} ({t['tti_fired_by_epsilon_rule'] + t['tti_fired_by_cap']} of "
             f"{t['responses']}: {t['tti_fired_by_epsilon_rule']} ε rule, "
             f"{t['tti_fired_by_cap']} L_max cap)"),
            ("T²PO", "TTI fire rate (kept turns)", f"{t['tti_fire_rate_kept_turns']:.2f}"),
            ("T²PO", "smallest window mean of |ΔM| per response, p10 / p50 (ε rule fires below ε)",
             " / ".join(f"{x:.3f}" for x in t["tti_closest_window_mean_p10_p50"])
             + f" (ε {t['tti_epsilon']}; {t['tti_responses_checked_by_epsilon_rule']} of {t['responses']} "
             "responses thought long enough to be checked)"),
            ("T²PO", "thinking tokens, TTI on / off (same seeds)",
             f"{t['think_tokens_with_tti']} / {t['think_tokens_without_tti']} (saved "
             f"{1 - t['think_tokens_with_tti'] / max(1, t['think_tokens_without_tti']):.0%}; "
             f"{t['think_tokens_saved_per_cut']:.1f} per cut)"),
            ("T²PO", "cut responses whose action is the one written with TTI off",
             f"{t.get('tti_cut_turns_same_action_with_tti_off', '-')} of "
             f"{t['tti_fired_by_epsilon_rule'] + t['tti_fired_by_cap']}"),
            ("T²PO", "TDS resample rate (turns k > 0, 0 < Γ < η)",
             f"{t['tds_resample_rate']:.2f} ({t['tds_resampled']} of {t['tds_turns_k_gt_0']}; median Γ "
             f"{t['tds_gamma_median']:.3f}, max {t['tds_gamma_max']:.3f}, η {t['tds_eta']})"),
            ("T²PO", "resampled turns repeating the previous action",
             f"{t['tds_repeat_rate_resampled']:.2f} ({t['tds_resampled_repeats']} of {t['tds_resampled']}; "
             f"all turns k > 0: {t['tds_repeat_rate_all']:.2f})"),
            ("T²PO", "P(a repeat's Γ < another turn's Γ) (TDS's premise: > 0.5)",
             f"{na(t.get('tds_gamma_separation'))} (median Γ, repeats / others: "
             + " / ".join(na(x) for x in t.get("tds_gamma_median_repeat_other", [None, None])) + ")"),
        ]
    if "arpo" in result:
        a = result["arpo"]
        for est in ("topk", "exact"):
            q = a[est]["dH_p10_p50_p90"]
            rows.append(("ARPO", f"P(fork) per tool result, ΔH {est}",
                         f"{a[est]['fork_probability_per_tool_result']:.2f} (ΔH p10/p50/p90 "
                         + " / ".join(f"{x:.2f}" for x in q) + ")"))
        rows.append(("ARPO", f"forks made per tool call run (--entropy {a['run_estimator']})",
                     f"{a['forks_per_tool_call']:.2f} ({a['forks_made']} forks, {a['tool_calls_run']} calls, "
                     f"{a['tool_results_probed']} tool results probed, {a['rollouts']} rollouts)"))
        rows.append(("ARPO", "policy tokens whose advantage hard attribution changes",
                     f"{a['tokens_hard_advantage_differs']} of {a['policy_tokens']} "
                     f"({a['shared_prefix_tokens']} tokens in forks' shared prefixes; "
                     f"{a['forked_questions_with_unequal_rewards']} forked questions with unequal rewards)"))
        u = a["update"]
        for key, name in [("flag_hard_vs_soft", "`--attribution hard` vs soft (each with its auto loss)"),
                          ("hard_vs_soft_under_token-mean", "hard vs soft, both token-mean"),
                          ("hard_vs_soft_under_seq-mean-token-mean",
                           "hard vs soft, both seq-mean-token-mean")]:
            rows.append(("ARPO", f"update difference, {name}",
                         f"‖Δg‖/‖g‖ {u[key]['grad_rel_diff']:.3g}, ‖Δθ_h − Δθ_s‖/‖Δθ_s‖ "
                         f"{u[key]['update_rel_diff']:.3g}, max |Δθ_h − Δθ_s| "
                         f"{u[key]['update_max_abs_diff']:.2g} (lr {u['lr']:g})"))
    if "loop" in result:
        lp = result["loop"]
        rows += [
            ("LOOP", "filtered fraction (rollouts dropped)",
             f"{lp['filtered_fraction']:.2f} ({lp['dropped_small_advantage'] + lp['dropped_env_failed']} of "
             f"{lp['rollouts']}; per iteration " + ", ".join(f"{x:.2f}" for x in lp["filtered_per_iteration"])
             + ")"),
            ("LOOP", "dropped for |A| < threshold / environment failed",
             f"{lp['dropped_small_advantage']} / {lp['dropped_env_failed']}"),
            ("LOOP", "iterations abandoned by the KL monitor",
             f"{lp['iterations_abandoned_kl']} of {lp['iterations']} (max k1 KL {lp['kl_k1_max']:.3f})"),
        ]
    return "| script | mechanism | measured |\n|---|---|---|\n" + "\n".join(f"| {a} | {b} | {c} |"
                                                                           for a, b, c in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["t2po", "arpo", "loop"], action="append",
                        help="measure only these scripts (repeatable; default: all three)")
    parser.add_argument("--quick", action="store_true", help="fewer tasks, questions and iterations")
    parser.add_argument("--t2po-tasks", type=int, help="T²PO training tasks rolled out (default 4; quick 2)")
    parser.add_argument("--t2po-group-size", type=int, default=4, help="T²PO episodes per task")
    parser.add_argument("--t2po-flags", default="", help="t2po.py flags on top of its default run's, e.g. "
                        "'--tti-min-think 8 --tds-eta 0.03' (one string)")
    parser.add_argument("--arpo-questions", type=int, help="ARPO training questions (default 4; quick 2)")
    parser.add_argument("--loop-steps", type=int, help="LOOP iterations (default 3; quick 1)")
    parser.add_argument("--loop-eval-tasks", type=int, default=1, help="LOOP held-out games per evaluation")
    parser.add_argument("--root", default="runs/mechanisms", help="where ARPO's cold-start model is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", help="also write every figure here")
    cli = parser.parse_args()
    sizes = dict(t2po_tasks=(4, 2), arpo_questions=(4, 2), loop_steps=(3, 1))
    for name, (full, quick) in sizes.items():
        if getattr(cli, name) is None:
            setattr(cli, name, quick if cli.quick else full)
    for name in ("t2po_tasks", "t2po_group_size", "arpo_questions", "loop_steps", "loop_eval_tasks"):
        if getattr(cli, name) < 1:
            raise SystemExit(f"mechanisms.py: --{name.replace('_', '-')} must be ≥ 1")
    if cli.json:  # its folder (e.g. runs/, absent in a fresh clone) made now: a bad path fails before the run
        os.makedirs(os.path.dirname(cli.json) or ".", exist_ok=True)
    if cli.threads:
        torch.set_num_threads(cli.threads)
    scripts = cli.only or ["t2po", "arpo", "loop"]
    root = os.path.dirname(HERE)
    result = {"command": "python benchmarks/mechanisms.py " + " ".join(sys.argv[1:]),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                       text=True).stdout.strip(), "seconds": {}}
    for name in scripts:
        t0 = time.time()
        if name == "t2po":
            result["t2po"] = t2po_mechanisms(cli.t2po_tasks, cli.t2po_group_size, cli.threads,
                                             tuple(cli.t2po_flags.split()))
        elif name == "arpo":
            result["arpo"] = arpo_mechanisms(cli.arpo_questions, cli.threads, cli.root)
        else:
            result["loop"] = loop_mechanisms(cli.loop_steps, cli.loop_eval_tasks)
        result["seconds"][name] = round(time.time() - t0)
        print(f"[mechanisms] {name}: {result['seconds'][name]} s", flush=True)
    print(table(result))
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
