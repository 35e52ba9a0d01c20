"""Every option of batchfix: its type, its one default, and the values it accepts.

These dataclasses are the schemas Hydra composes the YAML presets of `conf/` onto (registered in
Hydra's ConfigStore by `register_schemas`), so a value of the wrong type is refused while the
command line is parsed (`fit.batch_size=abc`). Ranges and combinations are checked in each
schema's `__post_init__`, which runs when a composed config becomes these objects (`validated`),
and when the Python API builds them from keyword options (`train_config`): no option reaches
torch or scanpy unchecked, and every error names the option and what it accepts.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchfix.errors import ConfigError

GENOMES = ("GRCh38", "mm10")
SCALES = ("counts", "log")
UNPLACED_CHOICES = ("keep", "drop")
ATTENTION_BACKENDS = ("guarded", "sdpa")
POSITION_ENCODINGS = ("real", "shuffled", "none", "learned")
TOKEN_IDENTITIES = ("learned", "coordinates")
LIKELIHOODS = ("nb", "gaussian")
PRECISIONS = ("32-true", "32", "16-mixed", "16", "bf16-mixed", "bf16", "64-true", "64")
STREAM_CHOICES = ("auto", "true", "false")
OUTPUT_MODES = ("counterfactual", "denoised")
REGIONAL_SHIFTS = ("apply", "keep", "keep_all", "keep_input")  # batchfix.correction.regional.RegionalShift
REGIONAL_ORDERS = ("genome", "shuffled")
SPREADS = ("batch", "gene")  # the counterfactual output's residual scale: one per batch | per gene and batch, shrunk
NEIGHBOR_METHODS = ("auto", "exact", "approximate")  # how batchfix.eval.metrics finds the scores' neighbour graphs


def one_of(option: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{option} must be one of {list(choices)}, got {value!r}.")


def at_least(option: str, value, minimum, what: str = "") -> None:
    if not (value >= minimum and math.isfinite(value)):  # NaN and inf are refused too
        raise ConfigError(f"{option} must be >= {minimum}{what}, got {value!r}.")


def within(option: str, value, low, high, high_open: bool = False) -> None:
    if not (low <= value < high if high_open else low <= value <= high):  # False for NaN
        raise ConfigError(f"{option} must be in [{low}, {high}{')' if high_open else ']'}, got {value!r}.")


def non_empty(option: str, value) -> None:
    if value is not None and not str(value).strip():
        raise ConfigError(f"{option} must name something (got an empty string); use null to leave it unset.")


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
class ModelConfig:
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
    attention: str = "guarded"  # guarded (written-out softmax with the fp16 guards) | sdpa (fused kernel)
    # Where a token's position comes from: real (sinusoids of its base-pair coordinate + a learned chromosome
    # vector) | shuffled (the same, coordinates permuted across tokens) | none | learned (a learned vector per
    # token, no coordinates). shuffled, none and learned are ablations; none and learned also switch the
    # distance bias off, so that they use no genomic coordinate at all.
    position_encoding: str = "real"
    # The permutation of position_encoding=shuffled; null = the run's seed (so each seed draws its own).
    shuffle_seed: Optional[int] = None
    # learned: each token has its own gene weights and a learned embedding | coordinates: one set of value
    # weights shared by every token, so the position encoding is all that tells tokens apart (with
    # position_encoding=none they are then interchangeable: the control of the ablation).
    token_identity: str = "learned"
    distance_bias: bool = False  # a learned per-head bias of the base-pair distance between tokens in attention
    distance_buckets: int = 16  # log-distance buckets of that bias, spanning min_wavelength..max_wavelength
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
        one_of("model.attention", self.attention, ATTENTION_BACKENDS)
        one_of("model.position_encoding", self.position_encoding, POSITION_ENCODINGS)
        if self.shuffle_seed is not None:
            within("model.shuffle_seed", self.shuffle_seed, 0, 2**32 - 1)
        one_of("model.token_identity", self.token_identity, TOKEN_IDENTITIES)
        at_least("model.distance_buckets", self.distance_buckets, 2)
        if self.attention_block_size is not None:
            at_least("model.attention_block_size", self.attention_block_size, 1, " (or null: all queries at once)")
        one_of("model.likelihood", self.likelihood, LIKELIHOODS)
        if not 0 < self.min_wavelength < self.max_wavelength < math.inf:
            raise ConfigError("model.min_wavelength and model.max_wavelength must satisfy 0 < min < max, got "
                              f"{self.min_wavelength!r} and {self.max_wavelength!r}.")
        at_least("model.kl_weight", self.kl_weight, 0.0)
        at_least("model.adversarial_weight", self.adversarial_weight, 0.0)

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


@dataclass
class EvaluationOptions:
    """How a corrected file is scored (`evaluation.*` of train and evaluate)."""

    # Larger files are scored (scIB metrics and UMAP) on a subsample of this many cells, stratified by batch x label.
    max_cells: int = 20000
    # Neighbour graphs of the scores and UMAP: exact (brute force) | approximate (pynndescent, scib-metrics'
    # default; compiled again by every process: 20-45 s) | auto (exact up to 50,000 scored cells, else approximate)
    neighbors: str = "auto"

    def __post_init__(self):
        at_least("evaluation.max_cells", self.max_cells, 100)
        one_of("evaluation.neighbors", self.neighbors, NEIGHBOR_METHODS)


@dataclass
class CorrectionOptions:
    """How corrected expression is made, in `train`'s run folder and by `correct`."""

    PREFIX: ClassVar[str] = "correction."  # how the options are named in messages
    # counterfactual: each cell's own expression with only what its batch explains removed (for DE and
    # markers; needs the batch column) | denoised: every cell decoded from its latent (clustering, pictures)
    output_mode: str = "counterfactual"
    reference: Optional[str] = None  # a training batch to express every cell as; null / average = all batches
    key_added: str = "batchfix"  # writes layers[KEY], var[KEY_modelled], obsm[X_KEY], uns[KEY]
    # Counterfactual output: what happens to the part of a cell's state-dependent batch shift that is smooth
    # along the genome (copy-number-like: batchfix.correction.counterfactual): keep (its deviation from the
    # batch's mean shift is left in the cell: a clone found in one batch keeps its CNVs) | apply (removed with
    # the rest) | keep_all (its deviation from the mean shift over all cells: a batch-wide regional shift, e.g.
    # a patient whose cells all carry one CNV, is kept too) | keep_input (the regional part of the whole change
    # the output makes to the cell, beyond the mean change over all cells, is not made: each cell keeps its
    # input's regional profile; the one that keeps a patient's CNVs whatever its batch's location and spread)
    regional_shift: str = "keep"
    regional_window: int = 100  # genes of the running mean along each chromosome that defines "regional"
    # genome (neighbours along the real coordinates) | shuffled (ablation: a random gene order drawn with
    # regional_seed, so "neighbours" are unrelated genes)
    regional_order: str = "genome"
    regional_seed: int = 0  # the random gene order of regional_order=shuffled
    # The counterfactual output's residual scale k: batch = one spread per batch | gene = a spread per gene and
    # batch, shrunk toward the batch's level (empirical Bayes, as ComBat's scale; docs/genewise_spread.md)
    spread: str = "batch"
    # Counterfactual output: the share of the decoder's state dependence of the batch shift that is applied.
    # 1 = all of it (each cell's own shift decoded_ref(z) - decoded_b(z)); 0 = its mean over the batch's cells
    # in the input, one shift per gene and batch, as ComBat's; between = mean + weight * (cell - mean).
    # Lower keeps DE ranks and markers closer to the input's, at a cost in mixing (docs/genewise_spread.md)
    state_dependence: float = 1.0
    # Counterfactual output: the share of each cell's residual (its own deviation from what the decoder expects in
    # its batch) that is kept, on top of the spread k_b. 1 = all of it; 0 = none: the denoised output (decoded as
    # the reference) plus the reference's location; between trades within-type neighbours and HVGs for mixing and
    # clustering scores (docs/genewise_spread.md)
    residual_weight: float = 1.0
    # Corrected counts: the seed of each count's randomised quantile (a counter-based draw per seed, cell and gene:
    # the same counts for the same input in every run, streamed or in memory)
    seed: int = 0

    def __post_init__(self):
        within(f"{self.PREFIX}seed", self.seed, 0, 2**32 - 1)
        one_of(f"{self.PREFIX}output_mode", self.output_mode, OUTPUT_MODES)
        one_of(f"{self.PREFIX}spread", self.spread, SPREADS)
        one_of(f"{self.PREFIX}regional_shift", self.regional_shift, REGIONAL_SHIFTS)
        one_of(f"{self.PREFIX}regional_order", self.regional_order, REGIONAL_ORDERS)
        at_least(f"{self.PREFIX}regional_window", self.regional_window, 2)
        within(f"{self.PREFIX}state_dependence", self.state_dependence, 0.0, 1.0)
        within(f"{self.PREFIX}residual_weight", self.residual_weight, 0.0, 1.0)
        within(f"{self.PREFIX}regional_seed", self.regional_seed, 0, 2**32 - 1)
        non_empty(f"{self.PREFIX}reference", self.reference)
        if self.key_added is None or not str(self.key_added).strip():
            raise ConfigError(f"{self.PREFIX}key_added must be a non-empty name, got {self.key_added!r}.")
        if "/" in self.key_added:
            raise ConfigError(f"{self.PREFIX}key_added must not contain '/', got {self.key_added!r}.")


@dataclass
class InferenceOptions:
    """How many cells correction handles at a time."""

    chunk_size: int = 4096  # cells read, corrected and written at a time (memory grows with it)
    # Cells per forward pass: on CPU the attention over ~60 locus tokens runs 2-4x faster per cell in
    # batches of 64-128 than of thousands (its (cells, heads, tokens, tokens) scores stay in cache).
    batch_size: int = 128
    max_missing_fraction: float = 0.2  # refuse when more of the model's genes than this are missing
    # Dynamically quantized int8 linear layers (CPU): corrected values move slightly, and it was not faster on the
    # default model (docs/benchmarks.md, INT8).
    int8: bool = False

    def __post_init__(self):
        at_least("chunk_size", self.chunk_size, 1)
        at_least("batch_size", self.batch_size, 1)
        within("max_missing_fraction", self.max_missing_fraction, 0.0, 1.0)


@dataclass
class CorrectionSettings(CorrectionOptions, InferenceOptions):
    """Everything the correction core needs besides the data and the model."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self):
        CorrectionOptions.__post_init__(self)
        InferenceOptions.__post_init__(self)


@dataclass
class TrainConfig:
    """`python -m batchfix train`: fit a model, write model.ckpt, corrected.h5ad and metrics.json."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    correction: CorrectionOptions = field(default_factory=CorrectionOptions)
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    seed: int = 0  # 0 .. 2**32 - 1 (what numpy accepts)
    threads: Optional[int] = None  # torch CPU threads; null = torch's default (all cores)
    resume: Optional[str] = None  # a previous run folder: continue from its checkpoints/last.ckpt
    overwrite: bool = False  # train into a run folder that holds a run: its outputs and checkpoints are deleted first
    evaluate: bool = True  # score batch mixing into metrics.json when data.label_key is set

    def __post_init__(self):
        within("seed", self.seed, 0, 2**32 - 1)
        if self.threads is not None:
            at_least("threads", self.threads, 1, " (or null: all cores)")
        non_empty("resume", self.resume)
        if self.data.scale == "counts" and self.model.likelihood == "gaussian":
            raise ConfigError("model.likelihood=gaussian is for log-scale input: set data.scale=log as well.")


@dataclass
class CorrectConfig(CorrectionSettings):
    """`python -m batchfix correct`: add corrected expression to an .h5ad with a trained checkpoint."""

    input: Optional[str] = None  # .h5ad to correct; null = the bundled dataset
    output: Optional[str] = None  # null = <input name>.corrected.h5ad in the working folder
    checkpoint: Optional[str] = None  # a run folder's model.ckpt
    counts_layer: Optional[str] = None  # the layer holding raw counts; X = the X matrix; null = as in training
    batch_key: Optional[str] = None  # obs column of each cell's batch (counterfactual); null = as in training
    all_batches_new: bool = False  # accept an input none of whose batches the model was trained on
    overwrite: bool = False  # replace an existing output
    progress: bool = True  # progress bar (cells/s) on stderr
    threads: Optional[int] = None  # torch CPU threads; null = torch's default (all cores)

    def __post_init__(self):
        super().__post_init__()
        for name in ("input", "output", "counts_layer", "batch_key"):
            non_empty(name, getattr(self, name))
        if not self.checkpoint or not str(self.checkpoint).strip():
            raise ConfigError("correct needs checkpoint=<run folder>/model.ckpt.")
        if self.threads is not None:
            at_least("threads", self.threads, 1, " (or null: all cores)")


@dataclass
class EvaluateConfig:
    """`python -m batchfix evaluate`: score a corrected file's batch mixing and biology conservation."""

    input: Optional[str] = None  # a corrected .h5ad; null = the bundled dataset
    data: DataKeys = field(default_factory=DataKeys)  # counts_layer: the uncorrected counts to compare with
    key_added: str = CorrectionOptions.key_added  # the key the correction was written under
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    overwrite: bool = False  # replace the metrics of a run folder (or an earlier evaluation's) evaluated into

    def __post_init__(self):
        non_empty("input", self.input)
        if not self.key_added or not str(self.key_added).strip():
            raise ConfigError(f"key_added must be a non-empty name, got {self.key_added!r}.")


@dataclass
class AttentionConfig:
    """`python -m batchfix attention`: mean attention between loci along the genome, per group of cells."""

    input: Optional[str] = None  # .h5ad whose cells are encoded; null = the bundled dataset
    checkpoint: Optional[str] = None  # a run folder's model.ckpt
    output: Optional[str] = None  # folder for attention.png and attention.npz; null = <input name>.attention
    group_by: Optional[str] = DataKeys.batch_key  # obs column: one map per value; null = all cells together
    counts_layer: Optional[str] = None  # null = X; else the layer holding raw counts
    max_cells: Optional[int] = 2000  # cells drawn at random (seed 0) to average over; null = every cell
    resolution: int = 256  # loci per axis at most: beyond it neighbouring tokens are averaged into bins
    batch_size: int = InferenceOptions.batch_size  # cells per forward pass
    max_missing_fraction: float = InferenceOptions.max_missing_fraction  # refuse when more model genes are missing
    overwrite: bool = False  # replace existing attention.png / attention.npz
    threads: Optional[int] = None  # torch CPU threads; null = torch's default (all cores)

    def __post_init__(self):
        for name in ("input", "output", "group_by", "counts_layer"):
            non_empty(name, getattr(self, name))
        if not self.checkpoint or not str(self.checkpoint).strip():
            raise ConfigError("attention needs checkpoint=<run folder>/model.ckpt.")
        if self.max_cells is not None:
            at_least("max_cells", self.max_cells, 1, " (or null: every cell)")
        at_least("resolution", self.resolution, 2)
        at_least("batch_size", self.batch_size, 1)
        within("max_missing_fraction", self.max_missing_fraction, 0.0, 1.0)
        if self.threads is not None:
            at_least("threads", self.threads, 1, " (or null: all cores)")


SCHEMAS = {"train": TrainConfig, "correct": CorrectConfig, "evaluate": EvaluateConfig, "attention": AttentionConfig}
GROUP_SCHEMAS = {"data": DataConfig, "model": ModelConfig, "fit": FitConfig, "trainer": TrainerConfig}


def register_schemas() -> None:
    """Put every schema in Hydra's ConfigStore: `<verb>_schema` for the verbs, `<group>/schema` for groups."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for verb, schema in SCHEMAS.items():
        store.store(name=f"{verb}_schema", node=schema)
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name="schema", node=schema)


def readable(err: OmegaConfBaseException) -> str:
    """One line from an OmegaConf error: the option and what was wrong with it."""
    message = str(getattr(err, "msg", None) or err).splitlines()[0]
    key = getattr(err, "full_key", None)
    return f"{key}: {message}" if key and not message.startswith(str(key)) else message


def dotted_options(schema: type, prefix: str = "") -> list[str]:
    """Every option of a schema by its dotted name (`model.n_heads`, `seed`), groups expanded."""
    names = []
    for f in fields(schema):
        group = f.default_factory if is_dataclass(f.default_factory) else None
        names += dotted_options(group, f"{prefix}{f.name}.") if group else [f"{prefix}{f.name}"]
    return names


def unknown_option_error(key: str, schema: type) -> ConfigError:
    """'Unknown option X; did you mean Y?', the suggestions drawn from the schema's own option names."""
    known = dotted_options(schema)
    by_last = {name.rpartition(".")[2]: name for name in known}
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.7)
    close += [by_last[n] for n in difflib.get_close_matches(key.rpartition(".")[2], by_last, n=3, cutoff=0.7)]
    close = list(dict.fromkeys(close))[:3]
    hint = f"; did you mean {' or '.join(f'`{name}`' for name in close)}?" if close else "."
    verb = next((v for v, s in SCHEMAS.items() if s is schema), None)
    where = f" `python -m batchfix {verb} --help` lists them." if verb else ""
    return ConfigError(f"Unknown option `{key}`{hint}{where}")


def unknown_options(cfg: DictConfig | dict, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of `cfg` that `schema` does not have (Hydra's own `hydra` node aside)."""
    names = {f.name: f for f in fields(schema)}
    unknown = []
    for key in cfg:
        if not prefix and key == "hydra":
            continue
        f = names.get(str(key))
        group = f.default_factory if f is not None and is_dataclass(f.default_factory) else None
        if f is None:
            unknown.append(f"{prefix}{key}")
        elif group is not None and isinstance(cfg[key], (dict, DictConfig)):
            unknown += unknown_options(cfg[key], group, f"{prefix}{key}.")
    return unknown


def validated(cfg: DictConfig | dict, schema: type):
    """The composed config as schema objects; every range and combination checked (ConfigError). A key the
    schema does not have (`+model.n_head=4`) is refused, with the option names closest to it."""
    unknown = unknown_options(cfg, schema)
    if unknown:
        raise unknown_option_error(unknown[0], schema)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(readable(err)) from None


def field_comments(schema: type) -> dict[str, str]:
    """{field: its comment in this file} for a schema and the schemas it extends: the comment ending the field's
    line, else the comment lines just above it. These comments are the options' one description (--help,
    the API's docstrings)."""
    import inspect
    import io
    import tokenize

    comments: dict[str, str] = {}
    for cls in reversed([c for c in schema.__mro__ if is_dataclass(c)]):
        lines = inspect.getsource(cls).splitlines()
        by_line = {token.start[0] - 1: token.string.lstrip("#").strip()
                   for token in tokenize.generate_tokens(io.StringIO("\n".join(lines)).readline)
                   if token.type == tokenize.COMMENT}
        for number, line in enumerate(lines):
            name = line.strip().split(":", 1)[0]
            if not line.startswith("    ") or line.startswith("     ") or not name.isidentifier() or ":" not in line:
                continue
            above = []
            while number - len(above) - 1 in by_line and lines[number - len(above) - 1].strip().startswith("#"):
                above.insert(0, by_line[number - len(above) - 1])
            text = by_line.get(number) if number in by_line and not line.strip().startswith("#") else None
            if text or above:
                comments[name] = text or " ".join(above)
    return comments


def option_descriptions(schema: type, prefix: str = "") -> dict[str, str]:
    """{dotted option: its description} of every option of a schema (groups expanded; '' where none)."""
    comments = field_comments(schema)
    out: dict[str, str] = {}
    for f in fields(schema):
        group = f.default_factory if is_dataclass(f.default_factory) else None
        if group is not None:
            out.update(option_descriptions(group, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = comments.get(f.name, "")
    return out


def flat_option_names(schema: type = TrainConfig) -> dict[str, str]:
    """{option name: dotted key} of a schema's options, e.g. {'n_heads': 'model.n_heads', 'seed': 'seed'}."""
    names: dict[str, str] = {}
    for top in fields(schema):
        group = top.default_factory if is_dataclass(top.default_factory) else None
        pairs = [(f.name, f"{top.name}.{f.name}") for f in fields(group)] if group else [(top.name, top.name)]
        for name, dotted in pairs:
            if name in names:
                raise AssertionError(f"option name '{name}' is ambiguous: {names[name]} and {dotted}")
            names[name] = dotted
    return names
