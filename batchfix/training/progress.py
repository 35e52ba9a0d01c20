"""Progress of a fit as log lines, for output that no one watches live (nohup, a SLURM log file, a pipe), where
Lightning's progress bar is not drawn: steps done of planned, the loss, the time spent and left; and one line when
early stopping ends the fit."""
from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

log = logging.getLogger(__name__)

LINES_PER_FIT = 10  # a line every tenth of the planned steps ...
SECONDS_BETWEEN_LINES = 60.0  # ... or once a minute, whichever comes first


def live_bar_watched() -> bool:
    """Whether a progress bar is watched live: stdout is a terminal, or a notebook shows it."""
    return bool(getattr(sys.stdout, "isatty", lambda: False)()) or "ipykernel" in sys.modules


def clock(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    return str(timedelta(seconds=round(seconds)))


class ProgressLines(Callback):
    """Log "step 120/500 (24%), loss ..., 0:01:10 elapsed, ETA 0:03:40" every tenth of the planned steps
    or once a minute, whichever comes first."""

    def __init__(self, every_seconds: float = SECONDS_BETWEEN_LINES):
        self.every_seconds = every_seconds
        self.started = self.last_line = 0.0
        self.first_step = self.every_steps = self.planned = 0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.planned = int(trainer.estimated_stepping_batches)
        self.every_steps = max(1, self.planned // LINES_PER_FIT)
        self.first_step = trainer.global_step  # a resumed fit goes on from there
        self.started = self.last_line = time.perf_counter()
        if trainer.is_global_zero:  # one process speaks for all under DDP
            log.info("Fitting: %d steps planned, a progress line every %d steps or %s.", self.planned,
                     self.every_steps, clock(self.every_seconds))

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, *args) -> None:
        step, now = trainer.global_step, time.perf_counter()
        due = step % self.every_steps == 0 or now - self.last_line >= self.every_seconds or step == self.planned
        if not (due and trainer.is_global_zero):
            return
        self.last_line = now
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        elapsed, done = now - self.started, max(step - self.first_step, 1)
        left = elapsed / done * max(self.planned - step, 0)
        log.info("Step %d/%d (%.0f%%), loss %s, %s elapsed, ETA %s.", step, self.planned,
                 100 * step / max(self.planned, 1), "n/a" if loss is None else f"{float(loss):.1f}", clock(elapsed),
                 clock(left))


def announce_early_stop(trainer: pl.Trainer) -> bool:
    """One line when early stopping ended the fit before its planned epochs (returns whether it did)."""
    stopper = trainer.early_stopping_callback
    if stopper is None or not stopper.stopped_epoch or not trainer.is_global_zero:
        return False
    log.info("Early stopping after epoch %d of %d (step %d): %s did not improve for %d validations; the best "
             "checkpoint (%s %.1f) is kept.", stopper.stopped_epoch + 1, trainer.max_epochs, trainer.global_step,
             stopper.monitor, stopper.wait_count, stopper.monitor, float(stopper.best_score))
    return True
