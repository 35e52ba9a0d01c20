"""The training plan: a thin LightningModule around BatchfixNet. Its hyperparameters are a checkpoint's, and
its network is built as batchfix.training.trained builds it, where checkpoints are loaded for inference."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytorch_lightning as pl
import torch

from batchfix.errors import TrainingError
from batchfix.nn.attention import EntropyMeter
from batchfix.training.tables import tables_from_network_keys
from batchfix.training.trained import network_parts

log = logging.getLogger(__name__)

ENTROPY_PREFIX = "attention_entropy"  # logged per epoch as attention_entropy_layer{l}_head{h} (nats)
COLLAPSED_NATS = 0.1  # a head below this mean entropy puts nearly all its weight on one token
UNIFORM_SHARE = 0.98  # a head above this share of log(tokens) weighs every token nearly alike


class BatchfixModule(pl.LightningModule):
    """Training plan: negative ELBO with KL warm-up, AdamW, cosine decay, logged losses."""

    def __init__(self, model: dict, genes: list[str], chromosome: list[str | None], start: list[int],
                 end: list[int], batch_categories: list[str], scale: str = "counts",
                 learning_rate: float = 2e-3, weight_decay: float = 1e-4, kl_warmup_fraction: float = 0.3,
                 planned_steps: int = 1000, data: dict | None = None, correction: dict | None = None,
                 extra_genes: list[str] | None = None, recommendation: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model_config, self.windows, self.net, self.tables = network_parts(model, genes, chromosome, start, end,
                                                                               batch_categories, extra_genes)
        self._register_load_state_dict_pre_hook(tables_from_network_keys, with_module=True)
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
