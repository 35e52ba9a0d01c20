"""The Python API, for notebooks: train and correct in-memory AnnData, no YAML and no run folder.

    model = batchfix.train(adata, batch_key="sample", n_heads=8, max_epochs=40)
    batchfix.correct(adata, model)              # in place, scanpy style
    model.save("model.ckpt"); model = batchfix.BatchfixModel.load("model.ckpt")

Options are the command line's, by their last name (`n_heads` is `model.n_heads`), with the same
defaults and the same validation (batchfix.config).
"""
from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

import anndata as ad

from batchfix.training import fitting
from batchfix.config import CorrectionSettings, DataConfig, TrainConfig, flat_option_names, validated
from batchfix.correction.corrector import correct_adata
from batchfix.correction.counterfactual import calibrated_model
from batchfix.errors import ConfigError
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


def train(adata: ad.AnnData, batch_key: str = DataConfig.batch_key, label_key: str | None = None,
          counts_layer: str | None = None, **options) -> BatchfixModel:
    """Train batchfix on an in-memory AnnData (raw counts in X, or in `counts_layer`); returns the model.

    `options` are any train options by name, e.g. `n_top_genes=3000, n_heads=8, max_epochs=40,
    seed=1, enable_progress_bar=False` (see batchfix.config). `adata` is not changed.
    """
    cfg = train_config(batch_key=batch_key, label_key=label_key, counts_layer=counts_layer, **options)
    fitting.seed_and_threads(cfg.seed, cfg.threads)
    prepared = fitting.load_training_data(cfg.data, adata)
    with tempfile.TemporaryDirectory(prefix="batchfix-train-") as scratch:
        result = fitting.fit(cfg, prepared, Path(scratch))
        model = calibrated_model(result.best_checkpoint, prepared)
    model.path = None  # the checkpoint it came from is gone: model.save(path) keeps it
    return model


def correct(adata: ad.AnnData, model: BatchfixModel | str | Path, *, output_mode: str = _CORRECTION.output_mode,
            batch_key: str = DataConfig.batch_key, counts_layer: str | None = None, copy: bool = False,
            progress: bool = False, reference: str | None = _CORRECTION.reference,
            key_added: str = _CORRECTION.key_added, chunk_size: int = _CORRECTION.chunk_size,
            batch_size: int = _CORRECTION.batch_size,
            max_missing_fraction: float = _CORRECTION.max_missing_fraction,
            int8: bool = _CORRECTION.int8, spread: str = _CORRECTION.spread) -> ad.AnnData | None:
    """Batch-correct an in-memory AnnData with a trained model (or a checkpoint path), scanpy style.

    Parameters
    ----------
    adata
        Cells x genes; var_names are matched to the model's genes by name. Raw counts in X, or in
        `counts_layer` (log-normalized values for a model trained with data.scale=log).
    model
        A `BatchfixModel` (from `batchfix.train` or `BatchfixModel.load`), or the path of a
        checkpoint such as `<run folder>/model.ckpt` (loaded without executing code from the file).
    output_mode
        "counterfactual": each cell's own expression with only what its batch explains removed
        (for differential expression and marker plots; reads obs[batch_key]); "denoised": every
        cell decoded from its latent (smooth, for clustering and pictures). See batchfix.correction.counterfactual.
    batch_key
        The obs column of each cell's batch (counterfactual only). Batches the model never saw have
        their effect estimated from their own cells (at least 10; fewer get the denoised output).
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
        slightly and it was not faster on the default model (the README's INT8 section measures both).
    spread
        The counterfactual output's residual scale: "batch" (one per batch) or "gene" (per gene and batch,
        shrunk toward the batch's level; batchfix.correction.counterfactual.shrunk_variances).

    Adds layers[key_added] (float32 CSR on the log1p(expression per 10k counts) scale, values stored
    for the modelled genes only: other genes read as 0 and are False in var[f"{key_added}_modelled"]),
    obsm[f"X_{key_added}"] (the latent) and uns[key_added] (version, checkpoint sha256, output mode,
    reference batch, unseen batches, modelled and missing genes, parameters). Returns the copy when
    copy=True, else None. For .h5ad files of any size use `python -m batchfix correct`, which streams
    cells from disk.
    """
    settings = validated(dict(output_mode=output_mode, reference=reference, key_added=key_added,
                              chunk_size=chunk_size, batch_size=batch_size,
                              max_missing_fraction=max_missing_fraction, int8=int8, spread=spread),
                         CorrectionSettings)
    trained = model if isinstance(model, BatchfixModel) else load_trained(model)
    return correct_adata(adata, trained, settings, counts_layer=counts_layer, batch_key=batch_key, copy=copy,
                         progress=progress)
