"""State groups: cell states without labels, as k-means groups of the latent, for what a correction estimates per
batch and state (batchfix.correction.evidence's weights, the state shrink's means).

A batch effect may differ between cell states, even in sign (a chemistry's capture of a gene in one cell type and
another): averaged over a batch's cells it cancels, and a cell's shift drawn toward its batch's mean loses it. Taken
per (batch, state group), it is measured and kept where its cells are. The groups are fitted once, in the estimate
pass, to the latents of a sample of the input's cells; every cell then belongs to the group of its nearest centroid
(a function of its latent alone, so any row range is corrected on its own).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

STATE_GROUPS = 10  # k-means groups of the latent standing in for cell states (as the recommendation's clusters)
SAMPLE_CELLS = 5000  # input cells whose latents the groups are fitted to
GROUP_CELLS = 20  # sampled cells per group at least: fewer groups for smaller inputs, none below two
KMEANS_STEPS = 50  # Lloyd iterations (each sampled cell's group settles well before on the development sets)


class LatentSample:
    """The latents of the input cells whose name keys (counts.name_keys, as the draws') fall below a threshold that
    takes about SAMPLE_CELLS of `n_obs` cells: which cells are sampled depends on their names alone, not on their
    rows, so a file's cells in another order give the same sample. Gathered in the estimate pass's first pass and
    merged over forward batches and processes (batchfix.correction.reduction); `sorted` puts it in the keys' order,
    the same however it was gathered."""

    SUMMED = ("keys", "latents")  # merged (concatenated), not added

    def __init__(self, n_obs: int, latent_dim: int):
        self.n_obs = n_obs
        self.keys, self.latents = np.empty(0, dtype=np.uint64), np.empty((0, latent_dim))

    def picked(self, keys: np.ndarray) -> np.ndarray:
        """(B,) bool: which cells of these name keys are sampled."""
        return sampled(keys, self.n_obs)

    def add(self, keys: np.ndarray, latents: np.ndarray) -> None:
        """The sampled cells' keys (n,) and latents (n, latent)."""
        self.keys = np.concatenate([self.keys, keys])
        self.latents = np.vstack([self.latents, latents])

    def merge(self, other: LatentSample) -> None:
        """Add another part's sample (batchfix.correction.reduction merges with this in place of a sum)."""
        self.add(other.keys, other.latents)

    def emptied(self) -> LatentSample:
        """A copy without cells (batchfix.correction.reduction's zero)."""
        fresh = copy.copy(self)
        fresh.keys, fresh.latents = np.empty(0, dtype=np.uint64), np.empty((0, self.latents.shape[1]))
        return fresh

    def sorted(self) -> np.ndarray:
        """(n, latent) the sampled latents by key (repeated names: by latent)."""
        order = np.lexsort((*self.latents.T[::-1], self.keys))
        return self.latents[order]


def sampled(keys: np.ndarray, n_obs: int) -> np.ndarray:
    """(B,) bool: which cells of these name keys (of an input of `n_obs` cells) are among the about SAMPLE_CELLS
    whose keys fall below the threshold that takes that many (every cell of an input of no more)."""
    return keys < np.uint64(min(2**64 - 1, int(2**64 * SAMPLE_CELLS / max(n_obs, 1))))


@dataclass(frozen=True)
class StateGroups:
    """Cell states without labels: k-means centroids (groups, latent) of the sampled latents; a cell belongs to the
    group of its nearest centroid."""

    centroids: np.ndarray

    def assign(self, latents) -> np.ndarray:
        """(B,) each latent's group, from (B, latent) latents (array or tensor)."""
        values = latents.numpy() if isinstance(latents, torch.Tensor) else np.asarray(latents)
        distance = np.square(values[:, None, :].astype(np.float64) - self.centroids[None, :, :]).sum(axis=-1)
        return distance.argmin(axis=1)


def fit_groups(sample: LatentSample) -> StateGroups | None:
    """k-means groups of the sampled latents (k-means++ seeding with a fixed seed, then Lloyd's steps, in plain
    numpy so every process finds the same groups bit for bit); None where fewer than two groups of GROUP_CELLS
    sampled cells fit."""
    latents = sample.sorted()
    n_groups = min(STATE_GROUPS, len(latents) // GROUP_CELLS)
    if n_groups < 2:
        return None
    rng = np.random.default_rng(0)
    centroids = latents[[rng.integers(len(latents))]]
    while len(centroids) < n_groups:  # k-means++: the next centroid drawn by squared distance to the nearest
        nearest = np.square(latents[:, None, :] - centroids[None]).sum(axis=-1).min(axis=1)
        if not nearest.any():
            return None if len(centroids) < 2 else StateGroups(centroids)  # no more distinct latents
        centroids = np.vstack([centroids, latents[rng.choice(len(latents), p=nearest / nearest.sum())]])
    for _ in range(KMEANS_STEPS):
        group = StateGroups(centroids).assign(latents)
        centroids = np.stack([latents[group == k].mean(axis=0) if (group == k).any() else centroids[k]
                              for k in range(len(centroids))])
    return StateGroups(centroids)


def group_codes(codes: np.ndarray, groups: StateGroups, latents) -> np.ndarray:
    """(B,) each cell's (batch code, group) as one code, code * groups + group (-1 for cells without a batch)."""
    return np.where(codes >= 0, codes * len(groups.centroids) + groups.assign(latents), -1)
