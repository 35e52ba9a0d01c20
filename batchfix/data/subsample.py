"""Stratified cell subsamples: every group (batch, or batch x label) keeps its share of the cells.

Used where a step needs a bounded number of cells rather than all of them: ranking highly variable
genes of a streamed file (by batch), and scoring a large corrected file (by batch x label). A plain
random subsample could drop a small batch or a rare cell type, which both of those steps rely on.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

SEED = 0  # a subsample is the same on every run


def stratified_rows(groups: list[np.ndarray], max_cells: int, seed: int = SEED) -> np.ndarray:
    """Ascending rows of a subsample of at most `max_cells` cells (all rows when there are no more).

    `groups`: one or more per-cell arrays (e.g. [batch, label]); a stratum is one combination of their
    values. Each stratum gets its proportional share (largest remainders round it), and at least one
    cell while `max_cells` allows; its cells are drawn without replacement.
    """
    codes = pd.MultiIndex.from_arrays([pd.Categorical(g) for g in groups]).factorize()[0] if len(groups) > 1 \
        else pd.Categorical(groups[0]).codes.astype(np.int64)
    n = len(codes)
    if n <= max_cells:
        return np.arange(n)
    sizes = np.bincount(codes)
    quota = allocate(sizes, max_cells)
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(np.flatnonzero(codes == code), size=k, replace=False)
              for code, k in enumerate(quota) if k > 0]
    return np.sort(np.concatenate(chosen))


def allocate(sizes: np.ndarray, total: int) -> np.ndarray:
    """Cells per stratum: proportional to `sizes`, summing to `total`, each >= 1 while `total` allows."""
    floor_one = np.minimum(sizes, 1) if total >= np.count_nonzero(sizes) else np.zeros_like(sizes)
    share = (total - floor_one.sum()) * (sizes - floor_one) / max((sizes - floor_one).sum(), 1)
    quota = floor_one + np.floor(share).astype(np.int64)
    leftover = total - quota.sum()
    remainders = np.where(quota < sizes, share - np.floor(share), -1.0)
    quota[np.argsort(-remainders, kind="stable")[:leftover]] += 1
    return np.minimum(quota, sizes)
