"""The option groups of `train`: `data.*`, `model.*`, `fit.*` and `trainer.*` (each checked when made)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from batchfix.config.choices import (
    ATTENTION_BACKENDS,
    GENOMES,
    LIKELIHOODS,
    POSITION_ENCODINGS,
    PRECISIONS,
    SCALES,
    STREAM_CHOICES,
    TOKEN_IDENTITIES,
    UNPLACED_CHOICES,
    at_least,
    non_empty,
    one_of,
    within,
)
from batchfix.errors import ConfigError


@dataclass
class DataKeys:
    """Where a file keeps its batches, labels and counts (`data.*` of every verb)."""

    batch_key: str = "batch"  # obs column naming each cell's batch
    label_key: Optional[str] = None  # obs column of cell labels (scoring only); null = no labels
    counts_layer: Optional[str] = None  # null = X; else the layer holding raw counts

    def __post_init__(self):
        for name in ("batch_key", "label_key", "counts_layer"):
            non_empty(f"data.{name}", getattr(self, name))
        if self.label_key is not None and self.label_key == self.batch_key:
            raise ConfigError(f"data.label_key and data.batch_key both name obs column '{self.batch_key}'.")


@dataclass
class DataConfig(DataKeys):
    """The input file and how its genes become the model's tokens (`data.*` of train)."""

    path: Optional[str] = None  # .h5ad file; null = the bundled CellBench dataset
    scale: str = "counts"  # counts (negative binomial) | log (log-normalized input, Gaussian)
    n_top_genes: Optional[int] = 2000  # batch-aware highly variable genes; null = all genes
    genome: str = "GRCh38"  # GRCh38 | mm10: the bundled coordinate table for genes var does not place
    gtf: Optional[str] = None  # a GTF file to place genes instead of the bundled table
    unplaced: str = "keep"  # keep (a trailing 'unplaced' group) | drop genes with no coordinates
    # Training minibatches read from the file on disk instead of memory: true | false | auto (streamed when
    # the counts matrix, uncompressed, is larger than stream_above_gb: in memory it is held several times).
    stream: str = "auto"
    stream_above_gb: float = 2.0  # stream=auto streams a counts matrix larger than this, uncompressed
    chunk_cells: int = 16384  # streaming: cells held at a time, read as 16 blocks from random places of the file
    hvg_max_cells: int = 20000  # streaming: HVGs are ranked on a subsample of this many cells, stratified by batch

    def __post_init__(self):
        super().__post_init__()
        for name in ("path", "gtf"):
            non_empty(f"data.{name}", getattr(self, name))
        one_of("data.scale", self.scale, SCALES)
        one_of("data.genome", self.genome, GENOMES)
        one_of("data.unplaced", self.unplaced, UNPLACED_CHOICES)
        if self.n_top_genes is not None:
            at_least("data.n_top_genes", self.n_top_genes, 1, " (or null for all genes)")
        self.stream = str(self.stream).lower()  # Hydra reads data.stream=true as a boolean
        one_of("data.stream", self.stream, STREAM_CHOICES)
        at_least("data.stream_above_gb", self.stream_above_gb, 0.0)
        at_least("data.chunk_cells", self.chunk_cells, 16, " (16 blocks of at least one cell)")
        at_least("data.hvg_max_cells", self.hvg_max_cells, 100)


@dataclass
class ModelOptions:
    """Network hyperparameters (`model.*`); sizes derived from the data (genes, batches) are not options."""

    genes_per_token: int = 32  # genes per locus token; attention cost grows with (genes / genes_per_token)^2
    d_model: int = 64  # token width
    # attention heads; must divide d_model. 2 heads of 32 dims score as 4 heads of 16 did (bundled data and
    # sub-problems, 3 seeds) for 16-20% less fit time (docs/scale.md, Attention heads)
    n_heads: int = 2
    n_layers: int = 2  # transformer blocks
    dropout: float = 0.0  # dropout rate in the transformer blocks
    latent_dim: int = 30  # batch-free latent space
    decoder_hidden: int = 128  # hidden units of the decoder
    min_wavelength: float = 1e3  # bp; sinusoid wavelengths span min..max geometrically
    max_wavelength: float = 3e8  # bp; the longest sinusoid wavelength
    attention_block_size: Optional[int] = None  # queries per attention block (bounds memory); null = all at once
    # Recompute each transformer block in the backward pass instead of keeping its activations (and, with
    # attention_block_size, each block of queries too): bounds the training memory of per-gene tokens, at the
    # cost of the recomputation (docs/per-gene-tokens.md measures both).
    gradient_checkpointing: bool = False
    likelihood: str = "nb"  # nb on counts | gaussian (set automatically for data.scale=log)
    kl_weight: float = 1.0  # weight of the latent's KL term in the ELBO
    adversarial_weight: float = 10.0  # batch classifier on the latent through gradient reversal (0 = off)

    def __post_init__(self):
        for name in ("genes_per_token", "d_model", "n_heads", "n_layers", "latent_dim", "decoder_hidden"):
            at_least(f"model.{name}", getattr(self, name), 1)
        at_least("model.d_model", self.d_model, 2, " (the sinusoidal encoding needs a sine and a cosine)")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}).")
        within("model.dropout", self.dropout, 0.0, 1.0, high_open=True)
        if self.attention_block_size is not None:
            at_least("model.attention_block_size", self.attention_block_size, 1, " (or null: all queries at once)")
        one_of("model.likelihood", self.likelihood, LIKELIHOODS)
        if not 0 < self.min_wavelength < self.max_wavelength < math.inf:
            raise ConfigError("model.min_wavelength and model.max_wavelength must satisfy 0 < min < max, got "
                              f"{self.min_wavelength!r} and {self.max_wavelength!r}.")
        at_least("model.kl_weight", self.kl_weight, 0.0)
        at_least("model.adversarial_weight", self.adversarial_weight, 0.0)


@dataclass
class ModelAblations:
    """The network's ablations (`ablation.*` of train): each takes away, or adds, one part of what makes the model
    genome-aware and fp16-safe, to measure what that part is worth (docs/lab/genomic-position.md, docs/lab/scale.md).
    Their verdicts are written; the defaults are the product."""

    # Where a token's position comes from: real (sinusoids of its base-pair coordinate + a learned chromosome
    # vector) | shuffled (the same, coordinates permuted across tokens) | none | learned (a learned vector per
    # token, no coordinates). none and learned also switch the distance bias off, so that they use no genomic
    # coordinate at all.
    position_encoding: str = "real"
    # The permutation of position_encoding=shuffled; null = the run's seed (so each seed draws its own).
    shuffle_seed: Optional[int] = None
    # learned: each token has its own gene weights and a learned embedding | coordinates: one set of value
    # weights shared by every token, so the position encoding is all that tells tokens apart (with
    # position_encoding=none they are then interchangeable: the control of the ablation).
    token_identity: str = "learned"
    distance_bias: bool = False  # a learned per-head bias of the base-pair distance between tokens in attention
    distance_buckets: int = 16  # log-distance buckets of that bias, spanning min_wavelength..max_wavelength
    attention: str = "guarded"  # guarded (written-out softmax with the fp16 guards) | sdpa (torch's fused kernel)

    def __post_init__(self):
        one_of("ablation.attention", self.attention, ATTENTION_BACKENDS)
        one_of("ablation.position_encoding", self.position_encoding, POSITION_ENCODINGS)
        if self.shuffle_seed is not None:
            within("ablation.shuffle_seed", self.shuffle_seed, 0, 2**32 - 1)
        one_of("ablation.token_identity", self.token_identity, TOKEN_IDENTITIES)
        at_least("ablation.distance_buckets", self.distance_buckets, 2)


@dataclass
class ModelConfig(ModelOptions, ModelAblations):
    """The network a checkpoint describes: the `model.*` options and the network's `ablation.*` switches together
    (a checkpoint's `model` hyperparameter; `batchfix.training.fitting.network_config` makes it)."""

    def __post_init__(self):
        ModelOptions.__post_init__(self)
        ModelAblations.__post_init__(self)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class FitConfig:
    """The optimisation (`fit.*`)."""

    batch_size: int = 128  # cells per minibatch
    learning_rate: float = 2e-3  # AdamW peak rate; cosine decay to 0.1x over the planned steps
    weight_decay: float = 1e-4  # AdamW decay of weight matrices (biases and LayerNorm are not decayed)
    kl_warmup_fraction: float = 0.3  # share of the planned steps over which the KL weight ramps 0 -> 1
    validation_fraction: float = 0.1  # held-out cells for early stopping (none below 50 cells) ...
    max_validation_cells: int = 10000  # ... but at most this many (a validation pass per epoch costs their forward)
    early_stopping_patience: int = 10  # epochs without a better validation ELBO; 0 = off
    # With trainer.max_epochs=null: epochs = ceil(target_steps / steps per epoch), but at least min_auto_epochs
    # (one pass: every cell seen) and at most max_auto_epochs. Measured (docs/scale.md, Step budget): scIB Total
    # peaks near 500 steps on the bundled 1,021 cells and on 10,000 resampled cells and falls beyond.
    target_steps: int = 500
    min_auto_epochs: int = 1  # with trainer.max_epochs=null: at least this many epochs ...
    max_auto_epochs: int = 400  # ... and at most this many

    def __post_init__(self):
        at_least("fit.batch_size", self.batch_size, 1)
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ConfigError(f"fit.learning_rate must be a finite number > 0, got {self.learning_rate!r}.")
        at_least("fit.weight_decay", self.weight_decay, 0.0)
        within("fit.kl_warmup_fraction", self.kl_warmup_fraction, 0.0, 1.0)
        within("fit.validation_fraction", self.validation_fraction, 0.0, 1.0, high_open=True)
        at_least("fit.max_validation_cells", self.max_validation_cells, 1)
        at_least("fit.early_stopping_patience", self.early_stopping_patience, 0, " (0 = off)")
        at_least("fit.target_steps", self.target_steps, 1)
        at_least("fit.min_auto_epochs", self.min_auto_epochs, 1)
        at_least("fit.max_auto_epochs", self.max_auto_epochs, self.min_auto_epochs, " (fit.min_auto_epochs)")


@dataclass
class TrainerConfig:
    """Lightning Trainer arguments (`trainer.*`)."""

    accelerator: str = "auto"  # auto | cpu | gpu | ...
    devices: Any = 1  # number of devices, a list of indices, or "auto"
    strategy: str = "auto"  # auto | ddp | ddp_find_unused_parameters_true | ...
    num_nodes: int = 1  # machines to train on (DDP)
    # null = 16-mixed on a GPU; on CPU bf16-mixed where it has bf16 matrix units (AMX), else 32-true
    precision: Optional[str] = None
    max_epochs: Optional[int] = None  # null = sized to the data (fit.target_steps)
    gradient_clip_val: Optional[float] = 1.0  # gradients clipped to this norm; null = not clipped
    log_every_n_steps: int = 5  # steps between the losses logged to logs/metrics.csv
    enable_progress_bar: bool = True  # Lightning's progress bar during training
    enable_model_summary: bool = False  # print the table of layers before training
    deterministic: bool = False  # deterministic algorithms only (slower; reproducible runs on a GPU)

    def __post_init__(self):
        if self.precision is not None:
            one_of("trainer.precision", str(self.precision), PRECISIONS)
        if self.max_epochs is not None:
            at_least("trainer.max_epochs", self.max_epochs, 1, " (or null: sized to the data)")
        if self.gradient_clip_val is not None:
            at_least("trainer.gradient_clip_val", self.gradient_clip_val, 0.0)
        at_least("trainer.log_every_n_steps", self.log_every_n_steps, 1)
        at_least("trainer.num_nodes", self.num_nodes, 1)
        devices = self.devices
        if isinstance(devices, bool) or not (
            devices == "auto" or (isinstance(devices, int) and (devices >= 1 or devices == -1))
            or (isinstance(devices, (list, tuple)) and devices and all(isinstance(d, int) and d >= 0 for d in devices))
        ):
            raise ConfigError(f"trainer.devices must be a positive count, -1 (all), a list of device indices or "
                              f"'auto', got {devices!r}.")
