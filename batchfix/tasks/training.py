"""The train verb as plain functions of validated options: fit, calibrate, save, correct the training file,
draw the attention picture, evaluate."""
from __future__ import annotations

import json
import logging
import shlex
import time
from pathlib import Path

import anndata as ad
import h5py

from batchfix import runfolder, signals
from batchfix.config import (
    DEFAULT_PRESET,
    AttentionConfig,
    ResolvedCorrection,
    TrainConfig,
    correction_ablations,
    remembered_correction,
)
from batchfix.correction.calibration import calibrated_model
from batchfix.correction.corrector import reference_index
from batchfix.correction.extra_genes import MIN_CELLS, add_extra_genes_from
from batchfix.correction.provenance import refuse_key_collisions_in_file
from batchfix.correction.recommendation import Recommendation, recommend_and_remember
from batchfix.correction.writers import correct_adata, correct_file
from batchfix.data import ondisk
from batchfix.data.atomic import atomic_output, refuse_unreplaceable
from batchfix.data.io import input_path
from batchfix.data.prepare import PreparedData
from batchfix.training import fitting
from batchfix.training.module import ENTROPY_PREFIX
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, run_dir: str | Path, preset: str = DEFAULT_PRESET) -> dict:
    """Fit on cfg.data.path; write model.ckpt (the best checkpoint, calibrated, remembering the correction: the
    preset cfg.correction came from and its options), corrected.h5ad and metrics.json into run_dir (rank 0 only).

    A run folder that holds a run is refused (batchfix.runfolder); everything the data and options decide
    is checked before training starts.
    """
    run_dir = Path(run_dir)
    runfolder.check_reuse(run_dir, cfg.overwrite, cfg.resume)
    source = input_path(cfg.data.path)  # never the corrected.h5ad that overwrite deletes and train writes again
    refuse_unreplaceable(run_dir / runfolder.CORRECTED_H5AD, reads={"input": source})
    refuse_key_collisions_in_file(source, cfg.correction.key_added)
    started = time.perf_counter()
    fitting.seed_and_threads(cfg.seed, cfg.threads)
    log.info("Preparing the data: %s.", source)
    with signals.interrupt_noted(lambda: " while reading the data, before training: nothing was saved"):
        adata = fitting.read_training_file(cfg.data)  # read once: trained on, then corrected in memory
        prepared = fitting.load_training_data(cfg.data, adata, source=input_path(cfg.data.path))
        signals.raise_pending()
    reference_index(prepared.batch_categories, cfg.correction.reference)  # refused now, not after training
    warn_if_mostly_unplaced(prepared.coordinates.placed, cfg.correction)
    run_dir.mkdir(parents=True, exist_ok=True)
    with runfolder.held(run_dir):  # no other command writes into it meanwhile
        return train_into(cfg, prepared, adata, run_dir, started, preset)


def warn_if_mostly_unplaced(placed, correction) -> bool:
    """Warn (and return True) when a regional_shift that keeps copy-number-like shifts meets a model whose genes are
    mostly unplaced: along the genome it sees only the placed ones."""
    if correction.output_mode != "counterfactual" or correction.regional_shift == "apply" or placed.mean() >= 0.5:
        return False
    log.warning("correction.regional_shift=%s keeps shifts that are smooth along the genome, but only %d of %d "
                "modelled genes are placed on it: the rest are corrected without it. Place them with data.genome or "
                "data.gtf (or var's chromosome, start and end).", correction.regional_shift, int(placed.sum()),
                len(placed))
    return True


def train_into(cfg: TrainConfig, prepared: PreparedData, adata: ad.AnnData | None, run_dir: Path,
               started: float, preset: str = DEFAULT_PRESET) -> dict:
    """Fit into the held run_dir (its previous run deleted with cfg.overwrite) and write the outputs (rank 0
    only: the other ranks return {}). `adata` is the input read whole, or None when it is streamed."""
    runfolder.claim(run_dir, cfg.overwrite, cfg.resume)
    result = fitting.fit(cfg, prepared, run_dir)
    if result.trainer.global_rank != 0:
        return {}
    with signals.interrupt_noted(lambda: f" after training, before its outputs were written; resume={run_dir} "
                                         "writes them"):
        metrics = write_outputs(cfg, result, prepared, adata, run_dir, preset)
    metrics["total_seconds"] = round(time.perf_counter() - started, 2)
    with atomic_output(run_dir / runfolder.METRICS_JSON, overwrite=True) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2))
    log.info("Run folder: %s (model.ckpt, corrected.h5ad, metrics.json).", run_dir)
    return metrics


def write_outputs(cfg: TrainConfig, result: fitting.FitResult, prepared: PreparedData, adata: ad.AnnData | None,
                  run_dir: Path, preset: str = DEFAULT_PRESET) -> dict:
    """model.ckpt (the best checkpoint, calibrated, with the correction it remembers), corrected.h5ad and the
    evaluation of a finished fit; returns the metrics so far."""
    model, corrected_genes, advice = finish(result.best_checkpoint, prepared, cfg, adata,
                                            remembered_correction(preset, cfg.correction),
                                            training_labels(cfg, adata), correct_command(cfg, run_dir))
    model.save(run_dir / runfolder.MODEL_CKPT, overwrite=True)
    metrics = {**fit_metrics(result, prepared), "corrected_genes": corrected_genes,
               "recommendation": advice.as_dict()}
    correct_started = time.perf_counter()
    log.info("Correcting the training file into %s.", run_dir / runfolder.CORRECTED_H5AD)
    corrected_path = write_corrected(cfg, model, adata, run_dir / runfolder.CORRECTED_H5AD)
    metrics["correct_seconds"] = round(time.perf_counter() - correct_started, 2)
    metrics.update(estimate_entries(corrected_path, cfg.correction.key_added))
    attention_picture(cfg, model, run_dir)
    if cfg.evaluate:  # without labels: the label-free mixing scores (iLISI, PCR) and a UMAP by batch
        from batchfix.eval.evaluate import evaluate_file

        log.info("Evaluating %s (batch mixing%s, gene-level fidelity).", corrected_path,
                 "" if cfg.data.label_key is None else ", biology conservation")
        metrics["evaluation"] = evaluate_file(corrected_path, cfg.data.batch_key, cfg.data.label_key, run_dir,
                                              counts_layer=cfg.data.counts_layer, key_added=cfg.correction.key_added,
                                              max_cells=cfg.evaluation.max_cells,
                                              neighbors=cfg.evaluation.neighbors)
    return metrics


def finish(best_checkpoint: Path, prepared: PreparedData, cfg: TrainConfig, adata: ad.AnnData | None,
           correction: dict, labels, apply: str) -> tuple[BatchfixModel, int, Recommendation]:
    """A fit made a model, for the verb and the API alike: the best checkpoint calibrated on the training cells, the
    extra genes' decoder fitted, the `correction` (remembered_correction) and the recommended preset remembered
    (`apply`: the command that applies a preset, with {preset}). (model, extra genes corrected, recommendation)."""
    log.info("Calibrating the output on the training cells (best checkpoint: %s).", best_checkpoint.name)
    model = calibrated_model(best_checkpoint, prepared)
    if model.config.likelihood == "nb":
        log.info("Fitting the extra genes' decoder (genes detected in >= %d cells beyond the modelled ones).",
                 MIN_CELLS)
    corrected_genes = add_extra_genes_from(model, prepared, cfg.data, adata, cfg.seed)
    model.remember_correction(correction)
    return model, corrected_genes, recommend_and_remember(model, prepared, labels, apply, cfg.seed)


def training_labels(cfg: TrainConfig, adata: ad.AnnData | None):
    """The training file's labels (data.label_key; each input row's), from memory or from the file; None without."""
    if cfg.data.label_key is None:
        return None
    if adata is not None:
        return adata.obs[cfg.data.label_key].astype(str).to_numpy()
    with h5py.File(input_path(cfg.data.path), "r") as f:
        return ondisk.read_obs_column(f, cfg.data.label_key).astype(str).to_numpy()


def write_corrected(cfg: TrainConfig, model: BatchfixModel, adata: ad.AnnData | None, target: Path) -> Path:
    """The training input with corrected expression added (the correction the model remembers): from the AnnData
    in memory, or streamed from the file."""
    settings = ResolvedCorrection(**model.correction["options"], **correction_ablations(cfg.ablation),
                                  preset=model.correction["preset"])
    keys = dict(counts_layer=cfg.data.counts_layer, batch_key=cfg.data.batch_key)
    if adata is None:
        return correct_file(input_path(cfg.data.path), target, model, settings, overwrite=True, **keys)
    correct_adata(adata, model, settings, **keys)
    with atomic_output(target, overwrite=True) as tmp:  # compressed, as `correct` writes: a quarter of the size
        adata.write_h5ad(tmp, compression="gzip", compression_opts=1)
    log.info("Wrote %s (%d cells; layers['%s'] (%s)).", target, adata.n_obs, settings.key_added, settings.output_mode)
    return target


def correct_command(cfg: TrainConfig, run_dir: Path) -> str:
    """The command that corrects the training file with this run's model and a preset ({preset}), complete and
    quoted for a shell: input, checkpoint, the data options the run used, and an output beside the run's own."""
    def quoted(value) -> str:  # for a shell, and kept whole by str.format
        return shlex.quote(str(value)).replace("{", "{{").replace("}", "}}")

    data = cfg.data
    parts = ["python -m batchfix correct", f"input={quoted(input_path(data.path))}",
             f"checkpoint={quoted(run_dir / runfolder.MODEL_CKPT)}",
             f"output={quoted(run_dir / 'corrected.recommended.h5ad')}", "correction={preset}",
             f"data.batch_key={quoted(data.batch_key)}"]
    if data.counts_layer is not None:
        parts.append(f"data.counts_layer={quoted(data.counts_layer)}")
    return " ".join(parts)


SUMMARISED_ESTIMATES = ("shift_evidence", "depth_shift")  # uns[key]['estimates'] entries metrics.json repeats


def estimate_entries(path: Path, key: str) -> dict:
    """{entry: uns[key]['estimates'][entry] or None} of a corrected file, for SUMMARISED_ESTIMATES: how much each
    batch's shifts were weighted down (batchfix.correction.evidence) and each batch's depth shift with its weight
    (correction.depth=reference); None where the correction made none."""
    with h5py.File(path, "r") as f:
        nodes = {entry: f.get(f"uns/{key}/estimates/{entry}") for entry in SUMMARISED_ESTIMATES}
        return {entry: None if node is None else ondisk.read_elem(node) for entry, node in nodes.items()}


def fit_metrics(result: fitting.FitResult, prepared: PreparedData) -> dict:
    """What the fit did: sizes, epochs, steps, precision, time and the last logged losses."""
    trainer = result.trainer
    return {
        "n_cells": int(prepared.n_cells),
        "scale": str(result.module.hparams.scale),  # counts, or log: a model of log values, which writes no counts
        "streamed": prepared.disk is not None,
        "n_genes": len(prepared.genes),
        "n_tokens": result.module.windows.n_tokens,
        "epochs": int(trainer.current_epoch),
        "steps": int(trainer.global_step),
        "precision": str(trainer.precision),
        "fit_seconds": round(result.seconds, 2),
        "train_cells_per_second": round(result.n_train_cells * trainer.current_epoch / max(result.seconds, 1e-9), 1),
        "losses": {k: float(v) for k, v in trainer.callback_metrics.items()
                   if v.numel() == 1 and not k.startswith(ENTROPY_PREFIX)},
    }


def attention_picture(cfg: TrainConfig, model: BatchfixModel, run_dir: Path) -> Path:
    """run_dir/attention.png: the trained model's attention along the genome, per label (else per batch)."""
    from batchfix.tasks.attention_maps import attention_maps, write_attention

    options = AttentionConfig(checkpoint=str(model.path), group_by=cfg.data.label_key or cfg.data.batch_key)
    maps = attention_maps(model, input_path(cfg.data.path), options.group_by,
                          ResolvedCorrection(), cfg.data.counts_layer, options.max_cells, options.resolution)
    return write_attention(maps, run_dir, npz=False, overwrite=True)[0]
