"""Mean attention between loci along the genome, per group of cells (a label or batch column).

`python -m batchfix attention` writes the maps (attention.npz) and their picture (attention.png);
`train` draws the picture into every run folder. Long token sequences (per-gene tokens) are pooled
into at most `resolution` bins of neighbouring tokens per axis while the weights stream past, so
memory stays at (groups, heads, bins, bins) per layer whatever the number of tokens.
"""
from __future__ import annotations

import io
import logging
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import h5py
import numpy as np
import torch
from PIL import Image

from batchfix.config import ResolvedCorrection
from batchfix.correction.corrector import BoundModel
from batchfix.data import ondisk
from batchfix.data.atomic import atomic_output, output_exists
from batchfix.data.genome import CHROMOSOMES
from batchfix.data.io import check_h5ad_path, obs_strings
from batchfix.errors import InputError
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)

MAX_GROUPS_DRAWN = 12  # the largest groups get a row of the picture; the .npz keeps every group
COLOUR_RANGE = 3.0  # the picture's colour scale: log2(attention / uniform) from -3 to +3


@dataclass
class AttentionMaps:
    """maps[g, l, h, i, j]: mean over the cells of group g of the attention that layer l, head h pays from
    the loci of bin i (queries) to those of bin j (keys); each row sums to 1."""

    maps: np.ndarray  # (groups, layers, heads, bins, bins)
    groups: list[str]
    n_cells: np.ndarray  # (groups,) cells averaged
    tokens_per_bin: np.ndarray  # (bins,)
    bin_chromosome: np.ndarray  # (bins,) chromosome name of each bin's first token

    def relative_to_uniform(self, heads_averaged: bool = False) -> np.ndarray:
        """log2(attention / the share of keys in the bin): 0 where a head weighs every token alike; with
        `heads_averaged` of each layer's mean over its heads, (groups, layers, bins, bins)."""
        share = self.tokens_per_bin / self.tokens_per_bin.sum()
        maps = self.maps.mean(axis=2) if heads_averaged else self.maps
        return np.log2(np.maximum(maps, 1e-12) / share)

    def save_npz(self, path: Path) -> None:
        np.savez_compressed(path, maps=self.maps, groups=np.array(self.groups), n_cells=self.n_cells,
                            tokens_per_bin=self.tokens_per_bin, bin_chromosome=self.bin_chromosome)


def token_bins(n_tokens: int, resolution: int) -> np.ndarray:
    """(tokens,) bin of each token: consecutive tokens (genomic order) share a bin when there are too many."""
    if n_tokens <= resolution:
        return np.arange(n_tokens)
    return np.arange(n_tokens) * resolution // n_tokens


class MapAccumulator:
    """An encoder observer summing attention into (groups, heads, bins, bins) per layer."""

    def __init__(self, n_layers: int, n_heads: int, n_groups: int, bins: np.ndarray):
        self.bins = torch.as_tensor(bins)
        n_bins = int(bins.max()) + 1
        self.pool = torch.nn.functional.one_hot(self.bins, n_bins).float()  # (L, bins)
        self.sums = torch.zeros(n_layers, n_groups, n_heads, n_bins, n_bins, dtype=torch.float64)
        self.group_codes = torch.zeros(0, dtype=torch.long)  # the groups of the cells being encoded

    def __call__(self, layer: int, weights: torch.Tensor, first: int) -> None:
        keys_pooled = weights.float() @ self.pool  # (B, H, Q, bins)
        n_groups, n_heads, _, n_bins = self.sums.shape[1:]
        by_group = keys_pooled.new_zeros(n_groups, *keys_pooled.shape[1:]).index_add_(0, self.group_codes,
                                                                                        keys_pooled)  # (G, H, Q, bins)
        query_bins = self.bins[first:first + weights.shape[2]]
        self.sums[layer].index_add_(2, query_bins, by_group.double())  # (G, H, bins, bins)

    def maps(self, groups: list[str], n_cells: np.ndarray, token_chromosome: np.ndarray) -> AttentionMaps:
        """The sums as means over each group's cells and each bin's query tokens."""
        tokens_per_bin = np.bincount(self.bins.numpy())
        maps = self.sums.numpy().transpose(1, 0, 2, 3, 4)  # (layers, G, H, i, j) -> (G, layers, H, i, j)
        maps = maps / (np.maximum(n_cells, 1)[:, None, None, None, None] * tokens_per_bin[:, None])
        first_tokens = np.searchsorted(self.bins.numpy(), np.arange(len(tokens_per_bin)))
        chromosome = np.array(CHROMOSOMES)[token_chromosome[first_tokens]]  # tokens are in genomic order
        return AttentionMaps(maps.astype(np.float32), groups, n_cells, tokens_per_bin, chromosome)


def obs_column(f: h5py.File, key: str) -> np.ndarray:
    """obs[key] of an open .h5ad file as strings (only that column is read)."""
    values = ondisk.read_obs_column(f, key)
    if values is None:
        columns = ondisk.obs_columns(f)
        raise InputError(f"group_by '{key}' is not an obs column. Columns present: {columns or '(none)'}.")
    return obs_strings(values, key)


def sampled_chunks(reader, rows: np.ndarray, chunk_size: int) -> Iterator[tuple[np.ndarray, object]]:
    """(rows, their values) for the wanted (sorted) rows, reading the file chunk_size rows at a time."""
    n_obs = reader.shape[0]
    for start in range(0, n_obs, chunk_size):
        wanted = rows[(rows >= start) & (rows < start + chunk_size)]
        if len(wanted):
            yield wanted, reader.rows(start, min(start + chunk_size, n_obs))[wanted - start]


def attention_maps(trained: BatchfixModel, path, group_by: str | None, settings: ResolvedCorrection,
                   counts_layer: str | None = None, max_cells: int | None = None,
                   resolution: int = 256) -> AttentionMaps:
    """Encode (a random subset of at most max_cells of) a file's cells, streamed, and average the attention per
    group of obs[group_by]."""
    source = check_h5ad_path(path)
    with ondisk.open_anndata(source) as f:
        n_obs = ondisk.n_obs_of(f)
        if n_obs == 0:
            raise InputError(f"{source} holds no cells: the attention maps average the attention of its cells.")
        groups = obs_column(f, group_by) if group_by else np.full(n_obs, "all cells")
        rows = np.arange(n_obs)
        if max_cells is not None and max_cells < n_obs:
            rows = np.sort(np.random.default_rng(0).choice(n_obs, max_cells, replace=False))
        names, codes = np.unique(groups[rows], return_inverse=True)
        # The maps read the encoder only: the denoised setting needs no batch column and no calibration.
        bound = BoundModel(trained, ondisk.read_var_names(f), replace(settings, output_mode="denoised"))
        encoder, config = trained.net.encoder, trained.config
        accumulate = MapAccumulator(config.n_layers, config.n_heads, len(names),
                                    token_bins(encoder.n_tokens, resolution))
        reader = ondisk.open_rows(ondisk.matrix_element(f, counts_layer))
        with torch.inference_mode(), encoder.observing(accumulate):
            for wanted, values in sampled_chunks(reader, rows, settings.chunk_size):
                x, wanted_codes = bound.model_input(values, int(wanted[0])), codes[np.searchsorted(rows, wanted)]
                for start in range(0, len(wanted), settings.batch_size):
                    accumulate.group_codes = torch.as_tensor(wanted_codes[start:start + settings.batch_size])
                    trained.net.encode(x[start:start + settings.batch_size])
    return accumulate.maps([str(n) for n in names], np.bincount(codes, minlength=len(names)),
                           trained.module.windows.chromosome)


def chromosome_segments(bin_chromosome: np.ndarray) -> tuple[list[int], list[tuple[float, str]]]:
    """Bins where a new chromosome starts (boundaries to mark) and (middle bin, name) tick labels."""
    starts = [0] + [i for i in range(1, len(bin_chromosome)) if bin_chromosome[i] != bin_chromosome[i - 1]]
    ends = starts[1:] + [len(bin_chromosome)]
    return starts[1:], [((a + b - 1) / 2, str(bin_chromosome[a])) for a, b in zip(starts, ends)]


PANEL_INCHES = 3.4  # each map's side in the picture
TITLE_CHARS_PER_INCH = 12  # characters of the 10-point title a line holds per inch of the picture
PICTURE_DPI = 100


def plot_attention_maps(maps: AttentionMaps, path: Path, title: str = "") -> None:
    """A row per group (the largest MAX_GROUPS_DRAWN), a panel per layer with its heads averaged (the .npz keeps
    each head); chromosome names on the axes and their boundaries drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = np.argsort(-maps.n_cells, kind="stable")[:MAX_GROUPS_DRAWN]
    n_layers = maps.maps.shape[1]
    relative = maps.relative_to_uniform(heads_averaged=True)  # (groups, layers, bins, bins)
    boundaries, ticks = chromosome_segments(maps.bin_chromosome)
    fig, axes = plt.subplots(len(drawn), n_layers, squeeze=False, constrained_layout=True,
                             figsize=(PANEL_INCHES * n_layers + 1.4, PANEL_INCHES * len(drawn) + 1.0))
    for row, group in enumerate(drawn):
        for layer in range(n_layers):
            ax = axes[row, layer]
            image = ax.imshow(relative[group, layer], cmap="RdBu_r", vmin=-COLOUR_RANGE, vmax=COLOUR_RANGE,
                              interpolation="nearest")
            for b in boundaries:
                ax.axhline(b - 0.5, color="black", lw=0.6, alpha=0.6)
                ax.axvline(b - 0.5, color="black", lw=0.6, alpha=0.6)
            label_axes(ax, ticks)
            ax.set_title(f"{maps.groups[group]} ({maps.n_cells[group]} cells), layer {layer}", fontsize=9)
            ax.set_xlabel("keys: attended loci, by chromosome", fontsize=8)
            ax.set_ylabel("queries: attending loci", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=min(0.6, 3.0 / len(drawn)), label="log2(attention / uniform)")
    shown = f" (the {len(drawn)} largest of {len(maps.groups)} groups)" if len(drawn) < len(maps.groups) else ""
    heading = (f"{title}Mean attention between loci in genomic order, heads averaged{shown}; "
               "lines: chromosome boundaries")
    width = PANEL_INCHES * n_layers + 1.4
    fig.suptitle(textwrap.fill(heading, int(width * TITLE_CHARS_PER_INCH)), fontsize=10)  # a narrow picture wraps it
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=PICTURE_DPI, format="png")
    plt.close(fig)
    # A 64-colour palette (steps of ~0.1 on the colour scale): the file shrinks several-fold.
    Image.open(buffer).convert("RGB").quantize(colors=64).save(path, format="png", optimize=True)


def label_axes(ax, ticks: list[tuple[float, str]]) -> None:
    """Chromosome names on both axes of a panel (every other one when crowded)."""
    step = 1 if len(ticks) <= 12 else 2
    positions, names = [t[0] for t in ticks][::step], [t[1] for t in ticks][::step]
    ax.set_yticks(positions, names, fontsize=7)
    ax.set_xticks(positions, names, fontsize=7, rotation=90)
    ax.tick_params(length=2, pad=1)


def write_attention(maps: AttentionMaps, folder: Path, npz: bool = True, overwrite: bool = False,
                    title: str = "") -> list[Path]:
    """attention.png (and attention.npz) in folder, each written atomically; returns the paths."""
    names = ["attention.png", "attention.npz"] if npz else ["attention.png"]
    existing = [folder / n for n in names if (folder / n).exists()]
    if existing and not overwrite:
        raise output_exists(existing[0])
    written = []
    with atomic_output(folder / "attention.png", overwrite) as tmp:
        plot_attention_maps(maps, tmp, title)
    written.append(folder / "attention.png")
    if npz:
        with atomic_output(folder / "attention.npz", overwrite) as tmp:
            with open(tmp, "wb") as fh:
                maps.save_npz(fh)
        written.append(folder / "attention.npz")
    return written
