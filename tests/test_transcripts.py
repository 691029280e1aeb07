"""Every evaluation leaves transcripts (prompt, response, action, observation, reward) in the run folder, and
a run ends by printing one held-out episode before and after RL, with counts in its summary line."""

import json
import re

import pytest

import arpo
import loop
import t2po
from common import run
from common.models import byte_tokenizer


def test_transcript_cuts_a_sequence_at_the_models_tokens():
    tok = byte_tokenizer()  # one id per byte: the texts below are the ids' bytes
    ids = list(b"Q?") + list(b"a1") + list(b"<r>") + list(b"a2")
    generated = [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert run.transcript(tok, ids, generated, ["go", "stop"], won=True) == {
        "won": True, "prompt": "Q?", "turns": [{"response": "a1", "action": "go", "observation": "<r>"},
                                               {"response": "a2", "action": "stop", "observation": ""}]}
    # a sequence that starts with model tokens, no actions given (arpo: tool results are the replies)
    assert run.transcript(tok, list(b"xy"), [1, 1]) == {"prompt": "", "turns": [
        {"response": "xy", "observation": ""}]}


def _episodes(folder, stage: str) -> list[dict]:
    with open(folder / "transcripts" / f"{stage}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("script", ["loop", "arpo", "t2po"])
def test_each_evaluation_writes_its_episodes_and_the_run_shows_one(script, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--model", "tiny-random", "--steps", "1", "--eval-tasks", "2", "--threads", "1",
              "--out", str(out)]
    per_task = 1
    if script == "loop":
        loop.main(["--env", "textworld", "--group-size", "2", "--tasks-per-step", "1", "--base-eval",
                   "--cold-start-episodes", "2", *common])
        stages, before = ["base", "cold_start", "rl"], "cold_start"
    elif script == "arpo":
        arpo.main(["--env", "tools", "--group-size", "2", "--initial-rollouts", "2", "--tasks-per-step", "1",
                   "--max-new-tokens", "16", "--max-minutes", "0", "--base-eval", *common])
        stages, before = ["base", "rl"], "base"  # no expert demonstration fits 16 tokens: no cold start
        per_task = arpo.Args.eval_samples  # sampled responses per held-out question
    else:
        t2po.main(["--env", "toy", "--group-size", "2", "--no-cold-start", *common])
        stages, before = ["base", "rl"], "base"
    printed = capsys.readouterr().out
    for stage in stages:
        episodes = _episodes(out, stage)
        assert len(episodes) == 2 * per_task  # per held-out task: one, or arpo's --eval-samples
        for ep in episodes:
            assert {"task", "won", "reward", "turns"} <= set(ep) and ep["turns"]
            for turn in ep["turns"]:
                assert {"response", "observation"} <= set(turn)
                assert script == "arpo" or "action" in turn  # arpo: one response, tool results between
            assert "prompt" in ep or all("prompt" in turn for turn in ep["turns"])
    # the prompt is the model's real input: the chat template's tokens are in it
    first = _episodes(out, "rl")[0]
    prompt = first.get("prompt") or first["turns"][0]["prompt"]
    assert "<|im_start|>" in prompt
    # one held-out episode before RL and after it, then the summary in counts of the 2 held-out tasks
    assert printed.count("--- held-out episode ") == 2
    assert re.search(rf"--- held-out episode \d .*, {before}: (won|lost)", printed)
    assert re.search(r"--- held-out episode \d .*, rl: (won|lost)", printed)
    # arpo.py: the mean over --eval-samples sampled responses a question (a quarter of a task each)
    assert re.search(r"held-out success \(2 tasks\): base [\d.]+/2 .*-> rl [\d.]+/2", printed)


def test_the_episode_shown_is_the_first_whose_outcome_changed(tmp_path, capsys):
    from types import SimpleNamespace

    args = SimpleNamespace(out=str(tmp_path))
    turn = {"response": "r", "action": "go east", "observation": "<|im_end|>a room"}
    before = [dict(task=t, won=False, reward=0, turns=[turn]) for t in ("a", "b", "c")]
    after = [dict(task=t, won=t != "a", reward=int(t != "a"), turns=[turn]) for t in ("a", "b", "c")]
    run.write_transcripts(args, "base", before)
    run.write_transcripts(args, "rl", after)
    run.show_transcripts(args, ["base", "rl"])
    out = capsys.readouterr().out.splitlines()
    assert out == ["--- held-out episode 1 (b), base: lost, reward 0", "  1. 'go east' -> a room",
                   "--- held-out episode 1 (b), rl: won, reward 1", "  1. 'go east' -> a room"]
    run.write_transcripts(args, "rl", before)  # no outcome changed: the first episode
    run.show_transcripts(args, ["base", "rl"])
    assert capsys.readouterr().out.startswith("--- held-out episode 0 (a), base: lost")


def test_the_summary_says_when_the_base_model_was_not_evaluated(tmp_path, capsys):
    # make demo's run skips the base evaluation: its last lines say so instead of dropping the stage
    from types import SimpleNamespace

    turn = {"response": "r", "action": "take coin", "observation": "won"}
    for stage, won in [("cold_start", [False, True]), ("rl", [True, True])]:
        episodes = [dict(task=t, won=w, reward=int(w), turns=[turn]) for t, w in zip("ab", won, strict=True)]
        run.write_transcripts(SimpleNamespace(out=str(tmp_path)), stage, episodes)
    extra = {"cold_start": {"eval/success_rate": 0.5}, "rl": {"eval/success_rate": 1.0}}
    for base_eval in (False, True):
        run.report(SimpleNamespace(out=str(tmp_path), base_eval=base_eval), extra, 2)
        lines = capsys.readouterr().out.splitlines()
        assert "held-out success (2 tasks): cold_start 1/2 -> rl 2/2" in lines
        assert ("base model not evaluated (--no-base-eval; --base-eval runs it)" in lines) is not base_eval
    extra["rl"]["eval/success_rate"] = 0.625  # 5 of 8 sampled responses: 1.25 tasks' worth, not 1
    run.report(SimpleNamespace(out=str(tmp_path), base_eval=True), extra, 2)
    assert "held-out success (2 tasks): cold_start 1/2 -> rl 1.25/2" in capsys.readouterr().out
