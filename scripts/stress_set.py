"""A stress set with known truth: real counts given extra per-batch, gene-wise batch effects of chemistry size.

For each batch b and gene g a multiplicative factor f(b, g) = exp(sd * e(b, g)), e standard normal, of which
a share `--shared` of the variance is common to the genes of similar mean expression (20 bins of the genes'
mean count: chemistries differ most by expression level) and the rest is the gene's own; then every cell of
the batch keeps a fraction `depth(b)` of its molecules (binomial thinning; depths spread evenly over
`--depth-range`, batches in sorted order). With `--state-share s` the effect also depends on the cell's state
(its label, `--label-key`): log f(t, b, g) = sqrt(1 - s) log f(b, g) + sd sqrt(s) e(t, b, g), a draw of its own per
label t, so a chemistry that captures a gene differently in each cell type (even in opposite directions) is
modelled too. Counts change as molecules do:

    f <= 1: Binomial(c, f)        f > 1: c + Poisson(c * (f - 1))        then Binomial(., depth(b))

The untouched counts are the truth (`layers['truth']`); X holds the stressed counts; `uns['stress']` the
parameters and seed. A method's error against the truth (`truth_error`) compares its correction of the
stressed data with its correction of the truth: the real batch effects of the data, corrected alike in both,
cancel, and what is left is the added effect the method failed to remove (or the biology it moved), and the
stress's counting noise; `group_truth_error` compares (batch, label) group means instead, where that noise
averages out, and `relative_group_truth_error` divides that by the spread of the groups' means, so that outputs
on different scales compare.

    python -m scripts.stress_set data/cellbench5.h5ad stress_sd1.h5ad --sd 1.0 --seed 0
    python -m scripts.stress_set data/cellbench5.h5ad pair_sd05.h5ad --sd 0.5 --batches sc_celseq2 sc_dropseq
    python -m scripts.stress_set data/cellbench5.h5ad state_sd1.h5ad --sd 1.0 --state-share 0.75
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp

from batchfix.data.atomic import atomic_output

N_EXPRESSION_BINS = 20  # genes grouped by mean count for the shared part of the effect


@dataclass(frozen=True)
class Stress:
    sd: float = 0.5  # sd of log f(b, g)
    shared: float = 0.5  # share of that variance common to genes of similar mean expression
    depth_low: float = 0.5  # the shallowest batch keeps this fraction of its molecules
    depth_high: float = 1.0
    state_share: float = 0.0  # share of log f's variance that is each label's own (a state-dependent effect)
    seed: int = 0


def gene_factors(mean_counts: np.ndarray, n_batches: int, stress: Stress, rng: np.random.Generator) -> np.ndarray:
    """(batches, genes) multiplicative factors f(b, g) (log-normal, part shared within expression bins)."""
    ranks = np.argsort(np.argsort(mean_counts, kind="stable"), kind="stable")
    bins = ranks * N_EXPRESSION_BINS // len(mean_counts)  # (genes,) expression bin of each gene
    shared = rng.standard_normal((n_batches, N_EXPRESSION_BINS))[:, bins]  # (batches, genes)
    own = rng.standard_normal((n_batches, len(mean_counts)))
    return np.exp(stress.sd * (np.sqrt(stress.shared) * shared + np.sqrt(1.0 - stress.shared) * own))


def scaled_counts(counts: sp.csr_matrix, factor: np.ndarray, depth: float, rng: np.random.Generator) -> sp.csr_matrix:
    """One batch's counts (cells x genes) with each gene scaled by its factor, then thinned to `depth`."""
    counts = sp.csr_matrix(counts, dtype=np.float64)
    values = counts.data.astype(np.int64)
    f = factor[counts.indices]  # per stored entry
    down = f <= 1.0
    values[down] = rng.binomial(values[down], f[down])
    values[~down] += rng.poisson(values[~down] * (f[~down] - 1.0))
    values = rng.binomial(values, depth)
    out = sp.csr_matrix((values.astype(np.float32), counts.indices, counts.indptr), shape=counts.shape)
    out.eliminate_zeros()
    return out


def stress_set(adata: ad.AnnData, batch_key: str, stress: Stress, label_key: str = "cell_type") -> ad.AnnData:
    """A copy of `adata` (raw counts in X) with X stressed, the untouched counts in layers['truth']."""
    counts = sp.csr_matrix(adata.X)
    if counts.nnz and not np.allclose(counts.data, np.round(counts.data)):
        raise ValueError("X must hold raw counts (whole numbers) for a stress set.")
    rng = np.random.default_rng(stress.seed)
    batches = sorted(adata.obs[batch_key].astype(str).unique())
    factors = gene_factors(np.asarray(counts.mean(0)).ravel(), len(batches), stress, rng)
    depths = np.linspace(stress.depth_low, stress.depth_high, len(batches))
    batch = adata.obs[batch_key].astype(str).to_numpy()
    labels = adata.obs[label_key].astype(str).to_numpy() if stress.state_share > 0 else np.zeros(len(batch), str)
    names = sorted(set(labels))
    by_label = factors[None] if stress.state_share == 0 else np.exp(  # (labels, batches, genes)
        np.log(factors)[None] * np.sqrt(1.0 - stress.state_share)
        + stress.sd * np.sqrt(stress.state_share) * rng.standard_normal((len(names), *factors.shape)))
    parts = {}
    for i, name in enumerate(batches):
        for t, label in enumerate(names):
            rows = np.flatnonzero((batch == name) & (labels == label))
            parts[name, label] = (rows, scaled_counts(counts[rows], by_label[t, i], depths[i], rng))
    order = np.concatenate([rows for rows, _ in parts.values()])
    stacked = sp.vstack([part for _, part in parts.values()]).tocsr()
    stressed = stacked[np.argsort(order)]  # back to the input's cell order
    out = adata.copy()
    out.layers["truth"] = counts.astype(np.float32)
    out.X = sp.csr_matrix(stressed, dtype=np.float32)
    out.uns["stress"] = {**asdict(stress), "batches": batches, "depths": depths.tolist(), "batch_key": batch_key}
    return out


def truth_error(corrected_on_stressed: np.ndarray, corrected_on_truth: np.ndarray) -> float:
    """Root-mean-square difference (cells x genes, log1p scale) between a method's correction of the stressed
    data and its correction of the untouched data."""
    diff = np.asarray(corrected_on_stressed, dtype=np.float64) - np.asarray(corrected_on_truth, dtype=np.float64)
    return float(np.sqrt(np.mean(diff ** 2)))


def group_means(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(groups, genes): the mean of each group's cells (rows of `values`), groups in sorted order."""
    values = np.asarray(values, dtype=np.float64)
    names, inverse = np.unique(np.asarray(groups), return_inverse=True)
    sums = np.zeros((len(names), values.shape[1]))
    np.add.at(sums, inverse.ravel(), values)
    return sums / np.bincount(inverse.ravel())[:, None]


def group_truth_error(corrected_on_stressed: np.ndarray, corrected_on_truth: np.ndarray, groups: np.ndarray) -> float:
    """Root-mean-square over (group, gene) of the difference between a group's mean corrected values in the two
    corrections: the stress's counting noise, independent from cell to cell, averages out within a group, so
    what is left is the added effect the method left in the group, or the biology it moved there."""
    diff = np.asarray(corrected_on_stressed, dtype=np.float64) - np.asarray(corrected_on_truth, dtype=np.float64)
    return float(np.sqrt(np.mean(group_means(diff, groups) ** 2)))


def group_errors_and_spread(
    corrected_on_stressed: np.ndarray, corrected_on_truth: np.ndarray, groups: np.ndarray,
) -> tuple[np.ndarray, float]:
    """((groups, genes) group-mean errors of the stressed run against the truth run, the spread of the truth
    run's group means: root-mean-square over (group, gene) of each gene's group means minus their mean)."""
    truth_means = group_means(corrected_on_truth, groups)  # (groups, genes)
    spread = np.sqrt(np.mean((truth_means - truth_means.mean(axis=0)) ** 2))
    return group_means(corrected_on_stressed, groups) - truth_means, float(spread)


def relative_group_truth_error(
    corrected_on_stressed: np.ndarray, corrected_on_truth: np.ndarray, groups: np.ndarray,
) -> float:
    """`group_truth_error` over the spread of the truth run's group means: the share of the differences between
    groups that is wrong. It does not depend on the output's scale, so a method whose values are not on the log1p
    scale (Scanorama's unit-norm cells) is compared with the others; 1.0 = an error as large as the groups'
    differences."""
    error_means, spread = group_errors_and_spread(corrected_on_stressed, corrected_on_truth, groups)
    return float(np.sqrt(np.mean(error_means ** 2)) / spread)


def contrast_truth_error(
    corrected_on_stressed: np.ndarray, corrected_on_truth: np.ndarray, groups: np.ndarray,
) -> float:
    """`relative_group_truth_error` of the differences between groups: each gene's error minus its mean error over
    the groups. Every batch got its own factors, so their mean per gene is in every batch and no method can tell it
    from the genes' true levels; each method puts it back its own way (ComBat the cells' grand mean, batchfix the
    average of its batches' decoders). What stays in this error is what a method got wrong between groups: an
    added effect left in one batch, or biology moved from one group to another."""
    error_means, spread = group_errors_and_spread(corrected_on_stressed, corrected_on_truth, groups)
    return float(np.sqrt(np.mean((error_means - error_means.mean(axis=0)) ** 2)) / spread)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help=".h5ad with raw counts in X")
    parser.add_argument("output", help="the stressed .h5ad to write (refused if it exists)")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--batches", nargs="+", help="keep only these batches (a sub-problem)")
    parser.add_argument("--label-key", default="cell_type", help="the cell states of --state-share")
    for name, default in asdict(Stress()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    adata = ad.read_h5ad(args.input)
    if args.batches:
        present = sorted(adata.obs[args.batch_key].astype(str).unique())
        unknown = sorted(set(args.batches) - set(present))
        if unknown:
            parser.error(f"batches {unknown} are not in obs['{args.batch_key}']; present: {present}")
        adata = adata[adata.obs[args.batch_key].astype(str).isin(args.batches)].copy()
    stress = Stress(**{name: getattr(args, name) for name in asdict(Stress())})
    out = stress_set(adata, args.batch_key, stress, args.label_key)
    with atomic_output(Path(args.output), overwrite=False) as tmp:
        out.write_h5ad(tmp)
    print(f"Wrote {args.output}: {out.n_obs} cells x {out.n_vars} genes, {stress}, depths "
          f"{ {b: round(d, 2) for b, d in zip(out.uns['stress']['batches'], out.uns['stress']['depths'])} }")


if __name__ == "__main__":
    main()
