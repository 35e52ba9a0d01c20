"""Rebuild data/cellbench5.h5ad, the bundled copy of the CellBench 5-batch dataset.

Every cell, gene, count and annotation is kept. X is stored dense (float32) with HDF5's
shuffle + gzip filters, which packs these integer counts into about half the space of the
sparse original; anndata reads it back as a dense array holding the same values.

    python -m scripts.make_bundled_data SOURCE.h5ad data/cellbench5.h5ad
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import scipy.sparse as sp


def pack(source: Path, target: Path) -> None:
    adata = ad.read_h5ad(source)
    counts = adata.X.toarray() if sp.issparse(adata.X) else np.asarray(adata.X)
    adata.X = counts.astype(np.float32)
    staging = target.with_suffix(".staging.h5ad")
    adata.write_h5ad(staging, compression="gzip")
    tmp = target.with_suffix(".tmp.h5ad")
    # Copy every group into a fresh file (drops the space freed by rewriting X), re-filtering X.
    with h5py.File(staging, "r") as src, h5py.File(tmp, "w") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        for key in src:
            if key != "X":
                src.copy(key, dst)
        x = dst.create_dataset(
            "X", data=src["X"][...], chunks=(64, counts.shape[1]),
            compression="gzip", compression_opts=9, shuffle=True,
        )
        for key, value in src["X"].attrs.items():
            x.attrs[key] = value
    staging.unlink()
    os.replace(tmp, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the sparse CellBench 5-batch .h5ad")
    parser.add_argument("target", type=Path, help="where to write the bundled copy")
    args = parser.parse_args()
    pack(args.source, args.target)
    original, bundled = ad.read_h5ad(args.source), ad.read_h5ad(args.target)
    same = np.array_equal(original.X.toarray(), bundled.X) and original.obs.equals(bundled.obs)
    print(f"{args.target}: {bundled.n_obs} cells x {bundled.n_vars} genes, "
          f"{args.target.stat().st_size / 1e6:.2f} MB, identical values: {same}")


if __name__ == "__main__":
    main()
