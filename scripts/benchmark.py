"""Benchmark batchfix against other batch-correction methods, scored with batchfix.eval.metrics.

Every method sees the same cells and genes: the `--n-top-genes` batch-aware seurat_v3 highly
variable genes of the raw counts. Log-normalized expression is normalize_total(1e4) + log1p on
those genes; the unintegrated embedding is its 50-component PCA, and it is the pre-integration
reference (PCR comparison) for every method scored with the same seed.

Methods (their own packages, default settings):
  unintegrated  PCA of the log-normalized expression
  combat        scanpy.pp.combat on the log-normalized expression, then PCA
  harmony       harmonypy on the unintegrated PCA (the PCA is not counted in its fit time)
  scanorama     scanorama.correct_scanpy(return_dimred=True) on the per-batch log-normalized
                expression: its integrated embedding (X_scanorama, as integrate_scanpy gives) is
                scored, and its corrected expression matrix for the gene-level scores
  scvi          scvi-tools SCVI on raw counts: latent, and batch-corrected expression
                (get_normalized_expression over all batches, library size 1e4) -> log1p -> PCA
  sysvi         scvi-tools SysVI (scvi.external, scvi-tools >= 1.3; defaults) on the log-normalized expression:
                latent, and its decoded expression averaged over all batches (log scale) -> PCA
  cellanova     CellANOVA (scripts/baselines.py) on the standardised log-normalized expression, every
                batch in its one control pool, Harmony inside it seeded with the run's seed; its
                integrated values put back on the log scale with the gene means and sds -> PCA
  batchfix      `run_batchfix`: trained once; latent, and PCA of the corrected log expression in
                each output mode (counterfactual and denoised: two rows)
With `--ablation`, batchfix runs once per position encoding (ablation.position_encoding =
real, none, shuffled, learned) for every seed; `--variant NAME KEY=VALUE ...` (repeatable) names a
model variant whose overrides are added to `--batchfix-override`, and each variant gets its own
batchfix runs (its own ablation with `--ablation`). The report then ends with the ablation table:
per variant and encoding, the mean and sd over seeds of each score of the corrected expression.

Gene-level scores (batchfix.eval.fidelity: DE-rank agreement, marker recall, within-type 10-NN kept,
HVG conservation) judge each method's corrected *matrix* against the within-batch reference
log1p(counts per 10k) of the same raw counts on the same genes. They are given on the row of the
embedding made from that matrix: "Unintegrated PCA" (the uncorrected log matrix itself, which is
the reference up to float32 rounding: a sanity row that scores ~1.0), "ComBat" (its corrected
log matrix), "Scanorama" (its corrected expression: Scanorama scales each cell's log values to
unit L2 norm before adding its correction vectors, and the matrix is scored on that scale as
returned, genes put back in the input order), "scVI corrected expression (PCA)" (the log1p of the
decoded expression above), "SysVI decoded expression (PCA)" (its decoder's mean over all batches),
"CellANOVA" (its integrated values on the log scale) and "batchfix
counterfactual (PCA)" / "batchfix denoised (PCA)" (the two output modes of one trained model).
Methods that give no matrix (Harmony, the latents) get n/a. Without labels only HVG conservation is computed.

Truth error (`--truth-layer truth`, for a stress set written by scripts/stress_set.py: stressed counts in X,
the untouched counts in that layer): every method that gives a corrected matrix is fitted a second time per
seed, with the same seed, on the layer's counts of the same cells and genes (the genes selected on X), and
each matrix gets stress_set.truth_error (RMS difference, log1p scale) against its counterpart from the truth
run (batchfix: every output mode of the model trained on the truth). The Unintegrated PCA row, log1p(counts
per 10k) of X against that of the layer, is the level without correction; the stress's counting noise is
part of every error. Truth error (group means) compares (batch, label) group means instead, where that noise
averages out; its relative form divides it by the spread of the truth run's group means, so that matrices on
other scales (Scanorama's unit-norm cells) compare; its contrast form takes each gene's mean error over the
groups out first (the batches' mean added factor, which no method can tell from the genes' true levels). The
scIB and gene-level scores stay those of the run on X.

`--balanced` scores every embedding a second time on the rows of a subsample with the same cell-type
composition in every batch (`balanced_cells`): on all cells the batch metrics also count a batch's own mix
of cell types as batch signal, on the balanced cells only batch effect left in, or put in, by a method.

fit seconds: wall-clock time of the method's own work (for batchfix: as `run_batchfix` reports,
train + that output mode's correction, plus the PCA of its corrected expression; for its latent
the train run with the faster correction), scoring excluded; it depends on what else the
machine runs. cpu seconds: CPU time of this process (all threads) over the same span (for
batchfix: the whole `run_batchfix` call). peak MB: growth of this process's resident set size
during the fit (psutil, sampled every 20 ms): memory freed earlier but still held by the process
can be reused unseen, and allocations shorter than a sample can be missed, so it is a lower
bound of what the method needs.

    python -m scripts.benchmark data/cellbench5.h5ad --methods unintegrated combat harmony
    python -m scripts.benchmark stress_sd1.h5ad --truth-layer truth --methods unintegrated combat batchfix
    python -m scripts.benchmark data/cellbench5.h5ad --balanced \\
        --batches sc_celseq2_5cl_p1 sc_celseq2_5cl_p2 sc_celseq2_5cl_p3
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import psutil
import scipy.sparse as sp

from batchfix.config import OUTPUT_MODES, REGIONAL_SHIFTS, SHRINKS, SPREADS, CorrectionOptions, ResolvedCorrection
from batchfix.data.normalize import log_cp10k
from batchfix.eval import cnv, detection, fidelity, matrix_scores, metrics, reports
from scripts import baselines
from scripts.stress_set import contrast_truth_error, group_truth_error, relative_group_truth_error, truth_error

BASELINES = ["unintegrated", "combat", "combat_seq", "harmony", "scanorama", "scvi", "sysvi", "cellanova"]
ALL_METHODS = ["batchfix", *BASELINES]
ABLATION_ENCODINGS = ["real", "none", "shuffled", "learned"]
STATE_DEPENDENCES = (0.5, 1.0)  # correction.state_dependence values corrected beside a run's own, on the same model
CNV_R, CNV_AMPLITUDE = "CNV profile r", "CNV amplitude ratio"  # batchfix.eval.cnv.profile_retention
# The model checks need a method's own model (batchfix stores its own with the corrected file): not scored here.
MATRIX_SCORES = [*fidelity.GENE_METRICS, CNV_R, CNV_AMPLITUDE,
                 *(c for c in matrix_scores.COLUMNS if c not in matrix_scores.MODEL_COLUMNS)]
TRUTH_ERROR = "Truth error"  # with --truth-layer: stress_set.truth_error of the matrix
TRUTH_GROUP_ERROR = "Truth error (group means)"  # stress_set.group_truth_error over (batch, label) groups
TRUTH_RELATIVE_ERROR = "Truth error (group means, relative)"  # stress_set.relative_group_truth_error
TRUTH_CONTRAST_ERROR = "Truth error (group contrasts, relative)"  # stress_set.contrast_truth_error
TRUTH_ERRORS = [TRUTH_ERROR, TRUTH_GROUP_ERROR, TRUTH_RELATIVE_ERROR, TRUTH_CONTRAST_ERROR]
TRUTH_GENE_SCORES = [f"{metric} (truth)" for metric in fidelity.GENE_METRICS]  # gene-level scores against the truth
TRUTH_COLUMNS = [*TRUTH_ERRORS, *TRUTH_GENE_SCORES]
BALANCED_COLUMNS = {column: f"{column} (balanced cells)" for column in metrics.AGGREGATE_COLUMNS}  # --balanced
NO_MATRIX = frozenset({"harmony"})  # methods that give no corrected matrix (not refitted on the truth)


@dataclass
class Prepared:
    """Inputs shared by every method for one seed."""

    counts: ad.AnnData  # raw counts on the selected genes, obs with batch (and labels)
    log_expression: np.ndarray  # normalize_total 1e4 + log1p of counts.X
    unintegrated: np.ndarray  # PCA of log_expression
    batch_key: str
    seed: int


@dataclass
class MethodResult:
    embeddings: dict[str, np.ndarray]
    fit_seconds: float
    cpu_seconds: float
    peak_mb: float
    # corrected log-expression matrix (cells x genes) by the name of the embedding made from it
    matrices: dict[str, np.ndarray] = field(default_factory=dict)
    # fit seconds of single embeddings where they differ from fit_seconds (batchfix's output modes)
    embedding_seconds: dict[str, float] = field(default_factory=dict)


def companion_settings(run: CorrectionOptions) -> dict[str, ResolvedCorrection]:
    """The settings of the outputs corrected beside a run's own, by output name: the other output mode, the other
    spread (counterfactual_SPREAD), the other regional shifts (counterfactual_regional_MODE), each state
    dependence of STATE_DEPENDENCES (counterfactual_state_W) and the other shrink (counterfactual_shrink_MODE).
    Each is the run's own options (a variant's overrides included) with the one it names changed."""
    own = ResolvedCorrection(**dataclasses.asdict(run))
    others = {mode: dataclasses.replace(own, output_mode=mode) for mode in OUTPUT_MODES if mode != run.output_mode}
    others.update({f"counterfactual_{spread}": dataclasses.replace(own, spread=spread)
                   for spread in SPREADS if spread != run.spread})
    others.update({f"counterfactual_regional_{shift}": dataclasses.replace(own, regional_shift=shift)
                   for shift in REGIONAL_SHIFTS if shift not in (run.regional_shift, "reference_cells")})
    others.update({f"counterfactual_state_{weight}": dataclasses.replace(own, state_dependence=weight)
                   for weight in STATE_DEPENDENCES if weight != run.state_dependence})
    others.update({f"counterfactual_shrink_{shrink}": dataclasses.replace(own, shrink=shrink)
                   for shrink in SHRINKS if shrink != run.shrink})
    return others


def run_batchfix(
    adata_hvg: ad.AnnData, batch_key: str, seed: int, overrides: list[str]
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
    """Train batchfix on `adata_hvg` (raw counts, genes already selected) once, and correct it in
    every output mode with the same model (and the counterfactual output with its other spread,
    named counterfactual_SPREAD, its other regional shifts, named counterfactual_regional_MODE, and
    correction.state_dependence=W for each W of STATE_DEPENDENCES, named counterfactual_state_W:
    `companion_settings`, the run's own options but the one each names).

    `overrides` are Hydra-style "key=value" strings (e.g. "ablation.position_encoding=none").
    Returns (latent (cells, k), corrected log expression (cells, genes) by output mode, seconds by
    output mode: the whole train run with that mode's correction in place of train's own).
    """
    from hydra import compose, initialize_config_module

    from batchfix import tasks
    from batchfix.config import TrainConfig, validated
    from batchfix.correction.writers import correct_file
    from batchfix.training.trained import load_trained

    with tempfile.TemporaryDirectory(prefix="batchfix-bench-") as tmp:
        source, run_dir = Path(tmp) / "input.h5ad", Path(tmp) / "run"
        adata_hvg.write_h5ad(source)
        with initialize_config_module(config_module="batchfix.conf", version_base=None):
            cfg = validated(compose("train", overrides=[
                f"data.path={source}", f"data.batch_key={batch_key}", "data.label_key=null",
                "data.n_top_genes=null", f"seed={seed}", "evaluate=false", "trainer.enable_progress_bar=false",
                *overrides,
            ]), TrainConfig)
        run = tasks.train(cfg, run_dir)
        paths = {cfg.correction.output_mode: run_dir / "corrected.h5ad"}
        # train + correct, as a user runs it (reading input, gene placement, fit, writing the file)
        seconds = {cfg.correction.output_mode: float(run["total_seconds"])}
        for mode, settings in companion_settings(cfg.correction).items():
            start = time.perf_counter()
            paths[mode] = correct_file(source, Path(tmp) / f"{mode}.h5ad", load_trained(run_dir / "model.ckpt"),
                                       settings, batch_key=batch_key, progress=False)
            seconds[mode] = run["total_seconds"] - run["correct_seconds"] + time.perf_counter() - start
        expression = {}
        for mode in paths:
            corrected = ad.read_h5ad(paths[mode])
            values = corrected.layers["batchfix"][:, corrected.var["batchfix_modelled"].to_numpy()]
            expression[mode] = values.toarray() if hasattr(values, "toarray") else np.asarray(values)
        return corrected.obsm["X_batchfix"], expression, seconds


class PeakMemory:
    """Peak resident set size of this process inside a `with` block, above its size at entry."""

    def __init__(self, interval: float = 0.02):
        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak_mb = 0.0

    def __enter__(self) -> PeakMemory:
        self._start = self._peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.peak_mb = (self._peak - self._start) / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, self._process.memory_info().rss)


def measured(
    fit: Callable[[], tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
) -> MethodResult:
    """Run `fit` (returning (embeddings, matrices)), timing it and tracking its peak memory."""
    with PeakMemory() as memory:
        start, cpu_start = time.perf_counter(), time.process_time()
        embeddings, matrices = fit()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return MethodResult(embeddings, seconds, cpu, memory.peak_mb, matrices)


def fit_unintegrated(data: Prepared) -> MethodResult:
    def fit():
        name = "Unintegrated PCA"
        return {name: metrics.pca_embedding(data.log_expression, seed=data.seed)}, {name: data.log_expression}

    return measured(fit)


def fit_combat(data: Prepared) -> MethodResult:
    def fit():
        corrected = baselines.combat(data.log_expression, data.counts.obs, data.batch_key)
        return {"ComBat": metrics.pca_embedding(corrected, seed=data.seed)}, {"ComBat": corrected}

    return measured(fit)


def fit_combat_seq(data: Prepared) -> MethodResult:
    """ComBat-seq's corrected counts, normalised and logged as every other method's input is (log_cp10k)."""
    def fit():
        adjusted = baselines.combat_seq(data.counts.X, data.counts.obs[data.batch_key].astype(str).to_numpy())
        corrected = np.asarray(log_cp10k(adjusted.toarray()), dtype=np.float32)
        return {"ComBat-seq": metrics.pca_embedding(corrected, seed=data.seed)}, {"ComBat-seq": corrected}

    return measured(fit)


def fit_harmony(data: Prepared) -> MethodResult:
    import harmonypy

    def fit():
        result = harmonypy.run_harmony(
            data.unintegrated, data.counts.obs, data.batch_key, random_state=data.seed, verbose=False
        )
        return {"Harmony": np.asarray(result.Z_corr, dtype=np.float32)}, {}

    return measured(fit)


def fit_scanorama(data: Prepared) -> MethodResult:
    import scanorama

    def fit():
        log_adata = ad.AnnData(data.log_expression, obs=data.counts.obs, var=data.counts.var[[]])
        batches = log_adata.obs[data.batch_key].astype(str)
        parts = [log_adata[(batches == b).to_numpy()].copy() for b in pd.unique(batches)]
        # the same embedding integrate_scanpy gives, plus the corrected expression
        parts = scanorama.correct_scanpy(parts, return_dimred=True, seed=data.seed, verbose=0)
        integrated = pd.concat(
            [pd.DataFrame(p.obsm["X_scanorama"], index=p.obs_names) for p in parts]
        ).loc[log_adata.obs_names]
        # Scanorama sorts genes by name: back to the input order
        expression = ad.concat(parts)[log_adata.obs_names, log_adata.var_names].X
        expression = expression.toarray() if hasattr(expression, "toarray") else np.asarray(expression)
        return (
            {"Scanorama": integrated.to_numpy(dtype=np.float32)},
            {"Scanorama": expression.astype(np.float32)},
        )

    return measured(fit)


def fit_scvi(data: Prepared) -> MethodResult:
    def fit():
        latent, log_corrected = baselines.scvi_fit(data.counts, data.batch_key, data.seed)
        name = "scVI corrected expression (PCA)"
        return {"scVI latent": latent, name: metrics.pca_embedding(log_corrected, seed=data.seed)}, {name: log_corrected}

    return measured(fit)


def fit_sysvi(data: Prepared) -> MethodResult:
    def fit():
        latent, decoded = baselines.sysvi_fit(data.log_expression, data.counts.obs, data.batch_key, data.seed)
        name = "SysVI decoded expression (PCA)"
        return {"SysVI latent": latent, name: metrics.pca_embedding(decoded, seed=data.seed)}, {name: decoded}

    return measured(fit)


def fit_cellanova(data: Prepared) -> MethodResult:
    def fit():
        corrected = baselines.cellanova(data.log_expression, data.counts.obs, data.batch_key, data.seed)
        return {"CellANOVA": metrics.pca_embedding(corrected, seed=data.seed)}, {"CellANOVA": corrected}

    return measured(fit)


def fit_batchfix(data: Prepared, overrides: list[str], name: str = "batchfix") -> MethodResult:
    """batchfix trained once; its latent and the PCA of its corrected expression in each output mode."""
    with PeakMemory() as memory:
        cpu_start = time.process_time()
        latent, expression, seconds = run_batchfix(data.counts.copy(), data.batch_key, data.seed, overrides)
        embeddings = {f"{name} latent": np.asarray(latent, dtype=np.float32)}
        matrices, embedding_seconds = {}, {}
        for mode, values in expression.items():
            start = time.perf_counter()
            key = f"{name} {mode} (PCA)"
            embeddings[key] = metrics.pca_embedding(values, seed=data.seed)
            matrices[key] = values
            embedding_seconds[key] = seconds[mode] + time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    fit_seconds = min(seconds.values())  # the latent: the train run with the cheaper correction
    return MethodResult(embeddings, fit_seconds, cpu, memory.peak_mb, matrices, embedding_seconds)


BASELINE_FITS = {
    "unintegrated": fit_unintegrated,
    "combat": fit_combat,
    "combat_seq": fit_combat_seq,
    "harmony": fit_harmony,
    "scanorama": fit_scanorama,
    "scvi": fit_scvi,
    "sysvi": fit_sysvi,
    "cellanova": fit_cellanova,
}
# by method, what it needs beyond the package's own dependencies (the bench extra): a message if that is missing
MISSING_PACKAGE = {
    "combat_seq": lambda: baselines.missing_module("inmoose"),
    "harmony": lambda: baselines.missing_module("harmonypy"),
    "scanorama": lambda: baselines.missing_module("scanorama"),
    "scvi": lambda: baselines.missing_module("scvi"),
    "sysvi": baselines.sysvi_missing,
    "cellanova": lambda: baselines.missing_module("cellanova"),
}


def add_data_arguments(parser) -> None:
    """The data file, its batch and label keys and a batch subset, as the lab scripts read them (`load`)."""
    parser.add_argument("data", help=".h5ad with raw counts in X")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type")
    parser.add_argument("--batches", nargs="+", help="keep only these batches")


def load(path, batch_key: str, label_key: str | None, subset: int | None,
         batches: list[str] | None = None) -> ad.AnnData:
    """Read the file (raw counts in X) and check keys; optionally keep only the cells of `batches`
    (a sub-problem of the file), then `subset` random cells."""
    adata = ad.read_h5ad(path)
    metrics.check_obs_keys(adata.obs, batch_key, label_key)
    if batches:
        present = adata.obs[batch_key].astype(str)
        unknown = sorted(set(batches) - set(present))
        if unknown:
            raise SystemExit(f"--batches: {unknown} not in obs['{batch_key}']; batches there: "
                             f"{sorted(present.unique())}")
        adata = adata[present.isin(batches).to_numpy()].copy()
        adata.obs[batch_key] = adata.obs[batch_key].astype(str).astype("category")
    if subset is not None and subset < adata.n_obs:
        keep = np.sort(np.random.default_rng(0).choice(adata.n_obs, subset, replace=False))
        adata = adata[keep].copy()
    adata.X = dense_float32(adata.X)
    return adata


def dense_float32(matrix) -> np.ndarray:
    return (matrix.toarray() if hasattr(matrix, "toarray") else np.asarray(matrix)).astype(np.float32)


def select_genes(adata: ad.AnnData, batch_key: str, n_top_genes: int) -> ad.AnnData:
    """Counts on the batch-aware seurat_v3 highly variable genes (computed on raw counts), as batchfix
    selects them (batchfix.data.select)."""
    from batchfix.data.select import highly_variable_genes

    batch = adata.obs[batch_key].astype(str).to_numpy()
    return adata[:, highly_variable_genes(sp.csr_matrix(adata.X), batch, n_top_genes)].copy()


def prepare(counts: ad.AnnData, batch_key: str, seed: int) -> Prepared:
    log_expression = np.asarray(log_cp10k(counts.X), dtype=np.float32)
    unintegrated = metrics.pca_embedding(log_expression, seed=seed)
    return Prepared(counts, log_expression, unintegrated, batch_key, seed)


def run(args: argparse.Namespace) -> pd.DataFrame:
    """Fit and score every method for every seed; one row per (embedding, seed)."""
    labels = labels_from_args(args)
    adata = load(args.data, args.batch_key, labels, args.subset, args.batches)
    if args.truth_layer and args.truth_layer not in adata.layers:
        raise SystemExit(f"--truth-layer: no layer '{args.truth_layer}' in {args.data}; layers there: "
                         f"{sorted(adata.layers)}")
    truth = adata.layers.pop(args.truth_layer) if args.truth_layer else None
    counts = select_genes(adata, args.batch_key, args.n_top_genes)
    if truth is not None:  # the untouched counts of the same cells and genes (selected on X)
        columns = adata.var_names.get_indexer(counts.var_names)
        truth = ad.AnnData(dense_float32(truth[:, columns]), obs=counts.obs, var=counts.var)
    n_batches = counts.obs[args.batch_key].nunique()
    print(f"{counts.n_obs} cells x {counts.n_vars} genes, {n_batches} batches", flush=True)

    rows = []
    for seed in args.seeds:
        data = prepare(counts, args.batch_key, seed)
        results, tags = fit_methods(data, args)
        errors = truth_errors(results, prepare(truth, args.batch_key, seed), args, labels) if truth is not None else {}

        embeddings = {k: e for _, r in results.values() for k, e in r.embeddings.items()}
        start = time.perf_counter()
        table = metrics.score_embeddings(  # approximate: scib-metrics' default, as the reference scores
            counts.obs, embeddings, data.unintegrated, args.batch_key, labels, neighbors="approximate"
        )
        scoring = time.perf_counter() - start
        print(f"seed {seed}: scored {len(embeddings)} embeddings in {scoring:.1f} s "
              f"({scoring / len(embeddings):.1f} s each)", flush=True)
        balanced = balanced_scores(counts.obs, embeddings, data.unintegrated, args, seed) if args.balanced else {}
        genes = gene_scores(counts, results, args.batch_key, labels)
        for key, (method, result) in results.items():
            for name in result.embeddings:
                rows.append({
                    "embedding": name, "method": method, "seed": seed, **tags.get(key, {}),
                    **table.loc[name].to_dict(),
                    **genes.get(name, dict.fromkeys(MATRIX_SCORES, np.nan)),
                    **(errors.get(name, dict.fromkeys(TRUTH_COLUMNS, np.nan))
                       if truth is not None else {}),
                    **balanced.get(name, {}),
                    "fit_seconds": result.embedding_seconds.get(name, result.fit_seconds),
                    "cpu_seconds": result.cpu_seconds,
                    "peak_mb": result.peak_mb,
                    "scoring_seconds_each": scoring / len(embeddings),
                })
    return pd.DataFrame(rows)


def balanced_cells(obs: pd.DataFrame, batch_key: str, label_key: str, seed: int) -> np.ndarray:
    """Sorted row positions of a subsample with the same composition in every batch: of each label that every
    batch holds, as many cells from each batch as the batch with the fewest has (drawn at random, `seed`); labels
    some batch lacks are left out."""
    rng = np.random.default_rng(seed)
    labels, batches = obs[label_key].to_numpy(), obs[batch_key].to_numpy()
    counts = pd.crosstab(labels, batches)  # (labels, batches)
    rows = []
    for label, per_batch in counts.iterrows():
        if per_batch.min() == 0:
            continue
        for batch in counts.columns:
            members = np.flatnonzero((labels == label) & (batches == batch))
            rows.append(rng.choice(members, per_batch.min(), replace=False))
    if not rows:
        raise SystemExit(f"--balanced: no label of '{label_key}' is found in every batch of '{batch_key}'")
    return np.sort(np.concatenate(rows))


def balanced_scores(
    obs: pd.DataFrame, embeddings: dict[str, np.ndarray], unintegrated: np.ndarray, args: argparse.Namespace,
    seed: int,
) -> dict[str, dict[str, float]]:
    """By embedding name: the scIB aggregates on `balanced_cells` (the rows of each embedding, fitted on all
    cells). Where batches differ in composition, a batch's own mix of cell types shifts its mean expression, and
    the batch metrics count that as batch signal; on the balanced cells they count only what the method left of
    the batch effect, or added to it (a shift per gene and batch estimated on the whole batch moves the cells of
    every type of that batch)."""
    labels = labels_from_args(args)
    if labels is None:
        raise SystemExit("--balanced needs labels (--label-key)")
    rows = balanced_cells(obs, args.batch_key, labels, seed)
    print(f"seed {seed}: scoring {len(rows)} composition-balanced cells", flush=True)
    table = metrics.score_embeddings(obs.iloc[rows], {name: e[rows] for name, e in embeddings.items()},
                                     unintegrated[rows], args.batch_key, labels, neighbors="approximate")
    return {name: {BALANCED_COLUMNS[column]: float(table.loc[name, column]) for column in BALANCED_COLUMNS}
            for name in embeddings}


def fit_methods(
    data: Prepared, args: argparse.Namespace, skip: frozenset[str] = frozenset(),
) -> tuple[dict[str, tuple[str, MethodResult]], dict[str, dict[str, str]]]:
    """Fit every method of `args.methods` but `skip` on `data` (batchfix: each of `batchfix_runs`).
    Returns ({result name: (method, result)}, {batchfix result name: its variant and encoding})."""
    results: dict[str, tuple[str, MethodResult]] = {}
    for method in args.methods:
        if method == "batchfix" or method in skip:
            continue
        print(f"seed {data.seed}: {method} ...", flush=True)
        results[method] = (method, BASELINE_FITS[method](data))
    tags: dict[str, dict[str, str]] = {}
    if "batchfix" not in skip:
        for name, variant, encoding, overrides in batchfix_runs(args):
            print(f"seed {data.seed}: {name} ...", flush=True)
            results[name] = ("batchfix", fit_batchfix(data, overrides, name))
            tags[name] = {"variant": variant, "encoding": encoding}
    return results, tags


def truth_errors(
    results: dict[str, tuple[str, MethodResult]], truth: Prepared, args: argparse.Namespace, labels: str | None,
) -> dict[str, dict[str, float]]:
    """By matrix name: stress_set.truth_error and group_truth_error ((batch, label) groups; batches without
    labels) of every corrected matrix in `results` (fitted on the stressed counts) against the same method's
    matrix fitted on `truth` (the untouched counts of the same cells and genes), and the matrix's gene-level
    scores against the truth counts (TRUTH_GENE_SCORES; NaN where not computed)."""
    print(f"seed {truth.seed}: the same methods on the truth layer", flush=True)
    truth_results, _ = fit_methods(truth, args, skip=NO_MATRIX)
    obs = truth.counts.obs
    groups = obs[args.batch_key].astype(str).to_numpy()
    if labels:
        groups = np.char.add(np.char.add(groups.astype(str), "/"), obs[labels].astype(str).to_numpy().astype(str))
    batch, label_values = obs[args.batch_key].to_numpy(), obs[labels].to_numpy() if labels else None
    errors = {}
    for key, (_, result) in results.items():
        for name, matrix in result.matrices.items():
            on_truth = truth_results[key][1].matrices[name]
            genes = fidelity.gene_fidelity(truth.counts.X, matrix, batch, label_values)
            errors[name] = {TRUTH_ERROR: truth_error(matrix, on_truth),
                            TRUTH_GROUP_ERROR: group_truth_error(matrix, on_truth, groups),
                            TRUTH_RELATIVE_ERROR: relative_group_truth_error(matrix, on_truth, groups),
                            TRUTH_CONTRAST_ERROR: contrast_truth_error(matrix, on_truth, groups),
                            **{column: np.nan if genes[metric] is None else genes[metric]
                               for column, metric in zip(TRUTH_GENE_SCORES, fidelity.GENE_METRICS)}}
    return errors


def batchfix_runs(args: argparse.Namespace) -> list[tuple[str, str, str, list[str]]]:
    """(result name, variant, position encoding, overrides) of every batchfix run for one seed."""
    if "batchfix" not in args.methods:
        return []
    runs = []
    for variant, extra in args.variant or [("", [])]:
        base = "batchfix" + (f" {variant}" if variant else "")
        overrides = [*args.batchfix_override, *extra]
        if not args.ablation:
            runs.append((base, variant, "", overrides))
            continue
        for encoding in ABLATION_ENCODINGS:
            runs.append((f"{base} [position_encoding={encoding}]", variant, encoding,
                         [*overrides, f"ablation.position_encoding={encoding}"]))
    return runs


def ablation_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Corrected-expression scores per (variant, encoding, output mode): mean and sd over seeds."""
    if "encoding" not in rows:
        return pd.DataFrame()
    corrected = rows[rows["embedding"].str.endswith("(PCA)") & (rows["method"] == "batchfix")].copy()
    corrected["output"] = corrected["embedding"].str.extract(r" (\w+) \(PCA\)$", expand=False)
    columns = [metrics.TOTAL_SCORE, metrics.BATCH_SCORE, metrics.BIO_SCORE, *MATRIX_SCORES, *TRUTH_COLUMNS]
    grouped = corrected.groupby(["variant", "encoding", "output"], sort=False)[[c for c in columns if c in corrected]]
    table = grouped.mean().join(grouped.std(), rsuffix=" sd")
    table.insert(0, "seeds", grouped.size())
    table.index = [f"{variant or 'default'}, {encoding}, {output}" for variant, encoding, output in table.index]
    table.index.name = "variant, encoding, output"
    return table


def gene_scores(
    counts: ad.AnnData, results: dict[str, tuple[str, MethodResult]], batch_key: str,
    label_key: str | None,
) -> dict[str, dict[str, float]]:
    """Gene-level fidelity (batchfix.eval.fidelity) of every corrected matrix, by embedding name,
    against the within-batch log1p(counts per 10k) of the same raw counts, its CNV profile retention
    (batchfix.eval.cnv; needs labels and var chromosome/start) and the scores of batchfix.eval.matrix_scores (the
    batch effect it leaves within each label among them; every row against the batch-free NB reference of the raw
    counts); NaN where not computed."""
    matrices = {k: m for _, r in results.values() for k, m in r.matrices.items()}
    batch = counts.obs[batch_key].to_numpy()
    labels = counts.obs[label_key].to_numpy() if label_key else None
    placed = label_key is not None and {"chromosome", "start"} <= set(counts.var.columns)
    windows = cnv.windows_of(counts.var) if placed else None
    scores, notes = {}, set()
    start = time.perf_counter()
    raw, names = sp.csr_matrix(counts.X), None if labels is None else labels.astype(str)
    expected = None if names is None else detection.reference_nonzero(raw, names)  # one reference for every row
    for name, matrix in matrices.items():
        result = fidelity.gene_fidelity(counts.X, matrix, batch, labels)
        scores[name] = {k: v for k, v in matrix_scores.score_matrix(
            matrix_scores.MatrixInput(matrix, raw, names, batch.astype(str), expected)).items() if k in MATRIX_SCORES}
        scores[name].update({k: np.nan if result[k] is None else result[k] for k in fidelity.GENE_METRICS})
        retention = (cnv.profile_retention(log_cp10k(counts.X), matrix, batch, labels, windows) if placed
                     else {"retention_r": None, "amplitude_ratio": None})
        scores[name][CNV_R] = np.nan if retention["retention_r"] is None else retention["retention_r"]
        scores[name][CNV_AMPLITUDE] = np.nan if retention["amplitude_ratio"] is None else retention["amplitude_ratio"]
        if "note" in result and result["note"] not in notes:
            notes.add(result["note"])
            print(f"gene-level scores: {result['note']}", flush=True)
    if matrices:
        print(f"gene-level scores of {len(matrices)} matrices in {time.perf_counter() - start:.1f} s",
              flush=True)
    return scores


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per embedding (with the standard deviation when there are several)."""
    columns = [metrics.BATCH_SCORE, metrics.BIO_SCORE, metrics.TOTAL_SCORE, *MATRIX_SCORES,
               *(TRUTH_COLUMNS if TRUTH_ERROR in rows else []),
               *[c for c in BALANCED_COLUMNS.values() if c in rows], "fit_seconds", "cpu_seconds",
               "peak_mb"]
    grouped = rows.groupby("embedding", sort=False)
    table = grouped[columns].mean()
    table.insert(0, "seeds", grouped.size())
    headline = (metrics.TOTAL_SCORE if table[metrics.TOTAL_SCORE].notna().any()
                else metrics.BATCH_SCORE)
    if rows["seed"].nunique() > 1:
        table[f"{headline} sd"] = grouped[headline].std()
    table = table.sort_values(headline, ascending=False)
    table.index.name = "method"
    return table


def markdown(rows: pd.DataFrame, table: pd.DataFrame, args: argparse.Namespace) -> str:
    n_cells = f"{args.subset} random cells" if args.subset else "all cells"
    lines = [
        f"# Benchmark: {Path(args.data).name}",
        "",
        f"{n_cells}, {args.n_top_genes} batch-aware seurat_v3 HVGs; batch key `{args.batch_key}`, "
        f"label key `{args.label_key}`; seeds {', '.join(map(str, args.seeds))}.",
        "scib-metrics Benchmarker defaults, unscaled; Total = 0.4 batch + 0.6 bio. fit seconds: "
        "wall-clock time of the method's own work, scoring excluded; cpu seconds: CPU time of the "
        "process over the same span; peak MB: growth of the process's resident memory during the "
        "fit (psutil, 20 ms samples; a lower bound).",
        "",
        GENE_SCORES_NOTE,
        "",
        *([truth_error_note(args.truth_layer), ""] if args.truth_layer else []),
        *([BALANCED_NOTE, ""] if args.balanced else []),
        *([metrics.LABEL_FREE_NOTE, fidelity.NO_LABELS_NOTE, ""]
          if labels_from_args(args) is None else []),
        "## Summary (mean over seeds)",
        "",
        reports.markdown_table(table, digits=3),
        "## Every metric, every seed",
        "",
        reports.markdown_table(rows.set_index("embedding").drop(columns="method"), digits=3),
    ]
    if args.ablation:
        lines += ["", "## Position-encoding ablation (corrected expression; mean and sd over seeds)", "",
                  reports.markdown_table(ablation_table(rows), digits=3)]
    return "\n".join(lines)


BALANCED_NOTE = (
    "(balanced cells): the same scIB scores on a subsample with the same composition in every batch "
    "(benchmark.balanced_cells: of each label that every batch holds, as many cells per batch as the batch "
    "with the fewest, drawn with the seed; the rows of each embedding fitted on all cells). Where batches "
    "differ in composition, the batch metrics on all cells count each batch's own mix of cell types as batch "
    "signal; on the balanced cells they count only batch effect left in, or put in, by the method."
)


GENE_SCORES_NOTE = (
    "Gene-level scores (batchfix.eval.fidelity) compare a method's corrected expression matrix with "
    "log1p(counts per 10k) of the uncorrected counts on the same genes, within each batch: "
    f"{fidelity.DE_RANK} = Spearman correlation of per-gene label-vs-rest mean differences "
    f"(within batches with >= {fidelity.MIN_CELLS_DE} cells of the label and of the rest, averaged "
    f"over them; mean over labels); {fidelity.MARKER_RECALL} = shared top-{fidelity.N_MARKERS} "
    f"up-regulated genes / {fidelity.N_MARKERS}; {fidelity.WITHIN_TYPE} = Jaccard index of each "
    f"cell's {fidelity.N_NEIGHBORS}-NN on {fidelity.N_PCS}-PC PCAs within (batch, label) groups of "
    f">= {fidelity.MIN_CELLS_GROUP} cells (mean over cells, then unweighted over groups); "
    f"{fidelity.HVG_CONSERVATION} = shared top-{fidelity.N_HVG} highest-variance genes per batch "
    f"/ {fidelity.N_HVG}, mean over batches. The uncorrected matrix (Unintegrated PCA row) is the "
    "reference itself; Scanorama's matrix is on its own scale (each cell's log values scaled to "
    "unit L2 norm, plus its corrections), scored as returned. n/a: the method gives no matrix. "
    f"{CNV_R} (batchfix.eval.cnv): per (label, batch) group, Pearson r of its CNV profile (mean log "
    f"expression minus the mean of all cells, running mean over {cnv.WINDOW} genes in genomic order) "
    f"with its label's uncorrected profile in the other batches, mean over groups; {CNV_AMPLITUDE}: the "
    "profiles' slope on that truth, corrected / uncorrected (1.0 = CNV depth kept). "
    "Matrix scores (batchfix.eval.matrix_scores; an entry counts as detected where it is positive): "
    f"{matrix_scores.DETECTION_WITHIN} = share of (gene, label, batch) groups of >= {detection.MIN_GROUP_CELLS} "
    "cells whose nonzero share is within 0.05 of the one expected under the reference (every row: "
    f"{matrix_scores.BATCH_FREE_REFERENCE}), {matrix_scores.DETECTION_CEILING} the share counts drawn from that "
    f"reference reach (the most a matrix can); {matrix_scores.DETECTION_SPREAD}: sd over batches of that share, "
    f"mean over (gene, label), beside the raw counts'; {matrix_scores.ZEROS_RAISED}: share of raw zeros made "
    f"positive; {matrix_scores.FALSE_DE_ZERO_RAW}: t-test calls (|logFC| > 1, padj < 0.05) between batches "
    "within a label on genes with zero raw counts in both groups (must be 0)."
)


def truth_error_note(layer: str) -> str:
    return (
        f"{TRUTH_ERROR} (stress set, scripts/stress_set.py): each method giving a corrected matrix was fitted "
        f"twice per seed, with the same seed, on X (the stressed counts) and on layers['{layer}'] (the untouched "
        "counts of the same cells and genes, the genes selected on X); the error is the root-mean-square "
        "difference of the two matrices (cells x genes, log1p scale; stress_set.truth_error). The data's own "
        "batch effects, corrected alike in both, cancel: what is left is the added effect the method did not "
        "remove, biology it moved, and the counting noise of the stress (which a method keeping each cell's "
        "values cannot remove, and a smoothing one removes in both runs). The Unintegrated PCA row (log1p "
        "counts per 10k of X against those of the truth) is the level without correction; 0 = the added "
        "effects removed exactly. batchfix's two matrices come from two trainings (same seed, different data), "
        "so its error also holds the difference between trainings; Scanorama's matrices are on its own scale "
        f"(each cell's log values scaled to unit L2 norm), not that of the others: {TRUTH_RELATIVE_ERROR} "
        "compares them. The scIB and gene-level scores are those of the run on X: the gene-level reference is "
        "then the stressed counts, which hold the added effects; the columns '... (truth)' score the same "
        "matrices against the truth counts instead (which true markers, DE ranks, neighbours and HVGs the "
        "correction of the stressed counts recovers; the stressed counts themselves no longer score 1). "
        f"{TRUTH_GROUP_ERROR}: the same comparison on the mean of each (batch, label) group "
        "(stress_set.group_truth_error): the counting noise averages out within a group, so it ranks what the "
        "methods left of the added effects and what biology they moved. "
        f"{TRUTH_RELATIVE_ERROR}: that error over the spread of the truth run's group means around each gene's "
        "mean (stress_set.relative_group_truth_error), which no scale of the output changes. "
        f"{TRUTH_CONTRAST_ERROR}: the same after each gene's mean error over the groups is taken out "
        "(stress_set.contrast_truth_error): the batches' mean added factor is in every batch and no method can "
        "tell it from the genes' true levels, so this ranks what each method got wrong between groups."
    )


def labels_from_args(args: argparse.Namespace) -> str | None:
    return None if args.label_key.lower() in ("", "none") else args.label_key


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="an .h5ad file with raw counts in X")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type", help="obs column; 'none' for no labels")
    parser.add_argument("--n-top-genes", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", choices=ALL_METHODS, default=ALL_METHODS)
    parser.add_argument("--ablation", action="store_true",
                        help="run batchfix with ablation.position_encoding=" + "|".join(ABLATION_ENCODINGS))
    parser.add_argument("--variant", nargs="+", action="append", type=str, metavar=("NAME", "KEY=VALUE"),
                        help="a named batchfix variant and its overrides (repeatable): each gets its own runs")
    parser.add_argument("--batchfix-override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Hydra overrides for every batchfix run, e.g. trainer.max_epochs=20")
    parser.add_argument("--batches", nargs="+", default=None, metavar="BATCH",
                        help="keep only the cells of these batches (a sub-problem of the file)")
    parser.add_argument("--subset", type=int, default=None, help="keep N random cells (seed 0)")
    parser.add_argument("--truth-layer", default=None, metavar="LAYER",
                        help="a stress set's layer of untouched counts (scripts/stress_set.py writes 'truth'): "
                             "fit each method with a matrix on it too and add its Truth error")
    parser.add_argument("--balanced", action="store_true",
                        help="also score each embedding on a subsample with the same cell-type composition in "
                             "every batch (needs labels)")
    parser.add_argument("--out", default="benchmark_results.csv",
                        help="CSV of every row; a markdown report is written beside it (.md)")
    args = parser.parse_args(argv)
    if args.variant and any("=" in name for name, *_ in args.variant):
        parser.error("--variant: give a NAME first, then its KEY=VALUE overrides")
    for method in [m for m in args.methods if m in MISSING_PACKAGE]:
        if missing := MISSING_PACKAGE[method]():
            parser.error(f"--methods {method}: {missing}")
    args.variant = [(name, extra) for name, *extra in args.variant or []]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    table = summary(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out, index=False)
    out.with_suffix(".md").write_text(markdown(rows, table, args))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(3).to_string(na_rep="n/a"))
        if args.ablation:
            print(ablation_table(rows).round(3).to_string(na_rep="n/a"))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
