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
import tempfile
from dataclasses import fields
from pathlib import Path

import anndata as ad

from batchfix.config import (
    CorrectionOptions,
    CorrectionSettings,
    DataConfig,
    EvaluationOptions,
    FitConfig,
    ModelConfig,
    TrainConfig,
    TrainerConfig,
    flat_option_names,
    option_descriptions,
    validated,
)
from batchfix.correction.calibration import calibrated_model
from batchfix.correction.writers import correct_adata
from batchfix.errors import ConfigError
from batchfix.training import fitting
from batchfix.training.module import BatchfixModel, load_trained

# Options of the command line that have no meaning for an in-memory AnnData.
NOT_API_OPTIONS = {"path": "pass the AnnData itself", "resume": "resume needs a run folder: use the command line",
                   "evaluate": "score with batchfix.eval.metrics or `python -m batchfix evaluate`",
                   "overwrite": "the Python API writes no run folder",
                   **dict.fromkeys(("stream", "stream_above_gb", "chunk_cells", "hvg_max_cells"),
                                   "an in-memory AnnData is trained from memory; files too large for it stream "
                                   "with the command line (data.stream)"),
                   **dict.fromkeys(("max_cells", "neighbors"),
                                   "the Python API does not evaluate: score with batchfix.eval.metrics")}
_CORRECTION = CorrectionSettings()


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


# Options of `train` that belong to correction: the Python API trains, and batchfix.correct takes them.
CORRECTION_ONLY = tuple(option.name for option in fields(CorrectionOptions))


def train(adata: ad.AnnData, batch_key: str = DataConfig.batch_key, label_key: str | None = DataConfig.label_key,
          counts_layer: str | None = DataConfig.counts_layer, *, scale: str = DataConfig.scale,
          n_top_genes: int | None = DataConfig.n_top_genes, genome: str = DataConfig.genome,
          gtf: str | None = DataConfig.gtf, unplaced: str = DataConfig.unplaced,
          genes_per_token: int = ModelConfig.genes_per_token, d_model: int = ModelConfig.d_model,
          n_heads: int = ModelConfig.n_heads, n_layers: int = ModelConfig.n_layers,
          dropout: float = ModelConfig.dropout, latent_dim: int = ModelConfig.latent_dim,
          decoder_hidden: int = ModelConfig.decoder_hidden, attention: str = ModelConfig.attention,
          position_encoding: str = ModelConfig.position_encoding, shuffle_seed: int | None = ModelConfig.shuffle_seed,
          token_identity: str = ModelConfig.token_identity,
          distance_bias: bool = ModelConfig.distance_bias, distance_buckets: int = ModelConfig.distance_buckets,
          min_wavelength: float = ModelConfig.min_wavelength, max_wavelength: float = ModelConfig.max_wavelength,
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
          threads: int | None = TrainConfig.threads,
          **unknown) -> BatchfixModel:
    """Train batchfix on an in-memory AnnData (raw counts in X, or in `counts_layer`); returns the model.

    Every keyword is the `python -m batchfix train` option of that last name, with its default and
    validation (`python -m batchfix train --help`, batchfix.config); their descriptions follow below.
    The data options (batch_key, counts_layer, label_key, genome, scale) are saved with the model and
    are `batchfix.correct`'s defaults. `adata` is not changed. An option that is no train option, or has
    no effect here (output_mode, resume, ...), is refused (ConfigError) naming the option meant.
    """
    options = {name: value for name, value in locals().items() if name not in ("adata", "unknown")}
    for name in unknown:
        if name in CORRECTION_ONLY:
            raise ConfigError(f"'{name}' is not an option of batchfix.train: pass it to batchfix.correct.")
    cfg = train_config(**options, **unknown)
    fitting.seed_and_threads(cfg.seed, cfg.threads)
    prepared = fitting.load_training_data(cfg.data, adata)
    with tempfile.TemporaryDirectory(prefix="batchfix-train-") as scratch:
        result = fitting.fit(cfg, prepared, Path(scratch))
        model = calibrated_model(result.best_checkpoint, prepared)
    model.path = None  # the checkpoint it came from is gone: model.save(path) keeps it
    return model


def options_doc(names: list[str]) -> str:
    """A numpydoc Parameters section of options, from their descriptions in batchfix.config."""
    described = {dotted.rpartition(".")[2]: text for dotted, text in option_descriptions(TrainConfig).items()}
    return "\n    Parameters\n    ----------\n" + "".join(
        f"    {name}\n        {described[name]}\n" for name in names)


train.__doc__ += options_doc([name for name in inspect.signature(train).parameters if name not in ("adata", "unknown")])


def correct(adata: ad.AnnData, model: BatchfixModel | str | Path, *, output_mode: str = _CORRECTION.output_mode,
            batch_key: str | None = None, counts_layer: str | None = None, all_batches_new: bool = False,
            copy: bool = False,
            progress: bool = False, reference: str | None = _CORRECTION.reference,
            key_added: str = _CORRECTION.key_added, chunk_size: int = _CORRECTION.chunk_size,
            batch_size: int = _CORRECTION.batch_size,
            max_missing_fraction: float = _CORRECTION.max_missing_fraction,
            int8: bool = _CORRECTION.int8, regional_shift: str = _CORRECTION.regional_shift,
            regional_window: int = _CORRECTION.regional_window, regional_order: str = _CORRECTION.regional_order,
            regional_seed: int = _CORRECTION.regional_seed,
            spread: str = _CORRECTION.spread,
            state_dependence: float = _CORRECTION.state_dependence,
            residual_weight: float = _CORRECTION.residual_weight) -> ad.AnnData | None:
    """Batch-correct an in-memory AnnData with a trained model (or a checkpoint path), scanpy style.

    Parameters
    ----------
    adata
        Cells x genes; var_names are matched to the model's genes by name. Raw counts in X, or in
        `counts_layer` (log-normalized values for a model trained with data.scale=log). None: the layer
        the model was trained on; "X": the X matrix.
    model
        A `BatchfixModel` (from `batchfix.train` or `BatchfixModel.load`), or the path of a
        checkpoint such as `<run folder>/model.ckpt` (loaded without executing code from the file).
    output_mode
        "counterfactual": each cell's own expression with only what its batch explains removed
        (for differential expression and marker plots; reads obs[batch_key]); "denoised": every
        cell decoded from its latent (smooth, for clustering and pictures). See batchfix.correction.counterfactual.
    batch_key
        The obs column of each cell's batch (counterfactual only); None: the column the model was
        trained with. Batches the model never saw have their effect estimated from their own cells (at
        least 10; fewer get the denoised output).
    all_batches_new
        Accept an input none of whose batches the model was trained on (refused otherwise: it is most
        often the wrong batch_key).
    reference
        A training batch to express every cell as, or None / "average" for the average over the
        training batches.
    key_added
        Names what is added: layers[key_added], var[f"{key_added}_modelled"], obsm[f"X_{key_added}"],
        uns[key_added].
    copy
        Return a corrected copy instead of adding to `adata` (which is then left unchanged).
    max_missing_fraction
        Refuse (InputError) when more than this share of the model's genes is missing from var_names;
        fewer missing genes enter the model as zeros and are listed in uns[key_added]["missing_genes"].
    chunk_size, batch_size
        Cells processed at a time, and cells per forward pass of the network.
    int8
        Run the network's linear layers dynamically quantized to int8 (CPU). The corrected values move
        slightly and it was not faster on the default model (docs/benchmarks.md, INT8 inference, measures both).
    regional_shift, regional_window, regional_order, regional_seed
        Counterfactual output: "keep" leaves in each cell the part of its state-dependent batch shift that
        deviates from its batch's mean shift and is smooth along the genome over `regional_window` genes
        (copy-number-like biology); "keep_all" measures the deviation from the mean over all cells (a
        batch-wide regional shift is kept too); "keep_input" splits the output's whole change to the cell
        (decoder term, location, spread and the floor at 0) against the mean change over all cells, so each
        cell keeps its input's regional profile; "apply" removes it with the rest. regional_order="shuffled"
        is the ablation (smoothing over a random gene order, `regional_seed`). See batchfix.correction.counterfactual
        and docs/cnv.md.
    state_dependence
        Counterfactual output: the share (0-1) of the cell-state dependence of its batch shift that is applied;
        the rest is replaced by the shift's mean over the batch's cells (1, the default: all of it; 0: one shift
        per gene and batch, as ComBat's). Lower keeps DE ranks and markers closer to the input's.
    residual_weight
        Counterfactual output: the share (0-1) of each cell's residual (its deviation from what the decoder
        expects for its state in its batch) that is kept (1, the default: all of it; 0: the denoised output plus
        the reference's location). Lower mixes and clusters better and keeps fewer within-type neighbours.
    spread
        The counterfactual output's residual scale: "batch" (one per batch) or "gene" (per gene and batch,
        shrunk toward the batch's level; batchfix.correction.calibration.shrunk_variances).

    Adds layers[key_added] (float32 CSR on the log1p(expression per 10k counts) scale, values stored
    for the modelled genes only: other genes read as 0 and are False in var[f"{key_added}_modelled"]),
    obsm[f"X_{key_added}"] (the latent) and uns[key_added] (version, checkpoint sha256, output mode,
    reference batch, unseen batches, modelled and missing genes, parameters). Returns the copy when
    copy=True, else None. For .h5ad files of any size use `python -m batchfix correct`, which streams
    cells from disk.
    """
    settings = validated(dict(output_mode=output_mode, reference=reference, key_added=key_added,
                              chunk_size=chunk_size, batch_size=batch_size,
                              max_missing_fraction=max_missing_fraction, int8=int8,
                              regional_shift=regional_shift, regional_window=regional_window,
                              regional_order=regional_order, regional_seed=regional_seed, spread=spread,
                              state_dependence=state_dependence, residual_weight=residual_weight),
                         CorrectionSettings)
    trained = model if isinstance(model, BatchfixModel) else load_trained(model)
    return correct_adata(adata, trained, settings, counts_layer=counts_layer, batch_key=batch_key, copy=copy,
                         progress=progress, all_batches_new=all_batches_new)


def evaluate(adata: ad.AnnData, *, batch_key: str = DataConfig.batch_key, label_key: str | None = "cell_type",
             counts_layer: str | None = None, key_added: str = CorrectionSettings.key_added,
             max_cells: int = EvaluationOptions.max_cells, neighbors: str = EvaluationOptions.neighbors,
             out_dir: str | Path | None = None) -> dict:
    """Score a corrected AnnData (after `batchfix.correct`) as `python -m batchfix evaluate` does, with its
    defaults: batch mixing and biology conservation (scib-metrics; label_key=None scores mixing only) of
    the latent, of the corrected layer and of the uncorrected data, and gene-level fidelity.

    Returns the result (what metrics.json holds: `scores[embedding]["Total"]`, `gene_fidelity`, ...);
    with `out_dir`, metrics.json, metrics.md and umap.png are written there too. `adata` is not changed.
    """
    from batchfix.config import EvaluateConfig
    from batchfix.eval.evaluate import evaluate_file

    validated(dict(data=dict(batch_key=batch_key, label_key=label_key, counts_layer=counts_layer),
                   key_added=key_added, evaluation=dict(max_cells=max_cells, neighbors=neighbors)), EvaluateConfig)
    with tempfile.TemporaryDirectory(prefix="batchfix-evaluate-") as scratch:
        path = Path(scratch) / "corrected.h5ad"
        adata.write_h5ad(path)
        return evaluate_file(path, batch_key, label_key, out_dir or Path(scratch) / "evaluation",
                             counts_layer=counts_layer, key_added=key_added, max_cells=max_cells, neighbors=neighbors)
