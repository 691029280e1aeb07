"""`search`: multi-turn search QA, as Search-R1 and T²PO's Search QA play it.

Each turn the agent writes `<search>query</search>` -- the retrieved passages come back as the next
observation inside `<information>...</information>` -- or `<answer>...</answer>`, which ends the episode.
As Search-R1 (search_r1/llm_agent/generation.py) reads a turn: the text is cut after its first
`</search>`, else after its first `</answer>`; the first complete `<search>` or `<answer>` tag of what is
left is the action; an answer is scored on the *last* `<answer>...</answer>` of that text (qa_em.py's
extract_solution takes the last), so `<answer>A</answer><answer>B</answer><search>q</search>` answers B.
Reward: exact match of the answer against any golden answer after SQuAD normalisation (Search-R1's
`em_check`); the token F1 is logged in info["f1"]. Search-R1 runs `max_turns` turns whose searches are
executed, then one final turn whose search is not: here too, turn max_turns + 1 ends the episode, with the
answer's reward if it answers, else 0. (Search-R1 scores the last answer of the whole trajectory; an
earlier turn holds a complete answer only inside a search query, which we do not score.) An action with
neither tag (or an unclosed one) is invalid: the observation says how to act, the turn is used up, and
info["valid_action"] is False (T²PO logs it as inadmissible_rate; its format penalty is its own parse).

Retrieval: BM25 over a corpus jsonl (`corpus=`), or a Search-R1 retrieval server (`url=`); by default the
offline world of envs/qa_data.py (single-hop and two-hop questions over a generated corpus). QA files:
jsonl or parquet with `question` and `golden_answers`.
"""

from __future__ import annotations

import re

from envs.qa_data import load_splits, write_offline
from envs.retrieval import make_retriever, search_text
from envs.tools import f1_score, normalize_answer

INSTRUCTION = (
    "Answer the given question. Reason inside <think> and </think> every time you get new information. "
    "If you lack some knowledge, call the search engine with <search> query </search>; the top results "
    "come back between <information> and </information>. You can search several times. When no more "
    "knowledge is needed, give the answer inside <answer> and </answer>, without explanation, for example "
    "<answer> Beijing </answer>.")
ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def exact_match(prediction: str, golden_answers: list[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def turn_text(action: str) -> str:
    """Search-R1's _postprocess_responses: the turn ends at its first </search>, else its first </answer>."""
    for tag in ("</search>", "</answer>"):
        if tag in action:
            return action.split(tag)[0] + tag
    return action


def parse_action(action: str) -> tuple[str, str] | None:
    """("search", query) or ("answer", the last answer) of the turn's first complete tag, or None."""
    text = turn_text(action)
    m = ACTION_RE.search(text)
    if m is None:
        return None
    if m.group(1) == "answer":
        return "answer", ANSWER_RE.findall(text)[-1].strip()
    return "search", m.group(2).strip()


class SearchEnv:
    def __init__(self, seed: int = 0, train_path: str | None = None, eval_path: str | None = None,
                 corpus: str | None = None, url: str | None = None, topk: int = 3, max_turns: int = 4,
                 retriever_timeout_s: float = 10.0, n_train: int = 400, n_eval: int = 100):
        offline = None if train_path and (corpus or url) else write_offline(seed)
        self.data = load_splits(train_path, eval_path, offline, "search", n_train, n_eval)
        self.corpus, self.url = corpus or (offline["corpus"] if offline else None), url
        self.topk, self.max_turns, self.retriever_timeout_s = topk, max_turns, retriever_timeout_s
        self._retriever = None
        self.row: dict | None = None
        self.turn, self.done = 0, True

    def tasks(self, split: str) -> list[int]:
        if split not in self.data:
            raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
        offset = 0 if split == "train" else len(self.data["train"])
        return [offset + i for i in range(len(self.data[split]))]

    @property
    def retriever(self):
        if self._retriever is None:
            self._retriever = make_retriever(corpus=self.corpus, url=self.url,
                                             timeout_s=self.retriever_timeout_s)
        return self._retriever

    def _info(self, **extra) -> dict:
        row = self.row or {"question": "", "golden_answers": []}
        return {"instruction": row["question"], "won": False, "task_score": 0.0, "valid_action": True,
                "golden_answers": row["golden_answers"], "turn": self.turn, **extra}

    def reset(self, task=0) -> tuple[str, dict]:
        n = len(self.data["train"])
        task = int(task)
        self.row = self.data["train"][task] if task < n else self.data["eval"][task - n]
        self.turn, self.done = 0, False
        return f"{INSTRUCTION}\nQuestion: {self.row['question']}", self._info()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done or self.row is None:
            return "The episode is over; call reset.", 0.0, True, self._info(valid_action=False)
        self.turn += 1
        parsed = parse_action(action if isinstance(action, str) else str(action))
        if parsed is not None and parsed[0] == "answer":
            self.done = True
            em = exact_match(parsed[1], self.row["golden_answers"])
            f1 = f1_score(parsed[1], self.row["golden_answers"])
            return "Episode finished.", em, True, self._info(won=em == 1.0, task_score=em, f1=f1,
                                                              answer=parsed[1])
        if self.turn > self.max_turns:  # Search-R1's final turn: its search is not run
            self.done = True
            return "Turn limit reached without an answer.", 0.0, True, self._info(
                valid_action=parsed is not None, f1=0.0)
        if parsed is not None:
            return f"<information>\n{self._search(parsed[1])}\n</information>", 0.0, False, self._info()
        return ("Invalid action: write <search> query </search> to search, or <answer> text </answer> to "
                "answer."), 0.0, False, self._info(valid_action=False)

    def _search(self, query: str) -> str:
        try:
            return search_text(self.retriever, query, self.topk)
        except Exception as e:  # noqa: BLE001 -- e.g. a corpus that cannot be loaded: an observation
            return f"Error: search is unavailable ({type(e).__name__}: {str(e)[:200]})."


def make(**options) -> SearchEnv:
    return SearchEnv(**options)
