"""The verbs as plain functions of validated options: train, correct, evaluate (the CLI and tests call these)."""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from batchfix import training
from batchfix.config import AttentionConfig, CorrectConfig, CorrectionSettings, EvaluateConfig, TrainConfig
from batchfix.correction import correct_file
from batchfix.data import PreparedData
from batchfix.io import atomic_output
from batchfix.module import ENTROPY_PREFIX, load_trained

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, run_dir: str | Path) -> dict:
    """Fit on cfg.data.path; write model.ckpt, corrected.h5ad and metrics.json into run_dir (rank 0 only)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    training.seed_and_threads(cfg.seed, cfg.threads)
    prepared = training.load_training_data(cfg.data)
    result = training.fit(cfg, prepared, run_dir)
    if result.trainer.global_rank != 0:
        return {}
    checkpoint = save_model(result, run_dir)
    metrics = fit_metrics(result, prepared)
    correct_started = time.perf_counter()
    corrected_path = correct_file(training.input_path(cfg.data.path), run_dir / "corrected.h5ad",
                                  load_trained(checkpoint), CorrectionSettings(**asdict(cfg.correction)),
                                  counts_layer=cfg.data.counts_layer, overwrite=True)
    metrics["correct_seconds"] = round(time.perf_counter() - correct_started, 2)
    attention_picture(cfg, checkpoint, run_dir)
    if cfg.evaluate and cfg.data.label_key:
        from batchfix.evaluate import evaluate_file

        metrics["evaluation"] = evaluate_file(corrected_path, cfg.data.batch_key, cfg.data.label_key, run_dir,
                                              counts_layer=cfg.data.counts_layer, key_added=cfg.correction.key_added)
    metrics["total_seconds"] = round(time.perf_counter() - started, 2)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("Run folder: %s (model.ckpt, corrected.h5ad, metrics.json).", run_dir)
    return metrics


def save_model(result: training.FitResult, run_dir: Path) -> Path:
    """Copy the best checkpoint to run_dir/model.ckpt (atomically)."""
    checkpoint = run_dir / "model.ckpt"
    with atomic_output(checkpoint, overwrite=True) as tmp:
        shutil.copyfile(result.best_checkpoint, tmp)
    return checkpoint


def fit_metrics(result: training.FitResult, prepared: PreparedData) -> dict:
    """What the fit did: sizes, epochs, steps, precision, time and the last logged losses."""
    trainer = result.trainer
    return {
        "n_cells": int(prepared.counts.shape[0]),
        "n_genes": len(prepared.genes),
        "n_tokens": result.module.windows.n_tokens,
        "epochs": int(trainer.current_epoch),
        "steps": int(trainer.global_step),
        "precision": str(trainer.precision),
        "fit_seconds": round(result.seconds, 2),
        "train_cells_per_second": round(result.n_train_cells * trainer.current_epoch / max(result.seconds, 1e-9), 1),
        "losses": {k: float(v) for k, v in trainer.callback_metrics.items()
                   if v.numel() == 1 and not k.startswith(ENTROPY_PREFIX)},
    }


def correct(cfg: CorrectConfig) -> Path:
    """Correct cfg.input with cfg.checkpoint into cfg.output (streamed, chunk_size cells at a time)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = training.input_path(cfg.input)
    output = cfg.output or Path.cwd() / (Path(source).stem + ".corrected.h5ad")
    written = correct_file(source, output, load_trained(cfg.checkpoint), cfg, counts_layer=cfg.counts_layer,
                           overwrite=cfg.overwrite, progress=cfg.progress)
    log.info("Wrote %s", written)
    return written


def attention_picture(cfg: TrainConfig, checkpoint: Path, run_dir: Path) -> Path:
    """run_dir/attention.png: the trained model's attention along the genome, per label (else per batch)."""
    from batchfix.attention_maps import attention_maps, write_attention

    options = AttentionConfig(checkpoint=str(checkpoint), group_by=cfg.data.label_key or cfg.data.batch_key)
    maps = attention_maps(load_trained(checkpoint), training.input_path(cfg.data.path), options.group_by,
                          CorrectionSettings(), cfg.data.counts_layer, options.max_cells, options.resolution)
    return write_attention(maps, run_dir, npz=False, overwrite=True)[0]


def attention(cfg: AttentionConfig) -> list[Path]:
    """Mean attention between loci per group of cfg.input's cells: attention.png and attention.npz in cfg.output."""
    from batchfix.attention_maps import attention_maps, write_attention

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = training.input_path(cfg.input)
    output = Path(cfg.output).expanduser() if cfg.output else Path.cwd() / (Path(source).stem + ".attention")
    settings = CorrectionSettings(batch_size=cfg.batch_size, max_missing_fraction=cfg.max_missing_fraction)
    trained = load_trained(cfg.checkpoint)
    maps = attention_maps(trained, source, cfg.group_by, settings, cfg.counts_layer, cfg.max_cells, cfg.resolution)
    written = write_attention(maps, output, overwrite=cfg.overwrite, title=f"{Path(source).name}: ")
    log.info("Wrote %s", ", ".join(map(str, written)))
    return written


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

