"""Each verb's schema (`train`, `correct`, `evaluate`, `attention`), the correction, inference and evaluation
options they share, and their registration in Hydra's ConfigStore."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, List, Optional

from batchfix.config.choices import (
    DEPTHS,
    NEIGHBOR_METHODS,
    OUTPUT_MODES,
    REGIONAL_ORDERS,
    REGIONAL_SHIFTS,
    RETIRED_REGIONAL_SHIFTS,
    SHRINKS,
    SPREADS,
    at_least,
    non_empty,
    one_of,
    thread_count,
    within,
)
from batchfix.config.groups import DataConfig, DataKeys, FitConfig, ModelAblations, ModelOptions, TrainerConfig
from batchfix.errors import ConfigError


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
    # Counterfactual output: what happens to the part of a cell's batch shift that is smooth along the genome
    # (copy-number-like: batchfix.correction.regional): keep (its deviation from the batch's mean shift is left in
    # the cell: a clone found in one batch keeps its CNVs) | keep_input (the regional part of the whole change the
    # output makes to the cell, beyond the mean change over all cells, is not made: each cell keeps its input's
    # regional profile, a patient's CNVs whatever its batch's location and spread) | reference_cells (each batch's
    # regional part taken from its normal cells, named by normal_key / normal_values) | apply (removed with the rest)
    regional_shift: str = "keep"
    regional_window: int = 100  # genes of the running mean along each chromosome that defines "regional"
    # regional_shift=reference_cells: the obs column and its values that mark cells known to be diploid, as
    # infercnv's reference groups (set at correct time, no retraining; counts or log scale). The regional part of
    # each batch's correction is taken from its normal cells (their regional level, shrunk by its noise, brought to
    # the batches' mean): a batch's regional artefact leaves all its cells, a clone all its malignant cells carry
    # stays. A batch with fewer than 20 normal cells keeps its cells' regional profile. Name normal cells of the
    # same types in every batch (docs/cnv.md, Reference cells).
    normal_key: Optional[str] = None
    normal_values: List[str] = field(default_factory=list)  # normal_key's values marking normal cells
    # Spread. Corrected counts: batch = each count keeps its batch's NB dispersion, only the mean moves | gene = mapped
    # to the reference's per-gene dispersion (more mixing, fewer genes kept; docs/results.md). Log-scale output: the
    # residual scale k, one per batch | per gene and batch, shrunk toward the batch's (docs/genewise_spread.md)
    spread: str = "batch"
    # Counterfactual output: the share of the decoder's state dependence of the batch shift that is applied.
    # 1 = all of it (each cell's own shift decoded_ref(z) - decoded_b(z)); 0 = its mean over the batch's cells
    # in the input, one shift per gene and batch, as ComBat's; between = mean + weight * (cell - mean), the mean
    # over the batch's cells in the cell's state group (with evidence weights: k-means groups of the latent, which
    # the corrected counts' weights are also taken in; docs/lab/state-groups.md). 0.5 by default: every gene line
    # up against 1 on the three development sets and against a stress set's truth (docs/results.md, Which form is
    # the default)
    state_dependence: float = 0.5
    # Corrected counts: evidence = each batch's shift of each gene weighted by how well the batch's cells measure it
    # (empirical Bayes across genes, centred on no shift: a shift within its own noise is not applied, a
    # well-measured one passes whole; batchfix.correction.evidence) | none = every estimated shift applied in full
    shrink: str = "evidence"
    # Corrected counts: keep = each cell keeps its library (sequencing depth), only its genes' shares move | reference
    # = each batch's typical library is brought to the reference's, measured within state groups and weighed as one
    # number per batch (a plate sequenced at half the depth is raised; a depth difference within its noise moves
    # nothing; a gene a batch lacks stays absent; batchfix.correction.library_shift, docs/lab/library-shift.md)
    depth: str = "keep"
    # Counterfactual output: the share of each cell's residual (its own deviation from what the decoder expects in
    # its batch) that is kept, on top of the spread k_b. 1 = all of it; 0 = none: the denoised output (decoded as
    # the reference) plus the reference's location; between trades within-type neighbours and HVGs for mixing and
    # clustering scores (docs/genewise_spread.md)
    residual_weight: float = 1.0

    def __post_init__(self):
        one_of(f"{self.PREFIX}output_mode", self.output_mode, OUTPUT_MODES)
        one_of(f"{self.PREFIX}spread", self.spread, SPREADS)
        one_of(f"{self.PREFIX}shrink", self.shrink, SHRINKS)
        one_of(f"{self.PREFIX}depth", self.depth, DEPTHS)
        if self.regional_shift in RETIRED_REGIONAL_SHIFTS:
            raise ConfigError(f"{self.PREFIX}regional_shift={self.regional_shift} is retired: "
                              f"{RETIRED_REGIONAL_SHIFTS[self.regional_shift]}.")
        one_of(f"{self.PREFIX}regional_shift", self.regional_shift, REGIONAL_SHIFTS)
        at_least(f"{self.PREFIX}regional_window", self.regional_window, 2)
        within(f"{self.PREFIX}state_dependence", self.state_dependence, 0.0, 1.0)
        within(f"{self.PREFIX}residual_weight", self.residual_weight, 0.0, 1.0)
        non_empty(f"{self.PREFIX}reference", self.reference)
        non_empty(f"{self.PREFIX}normal_key", self.normal_key)
        if (self.normal_key is None) != (not self.normal_values):
            raise ConfigError(f"{self.PREFIX}normal_key and {self.PREFIX}normal_values go together: the obs column "
                              f"and its values that mark normal cells (e.g. {self.PREFIX}normal_key=cell_type "
                              f"{self.PREFIX}normal_values=[T_cell,fibroblast]); got normal_key={self.normal_key!r}, "
                              f"normal_values={list(self.normal_values)!r}.")
        if (self.normal_key is not None) != (self.regional_shift == "reference_cells"):
            raise ConfigError(f"{self.PREFIX}regional_shift=reference_cells and {self.PREFIX}normal_key go together: "
                              f"the regional correction taken from the normal cells normal_key / normal_values name; "
                              f"got regional_shift={self.regional_shift}, normal_key={self.normal_key!r}.")
        if self.normal_key is not None and self.output_mode != "counterfactual":
            raise ConfigError(f"{self.PREFIX}regional_shift=reference_cells works with output_mode=counterfactual "
                              f"(the denoised output has no regional part); got output_mode={self.output_mode}.")
        if self.key_added is None or not str(self.key_added).strip():
            raise ConfigError(f"{self.PREFIX}key_added must be a non-empty name, got {self.key_added!r}.")
        if "/" in self.key_added:
            raise ConfigError(f"{self.PREFIX}key_added must not contain '/', got {self.key_added!r}.")


@dataclass
class AttentionInferenceOptions:
    """How many cells go through the network at a time (`inference.*` of attention)."""

    PREFIX: ClassVar[str] = "inference."  # how the options are named in messages
    # Cells per forward pass: on CPU the attention over ~60 locus tokens runs 2-4x faster per cell in
    # batches of 64-128 than of thousands (its (cells, heads, tokens, tokens) scores stay in cache).
    batch_size: int = 128
    max_missing_fraction: float = 0.2  # refuse when more of the model's genes than this are missing

    def __post_init__(self):
        at_least(f"{self.PREFIX}batch_size", self.batch_size, 1)
        within(f"{self.PREFIX}max_missing_fraction", self.max_missing_fraction, 0.0, 1.0)


@dataclass
class CorrectInferenceOptions(AttentionInferenceOptions):
    """How many cells correction handles at a time (`inference.*` of correct)."""

    chunk_size: int = 4096  # cells read, corrected and written at a time (memory grows with it)
    # One part of the correction, for independent jobs (a SLURM array): i/N writes OUT.shard-i-of-N, the cells of
    # part i of N; merge/N writes OUT from the N parts. null = every cell (under torchrun: each rank its part, rank 0
    # merges). Parts start where a one-process run starts a forward batch, so they give its numbers.
    shard: Optional[str] = None

    def __post_init__(self):
        super().__post_init__()
        at_least(f"{self.PREFIX}chunk_size", self.chunk_size, 1)
        self.shard_part()

    def shard_part(self) -> tuple[int | None, int] | None:
        """(i, N) of shard=i/N, (None, N) of merge/N, None without a shard; a malformed one refused in one line."""
        if self.shard is None:
            return None
        index, _, count = str(self.shard).partition("/")
        try:
            part = (None if index.strip() == "merge" else int(index), int(count))
        except ValueError:
            part = (-1, 0)
        if part[1] < 1 or (part[0] is not None and not 0 <= part[0] < part[1]):
            raise ConfigError(f"{self.PREFIX}shard must be i/N with 0 <= i < N (e.g. 0/4), or merge/N; got "
                              f"{self.shard!r}.")
        return part


@dataclass
class CorrectionAblations:
    """Ablations: switches that measure a claim (docs/lab/), not choices for a user's data; listed last.

    The correction's (`ablation.*` of correct, and of train with the network's): not remembered by the model,
    each command takes its own."""

    PREFIX: ClassVar[str] = "ablation."  # how the options are named in messages
    # The gene order regional_shift smooths along: genome (neighbours along the real coordinates) | shuffled (a
    # random gene order drawn with regional_seed, so "neighbours" are unrelated genes)
    regional_order: str = "genome"
    regional_seed: int = 0  # the random gene order of regional_order=shuffled
    # Corrected counts: the seed of each count's randomised quantile (a counter-based draw per seed, cell and gene:
    # the same counts for the same input in every run, streamed or in memory); another seed measures the draws' noise
    quantile_seed: int = 0

    def __post_init__(self):
        one_of(f"{self.PREFIX}regional_order", self.regional_order, REGIONAL_ORDERS)
        within(f"{self.PREFIX}regional_seed", self.regional_seed, 0, 2**32 - 1)
        within(f"{self.PREFIX}quantile_seed", self.quantile_seed, 0, 2**32 - 1)


def schema_values(options, schema: type) -> dict:
    """{name: value} of `schema`'s fields, read off `options` (a config holding them, and maybe more)."""
    return {f.name: getattr(options, f.name) for f in fields(schema)}


def correction_ablations(ablation: CorrectionAblations) -> dict:
    """{name: value} of the correction's ablations among a verb's `ablation.*` (train's hold the model's too)."""
    return schema_values(ablation, CorrectionAblations)


@dataclass
class TrainAblations(ModelAblations, CorrectionAblations):
    """Ablations: switches that measure a claim (docs/lab/), not choices for a user's data; listed last.

    The network's (ModelAblations) and the correction's (CorrectionAblations); the defaults are the product."""

    def __post_init__(self):
        ModelAblations.__post_init__(self)
        CorrectionAblations.__post_init__(self)


@dataclass
class ResolvedCorrection(CorrectionOptions, CorrectInferenceOptions, CorrectionAblations):
    """Everything the correction core needs besides the data and the model: the options, the ablations and the name
    of the correction preset they came from (recorded in uns[key_added])."""

    PREFIX: ClassVar[str] = ""
    preset: Optional[str] = None  # the conf/correction/ entry the correction options came from

    def __post_init__(self):
        CorrectionOptions.__post_init__(self)
        CorrectInferenceOptions.__post_init__(self)
        CorrectionAblations.__post_init__(self)


@dataclass
class TrainConfig:
    """`python -m batchfix train`: fit a model, write model.ckpt, corrected.h5ad and metrics.json."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelOptions = field(default_factory=ModelOptions)
    fit: FitConfig = field(default_factory=FitConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    correction: CorrectionOptions = field(default_factory=CorrectionOptions)
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    seed: int = 0  # 0 .. 2**32 - 1 (what numpy accepts)
    threads: Optional[int] = None  # torch CPU threads; null = torch's default (all cores)
    resume: Optional[str] = None  # a previous run folder: continue from its checkpoints/last.ckpt
    overwrite: bool = False  # train into a run folder that holds a run: its outputs and checkpoints are deleted first
    # score the corrected file into metrics.json and umap.png (without data.label_key: batch mixing only)
    evaluate: bool = True
    ablation: TrainAblations = field(default_factory=TrainAblations)

    def __post_init__(self):
        within("seed", self.seed, 0, 2**32 - 1)
        thread_count(self.threads)
        non_empty("resume", self.resume)
        if self.data.scale == "counts" and self.model.likelihood == "gaussian":
            raise ConfigError("model.likelihood=gaussian is for log-scale input: set data.scale=log as well.")


@dataclass
class CorrectDataOptions:
    """Where the file to correct keeps its counts and batches (`data.*` of correct)."""

    counts_layer: Optional[str] = None  # the layer holding raw counts; X = the X matrix; null = as in training
    batch_key: Optional[str] = None  # obs column of each cell's batch (counterfactual); null = as in training

    def __post_init__(self):
        for name in ("counts_layer", "batch_key"):
            non_empty(f"data.{name}", getattr(self, name))


@dataclass
class CorrectConfig:
    """`python -m batchfix correct`: add corrected expression to an .h5ad with a trained checkpoint."""

    input: Optional[str] = None  # .h5ad to correct; null = the bundled dataset
    output: Optional[str] = None  # null = <input name>.corrected.h5ad in the working folder
    checkpoint: Optional[str] = None  # a run folder's model.ckpt
    data: CorrectDataOptions = field(default_factory=CorrectDataOptions)
    # Unless correction=NAME or correction.KEY=VALUE is given, the checkpoint's: the preset and options it was
    # trained with (batchfix.config.presets)
    correction: CorrectionOptions = field(default_factory=CorrectionOptions)
    inference: CorrectInferenceOptions = field(default_factory=CorrectInferenceOptions)
    all_batches_new: bool = False  # accept an input none of whose batches the model was trained on
    overwrite: bool = False  # replace an existing output
    progress: bool = True  # progress bar (cells/s) on stderr
    threads: Optional[int] = None  # torch CPU threads; null = torch's default (all cores)
    ablation: CorrectionAblations = field(default_factory=CorrectionAblations)

    def __post_init__(self):
        for name in ("input", "output"):
            non_empty(name, getattr(self, name))
        if not self.checkpoint or not str(self.checkpoint).strip():
            raise ConfigError("correct needs checkpoint=<run folder>/model.ckpt.")
        thread_count(self.threads)


@dataclass
class EvaluateCorrectionOptions:
    """The key a file's correction was written under (`correction.key_added` of evaluate)."""

    key_added: str = CorrectionOptions.key_added  # the key the correction was written under

    def __post_init__(self):
        if not self.key_added or not str(self.key_added).strip():
            raise ConfigError(f"correction.key_added must be a non-empty name, got {self.key_added!r}.")


@dataclass
class EvaluateConfig:
    """`python -m batchfix evaluate`: score a corrected file's batch mixing and biology conservation."""

    input: Optional[str] = None  # a corrected .h5ad; null = the bundled dataset
    data: DataKeys = field(default_factory=DataKeys)  # counts_layer: the uncorrected counts to compare with
    correction: EvaluateCorrectionOptions = field(default_factory=EvaluateCorrectionOptions)
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    overwrite: bool = False  # replace the metrics of a run folder (or an earlier evaluation's) evaluated into

    def __post_init__(self):
        non_empty("input", self.input)


@dataclass
class AttentionDataOptions:
    """Where the file keeps its counts (`data.*` of attention)."""

    counts_layer: Optional[str] = None  # null = X; else the layer holding raw counts

    def __post_init__(self):
        non_empty("data.counts_layer", self.counts_layer)


@dataclass
class AttentionConfig:
    """`python -m batchfix attention`: mean attention between loci along the genome, per group of cells."""

    input: Optional[str] = None  # .h5ad whose cells are encoded; null = the bundled dataset
    checkpoint: Optional[str] = None  # a run folder's model.ckpt
    output: Optional[str] = None  # folder for attention.png and attention.npz; null = <input name>.attention
    group_by: Optional[str] = DataKeys.batch_key  # obs column: one map per value; null = all cells together
    data: AttentionDataOptions = field(default_factory=AttentionDataOptions)
    max_cells: Optional[int] = 2000  # cells drawn at random (seed 0) to average over; null = every cell
    resolution: int = 256  # loci per axis at most: beyond it neighbouring tokens are averaged into bins
    inference: AttentionInferenceOptions = field(default_factory=AttentionInferenceOptions)
    overwrite: bool = False  # replace existing attention.png / attention.npz
    threads: Optional[int] = None  # torch CPU threads; null = torch's default (all cores)

    def __post_init__(self):
        for name in ("input", "output", "group_by"):
            non_empty(name, getattr(self, name))
        if not self.checkpoint or not str(self.checkpoint).strip():
            raise ConfigError("attention needs checkpoint=<run folder>/model.ckpt.")
        if self.max_cells is not None:
            at_least("max_cells", self.max_cells, 1, " (or null: every cell)")
        at_least("resolution", self.resolution, 2)
        thread_count(self.threads)


SCHEMAS = {"train": TrainConfig, "correct": CorrectConfig, "evaluate": EvaluateConfig, "attention": AttentionConfig}
GROUP_SCHEMAS = {"data": DataConfig, "model": ModelOptions, "fit": FitConfig, "trainer": TrainerConfig}


def bundled_only(path: str | None, value: str) -> str | None:
    """`${bundled_only:${data.path},VALUE}`: VALUE for the bundled dataset (path null or 'bundled'), else null: a
    preset's column of the bundled file is never the default of a user's file."""
    return value if path in (None, "", "bundled") else None


def register_schemas() -> None:
    """Put every schema in Hydra's ConfigStore (`<verb>_schema` for the verbs, `<group>/schema` for groups) and
    register the presets' `bundled_only` resolver."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("bundled_only"):
        OmegaConf.register_new_resolver("bundled_only", bundled_only)
    store = ConfigStore.instance()
    for verb, schema in SCHEMAS.items():
        store.store(name=f"{verb}_schema", node=schema)
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name="schema", node=schema)
