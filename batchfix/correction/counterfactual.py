"""The counterfactual output: each cell's own expression with only what its batch explains removed.

For a cell c of batch b and a modelled gene g, on the log1p(counts per 10k) scale (the input's
scale for data.scale=log):

    r(c, g)   = observed(c, g) - decoded_b(z_c, g)
    corrected = max(0, decoded_ref(z_c, g) + location_ref(g) + k_b * (r(c, g) - location_b(g)))
    k_b       = spread_ref / spread_b

- decoded_b(z_c, g): the decoder's expected expression for the cell's latent z_c in its own batch;
  decoded_ref: the same as the reference (a training batch, or the average over the training
  batches, which is the denoised output). Their difference is the batch effect the model learned
  for that cell's state, so the residual r, which holds what is the cell's own, is carried over.
- location_b(g): the mean residual of gene g over the training cells of batch b. The decoder
  models the mean count, and log1p of a mean is not the mean of log1p: the gap depends on the
  batch's depth and noise, so it is a batch effect the decoder's mean leaves behind.
- spread_b: one number per batch, the root-mean-square over genes of the residual's within-batch
  standard deviation: noisier (shallower) batches would otherwise stay apart from the others.
  One scale per batch, not one per gene, so no gene gains or loses weight against another within
  a batch; the location and scale alone change no comparison made within a batch.
- For the average reference, location_ref is the mean of the training batches' locations and
  spread_ref the root-mean-square of their spreads; for a named reference, that batch's own.
- correction.spread=gene: k_{b,g} = spread_ref(g) / spread_b(g), a spread per gene and batch shrunk
  toward the batch's level (`shrunk_variances`), as ComBat's scale: a gene whose batch holds few cells
  keeps about the batch-wide ratio, one estimated on many cells its own.
- Values that would go below 0 (the floor of the log1p scale) are set to 0 and counted.

State dependence (correction.state_dependence, default 0.5). With w < 1 the decoder term decoded_ref(z_c) -
k_b decoded_b(z_c) is replaced by its mean over the batch's cells in the input plus w times the cell's deviation
from that mean: w = 0 gives one shift per gene and batch, as ComBat's, which moves within-batch comparisons (DE
ranks, markers) least and mixes least; the regional shift below then splits what is left.

Residual weight (correction.residual_weight, default 1). k_b is multiplied by a weight a in [0, 1], so the
output keeps the share a of each cell's residual: a = 0 gives decoded_ref(z_c) + location_ref (the denoised
output and the reference's location), and between the two the cell's own deviations, noise included, are
shrunk toward what the decoder expects for its state. The decoder term below is then decoded_ref - a k_b decoded_b.

The regional shift's smoother: batchfix.correction.regional; the training batches' calibration and
the per-batch statistics: batchfix.correction.calibration.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchfix.correction.calibration import MIN_UNSEEN_CELLS, Statistics
from batchfix.correction.regional import RegionalShift
from batchfix.correction.state_groups import StateGroups, group_codes
from batchfix.nn.network import BatchfixNet


@dataclass
class BatchCodes:
    """Each cell's batch as the counterfactual output treats it.

    codes: (cells,) int32: the training batch's index; n_training + j for the j-th batch of `unseen`
    (a batch the model never saw, whose location and spread are estimated from its cells); -1 for
    the cells of `denoised` (unseen batches with fewer than MIN_UNSEEN_CELLS cells: denoised output).
    """

    codes: np.ndarray
    n_training: int
    unseen: list[str]
    denoised: list[str]


def batch_codes(batch: np.ndarray, training: list[str]) -> BatchCodes:
    """Codes for the cells' batch names (strings), given the model's training batches."""
    names, inverse, counts = np.unique(batch, return_inverse=True, return_counts=True)
    position = {name: i for i, name in enumerate(training)}
    unseen = [n for n, c in zip(names, counts) if n not in position and c >= MIN_UNSEEN_CELLS]
    denoised = [n for n, c in zip(names, counts) if n not in position and c < MIN_UNSEEN_CELLS]
    position.update({name: len(training) + j for j, name in enumerate(unseen)})
    position.update({name: -1 for name in denoised})
    by_name = np.array([position[n] for n in names], dtype=np.int32)
    return BatchCodes(by_name[inverse.ravel()], len(training), [str(n) for n in unseen], [str(n) for n in denoised])


@dataclass
class StateShrink:
    """What correction.state_dependence < 1 needs: the weight w and each batch code's mean decoder term.

    mean: (codes, G) mean of decoded_ref(z) - k_b decoded_b(z) (the counts: of the log-mean shift) over the batch's
    input cells, or with `groups` (codes * groups, G) over its cells of each state group (code * groups + group:
    batchfix.correction.state_groups); estimated: (codes,) 1.0, or 0.0 for a batch with fewer than MIN_UNSEEN_CELLS
    cells (its cells keep the whole term). The term applied is mean + w * (cell's term - mean), the mean of the
    cell's batch (and group).
    """

    weight: float
    mean: torch.Tensor
    estimated: torch.Tensor
    groups: StateGroups | None = None

    def mean_of(self, codes: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        """(B, G) the mean each cell's term is shrunk toward, for cells of batch `codes` with latents `mu`."""
        known = codes.clamp_min(0).numpy()
        rows = known if self.groups is None else group_codes(known, self.groups, mu)
        return self.mean[torch.from_numpy(rows).long()]


@torch.no_grad()
def decoded_pair(net: BatchfixNet, mu: torch.Tensor, codes: torch.Tensor, reference: int | None,
                 present: torch.Tensor | None = None,
                 members: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded as the reference, decoded as each cell's own batch) for latents `mu`; the average decoder (over
    every training batch) stands in for batches the model never saw. The average reference of each gene is
    taken over its `members` (batches, G) where given."""
    reference_values = net.decoded(mu, reference, present, members)
    seen = (codes >= 0) & (codes < net.n_batches)
    plain = (reference is None and members is None) or seen.all()  # every row the average, or every row set below
    own = reference_values if plain else net.decoded(mu, None, present)  # unseen: the average
    if seen.any():
        own = own.clone()
        own[seen] = net.decoded(mu[seen], codes[seen].long(), present)
    return reference_values, own


@torch.no_grad()
def output_terms(net: BatchfixNet, x: torch.Tensor, mu: torch.Tensor, codes: torch.Tensor, reference: int | None,
                 stats: Statistics, present: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(values before the floor and the regional shift, decoder term decoded_ref(z) - k_b decoded_b(z), the input
    on the output's scale, decoded as the reference), each (B, G), for cells `x` with latents `mu`."""
    reference_values, own = decoded_pair(net, mu, codes, reference, present, stats.members)
    known = codes.clamp_min(0).long()
    observed = net.log_expression(x)
    residual = observed - own - stats.location[known]  # (B, G)
    values = reference_values + stats.ref_location + stats.scale[known] * residual
    return values, decoder_term(reference_values, own, stats.scale[known]), observed, reference_values


def decoder_term(reference_values: torch.Tensor, own: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(B, G) decoded_ref(z) - k_b decoded_b(z), with `scale` each cell's k ((B, 1) or (B, G))."""
    return reference_values - scale * own


@torch.no_grad()
def corrected(net: BatchfixNet, x: torch.Tensor, codes: torch.Tensor, reference: int | None, stats: Statistics,
              present: torch.Tensor | None = None, regional: RegionalShift | None = None,
              state: StateShrink | None = None,
              mu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(latent mean, counterfactual values (B, G), how many were raised to 0) for cells with batch `codes`; an
    input zero stays zero; with `state`, only the share `state.weight` of each cell's decoder term's deviation
    from its batch's mean is applied; with `regional`, the regional part of each cell's deviation from the mean
    shift is left in (with reference cells, the regional part of its whole change is its batch's
    `regional.offset`). `mu`: the cells' latent means if already encoded (the encoder, the costly part, then does
    not run again)."""
    if mu is None:
        mu, _ = net.encode(x)
    values, decoder, observed, reference_values = output_terms(net, x, mu, codes, reference, stats, present)
    known = codes.clamp_min(0).long()
    if state is not None:
        unapplied = (1.0 - state.weight) * (decoder - state.mean_of(codes, mu)) * state.estimated[known, None]
        values, decoder = values - unapplied, decoder - unapplied
    zero = x.eq(0)  # an input zero stays zero (the log output), before the regional split too
    values = values.masked_fill(zero, 0.0)
    floored = torch.zeros_like(values, dtype=torch.bool)  # raised to 0 before the regional split (keep_input)
    if regional is not None and regional.offset is not None:  # reference cells: the batch's regional change
        values = without_regional_change(values, values - observed, zero, regional.smoother,
                                         regional.offset[known].to(values.dtype))
    elif regional is not None:
        if regional.whole:  # the floor is part of the whole change: its regional part is not applied either
            floored = values.lt(0) & (codes >= 0)[:, None]
            values = values.clamp_min(0.0)
        shift = values - observed if regional.whole else decoder
        deviation = (shift - regional.mean_shift[known]) * regional.estimated[known, None]
        if regional.whole:
            values = without_regional_change(values, deviation, zero, regional.smoother)
        else:
            values = values - regional.smoother(deviation)
    values = torch.where((codes < 0)[:, None], reference_values, values)  # too few cells: denoised
    below = (values.lt(0) | floored) & ~zero
    n_clipped = int((below if present is None else below[:, present]).sum())
    return mu, values.clamp_min(0.0).masked_fill(zero, 0.0), n_clipped


MIN_NONZERO_SHARE = 0.1  # a region's regional change is carried by its nonzero values, at most 10x each


def without_regional_change(values: torch.Tensor, change: torch.Tensor, zero: torch.Tensor, smoother,
                            offset: torch.Tensor | None = None) -> torch.Tensor:
    """(B, G) the log output `values` with the regional part of `change` (its running mean along the genome)
    taken out, and `offset` put in instead: by the nonzero values alone (an input zero stays zero), each
    carrying it over its window's share of nonzero values, so the region's mean over all its genes moves by it."""
    regional = smoother(change) if offset is None else smoother(change) - offset
    share = smoother((~zero).to(values.dtype)).clamp_min(MIN_NONZERO_SHARE)
    return (values - regional / share).masked_fill(zero, 0.0)


@torch.no_grad()
def log_mean_shift(net: BatchfixNet, mu: torch.Tensor, codes: torch.Tensor, reference: int | None,
                   present: torch.Tensor | None, extra: bool = False,
                   members: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log(mean_ref / mean_b), the own batch's mean fractions), each (B, G), for latents `mu`: the decoder's shift
    of the NB mean that the corrected counts apply, before the options and the batches' ratios
    (batchfix.correction.counts). A batch the model never saw (code >= n_batches) has the average decoder as its
    own; cells of code -1 have no shift. `extra`: of the extra genes' decoder; `members` (training batches, G) bool:
    the batches the average reference of each gene is taken over (None: all; count_output.CountTables)."""
    tiny = torch.finfo(torch.float32).tiny
    if reference is None:
        chosen = None if members is None else torch.from_numpy(members).to(mu.dtype)
        reference_fractions, own = net.average_and_own_fractions(mu, codes.long(), present, extra, chosen)
    else:
        reference_fractions = net.mean_fractions(mu, reference, present, extra)
        own = net.mean_fractions(mu, None, present, extra)
        seen = (codes >= 0) & (codes < net.n_batches)
        if seen.any():
            own[seen] = net.mean_fractions(mu[seen], codes[seen].long(), present, extra)
    shift = reference_fractions.clamp_min(tiny).log() - own.clamp_min(tiny).log()
    return torch.where((codes < 0)[:, None], torch.zeros_like(shift), shift), own


def applied_shift(shift: torch.Tensor, codes: torch.Tensor, mu: torch.Tensor, state: StateShrink | None,
                  regional: RegionalShift | None) -> torch.Tensor:
    """The shift after correction.state_dependence (`state`) and the regional part kept (`regional`), as for the
    log output's decoder term (`corrected`), for cells of batch `codes` with latents `mu`."""
    known = codes.clamp_min(0).long()
    if state is not None:
        shift = shift - (1.0 - state.weight) * (shift - state.mean_of(codes, mu)) * state.estimated[known, None]
    if regional is not None:
        shift = shift - regional.smoother((shift - regional.mean_shift[known]) * regional.estimated[known, None])
    return torch.where((codes < 0)[:, None], torch.zeros_like(shift), shift)


def reference_cell_shift(total: torch.Tensor, codes: torch.Tensor, regional: RegionalShift) -> torch.Tensor:
    """The counts' whole log-mean shift (B, G) with its regional part replaced by the batch's regional offset from
    its reference cells (`regional.offset`): a clone is kept, the batch's regional artefact removed."""
    known = codes.clamp_min(0).long()
    shift = total - regional.smoother(total) + regional.offset[known].to(total.dtype)
    return torch.where((codes < 0)[:, None], torch.zeros_like(shift), shift)
