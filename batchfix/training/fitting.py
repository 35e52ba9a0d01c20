"""Fitting: validated options and data in, a trained model out.

The steps `python -m batchfix train` (batchfix.tasks.training) and the Python API (batchfix.api) share:
read and prepare the data, plan the epochs, build the Lightning Trainer and module, fit.
"""
from __future__ import annotations

import logging
import math
import signal
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import anndata as ad
import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities.exceptions import MisconfigurationException, SIGTERMException
from torch.utils.data import DataLoader

from batchfix import runfolder, signals
from batchfix.config import (
    DataConfig,
    FitConfig,
    ModelAblations,
    ModelConfig,
    TrainConfig,
    TrainerConfig,
    schema_values,
)
from batchfix.console import quiet_lightning_logs, quiet_warnings
from batchfix.data.genome import chromosome_runs
from batchfix.data.io import expression_input, input_path, read_h5ad
from batchfix.data.prepare import CellBatches, PreparedData, StreamedCells, minibatches, prepare, validation_size
from batchfix.data.streaming import prepare_streamed, use_streaming
from batchfix.errors import ConfigError, InputError, Interrupted
from batchfix.training.checkpoint_io import AtomicCheckpointIO
from batchfix.training.module import BatchfixModule
from batchfix.training.progress import ProgressLines, announce_early_stop, live_bar_watched
from batchfix.training.trained import TRAINED_DATA_OPTIONS, load_trained

log = logging.getLogger(__name__)


def seed_and_threads(seed: int, threads: int | None) -> None:
    pl.seed_everything(seed, workers=True)
    if threads:
        torch.set_num_threads(threads)


def read_training_file(data: DataConfig) -> ad.AnnData | None:
    """The file data.path read whole, or None when it stays on disk and is streamed (data.stream)."""
    path = input_path(data.path)
    return None if use_streaming(data, path) else read_h5ad(path)


def load_training_data(data: DataConfig, adata: ad.AnnData | None = None, source: str = "the AnnData") -> PreparedData:
    """Validated cells and modelled genes in genomic order, from `adata` (named `source` in errors) or else
    from the file data.path, read whole or streamed from disk (data.stream)."""
    if adata is None:
        path = input_path(data.path)
        if use_streaming(data, path):
            return prepare_streamed(path, data)
        adata, source = read_h5ad(path), path
    return prepare(expression_input(adata, data, data.scale, source=source), data)


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix units (Intel AMX tiles), where bf16-mixed training is the faster one.

    torch's probe is private: where it is missing or fails, the answer is no (float32 training).
    """
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe is not None and probe())
    except Exception:  # noqa: BLE001 - any failure of a private probe means "not known to have it"
        return False


def resolve_precision(requested: str | None, accelerator: str = "auto") -> str:
    """Unless asked: 16-mixed on a GPU; on CPU bf16-mixed where it has bf16 matrix units (AMX), else 32-true.
    Say what runs (Lightning makes 16-mixed bf16 on CPU)."""
    on_gpu = torch.cuda.is_available() and str(accelerator) in ("auto", "gpu", "cuda")
    if requested is not None:
        precision = str(requested)
    elif on_gpu:
        precision = "16-mixed"
    else:
        precision = "bf16-mixed" if cpu_multiplies_bf16() else "32-true"
    if not on_gpu and precision in ("16-mixed", "16"):
        log.warning("precision=16-mixed asked on CPU: Lightning runs bf16-mixed instead (fp16 needs a GPU).")
        precision = "bf16-mixed"
    chosen_for_cpu = requested is None and precision == "bf16-mixed"  # the default, not the user's choice
    why = " (the CPU has bf16 matrix units; trainer.precision=32-true trains in float32)" if chosen_for_cpu else ""
    log.info("Training precision: %s on %s%s.", precision, "GPU" if on_gpu else "CPU", why)
    return precision


def planned_epochs(trainer: TrainerConfig, fit: FitConfig, steps_per_epoch: int) -> int:
    """trainer.max_epochs, or when null a size-scaled count giving about fit.target_steps gradient steps."""
    if trainer.max_epochs is not None:
        return trainer.max_epochs
    epochs = math.ceil(fit.target_steps / steps_per_epoch)
    return int(min(max(epochs, fit.min_auto_epochs), fit.max_auto_epochs))


class StopOnSignal(Callback):
    """Stop at a step boundary on a signal (batchfix.signals) and save checkpoints/last.ckpt for resume=.

    Lightning's own SIGTERM handling stops at the same boundaries with SIGTERMException; both save here.
    """

    def __init__(self, last: Path):
        self.last = last

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        signals.raise_pending()

    def on_validation_batch_end(self, trainer: pl.Trainer, *args) -> None:
        signals.raise_pending()

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, (Interrupted, SIGTERMException)) and trainer.global_step > 0:
            trainer.save_checkpoint(self.last)
            if trainer.logger is not None:
                trainer.logger.save()  # the losses logged so far reach logs/metrics.csv


def build_trainer(cfg: TrainConfig, run_dir: Path, has_validation: bool) -> pl.Trainer:
    """The Trainer; its max_epochs is set by the caller once the per-process steps are known."""
    options = cfg.trainer
    # The negative ELBO, not the training loss: the adversarial term rises as mixing succeeds.
    monitor = "val_elbo" if has_validation else "train_elbo"
    last = runfolder.last_checkpoint(run_dir)
    # No version counter: a name in use is replaced, never sidestepped with a "-v1" copy beside a stale one.
    callbacks = [ModelCheckpoint(dirpath=last.parent, filename="best", monitor=monitor, save_top_k=1,
                                 save_last=True, enable_version_counter=False), StopOnSignal(last)]
    if cfg.fit.early_stopping_patience and has_validation:
        callbacks.append(EarlyStopping(monitor=monitor, patience=cfg.fit.early_stopping_patience))
    progress_bar = options.enable_progress_bar and live_bar_watched()  # in a log file a bar is only noise
    if not progress_bar:
        callbacks.append(ProgressLines())
    quiet_lightning_logs()
    try:
        return pl.Trainer(
            default_root_dir=str(run_dir), callbacks=callbacks, plugins=[AtomicCheckpointIO()],
            logger=CSVLogger(str(run_dir), name=runfolder.LOGS, version=""),
            accelerator=options.accelerator, devices=options.devices, strategy=options.strategy,
            num_nodes=options.num_nodes, precision=resolve_precision(options.precision, options.accelerator),
            gradient_clip_val=options.gradient_clip_val, log_every_n_steps=options.log_every_n_steps,
            enable_progress_bar=progress_bar, enable_model_summary=options.enable_model_summary,
            deterministic=options.deterministic, **({} if has_validation else {"limit_val_batches": 0}),
        )
    except (MisconfigurationException, ValueError, RuntimeError, ImportError) as err:  # e.g. no such accelerator
        raise ConfigError(f"Lightning refused the trainer.* options (accelerator={options.accelerator}, "
                          f"devices={options.devices}, strategy={options.strategy}): {err}") from None


def build_module(cfg: TrainConfig, prepared: PreparedData, planned_steps: int) -> BatchfixModule:
    """The Lightning module for the prepared genes and batches, with their standardisation statistics."""
    model = network_config(cfg)
    coordinates = prepared.coordinates
    widest = max(len(run) for run in chromosome_runs(coordinates))  # windows never cross a chromosome
    if model.genes_per_token > widest:
        log.info("model.genes_per_token=%d > %d, the most modelled genes on one chromosome: using %d (the same "
                 "windows, without slots that could only be padding).", model.genes_per_token, widest, widest)
        model = replace(model, genes_per_token=widest)
    if model.shuffle_seed is None:
        model = replace(model, shuffle_seed=cfg.seed)  # stored in the checkpoint: correction rebuilds the same one
    module = BatchfixModule(
        model=model.to_dict(), genes=prepared.genes, chromosome=list(coordinates.chromosome),
        start=coordinates.start.tolist(), end=coordinates.end.tolist(), batch_categories=prepared.batch_categories,
        scale=cfg.data.scale, learning_rate=cfg.fit.learning_rate, weight_decay=cfg.fit.weight_decay,
        kl_warmup_fraction=cfg.fit.kl_warmup_fraction, planned_steps=planned_steps,
        data={name: getattr(cfg.data, name) for name in TRAINED_DATA_OPTIONS},
    )
    module.set_normalization(prepared.gene_mean, prepared.gene_std)
    return module


def network_config(cfg: TrainConfig) -> ModelConfig:
    """The network to train: the model.* options, the network's ablation.* switches, a Gaussian likelihood for
    log-scale data."""
    model = ModelConfig(**asdict(cfg.model), **schema_values(cfg.ablation, ModelAblations))
    return replace(model, likelihood="gaussian") if cfg.data.scale == "log" else model


# The model options that shape the network's weights: a resumed run must keep them
SHAPE_OPTIONS = ("genes_per_token", "d_model", "n_heads", "n_layers", "latent_dim", "decoder_hidden",
                 "position_encoding", "token_identity", "distance_bias", "distance_buckets", "likelihood")


def option_group(name: str) -> str:
    """model | ablation: where a network option is set."""
    return "ablation" if name in {f.name for f in fields(ModelAblations)} else "model"


def resume_checkpoint(resume: str | None, prepared: PreparedData, model: ModelConfig | None = None) -> Path | None:
    """The last.ckpt of the run folder `resume`, checked to be a run on the same genes and batches, and of the same
    network shape as `model`."""
    if not resume:
        return None
    checkpoint = runfolder.last_checkpoint(resume)
    if not checkpoint.is_file():
        raise InputError(f"Cannot resume: no checkpoint at {checkpoint} (resume= names a run folder).")
    saved = load_trained(checkpoint)
    if saved.genes != prepared.genes or saved.batch_categories != prepared.batch_categories:
        raise InputError(f"Cannot resume from {resume}: it was trained on other genes or batches "
                         "(same data and data.* options are needed).")
    changed = [f"{option_group(name)}.{name}={getattr(saved.config, name)!r} (not {getattr(model, name)!r})"
               for name in SHAPE_OPTIONS if model is not None and getattr(saved.config, name) != getattr(model, name)]
    if changed:
        raise InputError(f"Cannot resume from {resume}: its network has another shape; resume with "
                         f"{', '.join(changed)}.")
    return checkpoint


@dataclass
class FitResult:
    """A finished fit: the trainer (rank, epochs, logged metrics), the module and the best checkpoint."""

    trainer: pl.Trainer
    module: BatchfixModule
    n_train_cells: int
    seconds: float

    @property
    def best_checkpoint(self) -> Path:
        callback = self.trainer.checkpoint_callback
        return Path(callback.best_model_path or callback.last_model_path)


def fit(cfg: TrainConfig, prepared: PreparedData, run_dir: Path) -> FitResult:
    """Train on the prepared data; checkpoints and logs/metrics.csv go into run_dir.

    A signal stops training at the next step boundary, saves checkpoints/last.ckpt and raises Interrupted.
    """
    datamodule = CellDataModule(prepared, cfg.fit.batch_size, cfg.fit.validation_fraction, cfg.seed,
                                cfg.fit.max_validation_cells, cfg.data.chunk_cells)
    resume_from = resume_checkpoint(cfg.resume, prepared, network_config(cfg))
    trainer = build_trainer(cfg, run_dir, has_validation=len(datamodule.validation_rows) > 0)
    # Under DDP each process takes every world_size-th minibatch: steps per epoch shrink accordingly.
    steps_per_epoch = math.ceil(math.ceil(len(datamodule.train_rows) / cfg.fit.batch_size) / trainer.world_size)
    max_epochs = planned_epochs(cfg.trainer, cfg.fit, steps_per_epoch)
    trainer.fit_loop.max_epochs = max_epochs
    module = build_module(cfg, prepared, planned_steps=max_epochs * steps_per_epoch)
    log.info("Modelling %d genes as %d locus tokens of %d genes, %d cells, %d batches; %d epochs planned.",
             len(prepared.genes), module.windows.n_tokens, module.model_config.genes_per_token,
             prepared.n_cells, len(prepared.batch_categories), max_epochs)
    started = time.perf_counter()
    try:
        with signals.deferred(), warnings.catch_warnings():
            quiet_warnings()  # e.g. a streamed dataset's length with loader workers: they run in-process here
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from else None)
    except (Interrupted, SIGTERMException) as err:
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGTERM
        raise Interrupted(signum, interruption_note(trainer, run_dir)) from None
    announce_early_stop(trainer)
    return FitResult(trainer, module, len(datamodule.train_rows), time.perf_counter() - started)


def interruption_note(trainer: pl.Trainer, run_dir: Path) -> str:
    """Where an interrupted fit stopped and what it saved."""
    last = runfolder.last_checkpoint(run_dir)
    if trainer.global_step == 0 or not last.is_file():
        return " before a training step: no checkpoint saved"
    return f" after {trainer.global_step} training steps; saved {last} (resume={run_dir} continues it)"


class CellDataModule(pl.LightningDataModule):
    """Train/validation split of the prepared cells (validation drives early stopping).

    The cells are served from memory, or streamed from disk (`StreamedCells`) when the prepared data
    stayed there.
    """

    def __init__(self, prepared: PreparedData, batch_size: int, validation_fraction: float, seed: int = 0,
                 max_validation_cells: int | None = None, chunk_cells: int | None = None):
        super().__init__()
        self.prepared, self.batch_size, self.seed, self.chunk_cells = prepared, batch_size, seed, chunk_cells
        n_cells = prepared.n_cells
        permutation = np.random.default_rng(seed).permutation(n_cells)
        n_validation = validation_size(n_cells, validation_fraction, max_validation_cells)
        self.validation_rows = np.sort(permutation[:n_validation])
        self.train_rows = np.sort(permutation[n_validation:])

    def loader(self, rows: np.ndarray, shuffle: bool) -> DataLoader:
        prepared = self.prepared
        if prepared.disk is None:
            dataset = CellBatches(prepared.counts[rows], prepared.batch_index[rows])
            return minibatches(dataset, self.batch_size, shuffle=shuffle, seed=self.seed)
        trainer = self.trainer
        streamed = StreamedCells(prepared.disk, rows, prepared.batch_index, self.batch_size, self.chunk_cells,
                                 shuffle, self.seed, trainer.global_rank if trainer else 0,
                                 trainer.world_size if trainer else 1)
        streamed.epoch = trainer.current_epoch if trainer and shuffle else 0  # a resumed run goes on from there
        return DataLoader(streamed, batch_size=None)

    def train_dataloader(self) -> DataLoader:
        return self.loader(self.train_rows, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.validation_rows, shuffle=False)
