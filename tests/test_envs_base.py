import time

import pytest

from envs.base import EnvPool, available_envs, make_env, register
from envs.toy import ToyEnv

CONTRACT_NAMES = ["toy", "textworld", "webshop-lite", "webshop", "alfworld", "search", "tools", "appworld"]


def test_registry_lists_all_contract_names():
    assert set(CONTRACT_NAMES) <= set(available_envs())


def test_unknown_env_error_lists_available_names():
    with pytest.raises(ValueError) as e:
        make_env("no-such-env")
    for name in CONTRACT_NAMES:
        assert name in str(e.value)


def test_register_and_options_reach_factory():
    register("toy-3", lambda **kw: ToyEnv(turns=3, **kw))
    env = make_env("toy-3", seed=5)
    assert env.turns == 3 and env.seed == 5
    register("toy-lazy", "envs.toy:make")
    assert make_env("toy-lazy", turns=4).turns == 4


class FlakyEnv(ToyEnv):
    """Toy env whose task decides how it misbehaves: "crash" raises on step, "hang" never returns."""

    def reset(self, task=0):
        self.task = task
        return super().reset(task)

    def step(self, action):
        if self.task == "crash":
            raise RuntimeError("boom")
        if self.task == "hang":
            time.sleep(3600)
        return super().step(action)


register("flaky", lambda **kw: FlakyEnv(**kw))


def test_pool_isolates_crashing_and_hanging_env():
    pool = EnvPool("flaky", 8, step_timeout_s=0.5, turns=2)
    tasks = [0, 1, "crash", 3, 4, "hang", 6, 7]
    assert [obs for obs, _ in pool.reset(tasks)] == ["Turn 1 of 2: write some words."] * 8
    start = time.monotonic()
    first = pool.step(["a b"] * 8)
    assert time.monotonic() - start < 2.0  # the hung env costs one timeout, not an hour
    for i in (2, 5):
        obs, reward, done, info = first[i]
        assert done and reward == 0.0 and not info["won"]
    assert "RuntimeError: boom" in first[2][3]["error"]
    assert "TimeoutError" in first[5][3]["error"]
    assert all(not first[i][2] and "error" not in first[i][3] for i in (0, 1, 3, 4, 6, 7))
    # the seven healthy episodes finish; failed slots are skipped by the caller (None)
    second = pool.step([None if i in (2, 5) else "abcd" for i in range(8)])
    assert second[2] is None and second[5] is None
    for i in (0, 1, 3, 4, 6, 7):
        _, reward, done, info = second[i]
        assert done and abs(reward - (1 / 3) / 2) < 1e-12  # ("a b": 1/3, "abcd": 0) / 2 turns


def test_pool_failed_slot_stays_done_and_recovers_next_episode():
    pool = EnvPool("flaky", 2, step_timeout_s=0.3, turns=1)
    pool.reset(["hang", 0])
    pool.step(["a", "a"])
    obs, reward, done, info = pool.step(["a", None])[0]  # stepping a failed slot again: still failed
    assert done and reward == 0.0 and "TimeoutError" in info["error"]
    pool.reset([0, 0])  # the hung slot got a fresh environment
    results = pool.step([" a", " a"])
    assert [r[1] for r in results] == [0.5, 0.5]


def test_pool_reset_crash_is_reported_not_raised(capsys):
    class BadReset(ToyEnv):
        def reset(self, task=0):
            raise OSError("no data")

    register("bad-reset", lambda **kw: BadReset(**kw))
    pool = EnvPool("bad-reset", 2, step_timeout_s=1.0)
    obs, info = pool.reset([0, 1])[0]
    assert "OSError: no data" in info["error"]
    # said on stderr, once per failed episode: an episode lost to the environment is not silently a loss
    assert capsys.readouterr().err.splitlines() == [
        f"WARNING: bad-reset env {i} failed, its episode ends: OSError: no data" for i in (0, 1)]
    assert pool.step(["x", "x"])[1][2] is True
    assert capsys.readouterr().err == ""  # the failed slots are not stepped again


def test_run_make_env_prepares_every_task_before_play():
    from common import run

    prepared = []

    class Prepared(ToyEnv):
        def prepare(self, tasks):
            prepared.append(tasks)

    register("prepared", lambda **kw: Prepared(**kw))
    args = type("Args", (), dict(env="prepared", env_options="{}", seed=0, eval_tasks=2, tasks_per_step=1))()
    _, _, train_tasks, eval_tasks = run.make_env(args)
    assert len(eval_tasks) == 2 and prepared == [train_tasks + eval_tasks]


def test_play_toy_from_scripted_input():
    from envs.play import main

    lines = iter(["a b", "abcd", "quit"])
    out = []
    assert main(["toy"], read=lambda _: next(lines), write=out.append) == [(1 / 3) / 2]
    assert out[0].startswith("Task: Write some words.")


def test_play_webshop_lite_following_the_expert_hint():
    from envs.play import main

    out, asked = [], [False]

    def read(_):  # alternate "?" and the expert's suggestion until the episode is over
        if any(line.startswith("Episode over") for line in out) or len(out) > 500:
            return "quit"
        asked[0] = not asked[0]
        hints = [line for line in out if line.startswith("expert: ")]
        return "?" if asked[0] else hints[-1].removeprefix("expert: ")

    assert main(["webshop-lite", "--seed", "0", "--task", "3"], read=read, write=out.append) == [1.0]
    assert any("won True" in line for line in out)


def test_play_unknown_env_exits_with_names(capsys):
    from envs.play import main

    with pytest.raises(SystemExit):
        main(["nope"])
    assert "webshop-lite" in capsys.readouterr().err


def test_pool_setup_errors_raise_in_the_caller():
    def broken(**_):
        raise RuntimeError("needs data: run the download command")

    register("broken", broken)
    with pytest.raises(RuntimeError, match="download command"):
        EnvPool("broken", 4)
    with pytest.raises(ValueError, match="available"):
        EnvPool("no-such-env", 4)


def test_pool_steps_run_concurrently():
    class Slow(ToyEnv):
        def step(self, action):
            time.sleep(0.3)
            return super().step(action)

    register("slow", lambda **kw: Slow(**kw))
    pool = EnvPool("slow", 8, step_timeout_s=5.0, turns=1)
    pool.reset(list(range(8)))
    start = time.monotonic()
    assert all(r[2] for r in pool.step(["a"] * 8))
    assert time.monotonic() - start < 1.2  # 8 x 0.3 s one after another would be 2.4 s
    pool.close()
