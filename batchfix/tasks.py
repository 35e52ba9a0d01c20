"""The verbs as plain functions of validated options: train, correct, evaluate (the CLI and tests call these)."""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from batchfix import runfolder, signals, training
from batchfix.config import CorrectConfig, CorrectionSettings, EvaluateConfig, TrainConfig
from batchfix.correction import correct_file, reference_index
from batchfix.data import PreparedData
from batchfix.errors import Interrupted
from batchfix.io import atomic_output
from batchfix.module import load_trained

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, run_dir: str | Path) -> dict:
    """Fit on cfg.data.path; write model.ckpt, corrected.h5ad and metrics.json into run_dir (rank 0 only).

    A run folder that holds a run is refused (batchfix.runfolder); everything the data and options decide
    is checked before training starts.
    """
    run_dir = Path(run_dir)
    runfolder.check_reuse(run_dir, cfg.overwrite, cfg.resume)
    started = time.perf_counter()
    training.seed_and_threads(cfg.seed, cfg.threads)
    try:
        prepared = training.load_training_data(cfg.data)
        signals.raise_pending()
    except Interrupted as err:
        raise Interrupted(err.signum, " while reading the data, before training: nothing was saved") from None
    reference_index(prepared.batch_categories, cfg.correction.reference)  # refused now, not after training
    runfolder.claim(run_dir, cfg.overwrite, cfg.resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    result = training.fit(cfg, prepared, run_dir)
    if result.trainer.global_rank != 0:
        return {}
    try:
        metrics = write_outputs(cfg, result, prepared, run_dir)
    except Interrupted as err:
        raise Interrupted(err.signum, f" after training, before its outputs were written; resume={run_dir} "
                                      "writes them") from None
    metrics["total_seconds"] = round(time.perf_counter() - started, 2)
    with atomic_output(run_dir / runfolder.METRICS_JSON, overwrite=True) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2))
    log.info("Run folder: %s (model.ckpt, corrected.h5ad, metrics.json).", run_dir)
    return metrics


def write_outputs(cfg: TrainConfig, result: training.FitResult, prepared: PreparedData, run_dir: Path) -> dict:
    """model.ckpt, corrected.h5ad and the evaluation of a finished fit; returns the metrics so far."""
    checkpoint = save_model(result, run_dir)
    metrics = fit_metrics(result, prepared)
    correct_started = time.perf_counter()
    corrected_path = correct_file(training.input_path(cfg.data.path), run_dir / runfolder.CORRECTED_H5AD,
                                  load_trained(checkpoint), CorrectionSettings(**asdict(cfg.correction)),
                                  counts_layer=cfg.data.counts_layer, overwrite=True)
    metrics["correct_seconds"] = round(time.perf_counter() - correct_started, 2)
    if cfg.evaluate and cfg.data.label_key:
        from batchfix.evaluate import evaluate_file

        metrics["evaluation"] = evaluate_file(corrected_path, cfg.data.batch_key, cfg.data.label_key, run_dir,
                                              counts_layer=cfg.data.counts_layer, key_added=cfg.correction.key_added)
    return metrics


def save_model(result: training.FitResult, run_dir: Path) -> Path:
    """Copy the best checkpoint to run_dir/model.ckpt (atomically)."""
    checkpoint = run_dir / runfolder.MODEL_CKPT
    with atomic_output(checkpoint, overwrite=True) as tmp:
        shutil.copyfile(result.best_checkpoint, tmp)
    return checkpoint


def fit_metrics(result: training.FitResult, prepared: PreparedData) -> dict:
    """What the fit did: sizes, epochs, steps, precision, time and the last logged losses."""
    trainer = result.trainer
    return {
        "n_cells": int(prepared.n_cells),
        "streamed": prepared.disk is not None,
        "n_genes": len(prepared.genes),
        "n_tokens": result.module.windows.n_tokens,
        "epochs": int(trainer.current_epoch),
        "steps": int(trainer.global_step),
        "precision": str(trainer.precision),
        "fit_seconds": round(result.seconds, 2),
        "train_cells_per_second": round(result.n_train_cells * trainer.current_epoch / max(result.seconds, 1e-9), 1),
        "losses": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
    }


def correct(cfg: CorrectConfig) -> Path:
    """Correct cfg.input with cfg.checkpoint into cfg.output (streamed, chunk_size cells at a time)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = training.input_path(cfg.input)
    output = Path(cfg.output or Path.cwd() / (Path(source).stem + ".corrected.h5ad"))
    earlier = file_identity(output)
    try:
        written = correct_file(source, output, load_trained(cfg.checkpoint), cfg, counts_layer=cfg.counts_layer,
                               overwrite=cfg.overwrite, progress=cfg.progress)
    except Interrupted as err:
        now = file_identity(output)
        state = ("was not written" if now is None else "is unchanged" if now == earlier
                 else "was complete before the signal came")
        raise Interrupted(err.signum, f"; {output} {state}") from None
    log.info("Wrote %s", written)
    return written


def file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a file, None when there is none: an atomic replacement changes it."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def evaluate(cfg: EvaluateConfig, out_dir: str | Path) -> dict:
    """Score a corrected file's batch mixing and biology conservation."""
    from batchfix.evaluate import evaluate_file

    return evaluate_file(training.input_path(cfg.input), cfg.data.batch_key, cfg.data.label_key, out_dir,
                         counts_layer=cfg.data.counts_layer, key_added=cfg.key_added)


def headline(metrics: dict) -> float | None:
    """The number a sweep optimises: corrected-expression Total when evaluated, else the validation negative ELBO."""
    from batchfix.metrics import CORRECTED, TOTAL_SCORE

    scores = (metrics.get("evaluation") or {}).get("scores", {})
    total = scores.get(CORRECTED, {}).get(TOTAL_SCORE)
    if total is not None:
        return float(total)
    loss = metrics.get("losses", {}).get("val_elbo")
    return None if loss is None else float(loss)

