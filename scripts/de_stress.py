"""A stress set with a planted DE truth: pseudo-batches split from one real batch, batch effects on a share of the
genes, and a planted two-level condition with known DE genes.

The cells of ONE real batch (`--source-batch`, default the largest) are dealt at random into `--n-batches`
pseudo-batches, so no real batch effect remains. Within each (pseudo-batch, cell type) half the cells are given
condition B and half A (obs['condition'], balanced within each batch), and each (batch, condition) is dealt into
`--replicates` samples (obs['sample'], for pseudobulk). Every effect is applied by binomial thinning, so the
counts stay integers and an NB count stays NB with its mean scaled:

- condition: a share `--de-share` of the genes are DE with log2 fold change (B over A) of size U(1, 2) and random
  sign; a gene up in B has its A cells thinned by 2^-lfc, a gene down in B its B cells by 2^lfc
  (var['de'], var['de_log2fc']); the counts after this step, before the batch effects, are layers['truth'];
- batch: a share `--batch-share` of the genes get a factor f per batch (var['batch_affected']; the rest are null
  genes, var['null_gene']), log f = sd * e; each batch's cells keep a fraction f / max_b f of their molecules.
  `--design multiplicative`: e = e(b, g), standard normal, the same in every cell type (the model of ComBat-seq
  and of a covariate GLM). `--design state`: e = sqrt(1 - s) e(b, g) + sqrt(s) e(b, g, t), with its own draw per
  cell type t (s = `--state-share`): a batch effect that depends on the cell's state (its type; within one type
  it is again one factor per gene and batch).

X holds the stressed counts; `uns['de_stress']` the parameters, seed, batches, cell types and the log factors.

    python -m scripts.de_stress data/cellbench5.h5ad de_mult.h5ad --design multiplicative --seed 0
    python -m scripts.de_stress data/cellbench5.h5ad de_state.h5ad --design state --seed 0
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from batchfix.data.atomic import atomic_output

DESIGNS = ("multiplicative", "state")


@dataclass(frozen=True)
class DEStress:
    design: str = "multiplicative"
    n_batches: int = 3
    replicates: int = 3  # samples per (batch, condition)
    de_share: float = 0.1  # share of the genes DE between the conditions
    batch_share: float = 0.5  # share of the genes with a batch effect (the rest are null genes)
    sd: float = 0.7  # sd of the log batch factors
    state_share: float = 0.75  # design 'state': share of the log factor's variance that is the cell type's own
    n_genes: int = 2000  # the most-detected genes of the source batch (0: all genes detected in >= 3 cells)
    seed: int = 0


def thin(counts: sp.csr_matrix, rows: np.ndarray, keep: np.ndarray, rng: np.random.Generator) -> None:
    """Binomial thinning in place: each entry of the given rows keeps its gene's fraction `keep` (genes,)."""
    start, stop = counts.indptr[rows], counts.indptr[rows + 1]
    entries = np.concatenate([np.arange(a, b) for a, b in zip(start, stop)]) if len(rows) else np.array([], int)
    counts.data[entries] = rng.binomial(counts.data[entries].astype(np.int64), keep[counts.indices[entries]])


def deal(groups: np.ndarray, n_parts: int, rng: np.random.Generator) -> np.ndarray:
    """Each cell's part 0..n_parts-1, dealt at random and evenly within each group."""
    parts = np.empty(len(groups), dtype=np.int64)
    for group in np.unique(groups):
        cells = rng.permutation(np.flatnonzero(groups == group))
        parts[cells] = (np.arange(len(cells)) + rng.integers(n_parts)) % n_parts
    return parts


def source_cells(adata: ad.AnnData, batch_key: str, source: str | None, n_genes: int) -> ad.AnnData:
    """The source batch's cells (the largest batch if none is named) and its most-detected genes."""
    batch = adata.obs[batch_key].astype(str)
    source = source or batch.value_counts().index[0]
    if source not in set(batch):
        raise ValueError(f"batch {source!r} is not in obs['{batch_key}']; present: {sorted(set(batch))}")
    adata = adata[(batch == source).to_numpy()]
    detected = np.asarray((sp.csr_matrix(adata.X) > 0).sum(axis=0)).ravel()
    order = np.argsort(-detected, kind="stable")
    genes = np.sort(order[:n_genes] if n_genes else np.flatnonzero(detected >= 3))
    out = adata[:, genes].copy()
    out.X = sp.csr_matrix(out.X, dtype=np.float64)
    if out.X.nnz and not np.allclose(out.X.data, np.round(out.X.data)):
        raise ValueError("X must hold raw counts (whole numbers) for a stress set.")
    out.uns["de_stress_source"] = source
    return out


def design_obs(cell_types: np.ndarray, stress: DEStress, rng: np.random.Generator) -> pd.DataFrame:
    """obs of the stress set: pseudo-batch, condition (balanced in each batch x cell type) and sample."""
    batch = deal(np.zeros(len(cell_types)), stress.n_batches, rng)
    condition = deal(np.char.add(batch.astype(str), "/" + cell_types.astype(str)), 2, rng)
    replicate = deal(np.char.add(batch.astype(str), condition.astype(str)), stress.replicates, rng)
    names = np.array([f"b{b}" for b in range(stress.n_batches)])[batch]
    conditions = np.array(["A", "B"])[condition]
    samples = [f"{b}_{c}_{r}" for b, c, r in zip(names, conditions, replicate)]
    return pd.DataFrame({"batch": pd.Categorical(names), "condition": pd.Categorical(conditions),
                         "sample": pd.Categorical(samples)})


def plant_condition(counts: sp.csr_matrix, condition: np.ndarray, stress: DEStress,
                    rng: np.random.Generator) -> np.ndarray:
    """Thin the DE genes' counts in place (B over A = 2^lfc in expectation); the genes' log2 fold changes."""
    n_genes = counts.shape[1]
    lfc = np.zeros(n_genes)
    de = rng.choice(n_genes, size=int(round(stress.de_share * n_genes)), replace=False)
    lfc[de] = rng.uniform(1.0, 2.0, len(de)) * rng.choice([-1.0, 1.0], len(de))
    thin(counts, np.flatnonzero(condition == "A"), np.exp2(-np.maximum(lfc, 0.0)), rng)
    thin(counts, np.flatnonzero(condition == "B"), np.exp2(np.minimum(lfc, 0.0)), rng)
    return lfc


def batch_log_factors(n_genes: int, n_types: int, stress: DEStress, rng: np.random.Generator) -> np.ndarray:
    """(cell types, batches, genes) log factors: sd * e on the affected genes, 0 on the null genes."""
    affected = np.zeros(n_genes, dtype=bool)
    affected[rng.choice(n_genes, size=int(round(stress.batch_share * n_genes)), replace=False)] = True
    common = rng.standard_normal((1, stress.n_batches, n_genes))
    if stress.design == "state":
        own = rng.standard_normal((n_types, stress.n_batches, n_genes))
        e = np.sqrt(1.0 - stress.state_share) * common + np.sqrt(stress.state_share) * own
    else:
        e = np.repeat(common, n_types, axis=0)
    return stress.sd * e * affected


def de_stress_set(adata: ad.AnnData, stress: DEStress, label_key: str = "cell_type") -> ad.AnnData:
    """The stress set from one batch's cells (raw counts in X): obs, stressed X, layers['truth'], truth in var/uns."""
    if stress.design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, not {stress.design!r}")
    rng = np.random.default_rng(stress.seed)
    cell_types = adata.obs[label_key].astype(str).to_numpy()
    obs = design_obs(cell_types, stress, rng)
    counts = sp.csr_matrix(adata.X, dtype=np.float64, copy=True)
    lfc = plant_condition(counts, obs["condition"].to_numpy(), stress, rng)
    truth = counts.copy()
    types = np.unique(cell_types)
    log_factors = batch_log_factors(counts.shape[1], len(types), stress, rng)
    batch_index = obs["batch"].cat.codes.to_numpy()
    keep = np.exp(log_factors - log_factors.max(axis=1, keepdims=True))  # every batch thinned, none raised
    for t, name in enumerate(types):
        for b in range(stress.n_batches):
            thin(counts, np.flatnonzero((cell_types == name) & (batch_index == b)), keep[t, b], rng)
    counts.eliminate_zeros()
    truth.eliminate_zeros()
    obs.index = adata.obs_names
    obs["cell_type"] = adata.obs[label_key].to_numpy()
    out = ad.AnnData(X=counts.astype(np.float32), obs=obs, var=adata.var.copy())
    out.layers["truth"] = truth.astype(np.float32)
    out.var["de"], out.var["de_log2fc"] = lfc != 0, lfc
    out.var["batch_affected"] = (log_factors != 0).any(axis=(0, 1))
    out.var["null_gene"] = ~out.var["batch_affected"]
    out.uns["de_stress"] = {**asdict(stress), "source_batch": adata.uns.get("de_stress_source", ""),
                            "batches": list(obs["batch"].cat.categories), "cell_types": types.tolist(),
                            "log_factors": log_factors}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help=".h5ad with raw counts in X")
    parser.add_argument("output", help="the stress set .h5ad to write (refused if it exists)")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type")
    parser.add_argument("--source-batch", help="the real batch split into pseudo-batches (default: the largest)")
    for name, default in asdict(DEStress()).items():
        choices = DESIGNS if name == "design" else None
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, choices=choices)
    args = parser.parse_args()
    stress = DEStress(**{name: getattr(args, name) for name in asdict(DEStress())})
    adata = source_cells(ad.read_h5ad(args.input), args.batch_key, args.source_batch, stress.n_genes)
    out = de_stress_set(adata, stress, args.label_key)
    with atomic_output(Path(args.output), overwrite=False) as tmp:
        out.write_h5ad(tmp)
    var, source = out.var, out.uns["de_stress"]["source_batch"]
    print(f"Wrote {args.output}: {out.n_obs} cells x {out.n_vars} genes from batch {source}, "
          f"{int(var['de'].sum())} DE genes, {int(var['null_gene'].sum())} null genes, {stress}")


if __name__ == "__main__":
    main()
