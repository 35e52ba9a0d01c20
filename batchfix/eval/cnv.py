"""Copy-number (CNV) fidelity of a corrected expression matrix.

A copy-number change moves the expression of hundreds of neighbouring genes together; a technical
batch effect is mostly gene by gene. A correction that treats a group's regional shift as batch
effect erases biology, so corrected matrices are also scored on their **CNV profiles**:

- **Profile** of a group of cells (one definition, `group_profiles`): the genes the matrix holds
  that have a chromosome and a start (autosomes and X) are put in genomic order per chromosome;
  the group's mean log-expression minus a reference (by default the mean over all cells of the
  same matrix) is averaged over running windows of `WINDOW` = 100 consecutive genes, every
  `STEP` = 10 genes, within each chromosome (a chromosome with fewer genes than a window gets
  one window of all of them). Not centred: Pearson r and the slope below ignore an offset.
- **Profile retention** (`profile_retention`): for each (label, batch) group with >= `MIN_CELLS`
  cells, Pearson r of its profile in the corrected matrix with the same label's profile in the
  *uncorrected* matrix of the *other* batches (their cells pooled, reference = the mean over
  all uncorrected cells). Mean over groups. The same score of the uncorrected matrix itself is
  the ceiling (a line's CNVs seen from another batch); `relative_r` = corrected / uncorrected.
  **Amplitude ratio**: the slope of each group's corrected profile regressed on that truth, over
  the slope of its uncorrected profile (ratio of the means over groups): 1.0 = CNV depth kept,
  0 = flattened. Noise that is not in the truth does not bias a slope, as it would a variance.
- **Segment depth** (`segment_depths`): a group's profile averaged over the windows whose centre
  lies in a segment (a chromosome, or an arm given as a base-pair range): what a known loss or
  gain should show; normal cells' depth should stay near 0 (the flat-normal check).
- **Regional artefact and its floor** (`regional_artefact`): for each label in >= 2 batches, each (label, batch)
  profile minus the label's mean profile over its batches, centred over windows; its sd over windows, mean over
  groups (A). The floor (F): the same between two random halves of each (label, batch) group (each half minus
  the halves' mean): the regional noise the matrix holds within one group. `above_floor` = sqrt(max(A^2 - F^2, 0)).
- **Segment shift** (`segment_shift`): mean log-expression over a segment's genes, contrasted
  between groups; the injected-clone score of scripts/inject_clones.py.

Inputs are log-scale matrices (cells x genes) on the same genes: `log_cp10k` of raw counts for
the uncorrected data, a corrected layer as it is.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import scipy.sparse as sp

WINDOW = 100  # genes per running window
STEP = 10  # genes between window starts
MIN_CELLS = 10  # cells a (label, batch) group needs to be profiled
CHROMOSOMES = [str(i) for i in range(1, 23)] + ["X"]  # profiled chromosomes, in genomic order


@dataclass
class GenomicWindows:
    """Running windows over the genes of a matrix, in genomic order.

    members: (windows, WINDOW) int64 column indices of each window's genes, -1 padding for short
    chromosomes; chromosome and centre (bp) of each window.
    """

    members: np.ndarray
    chromosome: np.ndarray
    centre: np.ndarray

    def average(self, values: np.ndarray) -> np.ndarray:
        """(rows, genes) -> (rows, windows): each window's mean over its genes."""
        padded = np.concatenate([values, np.full((values.shape[0], 1), np.nan)], axis=1)  # -1 reads the NaN
        return np.nanmean(padded[:, self.members], axis=2)  # (rows, windows, WINDOW) -> (rows, windows)


def genomic_windows(chromosome: Sequence, start: Sequence, window: int = WINDOW, step: int = STEP) -> GenomicWindows:
    """Windows of `window` consecutive placed genes every `step` genes, per chromosome in genomic order.

    chromosome: per gene, '1'..'22', 'X' (or 'chr1' ...); other or missing values leave the gene out.
    start: per gene, base-pair start (NaN leaves it out).
    """
    if window < 1 or step < 1:
        raise ValueError(f"window and step must be >= 1, got {window} and {step}.")
    names = pd.Series(np.asarray(chromosome, dtype=object)).astype(str).str.replace(r"^chr", "", regex=True)
    start = pd.to_numeric(pd.Series(np.asarray(start)), errors="coerce").to_numpy(dtype=float)
    if len(names) != len(start):
        raise ValueError(f"chromosome has {len(names)} genes but start has {len(start)}.")
    members, window_chromosome, centre = [], [], []
    for name in CHROMOSOMES:
        genes = np.flatnonzero((names.to_numpy() == name) & np.isfinite(start))
        genes = genes[np.argsort(start[genes], kind="stable")]
        if len(genes) == 0:
            continue
        firsts = range(0, max(len(genes) - window, 0) + 1, step)
        for first in firsts:
            chunk = genes[first:first + window]
            members.append(np.pad(chunk, (0, window - len(chunk)), constant_values=-1))
            window_chromosome.append(name)
            centre.append(float(np.mean(start[chunk])))
    if not members:
        raise ValueError(f"No gene is placed on a profiled chromosome ({CHROMOSOMES[0]}..{CHROMOSOMES[-1]}); "
                         f"chromosome values seen: {sorted(set(names))[:10]}.")
    return GenomicWindows(np.array(members, dtype=np.int64), np.array(window_chromosome), np.array(centre))


def windows_of(var: pd.DataFrame, window: int = WINDOW, step: int = STEP) -> GenomicWindows:
    """`genomic_windows` from an AnnData var with `chromosome` and `start` columns (an error names the columns)."""
    missing = [c for c in ("chromosome", "start") if c not in var.columns]
    if missing:
        raise ValueError(f"CNV profiles need var columns 'chromosome' and 'start'; missing {missing}. "
                         f"var columns: {list(var.columns)}.")
    return genomic_windows(var["chromosome"].to_numpy(), var["start"].to_numpy(), window, step)


def dense(matrix) -> np.ndarray:
    return np.asarray(matrix.toarray() if sp.issparse(matrix) else matrix, dtype=np.float64)


def group_profiles(log_values, groups: Sequence, windows: GenomicWindows, reference: np.ndarray | None = None,
                   min_cells: int = MIN_CELLS) -> pd.DataFrame:
    """CNV profile of every group with >= min_cells cells: rows = groups, columns = windows.

    log_values: (cells, genes) log-expression; groups: (cells,) group of each cell; reference: (genes,),
    default the mean over all cells.
    """
    values = dense(log_values)
    groups = np.asarray(groups)
    if len(groups) != values.shape[0]:
        raise ValueError(f"groups has {len(groups)} entries for {values.shape[0]} cells.")
    reference = values.mean(axis=0) if reference is None else np.asarray(reference, dtype=np.float64)
    names, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    kept = np.flatnonzero(counts >= min_cells)
    means = np.stack([values[inverse == k].mean(axis=0) for k in kept]) if len(kept) else np.empty((0, values.shape[1]))
    return pd.DataFrame(windows.average(means - reference), index=names[kept])


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    denominator = np.sqrt((a @ a) * (b @ b))
    return float(a @ b / denominator) if denominator > 0 else float("nan")


def _slope(profile: np.ndarray, truth: np.ndarray) -> float:
    """Least-squares slope of `profile` regressed on `truth` (with an intercept)."""
    t = truth - truth.mean()
    return float(t @ (profile - profile.mean()) / (t @ t)) if t @ t > 0 else float("nan")


def profile_retention(uncorrected_log, corrected_log, batch: Sequence, labels: Sequence, windows: GenomicWindows,
                      truth_log=None, truth_batch: Sequence | None = None, truth_labels: Sequence | None = None,
                      min_cells: int = MIN_CELLS, scored_labels: Sequence | None = None) -> dict:
    """Profile retention of the corrected matrix (module docstring).

    uncorrected_log / corrected_log: (cells, genes) log values of the same cells and genes. The truth of a
    (label, batch) group is its label's profile in the uncorrected values of the other batches; by default
    from the same cells, or from `truth_log` with its own batches and labels (the confounded design scores
    the cells a label kept against its cells that were taken out). scored_labels: only these labels' groups are
    scored (every cell still makes the reference); default every label.
    Returns retention_r, uncorrected_r, relative_r, amplitude_ratio, n_groups and per-group rows (`groups`).
    """
    batch, labels = np.asarray(batch).astype(str), np.asarray(labels).astype(str)
    if truth_log is None:
        truth_log, truth_batch, truth_labels = uncorrected_log, batch, labels
    truth_values = dense(truth_log)
    truth_batch, truth_labels = np.asarray(truth_batch).astype(str), np.asarray(truth_labels).astype(str)
    truth_reference = truth_values.mean(axis=0)
    group = np.char.add(np.char.add(labels, "\t"), batch)
    corrected = group_profiles(corrected_log, group, windows, min_cells=min_cells)
    uncorrected = group_profiles(uncorrected_log, group, windows, min_cells=min_cells)
    rows = []
    for name in corrected.index:
        label, own = name.split("\t")
        others = (truth_labels == label) & (truth_batch != own)
        if others.sum() < min_cells or (scored_labels is not None and label not in scored_labels):
            continue
        truth = windows.average(truth_values[others].mean(axis=0, keepdims=True) - truth_reference)[0]
        c, u = corrected.loc[name].to_numpy(), uncorrected.loc[name].to_numpy()
        rows.append({"label": label, "batch": own, "r": _pearson(c, truth), "uncorrected_r": _pearson(u, truth),
                     "slope": _slope(c, truth), "uncorrected_slope": _slope(u, truth)})
    table = pd.DataFrame(rows, columns=["label", "batch", "r", "uncorrected_r", "slope", "uncorrected_slope"])
    if table.empty:
        return {"retention_r": None, "uncorrected_r": None, "relative_r": None, "amplitude_ratio": None,
                "n_groups": 0, "groups": [],
                "note": f"no label has >= {min_cells} cells in one batch and in another batch"}
    r, r0 = float(table["r"].mean()), float(table["uncorrected_r"].mean())
    return {"retention_r": r, "uncorrected_r": r0, "relative_r": r / r0 if r0 > 0 else None,
            "amplitude_ratio": float(table["slope"].mean() / table["uncorrected_slope"].mean()),
            "n_groups": len(table), "groups": table.to_dict(orient="records")}


def segment_mask(windows: GenomicWindows, chromosome: str, start: float = 0.0, end: float = np.inf) -> np.ndarray:
    """(windows,) bool: windows on `chromosome` whose centre lies in [start, end) bp."""
    mask = (windows.chromosome == str(chromosome)) & (windows.centre >= start) & (windows.centre < end)
    if not mask.any():
        raise ValueError(f"No profile window on chromosome {chromosome} in [{start:g}, {end:g}); windows exist on "
                         f"{sorted(set(windows.chromosome), key=CHROMOSOMES.index)}.")
    return mask


def segment_depths(profiles: pd.DataFrame, windows: GenomicWindows, segments: dict[str, tuple]) -> pd.DataFrame:
    """Mean profile over each segment's windows: rows = profiles' groups, columns = segment names.

    segments: {name: (chromosome, start bp, end bp)}, e.g. {'1p': ('1', 0, 120e6)}.
    """
    return pd.DataFrame({name: profiles.to_numpy()[:, segment_mask(windows, *segment)].mean(axis=1)
                         for name, segment in segments.items()}, index=profiles.index)


def segment_shift(log_values, genes: np.ndarray, cells: np.ndarray, versus: np.ndarray) -> float:
    """Mean over the segment's `genes` (bool mask) of mean(log values of `cells`) - mean(of `versus` cells)."""
    values = dense(log_values[:, np.flatnonzero(genes)])
    if not cells.any() or not versus.any():
        raise ValueError("segment_shift needs cells on both sides of the contrast.")
    return float(values[cells].mean() - values[versus].mean())


def _centred_sd(deviations: np.ndarray) -> np.ndarray:
    """(groups, windows) -> (groups,): each row's sd over windows after removing its mean."""
    return (deviations - deviations.mean(axis=1, keepdims=True)).std(axis=1)


def regional_artefact(log_values, batch: Sequence, labels: Sequence, windows: GenomicWindows, seed: int = 0,
                      min_cells: int = MIN_CELLS) -> dict:
    """{'artefact': A, 'floor': F, 'above_floor': sqrt(max(A^2 - F^2, 0)), 'n_groups'} (module docstring) of a
    log-scale matrix; halves of a group are drawn with `seed`; groups need min_cells cells (each half half)."""
    values = dense(log_values)
    batch, labels = np.asarray(batch).astype(str), np.asarray(labels).astype(str)
    group = np.char.add(np.char.add(labels, "\t"), batch)
    profiles = group_profiles(values, group, windows, min_cells=min_cells)
    label_of = np.array([name.split("\t")[0] for name in profiles.index])
    shared = [label for label in np.unique(label_of) if (label_of == label).sum() >= 2]
    artefact = [_centred_sd(profiles[label_of == label].to_numpy() - profiles[label_of == label].to_numpy().mean(0))
                for label in shared]
    rng = np.random.default_rng(seed)
    half = np.full(len(group), "", dtype=object)
    for name in profiles.index:
        cells = rng.permutation(np.flatnonzero(group == name))
        half[cells[: len(cells) // 2]], half[cells[len(cells) // 2:]] = name + "\ta", name + "\tb"
    halves = group_profiles(values, half.astype(str), windows, reference=values.mean(axis=0),
                            min_cells=min_cells // 2)
    pairs = [(f"{name}\ta", f"{name}\tb") for name in profiles.index
             if f"{name}\ta" in halves.index and f"{name}\tb" in halves.index]
    floor = [_centred_sd((halves.loc[[a]].to_numpy() - halves.loc[[b]].to_numpy()) / 2.0) for a, b in pairs]
    a = float(np.mean(np.concatenate(artefact))) if artefact else float("nan")
    f = float(np.mean(np.concatenate(floor))) if floor else float("nan")
    return {"artefact": a, "floor": f, "above_floor": float(np.sqrt(max(a * a - f * f, 0.0))),
            "n_groups": int(sum(len(x) for x in artefact))}
