"""Are two `train` run folders' outputs identical? For refactors that must not change what batchfix produces.

    python -m scripts.compare_runs RUN_A RUN_B [--key batchfix]

Compares, with np.array_equal, every layer whose name starts with the key, obsm['X_<key>'] and every score in
metrics.json (the scores, not the timings), and prints one line per item; exits 1 when any differs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp

from batchfix.cli.sweep import flatten

TIMING_KEYS = ("seconds", "time", "_s", "peak", "memory", "rss")  # metrics.json entries that vary run to run


def dense(matrix) -> np.ndarray:
    return matrix.toarray() if sp.issparse(matrix) else np.asarray(matrix)


def scores(metrics: dict) -> dict[str, float]:
    """Every number in metrics.json by its dotted path (batchfix.cli.sweep.flatten), timings left out."""
    return {name: value for name, value in flatten(metrics).items()
            if not any(word in name.rsplit(".", 1)[-1].lower() for word in TIMING_KEYS)}


def compare(run_a: Path, run_b: Path, key: str) -> list[tuple[str, bool]]:
    """(item, equal) for the layers, the latent and the scores of the two runs."""
    a, b = ad.read_h5ad(run_a / "corrected.h5ad"), ad.read_h5ad(run_b / "corrected.h5ad")
    rows = []
    for name in sorted({*a.layers, *b.layers}):
        if name.startswith(key):
            same = name in a.layers and name in b.layers and np.array_equal(dense(a.layers[name]),
                                                                             dense(b.layers[name]))
            rows.append((f"layers['{name}']", same))
    latent = f"X_{key}"
    rows.append((f"obsm['{latent}']", np.array_equal(a.obsm[latent], b.obsm[latent])))
    metrics_a = scores(json.loads((run_a / "metrics.json").read_text()))
    metrics_b = scores(json.loads((run_b / "metrics.json").read_text()))
    for name in sorted(set(metrics_a) | set(metrics_b)):
        rows.append((f"metrics.json {name}", metrics_a.get(name) == metrics_b.get(name)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--key", default="batchfix", help="the correction's key_added (default batchfix)")
    args = parser.parse_args(argv)
    rows = compare(args.run_a, args.run_b, args.key)
    for item, same in rows:
        print(f"{'equal' if same else 'DIFFERENT':9s}  {item}")
    n_different = sum(not same for _, same in rows)
    print(f"{len(rows) - n_different} of {len(rows)} equal")
    return 1 if n_different else 0


if __name__ == "__main__":
    sys.exit(main())
