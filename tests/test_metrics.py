import json
import sys
from types import SimpleNamespace

import pytest

from common.metrics import MetricsLogger, missing_package


def steps(path) -> list:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resumed_logger_replaces_the_rows_it_will_redo(tmp_path):
    """A run killed after logging step 3 whose last checkpoint is step 2 (--save-every 2): the resumed
    run redoes step 3, so the old step-3 row goes (and a row cut short by the kill), not both kept."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval/success_rate": 0.0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n'
                    '{"step": 3, "eval/success_rate": 0.5}\n{"step": 4, "rew')
    resumed = MetricsLogger(str(tmp_path), total_steps=4, initial_step=2)
    assert steps(path) == [0, 1, 2]  # at once: a kill before the next row loses nothing more
    assert resumed.bar.n == 2
    for step in (3, 4):
        resumed.log({"step": step, "reward_mean": 1.0})
    resumed.close()
    assert steps(path) == [0, 1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp"))  # written beside it, then renamed over it


def test_resume_from_step_0_keeps_the_step_0_rows_and_a_new_run_starts_afresh(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval/success_rate": 0.1}\n{"step": 1}\n')
    MetricsLogger(str(tmp_path), total_steps=4, initial_step=0).close()  # t2po: the checkpoint after RFT
    assert steps(path) == [0]
    MetricsLogger(str(tmp_path), total_steps=4).close()  # --resume found no checkpoint: starting fresh
    assert path.read_text() == ""


def test_a_fresh_start_moves_earlier_rows_aside_never_over_an_earlier_copy(tmp_path, capsys):
    """--resume found no readable checkpoint, so the run starts fresh: the rows already in metrics.jsonl
    are renamed aside, each time to a name nothing holds, and one line says where."""
    path = tmp_path / "metrics.jsonl"
    asides = ["metrics.jsonl.old", "metrics.jsonl.old-2", "metrics.jsonl.old-3"]
    for n, aside in enumerate(asides, 1):
        path.write_text(f'{{"step": {n}}}\n')
        MetricsLogger(str(tmp_path), total_steps=4).close()
        assert path.read_text() == ""
        said = [line for line in capsys.readouterr().err.splitlines() if "starting fresh" in line]
        assert said == [f"starting fresh: the earlier rows of {path} are now in {tmp_path / aside}"]
    assert [(tmp_path / a).read_text() for a in asides] == ['{"step": 1}\n', '{"step": 2}\n', '{"step": 3}\n']
    MetricsLogger(str(tmp_path), total_steps=4).close()  # an empty file: nothing to keep, nothing said
    assert "starting fresh" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", *asides]


def tensorboard_steps(folder, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_report_to_tensorboard_writes_scalars_and_a_resume_replaces_the_redone_steps(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=3, report_to="tensorboard")
    for step in (1, 2, 3):
        logger.log({"step": step, "reward_mean": float(step), "note": "text is not a scalar"})
    logger.close()
    resumed = MetricsLogger(str(tmp_path), total_steps=3, initial_step=1, report_to="tensorboard")
    for step in (2, 3):
        resumed.log({"step": step, "reward_mean": 10.0 * step})
    resumed.close()
    assert tensorboard_steps(tmp_path / "tensorboard", "reward_mean") == [1, 2, 3]
    assert steps(tmp_path / "metrics.jsonl") == [1, 2, 3]


class FakeWandb:
    """Stands in for the wandb package: records what the logger asks of it."""

    def __init__(self):
        self.inits, self.logged, self.defined, self.finished = [], [], [], 0
        self.util = SimpleNamespace(generate_id=lambda: f"id{len(self.inits)}")

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return SimpleNamespace(log=self.logged.append, finish=self.finish,
                               define_metric=lambda *a, **k: self.defined.append((a, k)))

    def finish(self):
        self.finished += 1


def test_report_to_wandb_logs_each_row_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run-a"
    logger = MetricsLogger(str(out), total_steps=2, report_to="wandb", config={"lr": 0.1})
    logger.log({"step": 1, "reward_mean": 0.5})
    logger.close()
    resumed = MetricsLogger(str(out), total_steps=2, initial_step=1, report_to="wandb", config={"lr": 0.1})
    resumed.log({"step": 2, "reward_mean": 0.75})
    resumed.close()
    assert [(i["name"], i["id"], i["resume"], i["config"]) for i in fake.inits] == [
        ("run-a", "id0", "allow", {"lr": 0.1}), ("run-a", "id0", "allow", {"lr": 0.1})]
    assert fake.logged == [{"step": 1, "reward_mean": 0.5}, {"step": 2, "reward_mean": 0.75}]
    assert (("*",), {"step_metric": "step"}) in fake.defined and fake.finished == 2
    MetricsLogger(str(out), total_steps=2, report_to="wandb").close()  # a fresh run: a new wandb run
    assert fake.inits[-1]["id"] == "id2"


def test_a_missing_reporting_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec reports for a package not installed
    assert missing_package("wandb") == "--report-to wandb: wandb is not installed (pip install wandb)"
    assert missing_package("tensorboard") is None and missing_package("none") is None


@pytest.mark.slow
def test_t2po_logs_its_base_and_rft_evaluations(tmp_path):
    """t2po's held-out evaluations before RL (base model, then after the RFT cold start) are rows of
    metrics.jsonl at step 0, as loop.py and arpo.py log theirs, not only lines on stdout."""
    import t2po

    out = tmp_path / "run"
    # webshop-lite has a scripted expert: the RFT cold start trains, so it is evaluated too
    summary = t2po.main(["--env", "webshop-lite", "--model", "tiny-random", "--cold-start",
                         "--cold-start-episodes", "2",
                         "--group-size", "2", "--tasks-per-step", "1", "--max-turns", "6",
                         "--max-new-tokens", "8", "--tti-chunk", "8", "--tti-min-think", "4",
                         "--eval-tasks", "2", "--reward", "env", "--threads", "1", "--steps", "1",
                         "--out", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    base, rft = rows[0], rows[1]
    assert base == {"step": 0, **summary["base"]}
    held = {k: v for k, v in rft.items() if not k.startswith("cold_start/")}  # and the SFT's own keys
    assert held == {"step": 0, **{k.replace("eval/", "eval_cold_start/"): v
                                  for k, v in summary["cold_start"].items()}}
    assert rft["cold_start/samples"] > 0 and rft["cold_start/episodes"] == 2
    assert [row["step"] for row in rows[2:]] == [1, 1] and "reward_mean" in rows[2]  # RL, final eval


@pytest.mark.slow
@pytest.mark.parametrize("name, argv", [
    ("loop", ["--lora-rank", "0", "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "4"]),
    ("arpo", ["--group-size", "2", "--initial-rollouts", "1", "--max-new-tokens", "4", "--max-minutes", "0",
              "--base-eval"]),
    ("t2po", ["--group-size", "2", "--max-turns", "1", "--max-new-tokens", "4", "--tti-chunk", "4",
              "--reward", "env"]),
])
def test_time_s_counts_from_the_start_of_rl_and_step_time_s_is_the_step(name, argv, tmp_path):
    """DESIGN's `time_s` means the same in all three scripts: seconds from the start of RL to the end of
    the step's update; `step_time_s` is that step alone (rollout and update). So time_s grows by at least
    each step_time_s, and the first step starts when RL does (not after the model load and evaluation)."""
    import importlib

    script = importlib.import_module(name)
    out = tmp_path / name
    script.main(["--env", "toy", "--model", "tiny-random", "--backend", "hf", "--tasks-per-step", "1",
                 "--eval-tasks", "1", "--no-cold-start", "--steps", "3", "--out", str(out), *argv])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]
    time_s, step_s = [r["time_s"] for r in rows], [r["step_time_s"] for r in rows]
    assert len(rows) == 3 and all(s > 0 for s in step_s)
    assert time_s[0] == pytest.approx(step_s[0], abs=0.02)  # no model load or evaluation before it
    for i in (1, 2):
        assert time_s[i] - time_s[i - 1] >= step_s[i] - 1e-3  # since RL started, not per step
