"""The text-environment interface, the registry behind every script's `--env`, and a pool that steps
many environments at once.

An environment maps a task to a text game:

    tasks = env.tasks("train")                    # or "eval": task ids
    obs, info = env.reset(task)                   # the first observation
    obs, reward, done, info = env.step(action)    # action: the policy's text

Adding an environment is one file and one line: envs/<name>.py with a class that has `Env`'s three methods
(and whichever optional hooks below it can offer) and a `make(**options)` that builds it; then the line
`"<name>": "envs.<name>:make",` in `_REGISTRY` below. `make_env`, `EnvPool`, every script's `--env <name>`
and `python -m envs.play <name>` find it by that line, and tests/test_env_contract.py checks it against the
contract here. (`register(name, factory)` adds one at run time, e.g. in a test.) `--env-options '{"k": 1}'`
reaches `make` as keywords, and so does the run's `seed` unless `make` refuses it (a TypeError naming
'seed': retried without). `make` runs once per pool slot: copies built from the same options must list the
same tasks; each copy is used by one thread at a time. A user's error (missing data or package, bad option)
is a ValueError, RuntimeError, ImportError or OSError whose message says what to do: the scripts print it
as one line, before the model loads.

Required of every environment (what the scripts rely on):
- tasks(split): a non-empty list for "train" and for "eval", disjoint, the same on every call and in every
  copy (torchrun's ranks and a pool's slots each build their own).
- reset(task) -> (str, dict); step(action) -> (str, float, bool, dict). A step may be handed any text
  (empty, huge, binary) and does not raise on it: it flags it (valid_action False) and goes on. Under
  EnvPool (loop.py, t2po.py) a reset or step that raises or hangs anyway ends that episode only (done,
  reward 0, info["error"]); arpo.py calls its one env directly, so there it ends the run. After done, a
  further step returns done True and reward 0 (python -m envs.play may send one).
- reward: loop.py sums the rewards of every step of an episode; t2po.py reads only the reward of the step
  that ends it (done True; an episode cut by --max-turns gets 0); arpo.py plays one step per response
  (reset, then step(the whole response)) and takes that step's reward whatever done says, so an env for
  arpo.py scores a whole response in one step (toy: turns=1; tools: its default multi_turn=False).

info keys a script reads. Each is read with .get, so a missing one never raises: [the default it gets].
- "instruction": str, in every info, reset's and step's alike (the task text). [""]
    loop.py: put before the first observation unless that contains it. t2po.py: the "Task:" line of every
    turn prompt (rollouts take reset's; the expert cold start takes each step's). play prints it.
- "won": bool, True only once the episode is over (done). [False: nothing ever succeeds]
    loop.py, t2po.py: the last step's is the episode's success (success_rate; the cold start keeps only
    won expert episodes; t2po.py --reward success: the reward). arpo.py: the scored step's (success_rate,
    the cold start's filter).
- "task_score": float, in every info: the episode's score so far. [0.0]
    t2po.py: the `score` / `eval/score` metric, from the step that ends the episode.
- "valid_action": bool, in every step's info: False when the env could not use the action. [True]
    t2po.py: `inadmissible_rate` (its format penalty comes from its own parse of <think>/<action>, not from
    this key). play flags the step.
- "admissible_actions": list[str], in reset's and step's info where the env has a list of commands. [none]
    loop.py: "Available actions: a, b" after the first observation and each reply. t2po.py: the
    "Admissible actions" line of each turn prompt ("any text command" without), and --inadmissible-invalid
    makes an action outside the list (case-insensitive) ill-formed (without a list: nothing to check).
    play numbers them.
- "messages": list of {"role": str, "content": str}, the chat to prompt with, in reset's info and in
    step's (arpo.py's cold start builds its prompt from the scored step's info). [one user message: obs]
    arpo.py build_prompt (tools: its system prompt with the tool format, then the question).
- "error": str, set by EnvPool when a reset or step raised or timed out (an env may set it to end an
    episode the same way). [no failure]
    loop.py: the episode stops and is left out of its group's advantage and of training, counted in
    `env_errors`. t2po.py: the episode ends there (at reset: it is not played).
Other keys (textworld's "expert_actions", "lost", "truncated"; webshop-lite's "page"; tools' "f1",
"golden_answers", ...) are for tests, play and readers: no script reads them.

Optional hooks: methods a script looks up with hasattr on the one env `common.run.make_env` built (never
on a pool's copies). `HOOKS` lists their signatures; `require` refuses, in one line, an env without one.
- prepare(tasks) -> None: slow one-off work per task (TextWorld generates and caches its games).
    common/run.py make_env calls it once with every training and held-out task, before the model loads
    (not for --dry-run). Without: that work falls in the first reset, inside EnvPool's step_timeout_s
    (60 s), where a slow one loses its episode.
- game_file(task) -> str: the task's game file (the value is not used).
    loop.py build_envs calls it for every training and held-out task, after prepare. Without: skipped.
- expert_action() -> str: the scripted expert's next action in the current state ('' when it has none).
    loop.py cold start (--cold-start, --cold-start-episodes > 0) plays expert episodes on training tasks
    and fine-tunes on the won ones; without it that cold start is skipped, silently. t2po.py cold start
    (--cold-start-source auto or expert) and --dry-run's prompt lengths replay it, with expert_thought;
    without it: auto samples the policy instead (rejection sampling), expert ends in a one-line flag error
    (after the model has loaded), --dry-run measures first-turn prompts. play's `?` shows it.
- expert_thought(action, long=False) -> str: a short reason for `action` (long=True quotes the task:
    t2po.py --expert-thoughts long, textworld only).
    t2po.py writes each expert turn as `<think>{thought}</think>\\n<action>{action}</action>`. Without it,
    an env that has expert_action makes t2po.py's cold start and --dry-run raise AttributeError: offer
    both or neither.
- expert_demo(question) -> list[tuple[str, int]] | None: the expert's whole response to `question` (reset's
    observation) as (text, policy) segments, policy 1 = written by the expert, 0 = environment output (a
    tool's <result> block, masked from the loss); None = no demonstration for this question.
    arpo.py cold start (--cold-start) scores the joined text with reset + step and fine-tunes on it if won
    and within --max-new-tokens. Without: "[cold start] skipped: no scripted expert ..." and RL starts from
    the model as loaded.
- execute_tool(tag, content) -> str: the output of one tool call, tag "python" or "search" (arpo.py's
    TOOL_TAGS), content non-empty. It runs in the script's own thread, not in a pool: it must not raise.
    arpo.py rollout inserts it as ` <result>\\n{output}\\n</result>` (masked from the loss) and generation
    goes on. Without: every call's result is "error: this environment has no tools" (the toy env of the
    tests).
"""

from __future__ import annotations

import importlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


class Env(Protocol):
    """The three methods every environment has (the contract above); the optional hooks are in HOOKS."""

    def tasks(self, split: str) -> list: ...  # "train" | "eval": disjoint, non-empty, fixed
    def reset(self, task) -> tuple[str, dict]: ...  # (observation, info)
    def step(self, action: str) -> tuple[str, float, bool, dict]: ...  # (observation, reward, done, info)


# The optional hooks (see the module docstring: who calls each, what it returns, what happens without it).
HOOKS = {
    "prepare": "prepare(tasks) -> None",
    "game_file": "game_file(task) -> str",
    "expert_action": "expert_action() -> str",
    "expert_thought": "expert_thought(action, long=False) -> str",
    "expert_demo": "expert_demo(question) -> list[tuple[str, int]] | None",
    "execute_tool": "execute_tool(tag, content) -> str",
}


def require(env, *hooks: str, script: str, why: str, name: str | None = None) -> None:
    """End the run in one line (SystemExit) when `env` lacks an optional hook that `script` needs; `why`:
    what needs it; `name`: the --env it was built from (else its class names it). In a script, before the
    model loads: `require(env, "execute_tool", script="arpo.py", why="ARPO's rollouts call tools",
    name=args.env)`. A hook name not in HOOKS is a programming error: ValueError."""
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown or not hooks:
        raise ValueError(f"require: unknown hook(s) {unknown or '(none given)'}; hooks: {', '.join(HOOKS)}")
    missing = [HOOKS[h] for h in hooks if not callable(getattr(env, h, None))]
    if missing:
        kind = type(env)
        label = f"--env {name!r}" if name else f"the environment {kind.__name__}"
        it = "them" if len(missing) > 1 else "it"
        raise SystemExit(f"{script}: {label} has no {' and no '.join(missing)} ({why}); add {it} to "
                         f"{kind.__name__} in {kind.__module__.replace('.', '/')}.py (envs/base.py says what "
                         f"{it} must return), or use an --env that has {it}")


# name -> factory, or "module:attr" imported on first use, so a missing optional package (textworld,
# alfworld, WebShop, ...) only errors when that environment is asked for.
_REGISTRY: dict[str, Callable[..., Env] | str] = {
    "toy": "envs.toy:make",
    "textworld": "envs.textworld_env:make",
    "alfworld": "envs.alfworld_env:make",
    "webshop": "envs.webshop:make",
    "webshop-lite": "envs.webshop_lite:make",
    "search": "envs.search:make",
    "tools": "envs.tools:make",
    "appworld": "envs.appworld:make",
}


def register(name: str, factory: Callable[..., Env] | str) -> None:
    """Add (or replace) an environment: `factory(**options) -> Env`, or a "module:attr" string."""
    _REGISTRY[name] = factory


def available_envs() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(name: str) -> Callable[..., Env]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; available: {', '.join(available_envs())}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module_name, attr = factory.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:  # the module exists but needs an optional package: let it speak
                raise
            raise ValueError(f"environment {name!r} is registered but its module {module_name} "
                             "is not in this checkout") from None
        factory = getattr(module, attr)
    return factory


def make_env(name: str, **options) -> Env:
    """The registry: `make_env("webshop-lite", seed=0)`. Unknown name -> ValueError listing the names."""
    return _resolve(name)(**options)


def _failed(error: str) -> tuple[str, float, bool, dict]:
    info = {"instruction": "", "won": False, "task_score": 0.0, "valid_action": False, "error": error}
    return f"Episode ended: the environment failed ({error}).", 0.0, True, info


class _Worker:
    """One environment living on its own daemon thread. Calls go through a queue; the caller waits at
    most `timeout` for the answer. A worker that times out is abandoned (daemon: it cannot block exit)."""

    def __init__(self, env: Env | None, make: Callable[[], Env]):
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, args=(env, make), daemon=True)
        self.thread.start()

    def _loop(self, env: Env | None, make: Callable[[], Env]) -> None:
        while (job := self.inbox.get()) is not None:
            method, arg, outbox = job
            try:
                if env is None:  # a replacement for an abandoned worker: built here, failures isolated
                    env = make()
                outbox.put(("ok", getattr(env, method)(arg)))
            except BaseException as e:  # noqa: B036 -- isolate anything the environment throws
                outbox.put(("error", f"{type(e).__name__}: {e}"[:2000]))

    def submit(self, method: str, arg: Any) -> queue.Queue:
        outbox: queue.Queue = queue.Queue(maxsize=1)
        self.inbox.put((method, arg, outbox))
        return outbox


class EnvPool:
    """`n` copies of one environment stepped concurrently, each on its own thread.

    Threads, not processes. Measured on the 2-core dev machine (8 toy envs, 2 kB observations, 300
    batched steps): 0.06 ms per batch stepped serially, 0.8 ms through this thread pool, 1.3 ms through
    one process per env with pipes -- both far below one LLM generation, and threads are cheaper. The
    expensive engines (TextWorld's glulx interpreter, WebShop's Java search index) do their work outside
    the GIL, so threads still overlap them; processes would copy each catalogue / index per worker and
    require picklable options. What a process would add -- killing a hung environment -- we get by
    abandoning its daemon thread and building a fresh environment for the slot's next episode.

    A step that raises or takes longer than `step_timeout_s` ends that episode only: done=True, reward
    0, info["error"] says what happened; the other slots carry on.
    """

    def __init__(self, name: str, n: int, step_timeout_s: float = 60.0, **options):
        factory, self.name = _resolve(name), name
        self.make = lambda: factory(**options)
        self.n, self.step_timeout_s = n, step_timeout_s
        # built here, in the caller's thread: an unknown name or a missing package raises at once
        self.workers = [_Worker(self.make(), self.make) for _ in range(n)]
        self.errors: list[str | None] = [None] * n  # error that ended the slot's current episode

    def _gather(self, calls: list[tuple[int, str, Any]]) -> dict[int, tuple[str, Any]]:
        outboxes = {i: self.workers[i].submit(method, arg) for i, method, arg in calls}
        deadline = time.monotonic() + self.step_timeout_s  # all slots share one deadline: k hung envs
        results = {}                                        # cost one timeout, not k
        for i, outbox in outboxes.items():
            try:
                results[i] = outbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                results[i] = ("error", f"TimeoutError: step took longer than {self.step_timeout_s}s")
                self.workers[i] = _Worker(None, self.make)  # abandon the hung thread; fresh env next episode
        for i, (status, payload) in sorted(results.items()):
            if status == "error":  # the episode ends as a loss: say so, or a failure reads as a bad policy
                print(f"WARNING: {self.name} env {i} failed, its episode ends: {payload}", file=sys.stderr,
                      flush=True)
        return results

    def reset(self, tasks: list) -> list[tuple[str, dict]]:
        assert len(tasks) == self.n, f"EnvPool of {self.n} got {len(tasks)} tasks"
        results = self._gather([(i, "reset", task) for i, task in enumerate(tasks)])
        out = []
        for i in range(self.n):
            status, payload = results[i]
            self.errors[i] = None if status == "ok" else payload
            if status == "ok":
                out.append(payload)
            else:
                obs, _, _, info = _failed(payload)
                out.append((obs, info))
        return out

    def step(self, actions: list[str | None]) -> list[tuple[str, float, bool, dict] | None]:
        assert len(actions) == self.n, f"EnvPool of {self.n} got {len(actions)} actions"
        live = [i for i, a in enumerate(actions) if a is not None and self.errors[i] is None]
        results = self._gather([(i, "step", actions[i]) for i in live])
        out: list[tuple[str, float, bool, dict] | None] = []
        for i, action in enumerate(actions):
            if action is None:
                out.append(None)
            elif self.errors[i] is not None:  # failed at reset, or earlier in this episode
                out.append(_failed(self.errors[i]))
            elif results[i][0] == "ok":
                out.append(results[i][1])
            else:
                self.errors[i] = results[i][1]
                out.append(_failed(self.errors[i]))
        return out

    def close(self) -> None:
        for worker in self.workers:
            worker.inbox.put(None)
