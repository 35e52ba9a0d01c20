"""UMAP pictures of the scored embeddings, coloured by batch and by label."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp
from matplotlib.figure import Figure

from batchfix.config import EvaluationOptions
from batchfix.eval.metrics import resolve_neighbors


def plot_umaps(
    embeddings: Mapping[str, np.ndarray],
    batch: Sequence,
    labels: Sequence | None,
    out_png,
    seed: int = 0,
    image_format: str | None = None,
    neighbors: str = EvaluationOptions.neighbors,
) -> None:
    """One PNG: a row per embedding (UMAP of its 15-NN graph, found as `neighbors` says), coloured by batch
    and by label, each in its own palette; a column is titled with its obs column's name (a Series' name)."""
    columns = umap_columns(batch, labels)
    fig = Figure(figsize=(5.5 * len(columns), 4.5 * len(embeddings)), layout="constrained")
    axes = fig.subplots(len(embeddings), len(columns), squeeze=False)
    for row, (name, emb) in enumerate(embeddings.items()):
        coords = umap_coordinates(emb, seed, neighbors)
        for col, (what, values, colors) in enumerate(columns):
            _scatter_categories(axes[row, col], coords, values, colors, legend=row == 0)
            axes[row, col].set_title(f"{name} — {what}", fontsize=10)
    fig.savefig(out_png, dpi=110, format=image_format)


def umap_columns(batch: Sequence, labels: Sequence | None) -> list[tuple[str, np.ndarray, Callable]]:
    """(title, values, colours) of each column of the picture: the batch, then the labels when given; the title
    is the obs column's name (a Series' name), the colours (batch_colors, label_colors) never shared."""
    columns = [(getattr(batch, "name", None) or "batch", np.asarray(batch).astype(str), batch_colors)]
    if labels is not None:
        columns.append((getattr(labels, "name", None) or "label", np.asarray(labels).astype(str), label_colors))
    return columns


def umap_coordinates(embedding: np.ndarray, seed: int = 0, neighbors: str = EvaluationOptions.neighbors) -> np.ndarray:
    """2-D UMAP (scanpy) of an embedding, on its 15-nearest-neighbour graph (exact or as scanpy does)."""
    tmp = ad.AnnData(obsm={"X_emb": np.asarray(embedding, dtype=np.float32)},
                     obs=pd.DataFrame(index=np.arange(len(embedding)).astype(str)))
    # scanpy switches to pynndescent from 8192 cells; its transformer now returns a scipy sparse array,
    # which scanpy 1.11 cannot read (no getnnz): the same transformer, returning a sparse matrix.
    if resolve_neighbors(neighbors, len(embedding)) == "exact":
        transformer = "sklearn"  # scanpy's brute-force search
    else:
        transformer = approximate_neighbors(len(embedding), 15, seed) if len(embedding) >= 8192 else None
    sc.pp.neighbors(tmp, use_rep="X_emb", n_neighbors=15, random_state=seed, transformer=transformer)
    sc.tl.umap(tmp, random_state=seed, init_pos=umap_initialisation(tmp.obsp["connectivities"]))
    return tmp.obsm["X_umap"]


# umap-learn lays out every connected component of the graph with its own shift-invert eigensolver before
# the optimisation; with hundreds of small components (a 20,000-cell subsample of resampled cells) that took
# over 15 minutes on a 2-core CPU. Beyond this many components the layout starts from the embedding's PCA.
MAX_SPECTRAL_COMPONENTS = 20


def umap_initialisation(connectivities) -> str:
    """UMAP's starting layout for a neighbour graph: 'spectral' (scanpy's default) unless the graph falls into
    more than MAX_SPECTRAL_COMPONENTS connected components, then 'pca'."""
    from scipy.sparse.csgraph import connected_components

    n_components, _ = connected_components(connectivities, directed=False)
    return "spectral" if n_components <= MAX_SPECTRAL_COMPONENTS else "pca"


def approximate_neighbors(n_cells: int, n_neighbors: int, seed: int):
    """scanpy's default pynndescent transformer for n_cells (UMAP's n_trees and n_iters), giving a CSR matrix."""
    from pynndescent import PyNNDescentTransformer

    class MatrixOutput(PyNNDescentTransformer):
        def fit_transform(self, X, y=None, **kwargs):
            return sp.csr_matrix(super().fit_transform(X, y, **kwargs))

        def transform(self, X, y=None):
            return sp.csr_matrix(super().transform(X, y))

    return MatrixOutput(n_neighbors=n_neighbors, metric="euclidean", random_state=seed, n_jobs=None,
                        n_trees=min(64, 5 + round(n_cells**0.5 / 20.0)), n_iters=max(5, round(np.log2(n_cells))))


def _scatter_categories(ax, coords: np.ndarray, values: np.ndarray, colors: Callable, legend: bool) -> None:
    categories = sorted(pd.unique(values))
    cmap = colors(len(categories))
    order = np.random.default_rng(0).permutation(len(values))  # no category painted on top
    points = np.array([cmap[categories.index(v)] for v in values])
    ax.scatter(coords[order, 0], coords[order, 1], c=points[order], s=6, linewidths=0)
    ax.set_xticks([])
    ax.set_yticks([])
    if legend:
        for cat, color in zip(categories, cmap):
            ax.scatter([], [], color=color, s=20, label=cat)
        ax.legend(fontsize=7, markerscale=1.2, frameon=False, loc="best")


def label_colors(n: int) -> list:
    """n bright colours for labels (scanpy's: tab10, tab20 beyond 10)."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if n <= 10 else "tab20"]
    return [palette(i % palette.N) for i in range(n)]


def batch_colors(n: int) -> list:
    """n muted colours for batches, none of them a label's: tab20b, one shade of each of its 5 hues before the
    next shade (the second darkest first: the most distinct)."""
    from matplotlib import colormaps

    palette = colormaps["tab20b"]
    return [palette((i % 5) * 4 + (1, 0, 2, 3)[(i // 5) % 4]) for i in range(n)]
