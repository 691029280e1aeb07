"""Response tokens of ARPO's scripted-expert demonstrations per question kind, for each number of
passages per search: which kinds fit `--max-new-tokens` (docs/arpo.md, "Cold start").

    python benchmarks/studies/arpo_demo_lengths.py          # topk 3, 2, 1; first 40 train + 40 held-out
    python benchmarks/studies/arpo_demo_lengths.py --topk 1 --n 100
"""

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import AutoTokenizer  # noqa: E402

import arpo  # noqa: E402
from common.models import DEFAULT_MODEL, resolve_model_path  # noqa: E402
from envs.base import make_env  # noqa: E402

# question wording -> kind (envs/qa_data.py tool_question); first match wins
KINDS = [("combined population", "two-city sum + python"), ("years apart", "two-city difference + python"),
         ("population of", "one look-up"), ("crates", "word problem")]


def lengths(topk: int, n: int, tokenizer) -> dict[str, list[int | None]]:
    """Per kind: the demonstration's response tokens (results included), None where the expert gave up."""
    env = make_env("tools", seed=0, topk=topk)
    out = defaultdict(list)
    for split in ("train", "eval"):
        for task in env.tasks(split)[:n]:
            question, _ = env.reset(task)
            kind = next((k for key, k in KINDS if key in question), "arithmetic")
            segments = env.expert_demo(question)
            n_tokens = None if segments is None else len(arpo.demo_rollout(tokenizer, segments).response_ids)
            out[kind].append(n_tokens)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topk", type=int, nargs="+", default=[3, 2, 1], help="passages per search")
    parser.add_argument("--n", type=int, default=40, help="questions per split")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))
    print("| passages per search | kind | questions | no demonstration | tokens min–max |")
    print("|---|---|---|---|---|")
    for topk in args.topk:
        for kind, values in sorted(lengths(topk, args.n, tokenizer).items()):
            found = [v for v in values if v is not None]
            span = f"{min(found)}–{max(found)}" if found else "–"
            print(f"| {topk} | {kind} | {len(values)} | {len(values) - len(found)} | {span} |")


if __name__ == "__main__":
    main()
