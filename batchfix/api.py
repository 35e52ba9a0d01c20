"""The Python API, for notebooks: train and correct in-memory AnnData, no YAML and no run folder.

    model = batchfix.train(adata, batch_key="sample", label_key="cell_type")
    batchfix.correct(adata, model)              # in place, scanpy style
    scores = batchfix.evaluate(adata)           # scIB scores and gene-level fidelity, as the command line's
    model.save("model.ckpt"); model = batchfix.BatchfixModel.load("model.ckpt")

Options are the command line's, by their last name (`n_heads` is `model.n_heads`), with the same
defaults, descriptions and validation (batchfix.config); an option with no effect here is refused.
"""
from __future__ import annotations

import difflib
import inspect
import logging
import tempfile
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import anndata as ad

from batchfix.config import (
    RETIRED_OPTIONS,
    CorrectConfig,
    CorrectInferenceOptions,
    CorrectionAblations,
    CorrectionChoice,
    CorrectionOptions,
    DataConfig,
    EvaluationOptions,
    FitConfig,
    ModelAblations,
    ModelConfig,
    ResolvedCorrection,
    TrainConfig,
    TrainerConfig,
    flat_option_names,
    option_descriptions,
    preset_names,
    remembered_correction,
    validated,
)
from batchfix.correction.provenance import output_kind_name, refuse_key_collisions, warn_not_applied
from batchfix.correction.writers import correct_adata, normal_cells
from batchfix.data.memory import numpy_huge_pages_off
from batchfix.errors import ConfigError
from batchfix.training.trained import BatchfixModel, load_trained

# Options of the command line that have no meaning for an in-memory AnnData.
NOT_API_OPTIONS = {"path": "pass the AnnData itself", "resume": "resume needs a run folder: use the command line",
                   "evaluate": "score with batchfix.eval.metrics or `python -m batchfix evaluate`",
                   "overwrite": "the Python API writes no run folder",
                   **dict.fromkeys(("stream", "stream_above_gb", "chunk_cells", "hvg_max_cells"),
                                   "an in-memory AnnData is trained from memory; files too large for it stream "
                                   "with the command line (data.stream)"),
                   **dict.fromkeys(("max_cells", "neighbors"),
                                   "the Python API does not evaluate: score with batchfix.eval.metrics"),
                   "shard": "parts of a file are corrected over processes by the command line (inference.shard)"}
# The correction options: keywords of batchfix.train (remembered by the model) and of batchfix.correct.
CORRECTION_OPTIONS = tuple(option.name for option in fields(CorrectionOptions))
CORRECTION_ABLATIONS = tuple(option.name for option in fields(CorrectionAblations))  # keywords of batchfix.correct
MODEL_ABLATIONS = tuple(option.name for option in fields(ModelAblations))  # keywords of batchfix.train
INFERENCE_OPTIONS = tuple(option.name for option in fields(CorrectInferenceOptions)
                          if option.name not in NOT_API_OPTIONS)
log = logging.getLogger(__name__)

def train_config(**options) -> TrainConfig:
    """A validated TrainConfig from options named as in the config (`n_heads=8`, `max_epochs=20`, ...)."""
    names = flat_option_names(TrainConfig)
    nested: dict = {}
    for name, value in options.items():
        if name in NOT_API_OPTIONS:
            raise ConfigError(f"'{name}' is not an option of batchfix.train: {NOT_API_OPTIONS[name]}.")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            raise ConfigError(f"Unknown option '{name}'" + (f"; did you mean {close}?" if close else ".") +
                              " Options: batchfix.config (data, model, fit, trainer, correction).")
        *groups, last = names[name].split(".")
        node = nested
        for group in groups:
            node = node.setdefault(group, {})
        node[last] = value
    return validated(nested, TrainConfig)


def train(adata: ad.AnnData, batch_key: str = DataConfig.batch_key, label_key: str | None = DataConfig.label_key,
          counts_layer: str | None = DataConfig.counts_layer, *, scale: str = DataConfig.scale,
          n_top_genes: int | None = DataConfig.n_top_genes, genome: str = DataConfig.genome,
          gtf: str | None = DataConfig.gtf, unplaced: str = DataConfig.unplaced,
          genes_per_token: int = ModelConfig.genes_per_token, d_model: int = ModelConfig.d_model,
          n_heads: int = ModelConfig.n_heads, n_layers: int = ModelConfig.n_layers,
          dropout: float = ModelConfig.dropout, latent_dim: int = ModelConfig.latent_dim,
          decoder_hidden: int = ModelConfig.decoder_hidden, min_wavelength: float = ModelConfig.min_wavelength,
          max_wavelength: float = ModelConfig.max_wavelength,
          attention_block_size: int | None = ModelConfig.attention_block_size,
          gradient_checkpointing: bool = ModelConfig.gradient_checkpointing,
          likelihood: str = ModelConfig.likelihood, kl_weight: float = ModelConfig.kl_weight,
          adversarial_weight: float = ModelConfig.adversarial_weight, batch_size: int = FitConfig.batch_size,
          learning_rate: float = FitConfig.learning_rate, weight_decay: float = FitConfig.weight_decay,
          kl_warmup_fraction: float = FitConfig.kl_warmup_fraction,
          validation_fraction: float = FitConfig.validation_fraction,
          max_validation_cells: int = FitConfig.max_validation_cells,
          early_stopping_patience: int = FitConfig.early_stopping_patience,
          target_steps: int = FitConfig.target_steps, min_auto_epochs: int = FitConfig.min_auto_epochs,
          max_auto_epochs: int = FitConfig.max_auto_epochs, accelerator: str = TrainerConfig.accelerator,
          devices: int | str | list[int] = TrainerConfig.devices, strategy: str = TrainerConfig.strategy,
          num_nodes: int = TrainerConfig.num_nodes, precision: str | None = TrainerConfig.precision,
          max_epochs: int | None = TrainerConfig.max_epochs,
          gradient_clip_val: float | None = TrainerConfig.gradient_clip_val,
          log_every_n_steps: int = TrainerConfig.log_every_n_steps,
          enable_progress_bar: bool = TrainerConfig.enable_progress_bar,
          enable_model_summary: bool = TrainerConfig.enable_model_summary,
          deterministic: bool = TrainerConfig.deterministic, seed: int = TrainConfig.seed,
          threads: int | None = TrainConfig.threads, correction: str | None = None,
          **options) -> BatchfixModel:
    """Train batchfix on an in-memory AnnData (raw counts in X, or in `counts_layer`); returns the model.

    Every keyword is the `python -m batchfix train` option of that last name, with its default and
    validation (`python -m batchfix train --help`, batchfix.config); their descriptions follow below.
    The data options (batch_key, counts_layer, label_key, genome, scale) are saved with the model and
    are `batchfix.correct`'s defaults, and so is the correction: the preset `correction` names (an entry of
    conf/correction/; None = default) with the correction options given as keywords on top; the network's
    ablations (`position_encoding`, ..., listed last) are keywords too. `adata` is not changed. An option that is
    no train option, or has no effect here (resume, ...), is refused (ConfigError) naming the option meant.
    """
    given = {name: value for name, value in locals().items() if name not in ("adata", "correction", "options")}
    require_in_memory(adata, "train")
    cfg = train_config(**given, **options)
    correction_options = train_correction_options(options)
    preset, chosen = CorrectionChoice(correction, correction_options).resolve()
    normal_cells(adata.obs.get(chosen.normal_key or ""), chosen, list(adata.obs.columns))  # refused before training
    from batchfix.tasks.training import finish  # Lightning: loaded by train alone, so that correct starts without it
    from batchfix.training import fitting

    fitting.seed_and_threads(cfg.seed, cfg.threads)
    prepared = fitting.load_training_data(cfg.data, adata)
    labels = None if label_key is None else adata.obs[label_key].astype(str).to_numpy()
    with tempfile.TemporaryDirectory(prefix="batchfix-train-") as scratch:
        result = fitting.fit(cfg, prepared, Path(scratch))
        model, _, advice = finish(result.best_checkpoint, prepared, cfg, adata, remembered_correction(preset, chosen),
                                  labels, 'batchfix.correct(adata, model, correction="{preset}")')
    warn_if_recommended_otherwise(advice, preset)
    model.path = None  # the checkpoint it came from is gone: model.save(path) keeps it
    return model


def train_correction_options(options: dict) -> dict:
    """The correction options among batchfix.train's keywords (the model remembers them); the correction's ablations,
    which act on no model, refused: train writes no corrected expression."""
    ignored = sorted(set(options) & set(CORRECTION_ABLATIONS))
    if ignored:
        raise ConfigError(f"{ignored} have no effect in batchfix.train, which writes no corrected expression: give "
                          f"them to batchfix.correct.")
    return {name: value for name, value in options.items() if name in CORRECTION_OPTIONS}


def warn_if_recommended_otherwise(advice, preset: str) -> None:
    """A recommended correction other than `preset`, the one trained with, is a warning, which a notebook shows (info
    lines it does not, by default)."""
    if advice.preset != preset:
        log.warning("batchfix recommends correction=%r for these data (trained with %r): %s.%s", advice.preset, preset,
                    advice.reason, f" Apply it: {advice.command}" if advice.command else "")


def require_in_memory(adata: ad.AnnData, verb: str) -> None:
    """Refuse, before any work, what is no AnnData, or one backed by its file (read_h5ad(..., backed='r')): the API
    works in memory; the command line streams files."""
    if not isinstance(adata, ad.AnnData):
        from batchfix.errors import InputError

        raise InputError(f"batchfix.{verb} takes an AnnData (cells x genes), got {type(adata).__name__}: "
                         f"anndata.AnnData(X=..., obs=...) makes one, anndata.read_h5ad reads a file.")
    if getattr(adata, "isbacked", False):
        from batchfix.errors import InputError

        raise InputError(f"batchfix.{verb} works on an AnnData in memory; this one is backed by {adata.filename} "
                         f"(read with backed=...). Load it with adata.to_memory(), or use `python -m batchfix "
                         f"{verb}` on the file, which reads it in chunks.")


def options_doc(names: list[str], schema: type = TrainConfig) -> str:
    """A numpydoc Parameters section of options, from their descriptions in batchfix.config."""
    described = {dotted.rpartition(".")[2]: text for dotted, text in option_descriptions(schema).items()}
    described |= {name: text for name, text in API_ONLY.items() if name not in described}
    return "\n    Parameters\n    ----------\n" + "".join(
        f"    {name}\n        {described[name]}\n" for name in names)


# What the API's keywords that are no command-line option, or mean more here, are.
API_ONLY = {
    "adata": "Cells x genes; var_names are matched to the model's genes by name.",
    "model": "A BatchfixModel (batchfix.train, BatchfixModel.load) or the path of a checkpoint such as "
             "<run folder>/model.ckpt (loaded without executing code from the file).",
    "correction": f"A named correction, an entry of conf/correction/ ({', '.join(preset_names())}); the "
                  "correction options given as keywords override it. batchfix.correct: None = the correction the "
                  "model was trained with.",
    "copy": "Return a corrected copy instead of adding to `adata` (which is then left unchanged).",
}
TRAIN_KEYWORDS = [name for name in inspect.signature(train).parameters if name not in ("adata", "options")]
train.__doc__ += options_doc(TRAIN_KEYWORDS + [name for name in CORRECTION_OPTIONS if name not in TRAIN_KEYWORDS]
                             + list(MODEL_ABLATIONS))


def correct(adata: ad.AnnData, model: BatchfixModel | str | Path, *, correction: str | None = None,
            batch_key: str | None = None, counts_layer: str | None = None, all_batches_new: bool = False,
            copy: bool = False, progress: bool = False, **options) -> ad.AnnData | None:
    """Batch-correct an in-memory AnnData with a trained model (or a checkpoint path), scanpy style.

    Every keyword is the `python -m batchfix correct` option of that last name (`spread` is
    `correction.spread`, `chunk_size` is `inference.chunk_size`), with its default and validation. The
    correction is the one the model was trained with unless `correction` names a preset; correction options
    given as keywords override either. Adds layers[key_added] (and, for the NB model's counterfactual
    output, layers[key_added + '_counts']), var[key_added + '_modelled'], obsm['X_' + key_added] (the latent)
    and uns[key_added] (what produced it: checkpoint, preset, options applied). Returns the copy when
    copy=True, else None. For .h5ad files of any size use `python -m batchfix correct`, which streams cells
    from disk.
    """
    require_in_memory(adata, "correct")
    told, inference, ablations = correct_keywords(options)
    if not isinstance(model, (BatchfixModel, str, Path)):
        raise ConfigError(f"model must be a BatchfixModel (batchfix.train, BatchfixModel.load) or a checkpoint's path, "
                          f"got {type(model).__name__}.")
    trained = model if isinstance(model, BatchfixModel) else load_trained(model)
    preset, chosen = CorrectionChoice(correction, told).resolve(trained.correction)
    settings = ResolvedCorrection(**asdict(chosen), **asdict(inference), **asdict(ablations), preset=preset)
    warn_not_applied(told, output_kind_name(settings.output_mode, trained.config.likelihood))
    refuse_key_collisions(settings.key_added, adata.layers, adata.obsm, adata.var.columns, adata.uns)
    with numpy_huge_pages_off():
        return correct_adata(adata, trained, settings, counts_layer=counts_layer, batch_key=batch_key, copy=copy,
                             progress=progress, all_batches_new=all_batches_new)


def correct_keywords(options: dict) -> tuple[dict, CorrectInferenceOptions, CorrectionAblations]:
    """batchfix.correct's option keywords: (the correction options given, the inference options checked, the
    ablations checked); an unknown keyword is refused naming the option meant."""
    known = [*CORRECTION_OPTIONS, *INFERENCE_OPTIONS, *CORRECTION_ABLATIONS, *inspect.signature(correct).parameters]
    for name in options:
        if name in NOT_API_OPTIONS:
            raise ConfigError(f"'{name}' is not an option of batchfix.correct: {NOT_API_OPTIONS[name]}.")
        retired = [why for dotted, why in RETIRED_OPTIONS.items() if dotted.rpartition(".")[2] == name]
        if retired:
            raise ConfigError(f"'{name}': {retired[0]}.")
        if name not in (*CORRECTION_OPTIONS, *INFERENCE_OPTIONS, *CORRECTION_ABLATIONS):
            close = difflib.get_close_matches(name, known, n=3)
            raise ConfigError(f"Unknown option '{name}' of batchfix.correct" +
                              (f"; did you mean {close}?" if close else "."))
    told = {name: value for name, value in options.items() if name in CORRECTION_OPTIONS}
    validated(told, CorrectionOptions)  # a bad value is refused before the model is read
    inference = validated({name: value for name, value in options.items() if name in INFERENCE_OPTIONS},
                          CorrectInferenceOptions)
    ablations = validated({name: value for name, value in options.items() if name in CORRECTION_ABLATIONS},
                          CorrectionAblations)
    return told, inference, ablations


correct.__doc__ += options_doc([*(name for name in inspect.signature(correct).parameters if name != "options"),
                                *CORRECTION_OPTIONS, *INFERENCE_OPTIONS, *CORRECTION_ABLATIONS], CorrectConfig)


def evaluate(adata: ad.AnnData, *, batch_key: str = DataConfig.batch_key, label_key: str | None = "cell_type",
             counts_layer: str | None = None, key_added: str = ResolvedCorrection.key_added,
             max_cells: int = EvaluationOptions.max_cells, neighbors: str = EvaluationOptions.neighbors,
             out_dir: str | Path | None = None, model: BatchfixModel | str | Path | None = None) -> dict:
    """Score a corrected AnnData (after `batchfix.correct`) as `python -m batchfix evaluate` does, with its
    defaults: batch mixing and biology conservation (scib-metrics; label_key=None scores mixing only) of
    the latent, of the corrected layer and of the uncorrected data, and gene-level fidelity; the model's checks (PIT,
    detection against its reference) come from uns[key_added], where `correct` stored them. `model` is no longer
    read (a warning says so): the checks no longer need the model.

    Returns the result (what metrics.json holds: `scores[embedding]["Total"]`, `gene_fidelity`, ...);
    with `out_dir`, metrics.json, metrics.md and umap.png are written there too. `adata` is not changed.
    """
    from batchfix.config import EvaluateConfig
    from batchfix.eval.evaluate import evaluate_file

    require_in_memory(adata, "evaluate")
    if model is not None:
        warnings.warn("batchfix.evaluate(model=...) is no longer needed and is ignored: batchfix.correct stores the "
                      f"model's checks in uns['{key_added}'].", FutureWarning, stacklevel=2)
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():
        from batchfix.errors import OutputError

        raise OutputError(f"out_dir {out_dir} is a file: name a folder (new or existing) for metrics.json, metrics.md "
                          f"and umap.png.")
    validated(dict(data=dict(batch_key=batch_key, label_key=label_key, counts_layer=counts_layer),
                   correction=dict(key_added=key_added), evaluation=dict(max_cells=max_cells, neighbors=neighbors)),
              EvaluateConfig)
    with tempfile.TemporaryDirectory(prefix="batchfix-evaluate-") as scratch:
        path = Path(scratch) / "corrected.h5ad"
        adata.write_h5ad(path)
        return evaluate_file(path, batch_key, label_key, out_dir or Path(scratch) / "evaluation",
                             counts_layer=counts_layer, key_added=key_added, max_cells=max_cells, neighbors=neighbors,
                             in_memory=out_dir is None)
