"""`tools`: ARPO's tool-integrated reasoning environment (Dong et al., arXiv 2507.19849).

One response interleaves thinking with tool calls. Generation pauses when a closing tool tag is
produced; the tool runs, its output is inserted as `<result>...</result>` (environment tokens: mask them
out of the loss) and generation continues, until `<answer>...\\boxed{...}...</answer>`. Inside a result
the agent's tags and chat-template markers are written `&lt;answer>`, `&lt;/result>`, `&lt;|im_end|>`, ...:
no output closes its block, forges an answer or a chat turn, or becomes a special token.

API for a rollout that executes tools *inside* one response (arpo.py):

    env = make_env("tools", seed=0)             # or make(train_path=..., eval_path=..., corpus=..., url=...)
    question = env.reset(task)[0]               # the observation is the question text
    stop = TOOL_STOP                            # ["</python>", "</search>", "</answer>"]: generate until one
    env.execute_tool("python", code) -> str     # tool output only (sandboxed python / passages / error line)
    env.run_tool_call(text_so_far) -> str|None  # if the text ends with a closed <python>/<search> call and
                                                # the call limit is not spent: " <result>\\n...\\n</result>"
                                                # to append (ARPO's layout); else None (stop the response)
    env.run_tool_calls(texts) -> list[str|None] # many at once on threads (the sandbox is processes)
    env.max_tool_calls                          # ARPO's tool-call limit (maintainer: 5)
    reward(response, ground_truth) -> float     # ARPO's hierarchical reward, below
    score(response, ground_truth) -> dict       # the same with "f1", "answer", "format_ok", "reason"

Env interface (make_env / EnvPool): `reset(task)` -> (question, info); `step(full_response)` scores the
whole response and ends the episode (one step). With `multi_turn=True` the env instead plays the tool
loop itself: a step whose text ends with a closed tool call returns the `<result>` block as the next
observation; a step with `</answer>` (or no call, or the limit spent) ends it with the reward of the
whole transcript. info: "instruction", "won" (F1 == 1), "task_score" (F1), "valid_action" (format ok),
"f1", "answer", "tool_calls", "golden_answers", "system_prompt", "messages" (the chat to prompt with).

Reward (ARPO, verl `deep_research.py`; PAPERS.md §2):
- format invalid -> -1. Valid: `<think>`/`</think>` present and paired; exactly one `<answer>...</answer>`;
  every `<search>`/`<python>` closed and followed by a `<result>...</result>`, in that order; the answer
  holds `\\boxed{...}`;
- else F1 = token-level F1 of the last `\\boxed{}` content in the answer against each reference
  (lower-case, punctuation and articles removed, whitespace collapsed; best over references; a yes/no
  answer only matches the same yes/no); F1 > 0 and the response used both `</search>` and `</python>`:
  F1 + 0.1; F1 > 0: F1; F1 = 0: 0.

Python runs in envs/sandbox.py. On a machine whose kernel isolates nothing for it (no namespaces, no
Landlock, no seccomp) the env refuses to start (RuntimeError naming the switch) unless `unsafe_python=True`
(arpo.py --unsafe-python) accepts running model-written code with only the python audit hook and rlimits.

Tasks: the offline set (envs/qa_data.py: python arithmetic, word problems, corpus look-ups, look-up then
python), or files: jsonl (`question`, `golden_answers`) or ARPO's verl parquet (`prompt`,
`reward_model.ground_truth`; needs pyarrow).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from envs.qa_data import load_splits, write_offline
from envs.retrieval import make_retriever, search_text
from envs.sandbox import SandboxLimits, isolation, refusal, run_python

TOOL_TAGS = ["python", "search"]
TOOL_STOP = ["</python>", "</search>", "</answer>"]

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves the question step by step with the help of a python "
    "interpreter and a search tool. Think inside <think> </think>. To run python write <python> code "
    "</python>; to search write <search> query </search>. Each tool's output comes back inside <result> "
    "</result>. Call the tools when they help. End with <answer> ... \\boxed{final answer} </answer>.")


# ---------------------------------------------------------------------------------------------------
# ARPO's hierarchical reward


def format_check(text: str) -> tuple[bool, str]:
    """ARPO's format rule (see the module docstring); returns (valid, reason)."""
    if text.count("<think>") != text.count("</think>"):
        return False, "<think> and </think> not paired"
    if text.count("<think>") == 0:
        return False, "no <think> block"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False, "not exactly one <answer>...</answer>"
    for tag in TOOL_TAGS:  # every call: <tag> < </tag> < <result> < </result>, left to right
        pos = 0
        while (start := text.find(f"<{tag}>", pos)) != -1:
            close = text.find(f"</{tag}>", start)
            result = text.find("<result>", start)
            result_end = text.find("</result>", result) if result != -1 else -1
            if -1 in (close, result, result_end):
                return False, f"<{tag}> call without its closing tag or <result> block"
            if not start < close < result < result_end:
                return False, f"<{tag}> call and <result> out of order"
            pos = result_end
    start, end = text.find("<answer>"), text.find("</answer>")
    if start > end:
        return False, "</answer> before <answer>"
    if "\\boxed{" not in text[start:end]:
        return False, "the answer has no \\boxed{}"
    return True, "ok"


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces matched."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def normalize_answer(s: str) -> str:
    # SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse whitespace
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def f1_score(prediction: str, references: list[str]) -> float:
    """Token-level F1, best over references."""
    best = 0.0
    pred = normalize_answer(prediction)
    for ref in references:
        ref = normalize_answer(ref)
        if (pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer")) and pred != ref:
            continue
        common = sum((Counter(pred.split()) & Counter(ref.split())).values())
        if common == 0:
            continue
        precision, recall = common / len(pred.split()), common / len(ref.split())
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def score(response: str, ground_truth: str | list[str]) -> dict:
    refs = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    ok, reason = format_check(response)
    if not ok:
        return {"reward": -1.0, "f1": 0.0, "answer": None, "format_ok": False, "reason": reason}
    answer = last_boxed(response[response.find("<answer>"):response.find("</answer>")])
    if answer is None:
        return {"reward": -1.0, "f1": 0.0, "answer": None, "format_ok": False, "reason": "unclosed \\boxed{"}
    f1 = f1_score(answer, refs)
    both_tools = "</search>" in response and "</python>" in response
    r = f1 + 0.1 if f1 > 0 and both_tools else f1  # F1 = 0 -> 0
    return {"reward": r, "f1": f1, "answer": answer, "format_ok": True, "reason": reason}


def reward(response: str, ground_truth: str | list[str]) -> float:
    """ARPO's hierarchical reward: -1 bad format; else F1 (+0.1 when F1 > 0 and both tools were used)."""
    return score(response, ground_truth)["reward"]


# ---------------------------------------------------------------------------------------------------
# Tool calls inside one response


def count_tool_calls(text: str) -> int:
    return sum(text.count(f"</{tag}>") for tag in TOOL_TAGS)


def pending_call(text: str) -> tuple[str, str] | None:
    """(tag, content) when `text` ends with a closed tool call -- the moment generation stopped."""
    stripped = text.rstrip()
    for tag in TOOL_TAGS:
        if stripped.endswith(f"</{tag}>"):
            end = len(stripped) - len(tag) - 3
            start = stripped.rfind(f"<{tag}>", 0, end)
            if start == -1:
                return tag, ""
            return tag, stripped[start + len(tag) + 2:end].strip()
    return None


# The tags format_check, score and pending_call read, and the chat templates' markers (`<|im_end|>`,
# `<|im_start|>`, `<|endoftext|>`: ChatML, SmolLM2, Qwen; Llama 3's `<|eot_id|>`). Inside a result block
# each one's "<" is written "&lt;": what code prints (or a passage says) can neither close its block nor
# forge a call, a <think>, or an <answer> the scorer would take for the model's own, and no tokenizer
# (arpo.py's encode, a chat template's, vLLM's) reads a special token or a new chat turn in it.
AGENT_TAG = re.compile(r"<(?=\||/?(?:think|answer|result|python|search)\b)")


def result_block(output: str) -> str:
    """A tool's output as the environment inserts it (ARPO's layout, vllm_rollout_with_tools.py)."""
    return f" <result>\n{AGENT_TAG.sub('&lt;', output)}\n</result>"


# a city's passage in the offline corpus (envs/qa_data.py), as the expert reads it
CITY_FACTS = r"{} is a city in \w+\. It was founded in (\d+) and has a population of (\d+)\."


class ToolsEnv:
    def __init__(self, seed: int = 0, train_path: str | None = None, eval_path: str | None = None,
                 corpus: str | None = None, url: str | None = None, topk: int = 3, max_tool_calls: int = 5,
                 multi_turn: bool = False, python_timeout_s: float = 10.0, max_output_chars: int = 2000,
                 n_train: int = 400, n_eval: int = 100, max_workers: int = 8, unsafe_python: bool = False,
                 holdout: str = "all"):
        """holdout: "all" keeps every held-out question; "answer" only those none of whose answers (after
        the reward's normalisation) is a training question's answer, so a held-out success is never a
        memorised training answer."""
        if holdout not in ("all", "answer"):
            raise ValueError(f"holdout must be 'all' or 'answer', not {holdout!r}")
        if not unsafe_python and not isolation()["kernel_isolated"]:
            raise RuntimeError(refusal(isolation()))  # before any data or model: one line from the script
        offline = None if train_path and (corpus or url) else write_offline(seed)
        self.data = load_splits(train_path, eval_path, offline, "tools", n_train, n_eval)
        if holdout == "answer":
            seen = {normalize_answer(a) for row in self.data["train"] for a in row["golden_answers"]}
            self.data["eval"] = [row for row in self.data["eval"]
                                 if not any(normalize_answer(a) in seen for a in row["golden_answers"])]
        self.corpus, self.url = corpus or (offline["corpus"] if offline else None), url
        self._retriever = None
        self.topk, self.max_tool_calls, self.multi_turn = topk, max_tool_calls, multi_turn
        self.limits = SandboxLimits(timeout_s=python_timeout_s, cpu_s=max(1, int(python_timeout_s)),
                                    max_output_chars=max_output_chars, unsafe=unsafe_python)
        self.max_workers = max_workers
        self.row: dict | None = None
        self.transcript, self.done = "", True

    def tasks(self, split: str) -> list[int]:
        if split not in self.data:
            raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
        offset = 0 if split == "train" else len(self.data["train"])  # ids stay disjoint across splits
        return [offset + i for i in range(len(self.data[split]))]

    def _row(self, task: int) -> dict:
        n = len(self.data["train"])
        task = int(task)
        rows = self.data["train"] if task < n else self.data["eval"]
        return rows[task if task < n else task - n]

    @property
    def retriever(self):
        if self._retriever is None:  # built on first search: python-only runs never load the index
            self._retriever = make_retriever(corpus=self.corpus, url=self.url)
        return self._retriever

    def execute_tool(self, tag: str, content: str) -> str:
        """One tool call's output (never raises)."""
        if tag == "python":
            if not content.strip():
                return "Error: empty python code."
            return run_python(content, self.limits).output or "(no output)"
        if tag == "search":
            try:
                return search_text(self.retriever, content, self.topk)
            except Exception as e:  # noqa: BLE001 -- e.g. the corpus could not be loaded
                return f"Error: search is unavailable ({type(e).__name__}: {str(e)[:200]})."
        return f"Error: unknown tool {tag!r}; use <python> or <search>."

    def run_tool_call(self, text_so_far: str) -> str | None:
        """The `<result>` block to append after a just-closed call, or None (no call / call limit spent)."""
        call = pending_call(text_so_far)
        if call is None or count_tool_calls(text_so_far) > self.max_tool_calls:
            return None
        return result_block(self.execute_tool(*call))

    def run_tool_calls(self, texts: list[str]) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(texts)))) as pool:
            return list(pool.map(self.run_tool_call, texts))

    def expert_demo(self, question: str) -> list[tuple[str, int]] | None:
        """The scripted expert's response to one offline question (envs/qa_data.py `tool_question`), as
        (text, policy) segments: 1 = written by the expert, 0 = a `<result>` block this environment's own
        sandbox or retriever produced (arpo.py's cold start). Numbers come from the question or from the
        retrieved passage, never from the ground truth. None for a question it cannot read, or a look-up
        whose passage was not found."""
        def call(tag: str, content: str, why: str) -> list[tuple[str, int]]:
            output = self.execute_tool(tag, content)
            return [(f"<think>{why}</think>\n<{tag}>{content}</{tag}>", 1), (result_block(output), 0)]

        def answer(value: str) -> tuple[str, int]:
            return f"\n<think>The answer is {value}.</think>\n<answer>\\boxed{{{value}}}</answer>", 1

        def city(name: str) -> tuple[list[tuple[str, int]], re.Match | None]:
            segs = call("search", f"{name} city population founded", f"I need to look up the city of {name}.")
            return segs, re.search(CITY_FACTS.format(re.escape(name)), segs[1][0])

        if m := re.fullmatch(r"What is (\d+) \* (\d+) - (\d+)\?", question):
            code = f"print({m[1]} * {m[2]} - {m[3]})"
        elif m := re.search(r"holds (\d+) crates with (\d+) boxes.* (\d+) boxes are shipped.*sold for (\d+) "
                            r"dollars", question):
            code = f"print(({m[1]} * {m[2]} - {m[3]}) * {m[4]})"
        elif m := re.fullmatch(r"What is the population of the city of (\w+)\?", question):
            segs, facts = city(m[1])
            return segs + [answer(facts[2])] if facts else None
        elif m := re.fullmatch(r"How many years apart were the cities of (\w+) and (\w+) founded\?|What is "
                               r"the combined population of the cities of (\w+) and (\w+)\?", question):
            years = m[1] is not None
            (segs_x, x), (segs_y, y) = city(m[1] or m[3]), city(m[2] or m[4])
            if not (x and y):
                return None
            code = f"print(abs({x[1]} - {y[1]}))" if years else f"print({x[2]} + {y[2]})"
            segs = segs_x + segs_y + call("python", code, "Now compute it.")
            return segs + [answer(segs[-1][0].split("\n")[1].strip())]
        else:
            return None
        segs = call("python", code, "The numbers are large, so I compute with python.")
        return segs + [answer(segs[-1][0].split("\n")[1].strip())]

    def _info(self, **extra) -> dict:
        row = self.row or {"question": "", "golden_answers": []}
        messages = row.get("messages") or [{"role": "system", "content": SYSTEM_PROMPT},
                                           {"role": "user", "content": row["question"]}]
        return {"instruction": row["question"], "won": False, "task_score": 0.0, "valid_action": True,
                "golden_answers": row["golden_answers"], "system_prompt": SYSTEM_PROMPT, "messages": messages,
                "tool_calls": count_tool_calls(self.transcript), **extra}

    def reset(self, task=0) -> tuple[str, dict]:
        self.row, self.transcript, self.done = self._row(task), "", False
        return self.row["question"], self._info()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done or self.row is None:
            return "The episode is over; call reset.", 0.0, True, self._info(valid_action=False)
        action = action if isinstance(action, str) else str(action)
        self.transcript += action
        if self.multi_turn and "</answer>" not in action:
            result = self.run_tool_call(self.transcript)
            if result is not None:
                self.transcript += result
                return result, 0.0, False, self._info()
        self.done = True
        s = score(self.transcript, self.row["golden_answers"])
        info = self._info(won=s["f1"] == 1.0, task_score=s["f1"], valid_action=s["format_ok"], f1=s["f1"],
                          answer=s["answer"], reason=s["reason"])
        return "Episode finished.", s["reward"], True, info


def make(**options) -> ToolsEnv:
    return ToolsEnv(**options)
