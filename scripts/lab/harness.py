"""The lab's one access to the counterfactual output: its terms for every cell, built by batchfix's own functions.

For cell c of batch b (batchfix/correction/counterfactual.py):

    values = D(c) + location_ref + k_b * (observed(c) - location_b),   D(c) = decoded_ref(z_c) - k_b decoded_b(z_c)

`counterfactual_terms` runs the shipped `counterfactual.output_terms` with the shipped `calibration.Statistics`,
so `Terms.values` is the package's log-scale output before the floor (regional_shift=apply); a lab script builds its
variants from these terms (a decoder term or a k swapped, `Terms.unclipped`), and `recalibration` estimates a
location and a spread again with the shipped `calibration.ResidualSums` and `calibration.reference_statistics`.
No script holds a copy of the formula.
"""
from __future__ import annotations

from dataclasses import dataclass

import anndata as ad
import numpy as np
import torch

import batchfix
from batchfix.correction import calibration, counterfactual
from batchfix.nn.attention import fused_attention

BATCH_SIZE = 128  # cells per forward pass, as batchfix.correct's default


@dataclass
class Terms:
    """The counterfactual output's parts for every cell (rows) and modelled gene (columns, the model's order),
    float64."""

    reference: np.ndarray  # decoded_ref(z_c)
    own: np.ndarray  # decoded_b(z_c)
    observed: np.ndarray  # log1p(counts per 10k) of the cell
    location: np.ndarray  # location_b of the cell's batch
    scale: np.ndarray  # k_b of the cell's batch, (cells, 1), or (cells, G) for spread_by="gene"
    ref_location: np.ndarray  # location_ref, (genes,)
    codes: np.ndarray  # the cell's batch code
    decoder: np.ndarray  # D(c), `counterfactual.decoder_term`
    values: np.ndarray  # the shipped values before the floor, `counterfactual.output_terms`

    def unclipped(self, decoder: np.ndarray | None = None, scale: np.ndarray | None = None) -> np.ndarray:
        """Values before the floor with the decoder term and/or k swapped: D + location_ref + k (observed -
        location_b), the shipped `values` rearranged around D; the shipped values themselves when neither is
        given."""
        if decoder is None and scale is None:
            return self.values
        scale = self.scale if scale is None else scale
        decoder = self.decoder_term(scale=scale) if decoder is None else decoder
        return decoder + (self.values - self.decoder) + (scale - self.scale) * (self.observed - self.location)

    def decoder_term(self, reference: np.ndarray | None = None, scale: np.ndarray | None = None) -> np.ndarray:
        """`counterfactual.decoder_term` with decoded_ref and/or k swapped (the terms' own where not given)."""
        reference = self.reference if reference is None else reference
        scale = self.scale if scale is None else scale
        return counterfactual.decoder_term(*map(torch.from_numpy, (reference, self.own, scale))).numpy()

    def batch_mean(self, values: np.ndarray) -> np.ndarray:
        """Each cell's row replaced by the mean of its batch's rows."""
        means = np.empty_like(values)
        for code in np.unique(self.codes):
            rows = self.codes == code
            means[rows] = values[rows].mean(axis=0)
        return means

    def state_shrunk(self, decoder: np.ndarray, weight: float) -> np.ndarray:
        """A decoder term shrunk toward its batch mean, as correction.state_dependence=weight: mean + w (D - mean)."""
        mean = self.batch_mean(decoder)
        return mean + weight * (decoder - mean)


def statistics(model: batchfix.BatchfixModel, **options) -> calibration.Statistics:
    """The shipped statistics of the model's training batches (average reference); `options`: Statistics' spread_by
    and residual_weight."""
    return calibration.Statistics(model.tables, None, [], **options)


def cell_scale(model: batchfix.BatchfixModel, codes: np.ndarray, **options) -> np.ndarray:
    """Each cell's k (cells, 1) or (cells, G) as float64, from `statistics(model, **options)`."""
    return statistics(model, **options).scale.numpy()[codes].astype(np.float64)


@torch.no_grad()
def counterfactual_terms(adata: ad.AnnData, model: batchfix.BatchfixModel, batch_key: str, **options) -> Terms:
    """The model's terms for every cell, as the package's log-scale output computes them (average reference; `options`:
    `statistics`', spread per batch and residual weight 1 by default)."""
    net = model.net
    counts = np.asarray(adata[:, model.genes].X, dtype=np.float32)  # the model's gene order
    codes = counterfactual.batch_codes(adata.obs[batch_key].astype(str).to_numpy(), model.batch_categories).codes
    stats = statistics(model, **options)
    present = torch.ones(len(model.genes), dtype=torch.bool)
    parts = {"values": [], "decoder": [], "observed": [], "reference": [], "own": []}
    with fused_attention(net):
        for start in range(0, len(counts), BATCH_SIZE):
            x = torch.from_numpy(counts[start:start + BATCH_SIZE])
            block = torch.from_numpy(codes[start:start + len(x)])
            mu, _ = net.encode(x)
            terms = counterfactual.output_terms(net, x, mu, block, None, stats, present)
            own = counterfactual.decoded_pair(net, mu, block, None, present)[1]
            for name, values in zip(parts, (*terms, own)):
                parts[name].append(values.numpy())
    return Terms(**{name: np.concatenate(blocks).astype(np.float64) for name, blocks in parts.items()},
                 location=stats.location.numpy()[codes].astype(np.float64),
                 scale=stats.scale.numpy()[codes].astype(np.float64),
                 ref_location=stats.ref_location.numpy().astype(np.float64), codes=codes)


def recalibration(terms: Terms, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(location (batches, G), each cell's k (cells, 1)) estimated again, as the shipped calibration estimates them,
    from the residuals observed - own of all cells, one spread per batch."""
    n_batches = int(terms.codes.max()) + 1
    sums = [calibration.ResidualSums(own.shape[1]) for _ in range(n_batches)]
    for b, batch in enumerate(sums):
        batch.add(terms.observed[terms.codes == b] - own[terms.codes == b])
    location, spread = np.stack([s.location() for s in sums]), np.array([s.spread() for s in sums])
    reference_spread = calibration.reference_statistics(location, spread, None)[1]
    return location, (reference_spread / spread)[terms.codes][:, None]


@torch.no_grad()
def shipped_log_output(adata: ad.AnnData, model: batchfix.BatchfixModel, batch_key: str, spread: str = "batch",
                       residual_weight: float = 1.0, state_dependence: float = 1.0) -> np.ndarray:
    """The package's log-scale counterfactual output (`counterfactual.corrected`, regional_shift=apply; an input
    zero stays zero) of every cell, (cells, G) in the model's gene order, float64: what batchfix ships for a
    log-scale model and what the lab's rows are checked against where the input is not zero (for a counts model
    batchfix.correct writes corrected counts instead). The state shrink's batch means are the decoder term's over
    each batch's cells, as the package estimates them."""
    net = model.net
    counts = np.asarray(adata[:, model.genes].X, dtype=np.float32)
    codes = counterfactual.batch_codes(adata.obs[batch_key].astype(str).to_numpy(), model.batch_categories).codes
    stats = statistics(model, spread_by=spread, residual_weight=residual_weight)
    present = torch.ones(len(model.genes), dtype=torch.bool)
    state = None
    if state_dependence < 1:
        decoder = counterfactual_terms(adata, model, batch_key, spread_by=spread,
                                       residual_weight=residual_weight).decoder
        means = np.stack([decoder[codes == b].mean(axis=0) for b in range(len(model.batch_categories))])
        state = counterfactual.StateShrink(state_dependence, torch.as_tensor(means, dtype=torch.float32),
                                           torch.ones(len(means)))
    blocks = []
    with fused_attention(net):
        for start in range(0, len(counts), BATCH_SIZE):
            x = torch.from_numpy(counts[start:start + BATCH_SIZE])
            block = torch.from_numpy(codes[start:start + len(x)])
            blocks.append(counterfactual.corrected(net, x, block, None, stats, present, state=state)[1].numpy())
    return np.concatenate(blocks).astype(np.float64)

