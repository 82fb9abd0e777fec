"""TensorBoard event files of a training run, written with tensorboardX as the run goes: each
optimizer step's scalar metrics at that step (`train/loss`, `train/reward`, `train/kl`,
`train/learning_rate`, ..., `valid/...`) and a gated job's gate numbers (`gate/...`).

`[train] tensorboard` turns it on (the default) or off; `[train] log_dir` moves the files (empty:
a job's own directory, or `<data dir>/runs` for a run in Python). Writing never stops a run: a
writer that fails logs one warning and writes nothing more.
"""

from __future__ import annotations

import datetime
import logging
import numbers
import time
from pathlib import Path

log = logging.getLogger("kiln.train")

# metrics whose tag is not the plain rule's (train/<metric>, or valid/<rest> for valid_<rest>)
_TAGS = {"train_loss": "train/loss", "train_mean_token_accuracy": "train/mean_token_accuracy",
         "reward_mean": "train/reward", "valid_reward_mean": "valid/reward"}
# dict-valued metrics whose entries are the reward's components: train/reward/<name>
_REWARD_COMPONENTS = ("sub_rewards", "reward_components")


def _number(value) -> bool:
    return isinstance(value, numbers.Real)


def _tag(metric: str) -> str:
    if metric in _TAGS:
        return _TAGS[metric]
    return f"valid/{metric[6:]}" if metric.startswith("valid_") else f"train/{metric}"


def metric_scalars(metrics: dict) -> dict[str, float]:
    """A step's metrics as tag -> value: every number but the step itself; a dict of numbers
    (a reward's components) as one tag per entry."""
    out = {}
    for key, value in metrics.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            prefix = "train/reward" if key in _REWARD_COMPONENTS else _tag(key)
            out.update({f"{prefix}/{name}": float(v) for name, v in value.items() if _number(v)})
        elif _number(value):
            out[_tag(key)] = float(value)
    return out


def gate_scalars(result: dict) -> dict[str, float]:
    """A gate's result (GateResult.to_json()) as tag -> value: whether it passed, and per criterion
    the candidate's and the baseline's pass rates, the differences with their intervals, the
    paired items and the items that flipped."""
    out = {"gate/passed": float(bool(result.get("passed")))}
    for criterion in result.get("criteria") or []:
        at = f"gate/{criterion['testing_criteria']}"
        values = {"pass_rate": criterion.get("candidate_pass_rate"),
                  "baseline_pass_rate": criterion.get("baseline_pass_rate"),
                  "paired_items": criterion.get("paired_items")}
        for key in ("pass_rate_difference", "mean_score_difference"):
            interval = criterion.get(key) or {}
            values.update({key: interval.get("estimate"), f"{key}_ci_low": interval.get("ci_low"),
                           f"{key}_ci_high": interval.get("ci_high")})
        for key, items in (criterion.get("flipped") or {}).items():  # improved, regressed
            values[key] = len(items)
        out.update({f"{at}/{key}": float(v) for key, v in values.items() if _number(v)})
    return out


def job_log_dir(settings, job_dir: Path, job_id: str) -> Path | None:
    """Where a fine-tuning job writes: `<log_dir>/<job id>`, or the job's own directory; None when
    `[train] tensorboard` is off."""
    if not settings.train.tensorboard:
        return None
    return Path(settings.train.log_dir).expanduser() / job_id if settings.train.log_dir else job_dir / "tensorboard"


def run_log_dir(settings, name: str) -> Path | None:
    """Where a run in Python (`drive`, `kiln train`) writes: `<log_dir or <data dir>/runs>/<name>/<UTC
    time>`, a new directory each run; None when `[train] tensorboard` is off."""
    if not settings.train.tensorboard:
        return None
    root = Path(settings.train.log_dir).expanduser() if settings.train.log_dir else settings.training_dir() / "runs"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    directory, n = root / name / stamp, 1
    while directory.exists():  # two runs of one name in the same second
        n += 1
        directory = root / name / f"{stamp}-{n}"
    return directory


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch whenever it
    is installed (for tensors and graphs a run never writes), which costs a server about a second
    and a few hundred MB. Unless torch is already loaded, `import torch` fails for that moment."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # an import of it raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoard:
    """A run's event files in `directory` (None: writes nothing). purge_step: a resumed job's first
    new step; TensorBoard hides what an earlier attempt wrote from that step on."""

    def __init__(self, directory: Path | str | None, purge_step: int | None = None):
        self.directory = Path(directory) if directory is not None else None
        self._writer = None
        if self.directory is None:
            return
        try:
            SummaryWriter = _summary_writer()
            # the file's name holds the second it was made: the suffix keeps a resumed job's new file
            # (made in the same second, maybe) apart from the last one, and after it in name order
            self._writer = SummaryWriter(str(self.directory), purge_step=purge_step, flush_secs=1,
                                         filename_suffix=f".{time.time_ns()}")
            log.info("TensorBoard event files: %s", self.directory)
        except Exception as exc:  # anything a writer raises: the run goes on without its event files
            self._failed(exc)

    @property
    def active(self) -> bool:
        return self._writer is not None

    def step(self, metrics: dict) -> None:
        """One optimizer step's metrics, at its step number (`metrics["step"]`)."""
        self._write(lambda: (metric_scalars(metrics), int(metrics["step"])))

    def gate(self, result: dict, step: int) -> None:
        """A gate's numbers, at the run's last step."""
        self._write(lambda: (gate_scalars(result), step))

    def _write(self, scalars_at) -> None:
        """scalars_at() -> (tag -> value, step); written, then flushed."""
        if self._writer is None:
            return
        try:
            scalars, step = scalars_at()
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
            self._writer.flush()
        except Exception as exc:  # anything a writer raises: the run goes on without its event files
            self._failed(exc)

    def close(self) -> None:
        """Writes what is queued and closes the files; again, it does nothing."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except Exception as exc:  # anything a writer raises: the run goes on without its event files
            log.warning("TensorBoard event files in %s could not be closed: %s", self.directory, exc)

    def _failed(self, exc: Exception) -> None:
        log.warning("TensorBoard logging to %s stopped (the run goes on): %s: %s", self.directory,
                    type(exc).__name__, exc)
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # a broken writer's close: nothing to add to the warning above
                pass
