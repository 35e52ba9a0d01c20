"""Which correction preset fits a trained model's data, and why: measured once after training, printed in the run
summary, stored in metrics.json and in the checkpoint. It never switches the correction by itself.

Measured on at most SAMPLE_CELLS training cells (seeded), from what the model learned:
- **gene-wise batch effect**: the cells' latents decoded as each training batch give each gene's mean share of
  a cell's counts in that batch (times the batch's calibrated ratio r_b; a log-scale model: its decoded log1p
  values); its log, averaged over the cells, differs
  between batches by a standard deviation per gene; the median over genes (log scale: 0.5 is a typical 1.6-fold
  difference between batches at the same cell state);
- **regional batch shift**: each batch's deviation of those log means from their mean over batches, smoothed
  along the genome as correction.regional_window smooths (100 genes), its largest absolute value over genes and
  batches whose window holds at least MIN_WINDOW_GENES modelled genes (a window cut at a chromosome of two
  modelled genes is those genes' own effect, not a region's): a copy-number change that every cell of a batch
  carries shows there (one copy of two: log 1.5 = 0.41);
- **states in one batch only**: the share of cells whose state (label, or a k-means cluster of the latent
  without labels) has at least CONFINED_SHARE of its cells in one batch;
- **depth ratio** (counts): the largest ratio between two batches' typical libraries of the modelled genes, within
  states (batchfix.correction.library_shift's estimate, without its weight).

The rule (thresholds from the development sets: docs/results.md, Presets):
- `patient_cnv` where some batch carries a copy-number-sized regional shift (>= CNV_SHIFT) and states live in one
  batch only (>= CONFINED_CELLS of the cells): patients as batches, a clone in all of one patient's cells;
- `protocols` where the gene-wise batch effect is chemistry-sized (>= PROTOCOL_EFFECT);
- else the default; where a batch still carries a copy-number-sized regional shift (across all its states: a
  donor's constitutional copy number, sex chromosomes), the reason names it, says the default removes it from
  that batch's cells, and gives the call that keeps it (patient_cnv);
- whatever the preset, where the depth ratio reaches DEPTH_RATIO the reason names it and the option that moves each
  batch's depth to the reference's (correction.depth=reference: docs/lab/library-shift.md).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import numpy as np
import torch

from batchfix.config import CorrectionOptions
from batchfix.correction.library_shift import LibrarySums, library_shift
from batchfix.correction.regional import GenomeSmoother
from batchfix.data.prepare import PreparedData, in_order
from batchfix.nn.attention import fused_attention
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)

SAMPLE_CELLS = 2_000
BATCH_SIZE = 256
CONFINED_SHARE = 0.9  # a state with this share of its cells in one batch lives in that batch only
CLUSTERS = 10  # k-means clusters of the latent standing in for states without labels
REGIONAL_WINDOW = CorrectionOptions.regional_window  # what the default output calls regional
PROTOCOL_EFFECT = 0.85  # between the stress sets of sd 0.5 (0.64, default best) and 1.0 (1.05, protocols best)
CNV_SHIFT = 0.3
MIN_WINDOW_GENES = 10  # modelled genes a window needs for its regional shift to count
CONFINED_CELLS = 0.2
DEPTH_RATIO = 1.5  # below the platform pair's 1.6-fold, where depth=reference raised Total (docs/lab/library-shift.md)


@dataclass
class Recommendation:
    """The preset that fits, why, the command applying it, and the measurements behind it."""

    preset: str
    reason: str
    command: str
    gene_effect: float
    regional_shift: float
    regional_batch: str
    confined_cells: float
    states: str
    depth_ratio: float

    def as_dict(self) -> dict:
        return asdict(self)


def recommend(model: BatchfixModel, prepared: PreparedData, labels: np.ndarray | None, command: str,
              seed: int = 0) -> Recommendation:
    """Measure the trained model's data (module docstring) and name the preset that fits; `labels`: the input's
    (one per row) or None; `command`: how to apply a preset to this model, with {preset} in it."""
    cells = np.sort(np.random.default_rng(seed).permutation(prepared.n_cells)[:SAMPLE_CELLS])
    latents, log_means, libraries = batch_log_means(model, prepared, cells)  # (cells, k), (batches, G), (cells,)
    gene_effect = float(np.median(log_means.std(axis=0))) if len(log_means) > 1 else 0.0
    deviation = torch.as_tensor(log_means - log_means.mean(axis=0), dtype=torch.float32)
    smoother = GenomeSmoother(list(model.module.hparams.chromosome), REGIONAL_WINDOW)
    regional = smoother(deviation).abs() * full_windows(smoother)  # (batches, G)
    peaks = regional.max(dim=1).values  # (batches,)
    worst = int(peaks.argmax())
    regional_shift = float(peaks[worst])
    if labels is None:
        states, source = latent_clusters(latents, seed), "latent clusters"
    else:
        states, source = np.asarray(labels)[prepared.file_rows[cells]].astype(str), "labels"
    confined = confined_share(states, prepared.batch_index[cells])
    preset, reason = rule(gene_effect, regional_shift, model.batch_categories[worst], confined, source)
    applying = command.format(preset=preset) if preset != "default" else ""
    if preset == "default" and regional_shift >= CNV_SHIFT:
        reason += f"; to keep it: {command.format(preset='patient_cnv')}"
    ratio = depth_ratio(libraries, prepared.batch_index[cells], states, len(model.batch_categories))
    if ratio >= DEPTH_RATIO:
        reason += (f"; the batches' sequencing depths differ {ratio:.1f}-fold within states, which the corrected "
                   "counts keep (each cell's library): correction.depth=reference (or correction=depths) brings "
                   "each batch's to the reference's")
    return Recommendation(preset, reason, applying, round(gene_effect, 3), round(regional_shift, 3),
                          model.batch_categories[worst], round(confined, 3), source, round(ratio, 3))


def recommend_and_remember(model: BatchfixModel, prepared: PreparedData, labels: np.ndarray | None, command: str,
                           seed: int = 0) -> Recommendation:
    """`recommend`, stored in the model (its checkpoint carries it) and logged."""
    advice = recommend(model, prepared, labels, command, seed)
    model.remember_recommendation(advice.as_dict())
    log.info("Recommended correction: %s: %s", advice.preset, advice.reason)
    return advice


def rule(gene_effect: float, regional_shift: float, regional_batch: str, confined: float,
         source: str) -> tuple[str, str]:
    """(preset, reason) from the three measurements."""
    measured = (f"gene-wise batch effect {gene_effect:.2f} (log sd across batches, median over genes), largest "
                f"regional batch shift {regional_shift:.2f} ({regional_batch}), {confined:.0%} of cells in states "
                f"of one batch only ({source})")
    if regional_shift >= CNV_SHIFT and confined >= CONFINED_CELLS:
        return "patient_cnv", (f"{measured}: a copy-number-sized regional shift in one batch and states confined "
                               "to batches, as in patients with their own clones; patient_cnv keeps each cell's "
                               "regional profile (better still: name normal cells with "
                               "correction.regional_shift=reference_cells and correction.normal_key)")
    if gene_effect >= PROTOCOL_EFFECT:
        return "protocols", (f"{measured}: chemistry-sized gene-wise effects, which protocols (each gene's "
                             "dispersion mapped to the reference's) mixes better")
    if regional_shift >= CNV_SHIFT:
        return "default", (f"{measured}: the default fits the states; but {regional_batch} carries a "
                           "copy-number-sized regional shift in all its cells (if batches are donors: their "
                           "constitutional copy number or sex chromosomes), which the default removes from that "
                           "batch as a batch effect (what a batch lacks stays absent: a gene without any count in it, a "
                           "chrY gene or XIST it holds at an ambient level only)")
    return "default", f"{measured}: the default fits"


def depth_ratio(libraries: np.ndarray | None, batch: np.ndarray, states: np.ndarray, n_batches: int) -> float:
    """The largest ratio between two batches' depths within states (1.0 for a log-scale model, `libraries` None)."""
    if libraries is None:
        return 1.0
    names, state = np.unique(states, return_inverse=True)
    sums = LibrarySums(n_batches * len(names))
    sums.add(batch * len(names) + state, libraries[:, None])
    depth = library_shift(sums, len(names), n_batches, None)
    measured = depth.shift[depth.cells > 0]
    return float(np.exp(measured.max() - measured.min())) if len(measured) > 1 else 1.0


def full_windows(smoother: GenomeSmoother) -> torch.Tensor:
    """(G,) 1.0 for the genes whose regional window holds at least MIN_WINDOW_GENES placed genes, else 0.0."""
    width = torch.empty(len(smoother.order), dtype=torch.float32)
    width[smoother.order] = (smoother.high - smoother.low).float()
    return (width >= MIN_WINDOW_GENES).float() * smoother.placed.float()


@torch.no_grad()
def batch_log_means(model: BatchfixModel, prepared: PreparedData,
                    cells: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(latents (cells, k), each gene's log mean in each training batch at the same states (batches, G), averaged
    over `cells`, and for counts each cell's library of the modelled genes (cells,), else None): for counts the log
    of the decoder's mean share times the batch's calibrated ratio, for a log-scale model its decoded log1p
    values."""
    net = model.net.eval()
    counts = net.cfg.likelihood == "nb"
    sums, latents, libraries = np.zeros((len(model.batch_categories), net.n_genes)), [], []
    with fused_attention(net):
        for x, _ in in_order(prepared, BATCH_SIZE, cells):  # (B, G)
            mu, _ = net.encode(x)
            latents.append(mu.numpy())
            libraries.append(x.double().sum(-1).numpy())
            for b in range(len(sums)):
                if counts:
                    shares = net.mean_fractions(mu, b).double().numpy() * model.tables.count_ratio[b].double().numpy()
                    sums[b] += np.log(np.maximum(shares, 1e-12)).sum(axis=0)
                else:
                    sums[b] += net.decoded(mu, b).double().numpy().sum(axis=0)
    return np.concatenate(latents), sums / len(cells), np.concatenate(libraries) if counts else None


def latent_clusters(latents: np.ndarray, seed: int) -> np.ndarray:
    """k-means clusters of the latent (CLUSTERS, fewer for few cells) as state names."""
    from sklearn.cluster import KMeans

    k = max(1, min(CLUSTERS, len(latents) // 20))
    return KMeans(n_clusters=k, n_init=3, random_state=seed).fit_predict(latents).astype(str)


def confined_share(states: np.ndarray, batch: np.ndarray) -> float:
    """Share of cells whose state has at least CONFINED_SHARE of its cells in one batch (0 with one batch)."""
    if len(np.unique(batch)) < 2:
        return 0.0
    confined = np.zeros(len(states), dtype=bool)
    for state in np.unique(states):
        rows = states == state
        confined[rows] = np.bincount(batch[rows]).max() >= CONFINED_SHARE * rows.sum()
    return float(confined.mean())
