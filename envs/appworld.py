"""`appworld`: adapter to the real AppWorld (Trivedi et al., 2024), as LOOP trains on it.

The agent writes python in ```python fenced blocks (ReAct: reasoning in prose, then code); the code runs
in the task's world (`world.execute(code)`, which calls the apps through `apis.<app>.<api>(...)`); the
printed output is the next observation, cut at 3000 tokens (LOOP). The episode ends when the agent calls
`apis.supervisor.complete_task(...)` (`world.task_completed()`) or after `max_turns` actions. Reward at the
end: the fraction of the task's unit tests that pass (`world.evaluate()`: pass_count / num_tests);
success (info["won"]) = all pass.

One world per process: AppWorld freezes the clock process-wide and times code out with SIGALRM on the
main thread, so each env owns a worker process (spawned, so nothing of the trainer is inherited) that
holds at most one world at a time, and every episode gets its own experiment name (starting a world
wipes its experiment folder; concurrent rollouts of one task must not share one). A worker that hangs
past `step_timeout_s` is killed and the episode ends with an error; the next reset starts a fresh worker.

Needs the package and its data (network, once):

    pip install appworld && appworld install && appworld download data

run from (or with APPWORLD_ROOT set to) the folder that should hold `data/`. Without them `make()` ends
with one message giving these commands.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import re
import uuid

INSTALL_HELP = ("AppWorld is not available: {why}. Install it and its data once (needs the network):\n"
                "    pip install appworld\n    appworld install\n    appworld download data\n"
                "then run from the folder holding data/ or set APPWORLD_ROOT to it.")

REACT_PROMPT = """You are a coding agent working for {first_name} {last_name} ({email}, phone {phone}). \
You complete the task below by writing python code that calls the apps' APIs through the `apis` object, \
e.g. `apis.spotify.login(username=..., password=...)`.

How to act:
- Each turn, think briefly, then write exactly one ```python code block. It runs in a persistent session \
and you see what it prints. Work in small steps and print what you need to look at.
- Look up what exists before using it: `print(apis.api_docs.show_app_descriptions())`, \
`print(apis.api_docs.show_api_descriptions(app_name='spotify'))`, \
`print(apis.api_docs.show_api_doc(app_name='spotify', api_name='login'))`.
- Account passwords are in `apis.supervisor.show_account_passwords()`; the supervisor's own details in \
`apis.supervisor.show_profile()`. Results are paginated: loop over `page_index` until a page is empty.
- Do not guess values; find them with the APIs. Do not ask the supervisor anything.
- When the task is done, call `apis.supervisor.complete_task()`, or \
`apis.supervisor.complete_task(answer=<answer>)` when the task asks a question.

Task: {instruction}"""

WORKER_START_S = 60.0  # added to the first command's timeout: a fresh interpreter imports AppWorld first
CODE_RE = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The code of every ```python block in the response, in order, joined; None when there is none."""
    blocks = [b.strip("\n") for b in CODE_RE.findall(response)]
    blocks = [b for b in blocks if b.strip()]
    return "\n".join(blocks) if blocks else None


def truncate_output(text: str, max_tokens: int = 3000, tokenizer=None) -> str:
    """Cut the environment's output to `max_tokens` (LOOP: 3000); ~4 characters per token without a
    tokenizer. The cut goes back to the last newline so the model does not see half a line."""
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        head = tokenizer.decode(ids[:max_tokens])
    else:
        if len(text) <= 4 * max_tokens:
            return text
        head = text[:4 * max_tokens]
    cut = head.rfind("\n")
    head = head[:cut] if cut > len(head) // 2 else head
    return head + f"\n[output truncated at {max_tokens} tokens]"


def reward_from_evaluation(result) -> tuple[float, bool]:
    """(pass_count / num_tests, success) from `world.evaluate()` -- the TestTracker or its to_dict()."""
    if isinstance(result, dict):
        num, passed = result["num_tests"], len(result["passes"])
        success = bool(result.get("success", passed == num))
    else:
        num, passed, success = result.num_tests, result.pass_count, bool(result.success)
    return (passed / num if num else 0.0), success


def availability_error(root: str | None = None) -> str | None:
    """None when AppWorld can run here, else the message with the install commands."""
    if importlib.util.find_spec("appworld") is None:
        return INSTALL_HELP.format(why="the python package `appworld` is not installed")
    root = root or os.environ.get("APPWORLD_ROOT", os.getcwd())
    if not os.path.isdir(os.path.join(root, "data", "tasks")):
        return INSTALL_HELP.format(why=f"no AppWorld data under {os.path.join(root, 'data')}")
    return None


def _load(path: str):
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def _worker(conn, world_factory: str, task_ids_fn: str, root: str | None) -> None:
    """One process, at most one world at a time; commands arrive on the pipe."""
    if root:
        os.environ["APPWORLD_ROOT"] = root
    make_world = _load(world_factory)
    world = None
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "task_ids":
                out = _load(task_ids_fn)(arg)
            elif cmd == "reset":
                if world is not None:
                    world.close()
                world = make_world(task_id=arg[0], experiment_name=arg[1])
                s = world.task.supervisor
                out = {"instruction": world.task.instruction, "first_name": s.first_name,
                       "last_name": s.last_name, "email": s.email, "phone": s.phone_number}
            elif cmd == "execute":
                out = world.execute(arg)
            elif cmd == "completed":
                out = bool(world.task_completed())
            elif cmd == "evaluate":
                out = reward_from_evaluation(world.evaluate())
            elif cmd == "close":
                if world is not None:
                    world.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 -- reported to the parent as an error observation
            conn.send(("error", f"{type(e).__name__}: {str(e)[:1000]}"))


class AppWorldEnv:
    def __init__(self, train_split: str = "train", eval_split: str = "dev", max_turns: int = 40,
                 max_output_tokens: int = 3000, step_timeout_s: float = 300.0, experiment_prefix: str = "rl",
                 root: str | None = None, tokenizer=None, seed: int = 0,
                 world_factory: str = "appworld:AppWorld", task_ids_fn: str = "appworld:load_task_ids"):
        # world_factory / task_ids_fn: "module:attr" imported in the worker (the defaults are AppWorld's);
        # seed: accepted like every env's, unused (AppWorld's tasks are fixed and its worlds deterministic)
        if world_factory == "appworld:AppWorld" and (why := availability_error(root)):
            raise RuntimeError(why)
        self.splits = {"train": train_split, "eval": eval_split}
        self.max_turns, self.max_output_tokens = max_turns, max_output_tokens
        self.step_timeout_s, self.experiment_prefix, self.root = step_timeout_s, experiment_prefix, root
        self.factories, self.tokenizer = (world_factory, task_ids_fn), tokenizer
        self.proc, self.conn = None, None
        self.task_id, self.instruction, self.turn, self.done = None, "", 0, True

    # -- the worker process ----------------------------------------------------------------------------
    def _call(self, cmd: str, arg=None):
        timeout = self.step_timeout_s
        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker, args=(child, *self.factories, self.root), daemon=True)
            self.proc.start()
            timeout += WORKER_START_S  # the start is not the command's: seconds on a busy machine
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            self.close()  # hung (e.g. stuck in the apps' database): kill it; a fresh one comes next time
            raise TimeoutError(f"AppWorld did not answer {cmd!r} within {timeout:g} s")
        status, out = self.conn.recv()
        if status == "error":
            raise RuntimeError(out)
        return out

    def close(self) -> None:
        if getattr(self, "proc", None) is not None:  # __init__ may have raised before proc existed
            self.proc.kill()
            self.proc.join(5)
        self.proc, self.conn = None, None

    def __del__(self):
        self.close()

    # -- Env interface -----------------------------------------------------------------------------------
    def tasks(self, split: str) -> list[str]:
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
        return list(self._call("task_ids", self.splits[split]))

    def _info(self, **extra) -> dict:
        return {"instruction": self.instruction, "won": False, "task_score": 0.0, "valid_action": True,
                "turn": self.turn, "task_id": self.task_id, **extra}

    def reset(self, task) -> tuple[str, dict]:
        self.task_id, self.turn, self.done = str(task), 0, False
        # a distinct experiment per rollout: starting a world wipes its experiment's output folder
        self.experiment = f"{self.experiment_prefix}/{self.task_id}/{uuid.uuid4().hex[:12]}"
        t = self._call("reset", (self.task_id, self.experiment))
        self.instruction = t["instruction"]
        return REACT_PROMPT.format(**t), self._info()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return "The episode is over; call reset.", 0.0, True, self._info(valid_action=False)
        self.turn += 1
        code = extract_code(action if isinstance(action, str) else str(action))
        valid = code is not None
        try:
            if valid:
                obs = truncate_output(self._call("execute", code), self.max_output_tokens, self.tokenizer)
            else:
                obs = "No code found. Write your code in one ```python ... ``` block."
            if not (self.turn >= self.max_turns or (valid and self._call("completed"))):
                return obs, 0.0, False, self._info(valid_action=valid)
            self.done = True
            reward, success = self._call("evaluate")
        except (RuntimeError, TimeoutError, OSError, EOFError) as e:
            self.done = True
            return f"Episode ended: AppWorld failed ({e}).", 0.0, True, self._info(valid_action=valid,
                                                                                  error=str(e))
        return obs, reward, True, self._info(valid_action=valid, won=success, task_score=reward)


def make(**options) -> AppWorldEnv:
    return AppWorldEnv(**options)
