"""Injected copy-number clones with known truth, and how much of them a correction keeps.

In real raw counts, one chromosome's genes are raised (c + Poisson(0.8 c): x1.8 on average) and
another's thinned (Binomial(c, 0.5)) in the cells of one label, in one batch (`confounded`: the
clone's biology coincides with its batch, as a patient's malignant cells do in a tumour atlas), in
every batch (`shared`: a state every batch has, that a correction must keep) or in no cell (`none`:
a correction must not create a regional shift). Scores (`clone_scores`, on log1p(counts per 10k)
or corrected values of the same genes; per segment, the injected chromosome's genes):

- confounded: the clone's cross-batch shift, [seg(L, b) - seg(L, other batches)] minus the same
  for the other labels of batch b (their mean; it removes batch b's own technical shift of the
  segment), over the injected shift; 1.0 = kept whole, 0 = taken for batch effect.
- shared: per batch, seg(L) - seg(other labels) minus the same contrast in the uncorrected
  original counts, averaged over batches, over the injected shift.
- none: the confounded contrast itself (log units) on data with nothing injected: it should
  stay near the uncorrected data's value.

The injected shift is the mean over the clone's cells and the segment's genes of log1p(cp10k)
after minus before injection. seg(group) = mean over the segment's genes and the group's cells.

    python -m scripts.inject_clones data/cellbench5.h5ad --label H2228 --batch sc_celseq2 --out injected.h5ad
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import anndata as ad
import numpy as np

from batchfix.eval.cnv import dense, segment_shift

GAIN_FOLD_EXTRA = 0.8  # gained genes: c + Poisson(0.8 c)
LOSS_KEEP = 0.5  # lost genes: Binomial(c, 0.5)
DESIGNS = ("confounded", "shared", "none")


@dataclass
class Clone:
    """Where a clone was injected: its label, the batches of its cells (None = every batch) and its segments."""

    label: str
    batches: list[str] | None
    gain: str = "7"
    loss: str = "17"


def inject(adata: ad.AnnData, clone: Clone, label_key: str, batch_key: str, seed: int = 0) -> ad.AnnData:
    """A copy of `adata` (raw counts in X) with the clone injected; obs['clone'] marks its cells.

    Genes are on a chromosome by var['chromosome'] ('7' or 'chr7'). An unknown label, batch or
    chromosome is refused, naming what exists.
    """
    labels = adata.obs[label_key].astype(str).to_numpy()
    batch = adata.obs[batch_key].astype(str).to_numpy()
    if clone.label not in set(labels):
        raise ValueError(f"label {clone.label!r} not in obs[{label_key!r}]: {sorted(set(labels))}")
    unknown = sorted(set(clone.batches or []) - set(batch))
    if unknown:
        raise ValueError(f"batches {unknown} not in obs[{batch_key!r}]: {sorted(set(batch))}")
    cells = (labels == clone.label) & (np.isin(batch, clone.batches) if clone.batches is not None else True)
    chromosome = adata.var["chromosome"].astype(str).str.replace(r"^chr", "", regex=True).to_numpy()
    rng = np.random.default_rng(seed)
    counts = dense(adata.X).copy()
    for name in (clone.gain, clone.loss):
        if not (chromosome == name).any():
            raise ValueError(f"no gene on chromosome {name!r}; chromosomes: {sorted(set(chromosome))}")
    block = np.ix_(np.flatnonzero(cells), np.flatnonzero(chromosome == clone.gain))
    counts[block] += rng.poisson(GAIN_FOLD_EXTRA * counts[block])
    block = np.ix_(np.flatnonzero(cells), np.flatnonzero(chromosome == clone.loss))
    counts[block] = rng.binomial(counts[block].astype(np.int64), LOSS_KEEP)
    injected = ad.AnnData(counts.astype(np.float32), obs=adata.obs.copy(), var=adata.var.copy())
    injected.obs["clone"] = cells
    return injected


def segment_genes(var, name: str) -> np.ndarray:
    return var["chromosome"].astype(str).str.replace(r"^chr", "", regex=True).to_numpy() == name


def injected_shift(original_log, injected_log, cells: np.ndarray, genes: np.ndarray) -> float:
    """Mean over the clone's cells and the segment's genes of log values after minus before injection."""
    return float((dense(injected_log[:, np.flatnonzero(genes)]) - dense(original_log[:, np.flatnonzero(genes)]))
                 [cells].mean())


def _others(labels, batch, label, own, min_cells=10) -> list[str]:
    """Other labels with >= min_cells cells in batch `own` and in the other batches."""
    kept = []
    for other in sorted(set(labels) - {label}):
        here = ((labels == other) & (batch == own)).sum()
        there = ((labels == other) & (batch != own)).sum()
        if here >= min_cells and there >= min_cells:
            kept.append(other)
    if not kept:
        raise ValueError(f"batch {own!r} has no other label with >= {min_cells} cells there and elsewhere.")
    return kept


def cross_batch_contrast(log_values, genes, labels, batch, label, own) -> float:
    """[seg(label, own) - seg(label, other batches)] - mean over other labels of the same."""
    def cross(name):
        return segment_shift(log_values, genes, (labels == name) & (batch == own), (labels == name) & (batch != own))
    return cross(label) - float(np.mean([cross(o) for o in _others(labels, batch, label, own)]))


def within_batch_contrast(log_values, genes, labels, batch, label) -> float:
    """Mean over batches of seg(label) - seg(other labels of that batch)."""
    values = []
    for own in sorted(set(batch[labels == label])):
        here = batch == own
        if ((labels == label) & here).sum() >= 10 and ((labels != label) & here).sum() >= 10:
            values.append(segment_shift(log_values, genes, (labels == label) & here, (labels != label) & here))
    return float(np.mean(values))


def clone_scores(matrices: dict, original_log, injected_log, obs, var, clone: Clone, design: str,
                 label_key: str, batch_key: str) -> dict:
    """{method: {segment: score}} for log-scale matrices (cells x genes of `var`) of the injected data.

    original_log / injected_log: log1p(cp10k) of the counts before / after injection on the same genes.
    Scores as the module docstring defines them, per design; segments are named 'gain chr7', 'loss chr17'.
    """
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}.")
    labels, batch = obs[label_key].astype(str).to_numpy(), obs[batch_key].astype(str).to_numpy()
    cells = obs["clone"].to_numpy(dtype=bool) if "clone" in obs else np.zeros(len(obs), bool)
    own = clone.batches[0] if clone.batches else None
    scores = {name: {} for name in matrices}
    for kind, chromosome in (("gain", clone.gain), ("loss", clone.loss)):
        segment = f"{kind} chr{chromosome}"
        genes = segment_genes(var, chromosome)
        if design == "none":
            for name, values in matrices.items():
                scores[name][segment] = cross_batch_contrast(values, genes, labels, batch, clone.label, own)
            continue
        truth = injected_shift(original_log, injected_log, cells, genes)
        for name, values in matrices.items():
            if design == "confounded":
                kept = cross_batch_contrast(values, genes, labels, batch, clone.label, own)
            else:
                kept = (within_batch_contrast(values, genes, labels, batch, clone.label)
                        - within_batch_contrast(original_log, genes, labels, batch, clone.label))
            scores[name][segment] = kept / truth
    return scores


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", help=".h5ad with raw counts in X and var chromosome")
    parser.add_argument("--label", required=True)
    parser.add_argument("--batch", nargs="*", default=None, help="batches of the clone's cells (default: every batch)")
    parser.add_argument("--gain", default="7")
    parser.add_argument("--loss", default="17")
    parser.add_argument("--label-key", default="cell_type")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="the injected .h5ad to write")
    args = parser.parse_args(argv)
    adata = ad.read_h5ad(args.input)
    injected = inject(adata, Clone(args.label, args.batch, args.gain, args.loss), args.label_key, args.batch_key,
                      args.seed)
    injected.write_h5ad(args.out)
    print(f"{int(injected.obs['clone'].sum())} cells of {args.label} injected (gain chr{args.gain}, "
          f"loss chr{args.loss}); wrote {args.out}")


if __name__ == "__main__":
    main()
