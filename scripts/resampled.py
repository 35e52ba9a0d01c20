"""Large .h5ad files of resampled real cells, written chunk by chunk (the scale and correction benchmarks).

Cells are drawn with replacement from the bundled CellBench cells and their counts Poisson-resampled,
so a file keeps real genes, real batch structure and real cell lines at any size without holding it
in memory. Imported by scripts/bench/bench_scale.py and scripts/bench/bench_correct.py; on its own it writes one
such file (a larger development set, e.g. for scripts/stress_set.py):

    python -m scripts.resampled res15k.h5ad --cells 15000 --seed 1
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import h5py
import numpy as np

GENERATE_CHUNK = 20_000  # cells resampled and written at a time


def string_dataset(group: h5py.Group, name: str, values) -> h5py.Dataset:
    dataset = group.create_dataset(name, data=np.asarray(values, dtype=object), dtype=h5py.string_dtype())
    dataset.attrs.update({"encoding-type": "string-array", "encoding-version": "0.2.0"})
    return dataset


def categorical(obs: h5py.Group, name: str, categories: list[str], n_cells: int) -> h5py.Dataset:
    group = obs.create_group(name)
    group.attrs.update({"encoding-type": "categorical", "encoding-version": "0.2.0", "ordered": False})
    string_dataset(group, "categories", categories)
    codes = group.create_dataset("codes", shape=(n_cells,), dtype=np.int8, chunks=(min(n_cells, 1 << 18),))
    codes.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    return codes


def bundled_cells(genes: list[str] | None = None, n_genes: int | None = None):
    """The bundled AnnData on `genes` (by name), or on its `n_genes` most detected genes, or on all."""
    import anndata as ad

    from batchfix.data.io import bundled_dataset

    source = ad.read_h5ad(bundled_dataset())
    if genes is not None:
        missing = set(genes) - set(source.var_names)
        if missing:
            raise SystemExit(f"{len(missing)} of the requested genes are not in the bundled data "
                             "(use a model trained on it).")
        return source[:, genes]
    if n_genes:  # the most detected genes, in the file's order
        detected = (np.asarray(source.X) > 0).sum(axis=0)
        return source[:, np.sort(np.argsort(-detected, kind="stable")[:n_genes])]
    return source


def generate(path: Path, n_cells: int, genes: list[str] | None = None, n_genes: int | None = None,
             seed: int = 0) -> None:
    """An N-cell .h5ad of Poisson-resampled bundled cells (CSR counts, obs batch and cell_type), chunk by chunk;
    written beside `path` and renamed into place when complete."""
    import scipy.sparse as sp

    source = bundled_cells(genes, n_genes)
    counts = sp.csr_matrix(np.asarray(source.X, dtype=np.float32))
    obs = {key: source.obs[key].astype("category") for key in ("batch", "cell_type")}
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".partial")
    with h5py.File(tmp, "w") as f:
        f.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
        X = f.create_group("X")
        X.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0"})
        X.attrs["shape"] = np.array([n_cells, counts.shape[1]], dtype=np.int64)
        data = X.create_dataset("data", shape=(0,), maxshape=(None,), dtype=np.float32, chunks=(1 << 20,))
        indices = X.create_dataset("indices", shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(1 << 20,))
        indptr = X.create_dataset("indptr", shape=(n_cells + 1,), dtype=np.int64)
        o = f.create_group("obs")
        o.attrs.update({"_index": "_index", "column-order": np.array(list(obs), dtype=object),
                        "encoding-type": "dataframe", "encoding-version": "0.2.0"})
        names = o.create_dataset("_index", shape=(n_cells,), dtype=h5py.string_dtype())
        names.attrs.update({"encoding-type": "string-array", "encoding-version": "0.2.0"})
        codes = {key: categorical(o, key, list(col.cat.categories), n_cells) for key, col in obs.items()}
        var = f.create_group("var")
        var.attrs.update({"_index": "_index", "column-order": np.array([], dtype=np.float64),
                          "encoding-type": "dataframe", "encoding-version": "0.2.0"})
        string_dataset(var, "_index", source.var_names.to_numpy())
        for name in ("layers", "obsm", "obsp", "varm", "varp", "uns"):
            f.create_group(name).attrs.update({"encoding-type": "dict", "encoding-version": "0.1.0"})
        filled = 0
        indptr[0] = 0
        for start in range(0, n_cells, GENERATE_CHUNK):
            stop = min(start + GENERATE_CHUNK, n_cells)
            rows = rng.integers(0, counts.shape[0], size=stop - start)
            chunk = counts[rows]
            chunk.data = rng.poisson(chunk.data).astype(np.float32)
            chunk.eliminate_zeros()
            data.resize((filled + chunk.nnz,))
            indices.resize((filled + chunk.nnz,))
            data[filled:] = chunk.data
            indices[filled:] = chunk.indices
            indptr[start + 1:stop + 1] = chunk.indptr[1:].astype(np.int64) + filled
            filled += chunk.nnz
            names[start:stop] = np.array([f"cell{i:08d}" for i in range(start, stop)], dtype=object)
            for key, col in obs.items():
                codes[key][start:stop] = col.cat.codes.to_numpy()[rows]
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="the .h5ad to write (refused if it exists)")
    parser.add_argument("--cells", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.output.exists():
        parser.error(f"{args.output} exists; name another output")
    if args.cells < 1:
        parser.error(f"--cells {args.cells}: at least 1")
    generate(args.output, args.cells, seed=args.seed)
    print(f"Wrote {args.output}: {args.cells} resampled cells (seed {args.seed}).")


if __name__ == "__main__":
    main()
