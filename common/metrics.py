"""Metrics: one JSON object per line in <out>/metrics.jsonl, a tqdm bar with live reward / success,
and with --report-to the same numbers in TensorBoard (<out>/tensorboard) or Weights & Biases."""

import importlib.util
import json
import math
import os
import sys

from tqdm import tqdm

REPORT_TO = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # --report-to -> the package
BAR_KEYS = {"reward_mean": "reward", "success_rate": "success", "eval/success_rate": "eval", "loss": "loss"}


def _jsonable(value):
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # torch / numpy scalars
        return value.item()
    return value


def missing_package(report_to: str) -> str | None:
    """Why --report-to cannot work here (one line), or None: checked before the model loads."""
    package = REPORT_TO[report_to]
    if package is not None and importlib.util.find_spec(package) is None:
        return f"--report-to {report_to}: {package} is not installed (pip install {package})"
    return None


def keep_rows_through(path: str, last_step: int) -> None:
    """Rewrite the metrics file at `path` without the rows of steps after `last_step` (a resumed run redoes
    them: kept, they would appear twice) nor a last row cut short by a kill. Atomic: a temp file is
    renamed over it, so a kill here leaves the old file or the new one."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                row = None
            if isinstance(row, dict) and not (isinstance(row.get("step"), int) and row["step"] > last_step):
                kept.append(line)
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def free_path(path: str, suffix: str) -> str:
    """path + suffix, or + suffix-2, -3, ...: the first name nothing holds, so a rename never replaces an
    earlier copy the user may still want."""
    candidate, n = path + suffix, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}{suffix}-{n}"
    return candidate


def set_aside(path: str) -> None:
    """A new run starting over a non-empty metrics file (--resume found no readable checkpoint): rename the
    old rows to <path>.old (.old-2, ...) rather than empty the file, and say so in one line."""
    if not (os.path.isfile(path) and os.path.getsize(path) > 0):
        return
    aside = free_path(path, ".old")
    os.rename(path, aside)
    print(f"starting fresh: the earlier rows of {path} are now in {aside}", file=sys.stderr, flush=True)


class MetricsLogger:
    def __init__(self, out_dir: str, total_steps: int, desc: str = "train", *,
                 initial_step: int | None = None, report_to: str = "none", config: dict | None = None,
                 tensorboard: bool = False, enabled: bool = True):
        """initial_step: None for a new run (metrics.jsonl is started afresh; rows already there are moved
        aside, see set_aside); for --resume the step of the checkpoint: rows of later steps are dropped
        (keep_rows_through), then new rows are appended.
        report_to: REPORT_TO's keys (tensorboard=True: the same as "tensorboard"); config: the run's args,
        for wandb. enabled=False (ranks other than 0) makes every call a no-op."""
        self.enabled = enabled
        self.postfix: dict[str, str] = {}
        self.writer = self.wandb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        if initial_step is None:
            set_aside(path)
        else:
            keep_rows_through(path, initial_step)
        self.file = open(path, "w" if initial_step is None else "a")
        self.bar = tqdm(total=total_steps, initial=initial_step or 0, desc=desc, dynamic_ncols=True)
        if report_to == "wandb":
            self.wandb = _wandb_run(out_dir, config, resumed=initial_step is not None)
        if tensorboard or report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: the events of the steps a resumed run redoes are discarded, as above
                self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=
                                            None if initial_step is None else initial_step + 1)
            except ImportError:
                print("TensorBoard is not installed (pip install tensorboard); logging to metrics.jsonl only",
                      file=sys.stderr)

    def log(self, metrics: dict) -> None:
        """Append `metrics` as one line (flushed at once); move the bar to metrics["step"]."""
        if not self.enabled:
            return
        metrics = {k: _jsonable(v) for k, v in metrics.items()}
        self.file.write(json.dumps(metrics, default=str) + "\n")
        self.file.flush()
        for key, short in BAR_KEYS.items():
            if isinstance(metrics.get(key), int | float):
                self.postfix[short] = f"{metrics[key]:.3f}"
        self.bar.set_postfix(self.postfix, refresh=False)
        step = metrics.get("step")
        if isinstance(step, int) and step > self.bar.n:
            self.bar.update(step - self.bar.n)
        else:
            self.bar.refresh()
        if any(k.startswith("eval/") for k in metrics):  # evaluation lines stay visible above the bar
            self.bar.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in metrics.items()))
        if self.writer is not None and isinstance(step, int):
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics)  # plotted against its "step" (define_metric in _wandb_run)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(out_dir: str, config: dict | None, resumed: bool):
    """A wandb run named after the run folder; --resume continues the same wandb run (its id is kept in
    <out>/wandb-id). wandb keeps what it was sent: the rows of steps a resumed run redoes appear twice
    there (metrics.jsonl and TensorBoard drop them). Project and entity: WANDB_PROJECT, WANDB_ENTITY."""
    import wandb

    id_file = os.path.join(out_dir, "wandb-id")
    if resumed and os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_file, "w") as f:
            f.write(run_id)
    run = wandb.init(name=os.path.basename(os.path.normpath(out_dir)), dir=out_dir, config=config, id=run_id,
                     resume="allow")
    run.define_metric("step")
    run.define_metric("*", step_metric="step")  # x axis: our step, not wandb's count of log calls
    return run
