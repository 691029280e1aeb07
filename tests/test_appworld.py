"""`appworld`: what runs offline (prompt, code extraction, truncation, reward from an evaluation result,
the one-world-per-process plumbing), and the real AppWorld when the package and its data are present."""

import os
import time
from types import SimpleNamespace

import pytest

from envs import appworld
from envs.appworld import REACT_PROMPT, extract_code, reward_from_evaluation, truncate_output
from envs.base import make_env


def test_extract_code_joins_python_blocks():
    response = ("I will log in first.\n```python\nx = 1\n```\nthen print:\n```python\nprint(x)\n```\n"
                "```bash\nls\n```")
    assert extract_code(response) == "x = 1\nprint(x)"  # the bash block is ignored
    assert extract_code("no code here") is None
    assert extract_code("```python\n   \n```") is None  # an empty block is no code
    assert extract_code("```python\nprint(1)") is None  # unclosed


def test_truncate_output_at_3000_tokens():
    text = "line\n" * 5000  # 25 000 characters: over 3000 tokens at ~4 characters per token
    # the first 12 000 characters are 2400 whole lines; the cut drops the trailing newline
    assert truncate_output(text) == "line\n" * 2399 + "line" + "\n[output truncated at 3000 tokens]"
    assert truncate_output("short") == "short"


def test_reward_from_evaluation_result():
    as_dict = {"success": False, "difficulty": 1, "num_tests": 4, "passes": [{}, {}, {}], "failures": [{}]}
    assert reward_from_evaluation(as_dict) == (0.75, False)
    tracker = SimpleNamespace(pass_count=4, num_tests=4, success=True)
    assert reward_from_evaluation(tracker) == (1.0, True)
    assert reward_from_evaluation(SimpleNamespace(pass_count=0, num_tests=0, success=False)) == (0.0, False)


def test_react_prompt_holds_task_and_supervisor():
    text = REACT_PROMPT.format(instruction="Like my last song.", first_name="Joyce", last_name="Weaver",
                               email="j@x.com", phone="3155673041")
    assert text.endswith("Task: Like my last song.") and "Joyce Weaver (j@x.com, phone 3155673041)" in text
    assert "```python" in text and "apis.supervisor.complete_task(" in text


def test_missing_package_or_data_is_one_clear_error(tmp_path):
    why = appworld.availability_error(str(tmp_path))  # an empty folder has no data/
    assert "pip install appworld" in why and "appworld download data" in why
    if appworld.availability_error() is None:
        pytest.skip("AppWorld is installed with data here")
    with pytest.raises(RuntimeError, match="appworld install"):
        make_env("appworld")


# --- the worker process, with a stand-in world (AppWorld itself needs data we do not have offline) ----


class StandInWorld:
    """Just enough of AppWorld's surface to exercise the adapter's process plumbing."""

    def __init__(self, task_id: str, experiment_name: str):
        self.task = SimpleNamespace(instruction=f"do {task_id}", supervisor=SimpleNamespace(
            first_name="Ann", last_name="Lee", email="a@b.c", phone_number="1"))
        self.experiment_name, self.code = experiment_name, []

    def execute(self, code: str) -> str:
        self.code.append(code)
        if "hang" in code:
            time.sleep(60)
        return f"pid={os.getpid()} experiment={self.experiment_name}"

    def task_completed(self) -> bool:
        return any("apis.supervisor.complete_task" in c for c in self.code)

    def evaluate(self):
        right = sum("right" in c for c in self.code)
        return SimpleNamespace(pass_count=min(right, 2), num_tests=2, success=right >= 2)

    def close(self):
        pass


def stand_in_task_ids(split: str) -> list[str]:
    return [f"{split}_{i}" for i in range(3)]


@pytest.fixture
def env():
    e = make_env("appworld", world_factory="tests.test_appworld:StandInWorld",
                 task_ids_fn="tests.test_appworld:stand_in_task_ids", max_turns=3, step_timeout_s=20)
    yield e
    e.close()


def code(s: str) -> str:
    return f"Thought.\n```python\n{s}\n```"


def test_worker_process_and_distinct_experiments(env):
    assert env.tasks("train") == ["train_0", "train_1", "train_2"] and env.tasks("eval")[0] == "dev_0"
    obs, info = env.reset("train_0")
    assert obs.endswith("Task: do train_0") and info["instruction"] == "do train_0"
    out1, r, done, info = env.step(code("print(1)"))
    assert not done and r == 0.0 and info["valid_action"]
    pid, exp1 = out1.split()[0], out1.split()[1]
    assert pid != f"pid={os.getpid()}"  # the world lives in another process
    env.reset("train_0")
    out2, *_ = env.step(code("print(1)"))
    assert out2.split()[1] != exp1 and out2.split()[0] == pid  # same worker, fresh experiment name


def test_complete_task_ends_with_test_pass_fraction(env):
    env.reset("train_1")
    _, r, done, _ = env.step(code("right = 1"))
    assert not done
    _, r, done, info = env.step(code("apis.supervisor.complete_task()"))
    assert done and r == 0.5 and not info["won"]  # 1 of 2 tests


def test_turn_limit_and_invalid_action(env):
    env.reset("train_2")
    obs, r, done, info = env.step("I forgot the code block")
    assert obs.startswith("No code found") and not info["valid_action"] and not done
    env.step(code("right = 1"))
    _, r, done, info = env.step(code("right = 2"))  # turn 3 of 3: evaluated without complete_task
    assert done and r == 1.0 and info["won"]
    assert env.step(code("x"))[2] and not env.step(code("x"))[3]["valid_action"]


def test_hung_world_ends_the_episode_and_the_next_starts_fresh():
    e = make_env("appworld", world_factory="tests.test_appworld:StandInWorld",
                 task_ids_fn="tests.test_appworld:stand_in_task_ids", step_timeout_s=2)
    try:
        e.reset("t")
        t0 = time.time()
        obs, r, done, info = e.step(code("hang()"))
        assert done and r == 0.0 and "did not answer" in info["error"] and time.time() - t0 < 10
        obs, info = e.reset("t")  # a new worker process
        assert e.step(code("print(1)"))[0].startswith("pid=")
    finally:
        e.close()


def slow_start_world(task_id: str, experiment_name: str) -> StandInWorld:
    time.sleep(3)  # longer than the step timeout below, as a slow import of AppWorld would take
    return StandInWorld(task_id, experiment_name)


def test_a_fresh_worker_s_first_command_also_gets_time_to_start():
    # on a busy machine a spawned interpreter takes seconds to start: not the command's time
    e = make_env("appworld", world_factory="tests.test_appworld:slow_start_world",
                 task_ids_fn="tests.test_appworld:stand_in_task_ids", step_timeout_s=2)
    try:
        assert e.reset("t")[1]["task_id"] == "t"  # the first command of a new worker: 2 + 60 s
        t0 = time.time()
        obs, r, done, info = e.step(code("hang()"))  # a started worker: 2 s
        assert done and "within 2 s" in info["error"] and time.time() - t0 < 10
    finally:
        e.close()


def test_real_appworld_when_available():
    why = appworld.availability_error()
    if why:
        pytest.skip(why.splitlines()[0])
    e = make_env("appworld", max_turns=2)
    try:
        task = e.tasks("train")[0]
        obs, info = e.reset(task)
        assert info["instruction"] in obs
        obs, r, done, info = e.step(code("print(apis.api_docs.show_app_descriptions())"))
        assert "spotify" in obs.lower()
        obs, r, done, info = e.step(code("apis.supervisor.complete_task()"))
        assert done and 0.0 <= r < 1.0
    finally:
        e.close()
