"""Where the counterfactual output loses marker genes against ComBat: its terms switched off one at a time.

For cell c of batch b the counterfactual output (batchfix/correction/counterfactual.py) is

    corrected = max(0, D(c) + location_ref + k_b * (observed(c) - location_b)),
    D(c)      = decoded_ref(z_c) - k_b * decoded_b(z_c)     (the decoder term, `counterfactual.decoder_term`)

batchfix is trained once per seed, and every variant below is built from that one model's terms
(scripts/lab/harness.py), on the modelled genes:

    shipped          the package's log-scale output with regional_shift=apply (the terms' own values, checked against it)
    no clip          the same values without the floor at 0
    k=1              k_b = 1 for every batch: decoded_ref - decoded_b + location_ref + observed - location_b
    gene-wise shift  D(c) replaced by its mean over the cell's batch: one shift per gene and batch, as ComBat's
    gene-wise, no clip
    shrunk L         mean_b(D) + L * (D(c) - mean_b(D)), L in SHRINKS

They are scored with ComBat (scanpy's combat on log1p(counts per 10k) of the same genes) and the uncorrected
log1p(counts per 10k): the gene-level scores of batchfix.eval.fidelity against each batch's own
log1p(counts per 10k), and scib-metrics' Total of each matrix's PCA (batchfix.eval.metrics, exact neighbours).
"marker diff RMS" is how far the label-vs-rest differences those scores rank move (root-mean-square over each
label's top-50 reference markers): a continuous view of what marker recall counts in whole genes. "below 0 %" is
the share of values under 0 before any floor (ComBat's output has no floor).
The gene scores compare cells within one batch only, so a per-batch shift of a gene changes none of them:
the uncorrected values score 1.0, and so would the gene-wise shift if nothing were clipped and k_b were 1.

Printed: a line per (seed, variant), then mean and sd over seeds per variant, then how much of the marker-recall
and DE-rank gap between the shipped output and ComBat (and between the shipped output and the uncorrected
values) each single change closes.

    nice python -m scripts.lab.marker_loss data/cellbench5.h5ad --seeds 0 1 2 \\
        --batches sc_celseq2_5cl_p1 sc_celseq2_5cl_p2 sc_celseq2_5cl_p3
    nice python -m scripts.lab.marker_loss data/cellbench5.h5ad --seeds 0 1 2 --batches sc_celseq2 sc_dropseq
"""
from __future__ import annotations

import argparse
import sys

import anndata as ad
import numpy as np
import pandas as pd

import batchfix
from batchfix.data.normalize import log_cp10k
from batchfix.eval import fidelity, metrics
from scripts.baselines import combat
from scripts.benchmark import load
from scripts.lab.harness import Terms, counterfactual_terms, shipped_log_output

TRAIN_OPTIONS = dict(threads=1, enable_progress_bar=False)
SHRINKS = (0.25, 0.5)
SHIPPED, NO_CLIP, UNIT_K, GENEWISE = "shipped", "no clip", "k=1", "gene-wise shift"
SINGLE_CHANGES = (NO_CLIP, UNIT_K, GENEWISE)  # the decomposition's rows
MARKER_SHIFT = "marker diff RMS"
SCORES = [metrics.TOTAL_SCORE, metrics.BATCH_SCORE, metrics.BIO_SCORE, *fidelity.GENE_METRICS, MARKER_SHIFT,
          "below 0 %"]


def variant_matrices(terms: Terms) -> dict[str, np.ndarray]:
    """Unclipped values of every variant (the name says whether the floor at 0 applies)."""
    decoder = terms.decoder
    mean = terms.batch_mean(decoder)
    unclipped = {SHIPPED: terms.unclipped(), UNIT_K: terms.unclipped(scale=np.ones_like(terms.scale)),
                 GENEWISE: terms.unclipped(decoder=mean)}
    unclipped.update({f"shrunk {shrink:g}": terms.unclipped(decoder=mean + shrink * (decoder - mean))
                      for shrink in SHRINKS})
    clipped = {name: np.maximum(values, 0.0) for name, values in unclipped.items()}
    return {SHIPPED: clipped.pop(SHIPPED), NO_CLIP: unclipped[SHIPPED], UNIT_K: clipped.pop(UNIT_K),
            GENEWISE: clipped.pop(GENEWISE), f"{GENEWISE}, no clip": unclipped[GENEWISE], **clipped}


def shipped_values(adata: ad.AnnData, model: batchfix.BatchfixModel, batch_key: str, **options) -> np.ndarray:
    """The package's log-scale counterfactual output on the modelled genes, in the model's gene order, with the
    whole state shift removed (regional_shift=apply: the variants take that form apart); `options`: spread,
    residual_weight, state_dependence (harness.shipped_log_output)."""
    return shipped_log_output(adata, model, batch_key, **options)


def shipped_difference(values: np.ndarray, adata: ad.AnnData, model: batchfix.BatchfixModel, batch_key: str,
                       **options) -> float:
    """The largest difference of a rebuilt row (model gene order) from the package's output with `options`
    (`shipped_values`) where the input is not zero (there the package keeps the zero; the rows take the formula
    apart before that rule)."""
    nonzero = np.asarray(adata[:, model.genes].X) != 0  # dense counts, as the harness reads them
    return float(np.abs(values - shipped_values(adata, model, batch_key, **options))[nonzero].max())


def check_shipped(values: np.ndarray, adata: ad.AnnData, model: batchfix.BatchfixModel, batch_key: str, name: str,
                  **options) -> None:
    """Stop unless a rebuilt row (model gene order) is the package's output with `options` (`shipped_difference`)."""
    difference = shipped_difference(values, adata, model, batch_key, **options)
    if difference > 1e-4:
        raise SystemExit(f"The row '{name}' differs from the package's log-scale output by {difference:.2e}.")


def reference_rows(adata: ad.AnnData, genes: list, batch_key: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(counts on `genes`, {"uncorrected": their log1p(counts per 10k), "ComBat": scanpy's combat of those})."""
    counts = np.asarray(adata[:, genes].X, dtype=np.float32)
    log_values = np.asarray(log_cp10k(counts), dtype=np.float64)
    return counts, {"uncorrected": log_values, "ComBat": combat(log_values, adata.obs, batch_key)}


def seed_matrices(adata: ad.AnnData, batch_key: str, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(counts on the modelled genes, {row: log-scale matrix}) for one trained model."""
    model = batchfix.train(adata, batch_key=batch_key, seed=seed, **TRAIN_OPTIONS)
    terms = counterfactual_terms(adata, model, batch_key)
    variants = variant_matrices(terms)
    difference = shipped_difference(variants[SHIPPED], adata, model, batch_key)
    print(f"seed {seed}: re-implemented shipped output vs the package's, largest difference {difference:.2e}",
          flush=True)
    if difference > 1e-4:
        raise SystemExit("The re-implementation does not reproduce the package's output: the variants mean nothing.")
    counts, uncorrected = reference_rows(adata, model.genes, batch_key)
    return counts, {**uncorrected, **variants}


def label_differences(values: np.ndarray, batch: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """Per label, mean(label) - mean(rest) of every gene within each batch with enough cells of both, averaged over
    those batches: the differences batchfix.eval.fidelity ranks."""
    sums, n = {}, {}
    for b in pd.unique(batch):
        rows = batch == b
        for label in pd.unique(labels[rows]):
            inside = rows & (labels == label)
            outside = rows & (labels != label)
            if inside.sum() >= fidelity.MIN_CELLS_DE and outside.sum() >= fidelity.MIN_CELLS_DE:
                sums[label] = sums.get(label, 0.0) + values[inside].mean(axis=0) - values[outside].mean(axis=0)
                n[label] = n.get(label, 0) + 1
    return {label: sums[label] / n[label] for label in sums}


def marker_shift(reference: dict[str, np.ndarray], corrected: dict[str, np.ndarray]) -> float:
    """Root-mean-square change of the label-vs-rest differences on each label's top N_MARKERS reference genes."""
    moved = [(corrected[label] - diff)[np.argsort(-diff, kind="stable")[:fidelity.N_MARKERS]]
             for label, diff in reference.items()]
    return float(np.sqrt(np.mean(np.square(moved))))


def matrix_scores(adata: ad.AnnData, counts: np.ndarray, matrices: dict[str, np.ndarray], batch_key: str,
                  label_key: str, seed: int) -> dict[str, dict[str, float]]:
    """By matrix name: scib-metrics' aggregate scores of its PCA (against the "uncorrected" matrix's) and the gene
    scores of batchfix.eval.fidelity against `counts`."""
    embeddings = {name: metrics.pca_embedding(values.astype(np.float32), seed=seed)
                  for name, values in matrices.items()}
    scib = metrics.score_embeddings(adata.obs, embeddings, embeddings["uncorrected"], batch_key, label_key)
    batch, labels = adata.obs[batch_key].to_numpy(), adata.obs[label_key].to_numpy()
    rows = {}
    for name, values in matrices.items():
        genes = fidelity.gene_fidelity(counts, values, batch, labels)
        rows[name] = {**{column: float(scib.loc[name, column]) for column in metrics.AGGREGATE_COLUMNS},
                      **{metric: genes[metric] for metric in fidelity.GENE_METRICS}}
    return rows


def seed_scores(adata: ad.AnnData, batch_key: str, label_key: str, seed: int) -> pd.DataFrame:
    """Every row's scores for one seed (rows: uncorrected, ComBat, the variants)."""
    counts, matrices = seed_matrices(adata, batch_key, seed)
    rows = matrix_scores(adata, counts, matrices, batch_key, label_key, seed)
    batch, labels = adata.obs[batch_key].to_numpy(), adata.obs[label_key].to_numpy()
    reference = label_differences(matrices["uncorrected"], batch, labels)
    for name, values in matrices.items():
        rows[name].update({MARKER_SHIFT: marker_shift(reference, label_differences(values, batch, labels)),
                           "below 0 %": 100 * float((values < 0).mean())})
    table = pd.DataFrame.from_dict(rows, orient="index")[SCORES]
    print(table.round(4).to_string(), flush=True)
    return table.assign(seed=seed)


def summary(scores: pd.DataFrame) -> pd.DataFrame:
    """Mean ± sd over seeds per row (every column but "seed"), in the rows' first order."""
    columns = [column for column in scores.columns if column != "seed"]
    grouped = scores.groupby(level=0, sort=False)[columns]
    mean, sd = grouped.mean(), grouped.std().fillna(0.0)
    return pd.DataFrame({column: [f"{m:.4f} ± {s:.4f}" for m, s in zip(mean[column], sd[column])]
                         for column in columns}, index=mean.index)


def decomposition(scores: pd.DataFrame) -> pd.DataFrame:
    """Share of the gap between the shipped output and ComBat (and the uncorrected values) that each single change
    closes: (variant - shipped) / (target - shipped), on the seed means of each gene score."""
    mean = scores.groupby(level=0, sort=False)[SCORES].mean()
    table = {}
    for metric in (fidelity.MARKER_RECALL, fidelity.DE_RANK, MARKER_SHIFT):
        for target in ("ComBat", "uncorrected"):
            gap = mean.loc[target, metric] - mean.loc[SHIPPED, metric]
            table[f"{metric}: {target} - shipped = {gap:+.4f}"] = [
                f"{(mean.loc[name, metric] - mean.loc[SHIPPED, metric]) / gap:+.2f}" if abs(gap) > 1e-9 else "n/a"
                for name in SINGLE_CHANGES]
    return pd.DataFrame(table, index=list(SINGLE_CHANGES)).T


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help=".h5ad with raw counts in X")
    parser.add_argument("--batches", nargs="+", help="keep only these batches")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    adata = load(args.data, args.batch_key, args.label_key, None, args.batches)
    print(f"{adata.n_obs} cells, batches {sorted(adata.obs[args.batch_key].unique())}, seeds {args.seeds}", flush=True)
    scores = pd.concat([seed_scores(adata, args.batch_key, args.label_key, seed) for seed in args.seeds])
    with pd.option_context("display.width", 250, "display.max_columns", None):
        print(f"\nMean ± sd over seeds {args.seeds}:\n{summary(scores).to_string()}")
        print(f"\nShare of the gap closed by each single change (seed means):\n{decomposition(scores).to_string()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
