"""TextWorld env: the real engine on generated games (cached under $AGENTIC_RL_CACHE, so reruns are fast).

First run generates 6 games (a few seconds each); later runs reuse them.
"""

import hashlib
import json
import os
import random
import re
import subprocess
import sys

import pytest

textworld = pytest.importorskip("textworld", reason="textworld is not installed (pip install textworld)")

from envs.textworld_env import (  # noqa: E402
    EVAL_SEED_OFFSET,
    challenge_settings,
    clean_feedback,
    generate_game,
    make,
    parse_command,
)

ADMISSIBLE = ["examine coin", "go south", "inventory", "look", "take coin"]

# Recorded from the engine: TextWorld's reset feedback with its ASCII-art title and status bar.
RECORDED_RESET = (
    "\n\n\n                    ________  ________  __    __  ________        \n"
    "                   |        \\|        \\|  \\  |  \\|        \\       \n"
    "                    \\$$$$$$$$| $$$$$$$$| $$  | $$ \\$$$$$$$$       \n"
    "              \\$$      \\$$  \\$$$$$$  \\$$   \\$$ \\$$$$$$$$ \\$$$$$$$ \n\n"
    "Your objective is to retrieve the coin from the floor of the cellar.\n\n"
    "-= Cellar =-\nYou find yourself in a cellar. An usual one.\n\n\n\nThere is a coin on the floor.\n\n"
    ">                                                                -= Cellar =-0/1\n"
)
RECORDED_WIN = (
    "You pick up the coin from the ground.\n\n\n\nYour score has just gone up by one point.\n\n\n"
    "                                                       *** The End ***\n\n"
    "You scored 1 out of a possible 1, in 2 turns.\n\n\n"
    "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?"
)


def test_parse_command_matches_admissible_after_normalizing():
    assert parse_command("take coin", ADMISSIBLE) == ("take coin", "")
    assert parse_command("  Take   COIN. ", ADMISSIBLE) == ("take coin", "")
    assert parse_command("'go south'", ADMISSIBLE) == ("go south", "")
    assert parse_command("Command: take coin", ADMISSIBLE) == ("take coin", "")
    assert parse_command("> look", ADMISSIBLE) == ("look", "")
    assert parse_command("command: action: look", ADMISSIBLE)[0] is None  # one label only


@pytest.mark.parametrize("action, reason", [
    ("", "empty"),
    ("   \n\t", "empty"),
    ("x" * (1 << 20), "1048576 characters"),
    ("take\x00coin", "not plain printable"),
    ("tàke coin", "not plain printable"),
    ("go west", "'go west' is not an admissible command"),
    ("take coin\nlook", "'take coin look' is not an admissible command"),
    (None, "must be text"),
    (12, "must be text"),
])
def test_parse_command_rejects_with_reason(action, reason):
    command, error = parse_command(action, ADMISSIBLE)
    assert command is None
    assert reason in error


def test_parse_command_fuzz_never_raises():
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz .'\"\n\t\x00\x7f\xff\u2603<>[]"
    for _ in range(3000):
        kind = rng.random()
        if kind < 0.3:  # admissible commands with random case / spacing noise
            base = rng.choice(ADMISSIBLE)
            action = "".join(c.upper() if rng.random() < 0.3 else c for c in base) + " " * rng.randint(0, 3)
        elif kind < 0.6:
            action = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        else:
            action = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300))).decode("latin-1")
        command, error = parse_command(action, ADMISSIBLE)
        if command is None:
            assert error
        else:
            assert command in ADMISSIBLE and error == ""
            spaced = " ".join(action.lower().split())
            assert re.sub(r"^(>|command:|action:) ?", "", spaced).strip(" .'\"`") == command


def test_clean_feedback_on_recorded_text():
    assert clean_feedback(RECORDED_RESET) == (
        "Your objective is to retrieve the coin from the floor of the cellar.\n\n"
        "-= Cellar =-\nYou find yourself in a cellar. An usual one.\n\nThere is a coin on the floor."
    )
    assert clean_feedback(RECORDED_WIN) == (
        "You pick up the coin from the ground.\n\nYour score has just gone up by one point.\n\n"
        "*** The End ***\n\nYou scored 1 out of a possible 1, in 2 turns."
    )


def test_settings_and_splits():
    assert challenge_settings("tw-coin_collector", 3, 0) == {"level": 3}
    assert challenge_settings("simple", 1, 0) == {"rewards": "dense", "goal": "detailed", "test": False}
    with pytest.raises(ValueError, match="choose one of"):
        challenge_settings("zork", 1, 0)
    with pytest.raises(ValueError, match="levels are 1..30"):
        challenge_settings("treasure_hunter", 31, 0)
    env = make(train_games=5, eval_games=3)
    assert env.tasks("train") == [0, 1, 2, 3, 4]
    assert env.tasks("eval") == [1_000_000, 1_000_001, 1_000_002]
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("test")
    with pytest.raises(ValueError, match="integer seeds"):
        env.reset("kitchen")


WALKTHROUGH_GAMES = [  # (challenge, level, seed)
    ("coin_collector", 1, 0),
    ("coin_collector", 1, 1),
    ("coin_collector", 1, EVAL_SEED_OFFSET),
    ("treasure_hunter", 2, 0),
    ("simple", 1, 0),
    ("cooking", 1, 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("challenge, level, seed", WALKTHROUGH_GAMES)
def test_walkthrough_wins(challenge, level, seed):
    env = make(challenge=challenge, level=level, max_steps=100)
    obs, info = env.reset(seed)
    assert info["instruction"] and obs and info["valid_action"]
    assert not info["won"] and info["task_score"] == 0.0
    walkthrough = info["expert_actions"]
    assert walkthrough
    rewards = []
    for action in walkthrough:
        assert action in info["admissible_actions"]
        obs, reward, done, info = env.step(action)
        assert info["valid_action"]
        rewards.append(reward)
    assert done and info["won"] and info["task_score"] == 1.0
    assert sum(rewards) == pytest.approx(1.0)  # score deltas over max_score add up to the full score
    env.close()


@pytest.mark.slow
def test_coin_collector_level1_is_one_room_take_coin():
    env = make()  # the default: easiest setting
    _, info = env.reset(0)
    assert info["expert_actions"] == ["take coin"] and env.expert_action() == "take coin"
    assert "take coin" in info["admissible_actions"] and len(info["admissible_actions"]) <= 5
    env.step("take coin")
    assert env.expert_action() == ""  # won: nothing left to do


@pytest.mark.slow
def test_invalid_actions_flagged_and_game_unchanged():
    env = make(max_steps=10)
    obs0, info0 = env.reset(0)
    bad = ["", "x" * (1 << 20), bytes(range(256)).decode("latin-1"), "\x00\x01\x02", "go nowhere",
           "take coin\nlook", "\ud800"]
    for i, action in enumerate(bad, start=1):
        obs, reward, done, info = env.step(action)
        assert not info["valid_action"] and reward == 0.0 and not done
        assert obs.startswith("Invalid action:") and "Admissible commands: " in obs
        assert info["steps"] == i
        assert info["admissible_actions"] == info0["admissible_actions"]  # nothing happened in the game
    obs, reward, done, info = env.step("take coin")
    assert info["valid_action"] and info["won"] and done and reward == 1.0
    obs, reward, done, info = env.step("look")  # past the end: flagged, never raises
    assert done and not info["valid_action"] and reward == 0.0


@pytest.mark.slow
def test_max_steps_ends_the_episode():
    env = make(max_steps=3)
    env.reset(0)
    results = [env.step("look") for _ in range(3)]
    assert [done for _, _, done, _ in results] == [False, False, True]
    assert results[-1][3]["truncated"] and not results[-1][3]["won"]


def same_story(path_a: str, path_b: str) -> bool:
    """Two compiled .z8 games are the same story: equal bytes except the header's serial number (bytes
    18-23), which the Inform compiler sets to the compilation date (YYMMDD). A game compiled into the
    shared cache yesterday is the same game today."""
    a, b = (bytearray(open(p, "rb").read()) for p in (path_a, path_b))
    a[18:24] = b[18:24] = b"000000"
    return a == b


def test_same_story_ignores_only_the_compilation_date(tmp_path):
    header = bytearray(b"\x08" + bytes(17) + b"261130" + bytes(40))
    (tmp_path / "a.z8").write_bytes(header)
    header[18:24] = b"261201"  # the next day's serial: the same game
    (tmp_path / "b.z8").write_bytes(header)
    header[40] = 1  # any other byte: another game
    (tmp_path / "c.z8").write_bytes(header)
    a, b, c = (str(tmp_path / f"{n}.z8") for n in "abc")
    assert same_story(a, b) and not same_story(a, c)


@pytest.mark.slow
def test_same_seed_same_game_and_concurrent_generation(tmp_path):
    # Two processes generate the same game into one empty cache at once: both succeed, one copy stays.
    code = ("import sys; from envs.textworld_env import generate_game; "
            "print(generate_game('coin_collector', 1, 0, sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    expected = str(tmp_path / "textworld" / "coin_collector-L1-s0" / "game.z8")
    assert outputs == [expected, expected]
    assert sorted(os.listdir(tmp_path / "textworld")) == ["coin_collector-L1-s0"]  # no temp leftovers
    # The same seed generated in another cache gives the same compiled game (and the same game
    # structure; game.json's list order can vary with Python's hash seed); another seed differs.
    same = generate_game("coin_collector", 1, 0)  # the default cache, shared with the tests above
    other = generate_game("coin_collector", 1, 1)
    assert same_story(expected, same)
    assert not same_story(expected, other)

    def load(path):
        return textworld.Game.load(path.replace(".z8", ".json"))

    assert load(expected) == load(same) and load(expected) != load(other)


@pytest.mark.slow
def test_env_pool_plays_textworld_games_concurrently():
    # Jericho loads a private copy of the Frotz library per game, so games on the pool's threads
    # do not share interpreter state: each of the 3 walkthroughs must still win its own game.
    from envs.base import EnvPool

    pool = EnvPool("textworld", 3, step_timeout_s=120)
    resets = pool.reset([0, 1, EVAL_SEED_OFFSET])
    plans = [info["expert_actions"] for _, info in resets]
    assert all(plan == ["take coin"] for plan in plans)  # level 1: the coin is in the starting room
    results = pool.step([plan[0] for plan in plans])
    assert [(done, info["won"], reward) for _, reward, done, info in results] == [(True, True, 1.0)] * 3
    pool.close()


@pytest.mark.slow
def test_env_pool_starts_games_concurrently_in_a_fresh_process():
    # TextWorld's grammar parser is not thread-safe: in a fresh process (nothing parsed yet), games
    # started at once on the pool's threads failed at reset ("IndexError: pop from empty list").
    code = ("from envs.base import EnvPool\n"
            "resets = EnvPool('textworld', 4, step_timeout_s=120).reset([0, 1, 2, 0])\n"
            "print([info.get('error') for _, info in resets])\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[None, None, None, None]"


def test_walkthrough_holdout_family_is_a_fixed_hash():
    from envs.textworld_env import held_out

    # sha256("go north\ngo north\ntake coin") ends in ...0 mod 4 (computed with hashlib by hand);
    # "go north\ngo east\ntake coin" is 3 mod 4
    assert int(hashlib.sha256(b"go north\ngo north\ntake coin").hexdigest(), 16) % 4 == 0
    assert held_out(("go north", "go north", "take coin"))
    assert not held_out(("go north", "go east", "take coin"))
    with pytest.raises(ValueError, match="holdout must be"):
        make(holdout="layout")


def test_named_held_out_walkthroughs_replace_the_hash_rule():
    # level 3's 12 walkthroughs (the shipped table: no game is generated); one held out per first move
    named = ["go north, go west, take coin", "go south, go east, take coin", "go east, go north, take coin",
             "go west, go south, take coin"]
    env = make(level=3, train_games=16, eval_games=8, holdout="walkthrough", held_out_walkthroughs=named)
    from envs.textworld_env import walkthrough

    held = [walkthrough(env.challenge, env.level, s) for s in env.tasks("eval")]
    train = [walkthrough(env.challenge, env.level, s) for s in env.tasks("train")]
    assert set(held) == {tuple(w.split(", ")) for w in named}  # all four, 2 games each
    assert len(set(train)) == 8 and not set(train) & set(held)
    with pytest.raises(ValueError, match="needs holdout='walkthrough'"):
        make(level=3, held_out_walkthroughs=named)


@pytest.mark.slow
def test_demo_held_out_games_have_walkthroughs_never_seen_in_training():
    # The default run's (`python t2po.py`) held-out games: none of their expert action sequences is the
    # expert action sequence of a training game, and each command still occurs in training.
    import t2po
    from envs.textworld_env import walkthrough

    options = json.loads(t2po.PRESETS["textworld"]["env_options"])
    env = make(**options)
    train = {walkthrough(env.challenge, env.level, s) for s in env.tasks("train")}
    held = {walkthrough(env.challenge, env.level, s) for s in env.tasks("eval")}
    assert len(env.tasks("eval")) == options["eval_games"] >= 32 and len(held) >= 8
    assert not train & held
    assert {c for w in held for c in w} <= {c for w in train for c in w}
    # the generator's walkthrough is the one the compiled game's engine gives at reset
    for seed in env.tasks("train")[:2] + env.tasks("eval")[:2]:
        _, info = env.reset(seed)
        assert tuple(info["expert_actions"]) == walkthrough(env.challenge, env.level, seed)
    env.close()


LEVEL4_STUDY = {"level": 4, "train_games": 16, "eval_games": 32, "holdout": "walkthrough"}  # results/t2po.md


@pytest.mark.parametrize("study", ["default", "level 4"])
def test_the_default_runs_scan_needs_no_generation(tmp_path, monkeypatch, study):
    # make demo's first run (and the level-4 study's) reads the walkthroughs of every seed it scans from
    # the shipped table
    import t2po
    from envs import textworld_env

    def no_generation(*a, **kw):
        raise AssertionError("a walkthrough was generated")

    monkeypatch.setattr(textworld_env, "make_game", no_generation)
    options = json.loads(t2po.PRESETS["textworld"]["env_options"]) if study == "default" else LEVEL4_STUDY
    env = make(**options, cache=str(tmp_path))  # an empty cache
    assert len(env.tasks("train")) == options["train_games"]
    assert len(env.tasks("eval")) == options["eval_games"]
    assert not (tmp_path / "textworld").exists()


@pytest.mark.slow
def test_shipped_walkthroughs_are_the_generators_and_need_its_version(monkeypatch):
    from envs import textworld_env

    shipped = textworld_env.shipped_walkthroughs()
    keys = sorted(shipped)
    assert len(keys) >= 144 + 288
    for key in keys[::len(keys) // 12]:  # 12 across both splits and levels: generating one takes ~0.4 s
        challenge, level, seed = key.rsplit("-", 2)
        level, seed = int(level.removeprefix("L")), int(seed.removeprefix("s"))
        settings = textworld_env.challenge_settings(challenge, level, seed)
        game, _ = textworld_env.make_game(challenge, settings, seed)
        assert tuple(game.walkthrough) == shipped[key], key
    textworld_env.shipped_walkthroughs.cache_clear()
    monkeypatch.setattr(textworld_env.importlib.metadata, "version", lambda name: "0.0")
    assert textworld_env.shipped_walkthroughs() == {}  # another TextWorld may generate other games
    monkeypatch.undo()
    textworld_env.shipped_walkthroughs.cache_clear()


def test_prepare_generates_each_missing_game_once_before_play(tmp_path, capsys):
    # games are generated before play, one at a time: left to a pool's first reset, 8 threads generating
    # at once under the GIL on a busy 2-core machine passed the 60 s step deadline (7 of 8 episodes lost)
    from envs.textworld_env import TextWorldEnv, game_path

    env = make(level=1, cache=str(tmp_path))
    assert isinstance(env, TextWorldEnv)
    env.prepare([0, 0, EVAL_SEED_OFFSET])
    assert capsys.readouterr().out == "TextWorld: generating 2 game(s), once (then cached)\n"
    for seed in (0, EVAL_SEED_OFFSET):
        assert os.path.isfile(game_path("coin_collector", 1, seed, str(tmp_path)))
    env.prepare([0, EVAL_SEED_OFFSET])
    assert capsys.readouterr().out == ""  # cached: nothing to do, nothing said


def test_prepare_waits_for_the_process_generating_into_the_cache(tmp_path):
    # torchrun's ranks (or runs side by side) share one cache: while one holds its lock, another waits and
    # then finds the game made, instead of compiling it again
    from envs.textworld_env import cache_lock, game_path, generate_game

    code = ("import sys; from envs.textworld_env import TextWorldEnv; "
            "TextWorldEnv(level=1, cache=sys.argv[1]).prepare([0]); print('done', flush=True)")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    with cache_lock(str(tmp_path)):
        other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        first = other.stdout.readline()  # blocks until it says something: without the lock, "generating"
        assert first.startswith("TextWorld: waiting for another process"), first
        generate_game("coin_collector", 1, 0, str(tmp_path))
    rest, _ = other.communicate(timeout=120)
    assert other.returncode == 0 and rest == "done\n", rest  # it found the game: nothing generated
    assert os.path.isfile(game_path("coin_collector", 1, 0, str(tmp_path)))
