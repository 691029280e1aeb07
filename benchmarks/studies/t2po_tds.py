"""Which turns does T²PO's TDS resample? Its turn signal Φ before and after the one-scale change.

    python benchmarks/studies/t2po_tds.py --synthetic      # no model: Γ on synthetic turns, a few seconds
    python benchmarks/studies/t2po_tds.py --json tds.json  # the packaged model after the default RFT, ~10 min
    python benchmarks/studies/t2po_tds.py --from-json tds.json   # summarise the saved turns again

Before: Φ_k = geometric mean of M_t with M normalised over turn k alone and exact zeros floored at 1e-6.
Now (t2po.tds_phis): M of turns k−1 and k on one min–max scale, exact zeros (the scale's anchor) left out.

--synthetic: next-token distributions drawn from a Dirichlet over 50 tokens; per row, 30 pairs of turns
(length, concentration) and the mean Γ = |Φ_k − Φ_{k−1}| under both definitions.

Default: the default run's setting (TextWorld coin collector level 2, `python t2po.py`'s preset), its RFT
(4 expert episodes, 2 SFT epochs), then training rollouts (T 0.7, TTI on, B_max 1) of --tasks tasks x
--group-size episodes: step 1 as t2po.training_rollouts plays it (its tasks, its seeds). For every turn
k > 0 it records both Γ's, whether the turn's action repeats the previous turn's, and prints how many turns
each definition would resample, how many of those repeat, and how well each Γ separates repeats from the
other turns (see `summary`).
"""

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import t2po  # noqa: E402


def old_phi(out: t2po.Response, alpha: float) -> float:
    """The earlier Φ: min–max over the turn alone, M floored at 1e-6 in the geometric mean."""
    m = t2po.uncertainty(out.entropies, out.confidences, alpha, causal=False)
    return math.exp(sum(math.log(max(x, 1e-6)) for x in m) / len(m)) if m else 0.0


def gammas(prev: t2po.Response, cur: t2po.Response, alpha: float) -> tuple[float, float]:
    """(Γ before, Γ now) for the pair of turns."""
    phi_prev, phi = t2po.tds_phis(prev, cur, alpha)
    return abs(old_phi(cur, alpha) - old_phi(prev, alpha)), abs(phi - phi_prev)


def synthetic(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)

    def turn(length: int, concentration: float) -> t2po.Response:
        h, c = [], []
        for _ in range(length):
            logp = np.log(rng.dirichlet([concentration] * 50) + 1e-30)
            h.append(float(-(np.exp(logp) * logp).sum()))
            c.append(t2po.token_confidence(sorted(logp.tolist(), reverse=True)[:5], 5))
        return t2po.Response(entropies=h, confidences=c)

    rows = []
    for (ca, ta), (cb, tb) in [((0.05, 10), (0.05, 300)), ((0.3, 10), (0.3, 300)), ((0.05, 30), (0.05, 30)),
                               ((0.05, 30), (0.3, 30)), ((0.02, 30), (0.1, 30))]:
        pairs = [gammas(turn(ta, ca), turn(tb, cb), 0.5) for _ in range(30)]
        rows.append(dict(prev=f"{ta} tokens, conc {ca}", cur=f"{tb} tokens, conc {cb}",
                         gamma_before=float(np.mean([p[0] for p in pairs])),
                         gamma_now=float(np.mean([p[1] for p in pairs]))))
    return rows


def response_action(tokenizer, out: t2po.Response) -> str:
    """The action a generated turn response (generate_turn's output) hands to the environment."""
    return t2po.parse_response(tokenizer.decode(out.ids, skip_special_tokens=True))[0]


def real_turns(n_tasks: int, group_size: int, threads: int, t2po_flags: tuple[str, ...] = ()) -> dict:
    import torch

    from common import run
    from common.generation import make_generator
    from common.models import DEFAULT_MODEL, load_policy, resolve_model_path
    from envs.base import EnvPool

    if threads:
        torch.set_num_threads(threads)
    argv = ["--tds-max-try", "1", "--group-size", str(group_size), "--tasks-per-step", str(n_tasks),
            *t2po_flags]  # t2po_flags: e.g. other TTI / TDS constants than the default run's
    args = run.parse(t2po.Args, argv, t2po.PRESETS, t2po.check_args)  # the default run's setting
    env, options, train_tasks, eval_tasks = run.make_env(args)
    pool = EnvPool(args.env, n_tasks * group_size, **options)  # the step's episodes, as build_envs sizes it
    envs = t2po.Envs(env, options, train_tasks, eval_tasks, pool, None, None)
    model, tokenizer = load_policy(DEFAULT_MODEL)
    generator = make_generator("hf", model, tokenizer, resolve_model_path(DEFAULT_MODEL))
    torch.manual_seed(args.seed)
    r = run.Run(model=model, policy=model, tokenizer=tokenizer, generator=generator, optimizer=None,
                reference=None, logger=None, start_step=0, extra={}, device="cpu")
    t2po.cold_start(r, envs, args)  # RFT as main() runs it for the default run

    records = []
    decide = t2po.tds_should_resample

    def recording_redo(prev, cur, a):  # B_max 1: called once per turn k > 0, on its first sample
        if prev is not None:
            acts = [response_action(tokenizer, prev), response_action(tokenizer, cur)]
            before, now = gammas(prev, cur, a.alpha)
            records.append(dict(repeat=acts[1] == acts[0], gamma_before=before, gamma_now=now, actions=acts,
                                lengths=[len(prev.ids), len(cur.ids)],
                                prev=dict(entropies=prev.entropies, confidences=prev.confidences),
                                cur=dict(entropies=cur.entropies, confidences=cur.confidences)))
        return decide(prev, cur, a)

    t2po.tds_should_resample = recording_redo
    try:
        t2po.training_rollouts(r, envs, args, 1)  # the first RL step: its tasks (step_tasks), its seeds
    finally:
        t2po.tds_should_resample = decide
    return dict(eta=args.tds_eta, records=records)


def median(score, rows: list[dict]) -> float | None:
    """The median score of rows; None, not 0, when there are none."""
    return round(float(np.median([score(r) for r in rows])), 3) if rows else None


def summary(records: list[dict], eta: float) -> dict:
    """How many turns k > 0 each Γ would resample (0 < Γ < η) and how many of those repeat the previous
    action; and how well each Γ separates repeats (low Γ wanted) from the other turns: the probability
    that a repeat's Γ is below another turn's (0.5 = no better than chance; None without a repeat or
    without another turn), beside two plain detectors,
    the difference in length (tokens) and in mean entropy between the two turns."""
    def entropy_gap(r: dict) -> float:
        def mean(xs: list[float]) -> float:
            return sum(xs) / max(1, len(xs))
        return abs(mean(r["cur"]["entropies"]) - mean(r["prev"]["entropies"]))

    detectors = {"gamma_before": lambda r: r["gamma_before"], "gamma_now": lambda r: r["gamma_now"],
                 "length_gap": lambda r: abs(r["lengths"][1] - r["lengths"][0]), "entropy_gap": entropy_gap}
    repeats = [r for r in records if r["repeat"]]
    others = [r for r in records if not r["repeat"]]
    out = dict(turns_k_gt_0=len(records), repeats=len(repeats), eta=eta)
    for name, score in detectors.items():
        pairs = [(score(a), score(b)) for a in repeats for b in others]
        out[name] = dict(separation=round(sum((x < y) + 0.5 * (x == y) for x, y in pairs) / len(pairs), 3)
                         if pairs else None,
                         median_repeat=median(score, repeats), median_other=median(score, others))
        if name.startswith("gamma"):
            hits = [r for r in records if 0 < score(r) < eta]
            out[name].update(resampled=len(hits), of_them_repeats=sum(r["repeat"] for r in hits))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", action="store_true", help="synthetic turns only (no model)")
    parser.add_argument("--tasks", type=int, default=8, help="training tasks rolled out")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per task")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", help="also write the result (every turn's record) here")
    parser.add_argument("--from-json", help="only summarise the records a --json run wrote")
    cli = parser.parse_args()
    if cli.tasks < 1 or cli.group_size < 1:
        raise SystemExit("t2po_tds.py: --tasks and --group-size must be ≥ 1")
    if cli.from_json:  # summarise a saved --json result again
        with open(cli.from_json) as f:
            saved = json.load(f)
        print(json.dumps(summary(saved["records"], saved["eta"]), indent=1))
        return
    if cli.synthetic:
        result = synthetic()
        print("| previous turn | this turn | mean Γ before | mean Γ now |\n|---|---|---|---|")
        for r in result:
            print(f"| {r['prev']} | {r['cur']} | {r['gamma_before']:.3f} | {r['gamma_now']:.3f} |")
    else:
        result = real_turns(cli.tasks, cli.group_size, cli.threads)
        print(json.dumps(summary(result["records"], result["eta"]), indent=1))
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
