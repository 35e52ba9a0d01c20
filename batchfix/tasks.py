"""train / correct / evaluate as plain functions of a config (the CLI and the tests call these)."""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from batchfix.correction import correct_file
from batchfix.data import CellDataModule, prepare
from batchfix.io import InputError, atomic_output, load_expression
from batchfix.module import BatchfixModule, load_trained

log = logging.getLogger(__name__)


def bundled_dataset() -> str:
    """Path of the bundled CellBench dataset (the default of every command)."""
    from importlib import resources

    return str(resources.files("batchfix.bundled").joinpath("cellbench5.h5ad"))


def input_path(path: str | None) -> str:
    return bundled_dataset() if path in (None, "", "bundled") else str(Path(path).expanduser())


def resolve_precision(requested, accelerator="auto") -> str:
    """16-mixed on a GPU, 32-true on CPU unless asked; say what runs (Lightning makes 16-mixed bf16 on CPU)."""
    on_gpu = torch.cuda.is_available() and str(accelerator) in ("auto", "gpu", "cuda")
    precision = str(requested) if requested is not None else ("16-mixed" if on_gpu else "32-true")
    if not on_gpu and precision in ("16-mixed", "16"):
        log.warning("precision=16-mixed asked on CPU: Lightning runs bf16-mixed instead (fp16 needs a GPU).")
        precision = "bf16-mixed"
    log.info("Training precision: %s on %s.", precision, "GPU" if on_gpu else "CPU")
    return precision


def planned_epochs(cfg: DictConfig, steps_per_epoch: int) -> int:
    """trainer.max_epochs, or when null a size-scaled count giving about fit.target_steps gradient steps."""
    if cfg.trainer.get("max_epochs") is not None:
        return int(cfg.trainer.max_epochs)
    epochs = math.ceil(cfg.fit.target_steps / steps_per_epoch)
    return int(min(max(epochs, cfg.fit.min_epochs), cfg.fit.max_epochs))


def build_trainer(cfg: DictConfig, run_dir: Path, has_validation: bool) -> pl.Trainer:
    """The Trainer; its max_epochs is set by the caller once the per-process steps are known."""
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_args.pop("max_epochs", None)
    trainer_args["precision"] = resolve_precision(trainer_args.pop("precision", None),
                                                  trainer_args.get("accelerator", "auto"))
    # The negative ELBO, not the training loss: the adversarial term rises as mixing succeeds.
    monitor = "val_elbo" if has_validation else "train_elbo"
    callbacks = [
        ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="best", monitor=monitor, save_top_k=1,
                        save_last=True),
    ]
    if cfg.fit.early_stopping_patience and has_validation:
        callbacks.append(EarlyStopping(monitor=monitor, patience=cfg.fit.early_stopping_patience))
    if not has_validation:
        trainer_args["limit_val_batches"] = 0
    return pl.Trainer(
        default_root_dir=str(run_dir), callbacks=callbacks,
        logger=CSVLogger(str(run_dir), name="logs", version=""), **trainer_args,
    )


def train(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Fit batchfix on cfg.data.path; write model.ckpt, corrected.h5ad and metrics.json into run_dir."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(cfg.seed, workers=True)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    started = time.perf_counter()
    path = input_path(cfg.data.path)
    inp = load_expression(path, cfg.data.batch_key, cfg.data.label_key, cfg.data.counts_layer, cfg.data.scale)
    prepared = prepare(inp, cfg.data.n_top_genes, cfg.data.genome, cfg.data.gtf, cfg.data.unplaced)
    datamodule = CellDataModule(prepared, cfg.fit.batch_size, cfg.fit.validation_fraction, cfg.seed)
    trainer = build_trainer(cfg, run_dir, has_validation=len(datamodule.validation_rows) > 0)
    # Under DDP each process takes every world_size-th minibatch: steps per epoch shrink accordingly.
    steps_per_epoch = math.ceil(math.ceil(len(datamodule.train_rows) / cfg.fit.batch_size) / trainer.world_size)
    max_epochs = planned_epochs(cfg, steps_per_epoch)
    trainer.fit_loop.max_epochs = max_epochs
    model_params = OmegaConf.to_container(cfg.model, resolve=True)
    if cfg.data.scale == "counts" and model_params["likelihood"] == "gaussian":
        raise InputError("model.likelihood=gaussian is for log-scale input: set data.scale=log as well.")
    if cfg.data.scale == "log":
        model_params["likelihood"] = "gaussian"
    module = BatchfixModule(
        model=model_params, genes=prepared.genes, chromosome=list(prepared.coordinates.chromosome),
        start=prepared.coordinates.start.tolist(), end=prepared.coordinates.end.tolist(),
        batch_categories=prepared.batch_categories, scale=cfg.data.scale,
        learning_rate=cfg.fit.learning_rate, weight_decay=cfg.fit.weight_decay,
        kl_warmup_fraction=cfg.fit.kl_warmup_fraction, planned_steps=max_epochs * steps_per_epoch,
    )
    module.set_normalization(prepared.gene_mean, prepared.gene_std)
    log.info("Modelling %d genes as %d locus tokens of %d genes, %d cells, %d batches; %d epochs planned.",
             len(prepared.genes), module.windows.n_tokens, cfg.model.genes_per_token, prepared.counts.shape[0],
             len(prepared.batch_categories), max_epochs)
    resume_from = None
    if cfg.get("resume"):
        resume_from = Path(cfg.resume).expanduser() / "checkpoints" / "last.ckpt"
        if not resume_from.is_file():
            raise InputError(f"Cannot resume: no checkpoint at {resume_from}.")
        saved = load_trained(resume_from)
        if saved.genes != prepared.genes or saved.batch_categories != prepared.batch_categories:
            raise InputError(f"Cannot resume from {cfg.resume}: it was trained on other genes or batches "
                             "(same data and data.* options are needed).")

    fit_started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from else None)
    fit_seconds = time.perf_counter() - fit_started
    checkpoint = run_dir / "model.ckpt"
    if trainer.global_rank != 0:
        return {}
    with atomic_output(checkpoint, overwrite=True) as tmp:
        shutil.copyfile(trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path,
                        tmp)

    correct_started = time.perf_counter()
    corrected_path = correct_file(path, run_dir / "corrected.h5ad", checkpoint, counts_layer=cfg.data.counts_layer,
                                  overwrite=True)
    correct_seconds = time.perf_counter() - correct_started
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics = {
        "n_cells": int(prepared.counts.shape[0]),
        "n_genes": len(prepared.genes),
        "n_tokens": module.windows.n_tokens,
        "epochs": int(trainer.current_epoch),
        "steps": int(trainer.global_step),
        "precision": str(trainer.precision),
        "fit_seconds": round(fit_seconds, 2),
        "train_cells_per_second": round(len(datamodule.train_rows) * trainer.current_epoch / max(fit_seconds, 1e-9), 1),
        "correct_seconds": round(correct_seconds, 2),
        "losses": logged,
    }
    if cfg.get("evaluate") and cfg.data.label_key:
        from batchfix.evaluate import evaluate_file

        metrics["evaluation"] = evaluate_file(corrected_path, cfg.data.batch_key, cfg.data.label_key, run_dir,
                                              counts_layer=cfg.data.counts_layer)
    metrics["total_seconds"] = round(time.perf_counter() - started, 2)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("Run folder: %s (model.ckpt, corrected.h5ad, metrics.json).", run_dir)
    return metrics


def correct(cfg: DictConfig) -> Path:
    """Correct cfg.input with cfg.checkpoint into cfg.output (streamed, chunk_size cells at a time)."""
    if not cfg.get("checkpoint"):
        raise InputError("correct needs checkpoint=<run folder>/model.ckpt.")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    source = input_path(cfg.input)
    output = cfg.output or Path.cwd() / (Path(source).stem + ".corrected.h5ad")
    written = correct_file(source, output, cfg.checkpoint, reference=cfg.reference, counts_layer=cfg.counts_layer,
                           key_added=cfg.get("key_added", "batchfix"), chunk_size=cfg.chunk_size,
                           max_missing_fraction=cfg.max_missing_fraction, overwrite=cfg.overwrite,
                           batch_size=cfg.get("batch_size", 128), progress=cfg.get("progress", True))
    log.info("Wrote %s", written)
    return written


def evaluate(cfg: DictConfig, out_dir: str | Path) -> dict:
    """Score a corrected file's batch mixing and biology conservation."""
    from batchfix.evaluate import evaluate_file

    return evaluate_file(input_path(cfg.input), cfg.data.batch_key, cfg.data.label_key, out_dir)


def headline(metrics: dict) -> float | None:
    """The number a sweep optimises: corrected-expression Total when evaluated, else the validation negative ELBO."""
    from batchfix.metrics import CORRECTED, TOTAL_SCORE

    scores = (metrics.get("evaluation") or {}).get("scores", {})
    total = scores.get(CORRECTED, {}).get(TOTAL_SCORE)
    if total is not None:
        return float(total)
    loss = metrics.get("losses", {}).get("val_elbo")
    return None if loss is None else float(loss)
