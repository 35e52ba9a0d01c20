"""Thin LightningModule around BatchfixNet, and the safe checkpoint loader.

Everything correction needs (modelled genes in genomic order, their coordinates, batch
categories, input scale, model hyperparameters) is saved as plain hyperparameters, and the
normalization statistics as buffers, so a checkpoint loads with `torch.load(weights_only=True)`:
no Hydra, no unpickling of arbitrary objects.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from batchfix.config import ModelConfig
from batchfix.data.atomic import atomic_output
from batchfix.data.genome import GeneCoordinates, LocusWindows, make_windows
from batchfix.errors import CheckpointError, CheckpointFormatError, TrainingError
from batchfix.nn.attention import EntropyMeter
from batchfix.nn.network import BatchfixNet

log = logging.getLogger(__name__)

# What a checkpoint records of the data it was trained on (hyperparameter `data`), and what checkpoints written
# before it was recorded are taken to have used: the defaults of that time.
TRAINED_DATA_OPTIONS = ("batch_key", "label_key", "counts_layer", "genome")
LEGACY_DATA_OPTIONS = {"batch_key": "batch", "label_key": None, "counts_layer": None, "genome": "GRCh38"}

ENTROPY_PREFIX = "attention_entropy"  # logged per epoch as attention_entropy_layer{l}_head{h} (nats)
COLLAPSED_NATS = 0.1  # a head below this mean entropy puts nearly all its weight on one token
UNIFORM_SHARE = 0.98  # a head above this share of log(tokens) weighs every token nearly alike


class BatchfixModule(pl.LightningModule):
    """Training plan: negative ELBO with KL warm-up, AdamW, cosine decay, logged losses."""

    def __init__(self, model: dict, genes: list[str], chromosome: list[str | None], start: list[int],
                 end: list[int], batch_categories: list[str], scale: str = "counts",
                 learning_rate: float = 2e-3, weight_decay: float = 1e-4, kl_warmup_fraction: float = 0.3,
                 planned_steps: int = 1000, data: dict | None = None, correction: dict | None = None,
                 extra_genes: list[str] | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model_config = ModelConfig(**model)
        coordinates = GeneCoordinates(np.array(chromosome, dtype=object), np.array(start), np.array(end))
        self.windows: LocusWindows = make_windows(coordinates, self.model_config.genes_per_token)
        n_genes = len(genes)
        self.net = BatchfixNet(self.model_config, self.windows, n_genes, len(batch_categories),
                               gene_mean=np.zeros(n_genes), gene_std=np.ones(n_genes))
        if extra_genes:  # the genes the encoder does not read, corrected through a second decoder
            self.net.add_extra_genes(len(extra_genes))
        self.entropy = EntropyMeter(self.model_config.n_layers, self.model_config.n_heads)
        self.last_entropy: torch.Tensor | None = None  # (layers, heads) of the last validation epoch
        self.warned_heads: set[tuple[int, int]] = set()

    def set_normalization(self, gene_mean: np.ndarray, gene_std: np.ndarray) -> None:
        """Standardization statistics of the training data (saved with the weights)."""
        self.net.gene_mean.copy_(torch.as_tensor(gene_mean))
        self.net.gene_std.copy_(torch.as_tensor(gene_std))

    def kl_scale(self) -> float:
        warmup = max(1, int(self.hparams.kl_warmup_fraction * self.hparams.planned_steps))
        return min(1.0, (self.global_step + 1) / warmup)

    def training_step(self, batch, batch_idx):
        values, batch_index = batch
        losses = self.net.loss(values, batch_index, kl_scale=self.kl_scale())
        if not torch.isfinite(losses["loss"]):
            raise TrainingError(
                f"Training diverged: the loss is {losses['loss'].item()} at step {self.global_step} (epoch "
                f"{self.current_epoch}). Lower fit.learning_rate (now {self.hparams.learning_rate:g}), keep "
                "trainer.gradient_clip_val set, or check the input for extreme values.")
        self.log_dict({f"train_{k}": v for k, v in losses.items()}, prog_bar=False, on_step=False, on_epoch=True,
                      batch_size=values.shape[0], sync_dist=True)  # sync_dist: mean over DDP processes
        self.log("loss", losses["loss"], prog_bar=True, on_step=True, on_epoch=False, logger=False)
        return losses["loss"]

    def validation_step(self, batch, batch_idx):
        values, batch_index = batch
        with self.net.encoder.observing(self.entropy.add):
            losses = self.net.loss(values, batch_index, kl_scale=1.0)
        self.log_dict({f"val_{k}": v for k, v in losses.items()}, batch_size=values.shape[0], sync_dist=True)

    def on_validation_epoch_start(self):
        """Attention entropy is measured on the validation cells only: no cost in the training steps."""
        self.entropy = EntropyMeter(self.model_config.n_layers, self.model_config.n_heads)

    def on_validation_epoch_end(self):
        entropy = self.entropy.mean()  # (layers, heads)
        self.log_dict({f"{ENTROPY_PREFIX}_layer{layer}_head{head}": float(entropy[layer, head])
                       for layer in range(entropy.shape[0]) for head in range(entropy.shape[1])}, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.last_entropy = entropy
            self.warn_heads(entropy < COLLAPSED_NATS, f"collapsed onto single tokens (entropy < {COLLAPSED_NATS} nats)")

    def on_fit_end(self):
        if self.last_entropy is not None:
            uniform = self.last_entropy > UNIFORM_SHARE * math.log(self.windows.n_tokens)
            self.warn_heads(uniform, f"stayed near uniform (entropy > {UNIFORM_SHARE:.0%} of log(tokens))")

    def warn_heads(self, flagged: torch.Tensor, what: str) -> None:
        """One warning naming the (layer, head) pairs flagged that were not named before in this fit."""
        heads = [(layer, head) for layer, head in flagged.nonzero().tolist() if (layer, head) not in self.warned_heads]
        if heads and self.global_rank == 0:
            log.warning("Attention heads (layer, head) %s %s; see %s_* in logs/metrics.csv.", heads, what,
                        ENTROPY_PREFIX)
        self.warned_heads.update(heads)

    def parameter_groups(self) -> list[dict]:
        """AdamW groups: weight matrices (and embedding tables) decay; biases, LayerNorm scales and the
        NB dispersions (every parameter of fewer than 2 dimensions) do not, as in most transformer code."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameter_groups(), lr=self.hparams.learning_rate)
        # Cosine decay to 0.1 x learning_rate over planned_steps, then flat: a closed form of the step, so a
        # resumed run with more epochs follows its own plan (a restored CosineAnnealingLR would keep the old
        # T_max and climb back to the peak rate past it).
        planned = max(1, self.hparams.planned_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(step, planned) / planned)),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@dataclass
class BatchfixModel:
    """A trained batchfix model: the network plus what inference must check (genes, their order, batches).

    `BatchfixModel.load(path)` reads a checkpoint (a run folder's model.ckpt, or one `save` wrote);
    `save(path)` writes the same format; `batchfix.correct(adata, model)` adds corrected expression to an AnnData.
    """

    module: BatchfixModule
    path: Path | None = None  # the checkpoint file it was loaded from or last saved to

    @classmethod
    def load(cls, path: str | Path) -> "BatchfixModel":
        return load_trained(path)

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write a checkpoint that `load` and `python -m batchfix correct checkpoint=...` read (atomically)."""
        target = Path(path).expanduser()
        state = {"hyper_parameters": dict(self.module.hparams), "state_dict": self.module.state_dict(),
                 "pytorch-lightning_version": pl.__version__}
        with atomic_output(target, overwrite) as tmp:
            torch.save(state, tmp)
        self.path = target
        return target

    @property
    def config(self) -> ModelConfig:
        return self.module.model_config

    @property
    def net(self) -> BatchfixNet:
        return self.module.net

    @property
    def genes(self) -> list[str]:
        return list(self.module.hparams.genes)

    @property
    def extra_genes(self) -> list[str]:
        """The genes corrected through the second decoder (batchfix.correction.extra_genes), in its order."""
        return list(self.module.hparams.get("extra_genes") or [])

    @property
    def batch_categories(self) -> list[str]:
        return list(self.module.hparams.batch_categories)

    @property
    def scale(self) -> str:
        return self.module.hparams.scale

    @property
    def data_options(self) -> dict:
        """The data options it was trained with (TRAINED_DATA_OPTIONS), which `correct` takes as its defaults;
        a checkpoint written before they were saved gives the defaults of that time."""
        saved = self.module.hparams.get("data") or {}
        return {**LEGACY_DATA_OPTIONS, **saved, "scale": self.scale}

    @property
    def correction(self) -> dict | None:
        """The correction it was trained with ({'preset': name, 'options': every correction option}), which
        `correct` applies unless told otherwise; None for a checkpoint that does not record it."""
        return self.module.hparams.get("correction")

    def remember_correction(self, record: dict) -> None:
        """Keep `record` (batchfix.config.remembered_correction) as the correction `correct` applies by default."""
        self.module.hparams["correction"] = record


def load_trained(path: str | Path) -> BatchfixModel:
    """Load a batchfix checkpoint without executing code from the file (weights_only)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise CheckpointError(f"Checkpoint {path} is a folder: name the checkpoint file in it "
                              f"(e.g. {path}/model.ckpt).")
    if not path.is_file():
        raise CheckpointError(f"Checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"Cannot load checkpoint {path}: it is truncated, corrupt, or holds objects other than tensors "
            f"and plain values (refused for safety). {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
        ) from err
    if not isinstance(checkpoint, dict) or "hyper_parameters" not in checkpoint or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path} is not a batchfix checkpoint (no hyper_parameters/state_dict).")
    try:
        module = BatchfixModule(**checkpoint["hyper_parameters"])
        module.load_state_dict(checkpoint["state_dict"])
    except CheckpointFormatError:
        raise
    except (TypeError, RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path} does not match the batchfix model: {err}") from err
    module.eval()
    return BatchfixModel(module, path)
