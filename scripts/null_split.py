"""A null split: the cells of one real batch divided at random into pseudo-batches, so that every change a corrector
makes between them is an artefact (they share platform, run and biology; only the draw tells them apart).

The output holds raw counts in X (from `--counts-layer` when given), the input's obs columns and var, the
pseudo-batch (`<batch>_a`, `<batch>_b`, ...) in obs[batch_key] and the original batch in obs['source_batch'].
`--keep-batch` adds the cells of other batches unchanged (their own batch in both columns), so that a corrector
has real batch effects to learn beside the null pair; scripts/null_scores.py scores only the split cells.
`uns['null_split']` records the split batch, fractions, seed and the pseudo-batch names.

    python -m scripts.null_split data/cellbench5.h5ad null.h5ad --batch sc_celseq2 --fractions 0.5 0.5 --seed 0
    python -m scripts.null_split data/cellbench5.h5ad null_kept.h5ad --batch sc_celseq2 --fractions 0.5 0.5 \
        --keep-batch sc_dropseq --keep-batch sc_celseq2_5cl_p1
"""
from __future__ import annotations

import argparse
import string
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp

from batchfix.data.atomic import atomic_output, refuse_existing
from batchfix.errors import OutputExistsError

SOURCE_KEY = "source_batch"


def pseudo_batch_names(batch: str, n_parts: int) -> list[str]:
    """`<batch>_a`, `<batch>_b`, ... for `n_parts` parts (at most 26)."""
    if not 2 <= n_parts <= len(string.ascii_lowercase):
        raise ValueError(f"a null split needs 2 to 26 parts, not {n_parts}")
    return [f"{batch}_{letter}" for letter in string.ascii_lowercase[:n_parts]]


def split_sizes(n_cells: int, fractions: list[float]) -> np.ndarray:
    """Cells per part: the rounded cumulative fractions' differences (they sum to `n_cells`)."""
    fractions = np.asarray(fractions, dtype=np.float64)
    if (fractions <= 0).any() or abs(fractions.sum() - 1.0) > 1e-6:
        raise ValueError(f"fractions must be positive and sum to 1, not {fractions.tolist()}")
    bounds = np.round(np.cumsum(fractions) * n_cells).astype(int)
    bounds[-1] = n_cells
    return np.diff(bounds, prepend=0)


def null_split(adata: ad.AnnData, batch: str, fractions: list[float], seed: int = 0, batch_key: str = "batch",
               counts_layer: str | None = None, keep_batches: tuple[str, ...] = ()) -> ad.AnnData:
    """The cells of `batch` (and those of `keep_batches`, unchanged) with the split batch's cells assigned at random
    to pseudo-batches of the given fractions; raw counts in X, in the input's cell order."""
    batches = adata.obs[batch_key].astype(str).to_numpy()
    present = sorted(set(batches))
    unknown = sorted({batch, *keep_batches} - set(present))
    if unknown:
        raise ValueError(f"batches {unknown} are not in obs['{batch_key}']; present: {present}")
    if batch in keep_batches:
        raise ValueError(f"{batch} is the batch split; it cannot also be kept whole")
    split_cells = np.flatnonzero(batches == batch)
    names = pseudo_batch_names(batch, len(fractions))
    order = np.random.default_rng(seed).permutation(len(split_cells))
    assigned = np.empty(len(split_cells), dtype=object)
    assigned[order] = np.repeat(names, split_sizes(len(split_cells), fractions))
    rows = np.flatnonzero(np.isin(batches, [batch, *keep_batches]))
    new_batch = batches.astype(object)
    new_batch[split_cells] = assigned
    counts = adata.layers[counts_layer] if counts_layer else adata.X
    counts = counts[rows]
    obs = adata.obs.iloc[rows].copy()
    obs[SOURCE_KEY] = batches[rows]
    obs[batch_key] = new_batch[rows].astype(str)
    for key in (batch_key, SOURCE_KEY):
        obs[key] = obs[key].astype("category")
    out = ad.AnnData(X=sp.csr_matrix(counts) if sp.issparse(counts) else np.asarray(counts), obs=obs,
                     var=adata.var.copy())
    out.uns["null_split"] = {"batch": batch, "fractions": np.asarray(fractions, dtype=np.float64),
                             "seed": seed, "pseudo_batches": np.asarray(names), "batch_key": batch_key,
                             "kept_batches": np.asarray(sorted(keep_batches), dtype=str)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help=".h5ad with raw counts in X (or --counts-layer)")
    parser.add_argument("output", help=".h5ad written (never over an existing file)")
    parser.add_argument("--batch", required=True, help="the batch whose cells are split")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.5], help="one per pseudo-batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--counts-layer", help="the layer of raw counts (default: X)")
    parser.add_argument("--keep-batch", action="append", default=[], help="another batch written whole (repeat)")
    args = parser.parse_args(argv)
    try:
        refuse_existing(Path(args.output), overwrite=False)
        adata = ad.read_h5ad(args.input)
        out = null_split(adata, args.batch, args.fractions, args.seed, args.batch_key, args.counts_layer,
                         tuple(args.keep_batch))
    except (ValueError, OutputExistsError) as error:
        parser.error(str(error))
    with atomic_output(Path(args.output), overwrite=False) as tmp:
        out.write_h5ad(tmp)
    sizes = out.obs[args.batch_key].value_counts().sort_index().to_dict()
    print(f"Wrote {args.output}: {out.n_obs} cells x {out.n_vars} genes, cells per batch {sizes}")


if __name__ == "__main__":
    main()
