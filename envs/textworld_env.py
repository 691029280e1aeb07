"""TextWorld: the real TextWorld engine, with games generated offline from its built-in challenges.

Games come from TextWorld's own generators (`tw-coin_collector`, `tw-treasure_hunter`, `tw-simple`,
`tw-cooking`), compiled to Z-machine files with the Inform 7 compiler the `textworld` wheel ships, and
played by its Jericho/Frotz backend. A game is generated the first time its (challenge, level, seed) is
needed (a few seconds) and cached under $AGENTIC_RL_CACHE (default ~/.cache/agentic-rl)/textworld/, so
later runs and concurrent processes reuse it.

Tasks are seeds: `tasks("train")` and `tasks("eval")` are disjoint seed ranges. Different seeds can still
share a layout (coin collector level 3 has 12 walkthroughs, level 2 only 4), so a held-out game may have a
solution seen in training. `holdout="walkthrough"` splits by solution instead: a game is held out when its
walkthrough is one of the held-out ones (sha256 of the walkthrough, mod 4, is 0, or those named in
`held_out_walkthroughs`), so no held-out game's expert action sequence occurs in training. The default is the
easiest game TextWorld generates, coin collector level 1: one room, four admissible commands, and
"take coin" wins (a uniform pick among the admissible commands wins 1 step in 4). A 135M instruct
model prompted zero-shot rarely writes an exact command (SmolLM2-135M-Instruct: p("take coin") ~ 4e-5
per turn at temperature 1, measured with a plain chat prompt listing the commands), so start it with a
little supervised fine-tuning on the walkthroughs (`expert_actions`), the cold-start data.

Actions are checked against TextWorld's admissible commands before they reach the engine: only an
admissible command is played. Anything else (empty, huge, binary, unknown) is a flagged invalid step
(`valid_action=False`) whose observation says what was wrong; it costs a step but leaves the game as it
was. This also protects the Z-machine, which hangs on some binary input.

    python -m envs.textworld_env --challenge coin_collector --level 1 --split train --n 8   # pre-generate
"""

import argparse
import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import itertools
import json
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections import defaultdict

# Difficulty levels map onto TextWorld's own generator settings. coin_collector / treasure_hunter levels
# are the challenges' native ones; simple: (rewards, goal text); cooking: recipe size and needed skills.
CHALLENGES = ("coin_collector", "treasure_hunter", "simple", "cooking")
SIMPLE_LEVELS = {1: ("dense", "detailed"), 2: ("balanced", "detailed"), 3: ("sparse", "brief"),
                 4: ("sparse", "none")}
COOKING_LEVELS = {  # recipe size, ingredients to fetch, rooms, and which skills are needed
    1: dict(recipe=1, take=1, go=1, open=False, cook=False, cut=False),
    2: dict(recipe=1, take=1, go=6, open=True, cook=False, cut=False),
    3: dict(recipe=2, take=2, go=6, open=True, cook=False, cut=True),
    4: dict(recipe=3, take=3, go=9, open=True, cook=True, cut=True),
}
MAX_LEVEL = {"coin_collector": 300, "treasure_hunter": 30, "simple": len(SIMPLE_LEVELS),
             "cooking": len(COOKING_LEVELS)}
EVAL_SEED_OFFSET = 1_000_000  # eval seeds start here, so the two splits never share a game
HOLDOUT_MODULUS = 4  # holdout="walkthrough": about 1 walkthrough in 4 is held out
SCAN_FACTOR = 6  # holdout="walkthrough": seeds scanned per task wanted (~0.4 s each, then cached)
MAX_ACTION_CHARS = 200  # the longest admissible TextWorld command is far shorter
# walkthroughs of the seeds the default run and the level-4 study scan, shipped so that a first run does
# not spend minutes generating them (written by `--ship`, checked against the generator by test_textworld)
SHIPPED_WALKTHROUGHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "textworld_walkthroughs.json")


def cache_root() -> str:
    return os.environ.get("AGENTIC_RL_CACHE") or os.path.expanduser("~/.cache/agentic-rl")


def challenge_settings(challenge: str, level: int, seed: int) -> dict:
    """The settings dict TextWorld's challenge `make(settings, options)` expects, or ValueError."""
    challenge = challenge.removeprefix("tw-").replace("-", "_")
    if challenge not in CHALLENGES:
        raise ValueError(f"unknown TextWorld challenge {challenge!r}; choose one of {', '.join(CHALLENGES)}")
    if not 1 <= level <= MAX_LEVEL[challenge]:
        raise ValueError(f"{challenge} levels are 1..{MAX_LEVEL[challenge]}, got {level}")
    if challenge in ("coin_collector", "treasure_hunter"):
        return {"level": level}
    if challenge == "simple":
        rewards, goal = SIMPLE_LEVELS[level]
        return {"rewards": rewards, "goal": goal, "test": False}
    return {**COOKING_LEVELS[level], "drop": False, "recipe_seed": seed, "split": None}


def make_game(challenge: str, settings: dict, seed: int, path: str | None = None):
    """(game, options) from TextWorld's challenge generator, not compiled; `path`: where compiling writes."""
    import textworld.challenges
    from textworld.generator.game import GameOptions

    options = GameOptions()
    options.seeds = seed
    if path:
        options.path = path
    _, make, _ = textworld.challenges.CHALLENGES[f"tw-{challenge}"]
    return make(settings=settings, options=options), options


def game_path(challenge: str, level: int, seed: int, cache: str | None = None) -> str:
    return os.path.join(cache or cache_root(), "textworld", f"{challenge}-L{level}-s{seed}", "game.z8")


@contextlib.contextmanager
def cache_lock(cache: str | None = None):
    """Hold the game cache's lock file: one process at a time generates into it (torchrun's ranks, runs
    side by side), the others wait and then find the games made, instead of each compiling all of them.
    The OS drops the lock when its holder dies. A cache it cannot open for locking: no lock (generation is
    safe without one, see generate_game; the lock only saves the repeated work)."""
    root = os.path.join(cache or cache_root(), "textworld")
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, ".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        fd = None  # yielding here would chain the body's errors to this one
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"TextWorld: waiting for another process generating games into {root}", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def generate_game(challenge: str, level: int, seed: int, cache: str | None = None) -> str:
    """Path of the compiled game for (challenge, level, seed), generating it on first use.

    Written to a private temp folder and renamed into place, so concurrent processes never read a
    half-written game; if two generate the same game at once the loser's copy is discarded.
    """
    challenge = challenge.removeprefix("tw-").replace("-", "_")
    settings = challenge_settings(challenge, level, seed)
    game_file = game_path(challenge, level, seed, cache)
    folder = os.path.dirname(game_file)
    root = os.path.dirname(folder)
    if os.path.isfile(game_file):
        return game_file

    import textworld

    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{challenge}-L{level}-s{seed}-", dir=root)
    try:
        # compiling writes game.z8 and game.json side by side
        game, options = make_game(challenge, settings, seed, path=os.path.join(tmp, "game.z8"))
        textworld.generator.compile_game(game, options)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished the same game first
            if not os.path.isfile(game_file):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return game_file


@functools.cache
def shipped_walkthroughs() -> dict[str, tuple[str, ...]]:
    """'<challenge>-L<level>-s<seed>' -> walkthrough from SHIPPED_WALKTHROUGHS; empty when the installed
    TextWorld is not the version that wrote them (another version may generate other games)."""
    if not os.path.isfile(SHIPPED_WALKTHROUGHS):
        return {}
    with open(SHIPPED_WALKTHROUGHS) as f:
        table = json.load(f)
    if table["textworld"] != importlib.metadata.version("textworld"):
        return {}
    out = {}
    for game, entry in table["games"].items():
        layouts = [tuple(w.split("\n")) for w in entry["walkthroughs"]]
        out.update({f"{game}-s{seed}": layouts[i] for seed, i in entry["seeds"].items()})
    return out


def ship_walkthroughs(challenge: str, level: int, seeds: list[int]) -> None:
    """Add these seeds' walkthroughs (from the generator, never the table) to SHIPPED_WALKTHROUGHS."""
    table = {"textworld": importlib.metadata.version("textworld"), "games": {}}
    if os.path.isfile(SHIPPED_WALKTHROUGHS):
        with open(SHIPPED_WALKTHROUGHS) as f:
            table["games"] = json.load(f)["games"]
    entry = table["games"].setdefault(f"{challenge}-L{level}", {"walkthroughs": [], "seeds": {}})
    for seed in seeds:
        game, _ = make_game(challenge, challenge_settings(challenge, level, seed), seed)
        text = "\n".join(game.walkthrough)
        if text not in entry["walkthroughs"]:
            entry["walkthroughs"].append(text)
        entry["seeds"][str(seed)] = entry["walkthroughs"].index(text)
    write_atomic(SHIPPED_WALKTHROUGHS, json.dumps(table, indent=1) + "\n")  # a kill leaves the old table
    shipped_walkthroughs.cache_clear()


def walkthrough(challenge: str, level: int, seed: int, cache: str | None = None) -> tuple[str, ...]:
    """The winning command sequence of game (challenge, level, seed): shipped (SHIPPED_WALKTHROUGHS), or
    from TextWorld's generator alone (no Inform 7 compile: ~0.4 s), cached as a small text file beside
    the games."""
    challenge = challenge.removeprefix("tw-").replace("-", "_")
    key = f"{challenge}-L{level}-s{seed}"
    shipped = shipped_walkthroughs().get(key)
    if shipped is not None:
        return shipped
    path = os.path.join(cache or cache_root(), "textworld", "walkthroughs", f"{key}.txt")
    if os.path.isfile(path):
        with open(path) as f:
            return tuple(f.read().splitlines())
    game, _ = make_game(challenge, challenge_settings(challenge, level, seed), seed)
    commands = tuple(game.walkthrough)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, "\n".join(commands))
    return commands


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temp file and a rename: a concurrent reader, or a kill, leaves
    the whole file or the old one, never half of it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
    os.replace(tmp, path)


def held_out(commands: tuple[str, ...]) -> bool:
    """Whether a walkthrough belongs to the held-out family (a stable hash: the same on every machine)."""
    digest = hashlib.sha256("\n".join(commands).encode()).hexdigest()
    return int(digest, 16) % HOLDOUT_MODULUS == 0


# TextWorld parses its game logic with a grammar (tatsu) that is not thread-safe: envs started at once in
# an EnvPool's threads failed with "IndexError: pop from empty list". Starting a game is serialised;
# stepping running games stays concurrent.
START_LOCK = threading.Lock()

LABEL = re.compile(r"^(?:>|command:|action:)\s*")  # small models often write "Command: take coin"


def normalize_command(action: str) -> str:
    """Lower-case, single spaces, no leading '>' / 'Command:' label, no surrounding quotes or final
    period: 'Command: Take  coin.' -> 'take coin'."""
    return LABEL.sub("", " ".join(action.split()).lower()).strip(" .'\"`")


def task_steps(instruction: str) -> list[str]:
    """The sentences of a coin-collector task that name a move or the coin, in order: one per step of its
    walkthrough ("First off, head west.", "Then, travel north.", "That done, take the coin …")."""
    sentences = re.split(r"(?<=[.!?])\s+", instruction)
    return [s for s in sentences if re.search(r"\b(north|south|east|west|coin)\b", s)]


def expert_thought(action: str, instruction: str = "", k: int = 0, long: bool = False) -> str:
    """A reason for the walkthrough's action at step k (the walkthrough has none), for cold-start data written
    as `<think>…</think><action>…</action>` (t2po.py). Short: one sentence that fits the CPU demo's response
    budget. long: the decision first, then the task's sentence for step k and the steps done, ~40 tokens
    whose uncertainty settles once the action is decided (t2po's --expert-thoughts long: the overthinking
    TTI is meant to cut); the short one when the task has no sentence for step k."""
    steps = task_steps(instruction)
    if long and k < len(steps):
        return (f'I {action}. Step {k + 1} of the task says: "{steps[k]}" '
                f"I have done {k} of its {len(steps)} steps.")
    if action.startswith("go "):
        return "The task says which way to go."
    if action.startswith("take "):
        return "The coin is here, so take it."
    return "Open the result that best matches the task."


def parse_command(action: object, admissible: list[str]) -> tuple[str | None, str]:
    """Match an agent's action to an admissible command: (command, "") or (None, what went wrong)."""
    if isinstance(action, bytes):
        action = action.decode("utf-8", errors="replace")
    if not isinstance(action, str):
        return None, f"the action must be text, got {type(action).__name__}"
    if not action.strip():
        return None, "the action is empty"
    if len(action) > MAX_ACTION_CHARS:
        return None, f"the action is {len(action)} characters long; a command is a few words"
    if any(not (c.isprintable() or c in "\t\n\r") or ord(c) > 126 for c in action):
        return None, "the action contains characters that are not plain printable text"
    command = normalize_command(action)
    by_normal_form = {normalize_command(a): a for a in admissible}
    if command not in by_normal_form:
        return None, f"{command!r} is not an admissible command here"
    return by_normal_form[command], ""


def invalid_observation(error: str, admissible: list[str]) -> str:
    return f"Invalid action: {error}. Nothing happens.\nAdmissible commands: {', '.join(admissible)}."


BANNER_LINE = re.compile(r"^[\s_|\\/$<>]+$")  # the ASCII-art 'TEXTWORLD' title is made of these


def clean_feedback(text: str) -> str:
    """Drop the ASCII-art title, the '>' prompt with its status bar and the end-of-game 'RESTART,
    RESTORE ...' question; strip indentation and extra blank lines."""
    text = text.split("Would you like to RESTART")[0]
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if not (line.startswith(">") or (line and BANNER_LINE.match(line)))]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


class TextWorldEnv:
    """One TextWorld game at a time behind the text interface (tasks / reset / step)."""

    def __init__(self, challenge: str = "coin_collector", level: int = 1, max_steps: int = 30,
                 train_games: int = 100, eval_games: int = 20, cache: str | None = None,
                 holdout: str = "seed", held_out_walkthroughs: list[str] | None = None):
        self.challenge = challenge.removeprefix("tw-").replace("-", "_")
        challenge_settings(self.challenge, level, 0)  # fail now on a bad challenge / level
        if holdout not in ("seed", "walkthrough"):
            raise ValueError(f"holdout must be 'seed' or 'walkthrough', got {holdout!r}")
        if held_out_walkthroughs is not None and holdout != "walkthrough":
            raise ValueError("held_out_walkthroughs needs holdout='walkthrough'")
        self.holdout = holdout
        # the held-out family by name ("go north, go west, take coin"), instead of the hash rule
        self.held_out_walkthroughs = None if held_out_walkthroughs is None else {
            tuple(c.strip() for c in w.split(",")) for w in held_out_walkthroughs}
        self.level, self.max_steps = level, max_steps
        self.train_games, self.eval_games, self.cache = train_games, eval_games, cache
        self.game = None
        self.state = None

    def tasks(self, split: str) -> list[int]:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
        first, n = (0, self.train_games) if split == "train" else (EVAL_SEED_OFFSET, self.eval_games)
        if self.holdout == "seed":
            return list(range(first, first + n))
        # walkthrough: seeds of the split's family, taken round-robin over its walkthroughs (so that no
        # layout dominates a small held-out set) from the first SCAN_FACTOR * n seeds of the split's range
        want_held_out, by_walkthrough = split == "eval", defaultdict(list)
        for seed in range(first, first + SCAN_FACTOR * n):
            commands = walkthrough(self.challenge, self.level, seed, self.cache)
            family = held_out(commands) if self.held_out_walkthroughs is None else \
                commands in self.held_out_walkthroughs
            if family == want_held_out:
                by_walkthrough[commands].append(seed)
        found = [s for row in itertools.zip_longest(*by_walkthrough.values()) for s in row if s is not None]
        if len(found) < n:
            raise ValueError(f"{self.challenge} level {self.level}: only {len(found)} {split} games of {n} "
                             f"wanted in {SCAN_FACTOR * n} seeds: too few walkthroughs to hold some out")
        return found[:n]

    def prepare(self, tasks: list) -> None:
        """Generate the games of `tasks` not yet cached, one after another. A game takes seconds of Python to
        generate; left to the first reset, a pool's threads generate several at once under the GIL (a
        group's copies of one game each its own) and can pass the pool's step deadline: lost episodes.
        Under the cache's lock: another process generating the same games is waited for, not repeated."""
        def missing() -> list:
            return list(dict.fromkeys(t for t in tasks if not os.path.isfile(
                game_path(self.challenge, self.level, int(t), self.cache))))

        if not missing():
            return
        with cache_lock(self.cache):
            todo = missing()  # what the process that held the lock left
            if todo:
                print(f"TextWorld: generating {len(todo)} game(s), once (then cached)", flush=True)
            for task in todo:
                self.game_file(task)

    def game_file(self, task) -> str:
        try:
            seed = int(task)
        except (TypeError, ValueError):
            raise ValueError(f"TextWorld tasks are integer seeds, got {task!r}") from None
        return generate_game(self.challenge, self.level, seed, self.cache)

    def start(self, task):
        import textworld

        infos = textworld.EnvInfos(admissible_commands=True, policy_commands=True, won=True, lost=True,
                                   score=True, max_score=True, objective=True)
        # Jericho only knows published games' score layout; TextWorld tracks the score itself.
        warnings.filterwarnings("ignore", message=r"Game .* is not fully supported")
        return textworld.start(self.game_file(task), request_infos=infos)

    def admissible(self) -> list[str]:
        return list(self.state.admissible_commands or [])

    def instruction(self) -> str:
        """The task text, read once at reset."""
        return self.state.objective or ""

    def observation(self, feedback: str) -> str:
        return clean_feedback(feedback)

    def reset(self, task) -> tuple[str, dict]:
        self.close()
        self.task, self.state = task, None
        with START_LOCK:
            self.game = self.start(task)
            self.state = self.game.reset()
        self.steps, self.done, self.score = 0, False, 0
        self.task_instruction = self.instruction()
        return self.observation(self.state.feedback), self.info(valid_action=True)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.state is None:
            raise RuntimeError("call reset(task) before step(action)")
        if self.done:
            return "The episode is over; call reset(task).", 0.0, True, self.info(valid_action=False)
        self.steps += 1
        command, error = parse_command(action, self.admissible())
        if command is None:
            observation, reward = invalid_observation(error, self.admissible()), 0.0
        else:
            self.state, _, _ = self.game.step(command)
            observation, reward = self.observation(self.state.feedback), self.reward()
        self.done = bool(self.state.won or self.state.lost or self.steps >= self.max_steps)
        return observation, reward, self.done, self.info(valid_action=command is not None, error=error)

    def reward(self) -> float:
        """Score gained this step over the maximum, so an episode's rewards sum to its task_score."""
        gained, self.score = self.state.score - self.score, self.state.score
        return gained / max(1, self.state.max_score)

    def task_score(self) -> float:
        return self.state.score / max(1, self.state.max_score)

    def info(self, valid_action: bool, error: str = "") -> dict:
        info = {"instruction": self.task_instruction, "won": bool(self.state.won),
                "lost": bool(self.state.lost), "task_score": self.task_score(), "valid_action": valid_action,
                "admissible_actions": self.admissible(), "expert_actions": self.expert_actions(),
                "steps": self.steps, "truncated": self.steps >= self.max_steps and not self.state.won}
        if error:
            info["invalid_reason"] = error
        return info

    def expert_actions(self) -> list[str]:
        """TextWorld's walkthrough from the current state (`policy_commands`): cold-start data."""
        return list(self.state.policy_commands or [])

    def expert_action(self) -> str:
        """The walkthrough's next command ('' when there is none), as `python -m envs.play` asks."""
        return next(iter(self.expert_actions()), "")

    def expert_thought(self, action: str, long: bool = False) -> str:
        """A reason for the expert's `action` in this state (t2po.py's cold-start data)."""
        return expert_thought(action, self.task_instruction, self.steps, long)

    def close(self) -> None:
        if self.game is not None:
            self.game.close()
            self.game = None


def make(**options) -> TextWorldEnv:
    return TextWorldEnv(**options)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Pre-generate (cache) TextWorld games.")
    parser.add_argument("--challenge", default="coin_collector", choices=CHALLENGES)
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--split", default="train", choices=["train", "eval"])
    parser.add_argument("--n", type=int, default=8, help="how many games of the split")
    parser.add_argument("--ship", action="store_true", help="instead, add the walkthroughs of the seeds "
                        "that holdout='walkthrough' scans for --n games of --split to SHIPPED_WALKTHROUGHS")
    args = parser.parse_args()
    if args.ship:
        first = 0 if args.split == "train" else EVAL_SEED_OFFSET
        ship_walkthroughs(args.challenge, args.level, list(range(first, first + SCAN_FACTOR * args.n)))
        raise SystemExit(0)
    env = TextWorldEnv(args.challenge, args.level)
    for seed in env.tasks(args.split)[: args.n]:
        print(env.game_file(seed))
