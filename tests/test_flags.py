"""The three scripts' command lines: the same concept has the same flag, and it does the same thing."""

import dataclasses
import typing

import pytest

import arpo
import loop
import t2po
from common import cli, run


class Loaded(Exception):
    """Raised by the stand-in load_policy: main got as far as loading the model."""


@pytest.mark.parametrize("script", [loop, arpo, t2po], ids=["loop", "arpo", "t2po"])
def test_dtype_and_lora_alpha_reach_the_model_loader(script, monkeypatch, tmp_path):
    seen = {}

    def load_policy(name, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr(run.models, "load_policy", load_policy)
    with pytest.raises(Loaded):
        script.main(["--env", "toy", "--model", "tiny-random", "--backend", "hf", "--dtype", "bfloat16",
                     "--lora-rank", "4", "--lora-alpha", "8", "--out", str(tmp_path / "r")])
    assert (seen["dtype"], seen["lora_rank"], seen["lora_alpha"]) == ("bfloat16", 4, 8)


SCRIPTS = {"loop": loop, "arpo": arpo, "t2po": t2po}


def fields(script) -> set[str]:
    return {f.name for f in dataclasses.fields(script.Args)}


def test_the_shared_flags_are_declared_once_with_their_help_and_bounds():
    """A script re-declares a shared flag only to change its default: help, group and bounds are RunArgs'."""
    shared = {f.name for f in dataclasses.fields(run.RunArgs)}
    for name, script in SCRIPTS.items():
        assert shared <= fields(script), (name, shared - fields(script))
        for field in shared - {"preset"}:
            meta = cli.metadata(script.Args, field)
            assert meta["help"] and meta["group"], (name, field)
        assert cli.metadata(script.Args, "group_size")["bounds"] == {"ge": 2}


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("flags, shown", [
    (["--lr", "nan"], "--lr nan: must be a finite number"),
    (["--lr", "inf"], "--lr inf: must be a finite number"),
    (["--temperature", "inf"], "--temperature inf: must be a finite number"),
    (["--temperature", "nan"], "--temperature nan: must be a finite number"),
    (["--seed", str(2**70)], f"--seed {2**70}: must be < {2**31} (the range every RNG of the run accepts)"),
    (["--seed", "-1"], "--seed -1: must be >= 0 (the range every RNG of the run accepts)"),
    (["--group-size", "1"], "--group-size 1: must be >= 2 (a group-relative advantage needs a second "
                            "rollout)"),
    (["--tasks-per-step", "1001"], "--tasks-per-step 1001: --env 'toy' has only 1000 training tasks"),
    (["--tasks-per-step", "100000"], "--tasks-per-step 100000: --env 'toy' has only 1000 training tasks"),
])
def test_bad_input_is_one_line_before_the_model_loads_and_leaves_no_run_folder(name, flags, shown,
                                                                                monkeypatch, tmp_path):
    monkeypatch.setattr(run.models, "load_policy", lambda *a, **k: pytest.fail("the model must not load"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        SCRIPTS[name].main(["--env", "toy", "--model", "tiny-random", "--out", str(out), *flags])
    assert str(e.value.code) == f"{name}.py: {shown}"
    assert not out.exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_control_character_in_env_is_shown_escaped(name, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(run.models, "load_policy", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit) as e:
        SCRIPTS[name].main(["--env", "to\u202ey", "--out", str(tmp_path / "run")])
    message = str(e.value.code)
    assert "\u202e" not in message and "'to\\u202ey'" in message, message


def test_one_concept_one_flag_in_every_script():
    # in all three: run, model, rollout, cold start and torchrun settings
    shared = {"preset", "env", "model", "backend", "steps", "group_size", "tasks_per_step", "lr", "lora_rank",
              "lora_alpha", "dtype", "gradient_checkpointing", "micro_batch_size", "max_grad_norm", "kl_coef",
              "temperature", "max_new_tokens", "max_turns", "eval_every", "eval_tasks", "out", "resume",
              "report_to", "save_every", "seed", "cold_start", "cold_start_episodes", "cold_start_epochs",
              "cold_start_lr", "parallel", "dry_run",
              # the shared update's and main's flags, in RunArgs since 1e3f13f (arpo had --minibatches, loop
              # --epochs, t2po alone --max-minutes and --autocast, ...)
              "minibatch_size", "ppo_epochs", "kl_threshold", "max_minutes", "base_eval", "probe_tasks",
              "autocast", "share_prefixes"}
    for name, script in SCRIPTS.items():
        assert shared <= fields(script), (name, shared - fields(script))
    # in two of them, spelled alike
    assert {"std_normalize", "minibatch_size", "env_options"} <= fields(loop) & fields(t2po)
    assert "dual_clip" in fields(arpo) & fields(t2po)
    # the old spellings are gone everywhere
    old = {"micro_batch", "std_norm", "rft", "rft_source", "rft_episodes", "rft_epochs", "rft_lr",
           "ppo_minibatch", "clip_ratio_c", "cold_start_examples", "minibatches"}
    assert not any(old & fields(script) for script in SCRIPTS.values())
    assert "epochs" not in fields(loop)  # its PPO epochs are --ppo-epochs; t2po's --epochs: passes over tasks


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_starts_with_one_line_on_the_script_then_groups(name, capsys):
    script = SCRIPTS[name]
    with pytest.raises(SystemExit):
        cli.parse_args(script.Args, ["--help"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith(" [--flag value ...]") and lines[1] == "" and lines[3] == ""
    assert lines[2] == script.Args.__doc__.strip() and name.upper().replace("T2", "T²") in lines[2].upper()
    headers = [x[:-1] for x in lines if x and not x.startswith(" ") and x.endswith(":")]
    assert headers == ["options", "run", "model", "environment", "rollout", "algorithm", "cold start",
                       "optimisation", "torchrun"]  # every flag has its group: no "other"
    assert "Args(" not in out


@pytest.mark.parametrize("name", SCRIPTS)
def test_preset_choices_are_the_registered_presets(name):
    script = SCRIPTS[name]
    choices = typing.get_args(typing.get_type_hints(script.Args)["preset"])
    assert set(choices) == {"auto", "none"} | set(script.PRESETS)


@pytest.mark.parametrize("name, argv, printed, not_printed, kept", [
    ("loop", ["--env", "appworld", "--lr", "1e-3"], "preset appworld: --model Qwen/Qwen2.5-32B-Instruct",
     "--lr", ("lr", 1e-3)),
    ("arpo", ["--preset", "paper", "--group-size", "8"], "preset paper: --initial-rollouts 8 --branch-k 20",
     "--group-size", ("group_size", 8)),
    ("t2po", ["--env", "webshop", "--max-turns", "7"], "preset webshop: --group-size 8 --tasks-per-step 16",
     "--max-turns", ("max_turns", 7)),
])
def test_the_preset_in_force_is_printed_and_explicit_flags_win(name, argv, printed, not_printed, kept,
                                                               capsys):
    script = SCRIPTS[name]
    args = run.parse(script.Args, argv, script.PRESETS)
    line = capsys.readouterr().out
    assert line.startswith(printed) and line.count("\n") == 1 and not_printed not in line
    assert getattr(args, kept[0]) == kept[1]


def test_the_default_runs_name_their_preset_first(capsys):
    assert loop.main(["--dry-run"]) == {}  # textworld: the CPU default's preset
    assert capsys.readouterr().out.startswith("preset textworld: --env-options ")
    assert arpo.main(["--dry-run"]) == {}  # no preset is named after `tools`: the defaults
    assert capsys.readouterr().out.startswith("preset none: sets nothing\n")
    assert t2po.main(["--dry-run"]) == {}
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("preset textworld: --") and " --env-options " in first


@pytest.mark.slow
def test_an_unknown_flag_under_torchrun_is_one_message_not_a_traceback_per_rank():
    """Every rank parses the command line; rank 0 alone prints argparse's message and no rank prints a
    traceback of ours (torchrun's launcher still reports the failed child in its own words)."""
    import subprocess

    from torchrun_util import ROOT, torchrun_command, torchrun_env

    proc = subprocess.run(torchrun_command(f"{ROOT}/loop.py", "--bogus", "1"), env=torchrun_env(),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert proc.stderr.count("unrecognized arguments: --bogus 1") == 1, proc.stderr[-2000:]
    assert "common/cli.py" not in proc.stderr and "[rank 1] SystemExit" not in proc.stderr
