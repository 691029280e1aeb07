"""The environment contract of envs/base.py, checked on every registered environment and on a new one
written in one file and added by one registry line.

`check_tasks`, `check_episode` and `check_hooks` are the contract as code: what reset / step return (types,
info keys, won only when done, the instruction and the chat kept across steps, a step after done), what
each optional hook a script calls returns. Every entry of the registry is checked; webshop, alfworld and
appworld need packages and data that are not installed here and are skipped, with their own message.
"""

import itertools
import math
import os
import re
import textwrap

import pytest

from envs import base
from envs.base import HOOKS, EnvPool, available_envs, make_env, register, require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every name the registry had when this file was collected (its literal lines; tests register more later).
REGISTERED = sorted(name for name, factory in base._REGISTRY.items() if isinstance(factory, str))
NEEDS_PACKAGES = {"webshop", "alfworld", "appworld"}  # the real benchmarks: a package and data set each
OPTIONS = {  # small and fast: at most 2 TextWorld games are generated (cached, as tests/test_textworld.py)
    "textworld": dict(train_games=2, eval_games=1, max_steps=4),
    "webshop-lite": dict(seed=0),
    "search": dict(seed=0),
    "tools": dict(seed=0, python_timeout_s=5),
}
GARBAGE = ["", "zzz qqq", "x" * 20_000, "\x00\x7f\ud800 take", "<answer>", "click[nothing]"]  # no env wins
REQUIRED_INFO = {"instruction": str, "won": bool, "task_score": (int, float), "valid_action": bool}


def build(name: str):
    try:
        return make_env(name, **OPTIONS.get(name, {}))
    except (RuntimeError, ImportError, OSError, ValueError) as e:
        if name in NEEDS_PACKAGES:
            pytest.skip(f"{name}: {str(e).splitlines()[0]}")
        if name == "tools" and "isolat" in str(e):  # the sandbox refuses to run python on this machine
            pytest.skip(f"tools: {str(e).splitlines()[0]}")
        raise


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- the contract, as checks ----

def check_tasks(name: str, env) -> tuple[list, list]:
    train, evaluation = env.tasks("train"), env.tasks("eval")
    assert isinstance(train, list) and isinstance(evaluation, list), "tasks(split) returns a list"
    assert train and evaluation, "both splits have tasks"
    assert not set(map(repr, train)) & set(map(repr, evaluation)), "held-out tasks are not training tasks"
    assert env.tasks("train") == train, "the same list on every call"
    copy = make_env(name, **OPTIONS.get(name, {}))  # a pool slot or another rank builds its own
    assert (copy.tasks("train"), copy.tasks("eval")) == (train, evaluation), "the same list in every copy"
    return train, evaluation


def check_info(info, first: dict | None = None) -> None:
    assert isinstance(info, dict), f"info is a dict, got {type(info).__name__}"
    for key, kind in REQUIRED_INFO.items():
        assert isinstance(info.get(key), kind), f"info[{key!r}] is {kind}, got {info.get(key)!r:.80}"
    assert math.isfinite(info["task_score"]) and not isinstance(info["task_score"], bool)
    if "admissible_actions" in info:
        actions = info["admissible_actions"]
        assert isinstance(actions, list) and all(isinstance(a, str) for a in actions), "a list of str"
    if "messages" in info:
        assert isinstance(info["messages"], list) and info["messages"], "messages: a non-empty chat"
        for m in info["messages"]:
            assert isinstance(m.get("role"), str) and isinstance(m.get("content"), str), f"{m!r:.80}"
    if "error" in info:
        assert isinstance(info["error"], str)
    if first is not None:  # a step's info, against reset's
        assert info["instruction"] == first["instruction"], "the same instruction in every info"
        if "messages" in first:
            assert info.get("messages") == first["messages"], "the step's info keeps the chat (arpo.py)"


def check_reset(env, task) -> tuple[str, dict]:
    result = env.reset(task)
    assert isinstance(result, tuple) and len(result) == 2, "reset returns (observation, info)"
    obs, info = result
    assert isinstance(obs, str), "the observation is text"
    check_info(info)
    assert not info["won"], "nothing is won before the first step"
    if "messages" in info:
        assert any(obs in m["content"] for m in info["messages"]), "the chat holds the observation"
    return obs, info


def check_step(result, first: dict) -> tuple[str, float, bool, dict]:
    assert isinstance(result, tuple) and len(result) == 4, "step returns (observation, reward, done, info)"
    obs, reward, done, info = result
    assert isinstance(obs, str), "the observation is text"
    assert is_number(reward), f"the reward is a finite number, got {reward!r}"
    assert isinstance(done, bool), f"done is a bool, got {done!r}"
    check_info(info, first)
    assert done or not info["won"], "won only once the episode is over"
    return result


def check_episode(env, task, policy, max_steps: int = 30) -> tuple[float, bool, bool]:
    """Play `task` with policy(env, obs, info) -> action; (sum of rewards, won, done). After done, one more
    step: done again, reward 0."""
    obs, first = check_reset(env, task)
    info, total, done = first, 0.0, False
    for _ in range(max_steps):
        obs, reward, done, info = check_step(env.step(policy(env, obs, info)), first)
        total += reward
        if done:
            _, again, still, _ = check_step(env.step("look"), first)
            assert still and again == 0.0, "a step after done: done, reward 0"
            break
    return total, info["won"], done


def check_hooks(env, task) -> list[str]:
    """Call every optional hook `env` has as its script would; each returns what envs/base.py says."""
    present = [h for h in HOOKS if callable(getattr(env, h, None))]
    if "prepare" in present:
        assert env.prepare([task]) is None
    if "game_file" in present:
        path = env.game_file(task)
        assert isinstance(path, str) and os.path.isfile(path), f"game_file: a file, got {path!r}"
    obs, _ = env.reset(task)
    if "expert_action" in present:
        action = env.expert_action()
        assert isinstance(action, str), "expert_action() -> str"
        if "expert_thought" in present:
            assert isinstance(env.expert_thought(action), str), "expert_thought(action) -> str"
            assert isinstance(env.expert_thought(action, long=False), str)
    if "expert_demo" in present:
        demo = env.expert_demo(obs)
        assert demo is None or isinstance(demo, list), "expert_demo(question) -> list | None"
        for segment in demo or []:
            text, policy = segment
            assert isinstance(text, str) and policy in (0, 1), f"a (text, 0 | 1) segment, got {segment!r:.80}"
    if "execute_tool" in present:
        for tag, content in [("python", "print(6 * 7)"), ("search", "city population"), ("nope", "x"),
                             ("python", "raise SystemExit(3)"), ("python", "\x00")]:
            assert isinstance(env.execute_tool(tag, content), str), "execute_tool -> str, never raises"
    return present


# ---- the policies that win each registered offline env (for a new one: its expert, if it has one) ----

def expert(env, obs, info):
    return env.expert_action()


def tools_expert(env, obs, info):  # arpo.py's cold start: the whole demonstration as one response
    return "".join(text for text, _ in env.expert_demo(obs))


WINNERS = {
    "toy": lambda env, obs, info: "a b c d",  # 3 spaces in 7 characters, every turn: won (>= 0.25)
    "textworld": expert,
    "webshop-lite": expert,
    "search": lambda env, obs, info: f"<answer>{info['golden_answers'][0]}</answer>",
    "tools": tools_expert,
}


def winnable_task(name: str, env, train: list):
    if name == "tools":  # the expert reads some question forms only
        return next(t for t in train[:20] if env.expert_demo(env.reset(t)[0]) is not None)
    return train[0]


def garbage():
    """A policy writing text no environment can use, a different one each step: empty, nonsense, huge,
    binary, unclosed."""
    calls = itertools.count()
    return lambda env, obs, info: GARBAGE[next(calls) % len(GARBAGE)]


def check_environment(name: str, env) -> list[str]:
    """The whole contract on one env: its tasks, a won and a garbage episode, its hooks. Returns the hooks."""
    train, evaluation = check_tasks(name, env)
    winner = WINNERS.get(name) or (expert if callable(getattr(env, "expert_action", None)) else None)
    task = winnable_task(name, env, train)
    if winner is not None:
        won_total, won, done = check_episode(env, task, winner)
        assert done and won, f"{name}: the winning policy wins"
    lost_total, lost, _ = check_episode(env, task, garbage(), max_steps=12)
    assert not lost, f"{name}: garbage does not win"
    if winner is not None:
        assert won_total > lost_total, "a won episode earns more reward than garbage"
    check_episode(env, evaluation[0], garbage(), max_steps=2)  # a held-out task plays too
    # the same task in another copy starts the same way (pools and ranks)
    assert make_env(name, **OPTIONS.get(name, {})).reset(task)[0] == env.reset(task)[0]
    return check_hooks(env, task)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "textworld" else n
                                  for n in REGISTERED])  # textworld's first run generates 2 games (~15 s)
def test_registered_env_meets_the_contract(name):
    env = build(name)
    hooks = check_environment(name, env)
    # the hooks each offline env offers (a regression guard: the scripts' cold starts depend on them)
    expected = {"toy": [], "textworld": ["prepare", "game_file", "expert_action", "expert_thought"],
                "webshop-lite": ["expert_action", "expert_thought"], "search": [],
                "tools": ["expert_demo", "execute_tool"]}
    if name in expected:
        assert hooks == expected[name]


def test_the_contract_covers_the_offline_envs():
    assert {"toy", "textworld", "webshop-lite", "tools", "search"} | NEEDS_PACKAGES <= set(REGISTERED)


def test_tools_execute_tool_output():
    env = build("tools")
    assert env.execute_tool("python", "print(6 * 7)").strip() == "42"
    assert "unknown tool" in env.execute_tool("nope", "x")


# ---- the checks catch a broken env (else they would prove nothing) ----

class Counter:
    """Guess the task's number: `step("3")`. Won when right; 3 tries."""

    def __init__(self, seed: int = 0, tries: int = 3):
        self.seed, self.tries, self.target, self.left, self.over = seed, tries, None, 0, True

    def tasks(self, split):
        return list(range(5)) if split == "train" else list(range(5, 7))

    def info(self, won=False, valid=True):
        return {"instruction": "Guess the number.", "won": won, "task_score": float(won),
                "valid_action": valid, "admissible_actions": [str(n) for n in range(10)]}

    def reset(self, task):
        self.target, self.left, self.over = task % 10, self.tries, False
        return "Guess a number from 0 to 9.", self.info()

    def step(self, action):
        if self.over:
            return "Over; call reset.", 0.0, True, self.info(valid=False)
        self.left -= 1
        valid = action.strip() in self.info()["admissible_actions"]
        won = valid and int(action) == self.target
        self.over = won or self.left == 0
        return ("Right." if won else "Wrong."), float(won), self.over, self.info(won, valid)

    def expert_action(self):
        return str(self.target)

    def expert_thought(self, action, long=False):
        return f"The number is {action}."


def broken_step(env: Counter, breakage: str):
    """Counter.step with one part of the contract broken."""
    def step(action):
        was_over = env.over
        obs, reward, done, info = Counter.step(env, action)
        if breakage == "step returns a list":
            return [obs, reward, done, info]
        if breakage == "reward is text":
            reward = str(reward)
        elif breakage == "done is an int":
            done = int(done)
        elif breakage == "won before done":
            done = False
        elif breakage == "a step after done goes on":
            done = done and not was_over
        elif breakage == "reward after done":
            reward = 1.0 if was_over else reward
        elif breakage in ("instruction", "won", "task_score", "valid_action"):
            info.pop(breakage)
        elif breakage == "instruction changes":
            info["instruction"] += " Now."
        elif breakage == "admissible actions are not text":
            info["admissible_actions"] = [1, 2]
        elif breakage == "won is 1.0":
            info["won"] = float(info["won"])
        return obs, reward, done, info
    return step


BREAKAGES = ["step returns a list", "reward is text", "done is an int", "won before done",
             "a step after done goes on", "reward after done", "instruction", "won", "task_score",
             "valid_action", "instruction changes", "admissible actions are not text", "won is 1.0"]


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_checks_catch_a_broken_env(breakage):
    env = Counter()
    assert check_episode(env, 3, expert) == (1.0, True, True)  # unbroken: it passes
    env.step = broken_step(env, breakage)
    with pytest.raises(AssertionError):
        check_episode(env, 3, expert)


def test_the_checks_catch_broken_tasks_and_hooks():
    overlap = type("Overlap", (Counter,), {"tasks": lambda self, split: [1, 2]})
    register("counter-bad-tasks", lambda **kw: overlap(**kw))
    with pytest.raises(AssertionError, match="held-out"):
        check_tasks("counter-bad-tasks", make_env("counter-bad-tasks"))
    register("counter-bad-hook", lambda **kw: type("NoThought", (Counter,), {
        "expert_thought": lambda s, action, long=False: None})())
    with pytest.raises(AssertionError, match="expert_thought"):
        check_hooks(make_env("counter-bad-hook"), 3)


# ---- a new environment: one file, one registry line ----

NEW_ENV_FILE = '''
"""`guess`: guess the task's number in three tries (a new environment in one file)."""


class GuessEnv:
    def __init__(self, seed: int = 0, tries: int = 3):
        self.seed, self.tries, self.target, self.left, self.over = seed, tries, 0, 0, True

    def tasks(self, split: str) -> list[int]:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
        return list(range(8)) if split == "train" else list(range(8, 10))

    def info(self, won: bool = False, valid: bool = True) -> dict:
        return {"instruction": "Guess the number from 0 to 9.", "won": won, "task_score": float(won),
                "valid_action": valid, "admissible_actions": [str(n) for n in range(10)]}

    def reset(self, task) -> tuple[str, dict]:
        self.target, self.left, self.over = (task * 7 + self.seed) % 10, self.tries, False
        return "Which number?", self.info()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.over:
            return "The episode is over; call reset.", 0.0, True, self.info(valid=False)
        self.left -= 1
        valid = isinstance(action, str) and action.strip() in self.info()["admissible_actions"]
        won = valid and int(action) == self.target
        self.over = won or self.left == 0
        hint = "Right." if won else ("Higher." if valid and int(action) < self.target else "Lower.")
        return hint, float(won), self.over, self.info(won, valid)

    def expert_action(self) -> str:
        return str(self.target)

    def expert_thought(self, action: str, long: bool = False) -> str:
        return f"I remember the number: {action}."


def make(**options) -> GuessEnv:
    return GuessEnv(**options)
'''


@pytest.fixture
def guess_env(tmp_path, monkeypatch):
    """The new environment: its one file, and its one registry line (the same "module:attr" string a line
    in envs/base.py's _REGISTRY holds, resolved the same way)."""
    (tmp_path / "guess_env.py").write_text(textwrap.dedent(NEW_ENV_FILE))
    monkeypatch.syspath_prepend(str(tmp_path))
    register("guess", "guess_env:make")  # <- the one line
    yield "guess"
    base._REGISTRY.pop("guess")


def test_a_new_env_in_one_file_meets_the_contract_and_is_found_by_name(guess_env, capsys):
    assert "guess" in available_envs()
    env = make_env("guess", seed=1)
    assert type(env).__module__ == "guess_env"
    assert check_environment("guess", env) == ["expert_action", "expert_thought"]
    # ... by the pool the scripts play in
    pool = EnvPool("guess", 2, seed=1)
    pool.reset([0, 3])
    assert [r[1:3] for r in pool.step(["1", "2"])] == [(1.0, True), (1.0, True)]  # (0*7+1)%10, (3*7+1)%10
    pool.close()
    # ... by the scripts' set-up (common.run.make_env: the run's seed, --env-options, the task lists)
    from common import run

    args = type("Args", (), dict(env="guess", env_options='{"tries": 2}', seed=4, eval_tasks=1,
                                 tasks_per_step=2))()
    env, options, train, held_out = run.make_env(args)
    assert options == {"seed": 4, "tries": 2} and (env.seed, env.tries) == (4, 2) and held_out == [8]
    # ... and by python -m envs.play, whose `?` asks the expert
    from envs.play import main

    lines, out = iter(["?", "4", "quit"]), []
    argv = ["guess", "--split", "train", "--task", "0", "--seed", "4"]  # task 0: the number (0 * 7 + 4) % 10
    assert main(argv, read=lambda _: next(lines), write=out.append) == [1.0]
    assert "expert: 4" in out


def test_registry_lines_name_a_module_of_envs_with_its_factory():
    for name in REGISTERED:
        module, attr = base._REGISTRY[name].split(":")
        path = os.path.join(ROOT, *module.split(".")) + ".py"
        assert module.startswith("envs.") and os.path.isfile(path), f"{name}: {path}"
        with open(path) as f:
            assert re.search(rf"^def {attr}\(\*\*options\)", f.read(), re.M), f"{name}: def {attr}(**options)"


# ---- require: a script refuses an env without a hook it needs, in one line ----

def test_require_passes_an_env_that_has_the_hooks():
    env = Counter()
    assert require(env, "expert_action", script="t2po.py", why="x") is None
    assert require(env, "expert_action", "expert_thought", script="t2po.py", why="x", name="c") is None


def test_require_refuses_in_one_line_naming_env_hook_and_what_to_do():
    env = make_env("toy")
    with pytest.raises(SystemExit) as e:
        require(env, "execute_tool", script="arpo.py", why="ARPO's rollouts call tools", name="toy")
    message = str(e.value.code)
    assert "\n" not in message
    assert message.startswith("arpo.py: --env 'toy' has no execute_tool(tag, content) -> str (ARPO's "
                              "rollouts call tools); add it to ToyEnv in envs/toy.py")
    assert "or use an --env that has it" in message


def test_require_names_every_missing_hook_and_the_class_without_a_name():
    class OnlyActs(Counter):
        expert_thought = None  # not callable: missing

    with pytest.raises(SystemExit) as e:
        require(OnlyActs(), "expert_action", "expert_thought", "expert_demo", script="t2po.py",
                why="--cold-start-source expert")
    message = str(e.value.code)
    assert "the environment OnlyActs has no expert_thought(action, long=False) -> str and no expert_demo(" \
           in message and "expert_action()" not in message and "add them to OnlyActs" in message


def test_require_rejects_a_hook_name_it_does_not_know():
    with pytest.raises(ValueError, match="expert_actions"):
        require(Counter(), "expert_actions", script="loop.py", why="x")
    with pytest.raises(ValueError):
        require(Counter(), script="loop.py", why="x")


# ---- the documentation names everything the scripts read ----

SCRIPTS = ["loop.py", "arpo.py", "t2po.py", "envs/play.py"] + [
    os.path.join("common", f) for f in sorted(os.listdir(os.path.join(ROOT, "common"))) if f.endswith(".py")]


def read_scripts() -> str:
    text = ""
    for path in SCRIPTS:
        with open(os.path.join(ROOT, path)) as f:
            text += f.read()
    return text


def test_every_hook_a_script_uses_is_in_hooks_and_documented():
    text = read_scripts()
    # the scripts reach the environment as `env` or, since the shared skeleton, as `envs.env` (Envs)
    used = set(re.findall(r"(?:hasattr|getattr)\((?:envs\.)?env, [\"'](\w+)[\"']", text))
    used |= set(re.findall(r"(?<![\w.])(?:envs\.)?env\.(\w+)", text))
    assert {"expert_action", "expert_thought", "expert_demo", "execute_tool", "game_file", "prepare"} <= used
    assert used - {"tasks", "reset", "step"} <= set(HOOKS), "a hook the scripts use is missing from HOOKS"
    for signature in HOOKS.values():
        assert f"\n- {signature}" in base.__doc__, f"envs/base.py documents {signature}"


def test_every_info_key_a_script_reads_is_documented():
    text = read_scripts()
    keys = set(re.findall(r"(?<![\w.])(?:info|infos\[i\]|i)\.get\([\"'](\w+)[\"']", text))
    keys |= set(re.findall(r"(?<![\w.])info\[[\"'](\w+)[\"']\]", text))
    assert {"instruction", "won", "task_score", "valid_action", "admissible_actions", "messages",
            "error"} <= keys
    for key in keys:
        assert f'\n- "{key}":' in base.__doc__, f"envs/base.py documents info[{key!r}]"
