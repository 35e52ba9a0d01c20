"""The estimate pass: what a correction reduces from *all* of the input's cells before any row is corrected.

`estimate` runs it over the input and returns one frozen `Estimates`; the output kinds
(batchfix.correction.outputs) then correct any row range from the bound model, the estimates and those rows.

- Batches the model never saw: their location and spread (the log output), or their per-gene ratio to the
  average decoder and their dispersion (the corrected counts), from one pass over their cells.
- Every batch's mean shift, for correction.state_dependence < 1 and the regional shift: the mean of the decoder
  term (log output) or of the log-mean shift (counts) over the batch's cells (keep, reference_cells) or over all
  cells (keep_input: the whole change on the log output's scale, the log-mean shift on the counts');
  with reference cells (regional_shift=reference_cells), each batch's regional correction from its normal cells instead
  (`ReferenceCellSums`).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchfix.correction import calibration, count_output, counterfactual, counts
from batchfix.correction.count_output import CountTables
from batchfix.correction.evidence import (
    DetectionSums,
    LogShiftEvidenceSums,
    ShiftEvidenceSums,
    add_evidence,
    depth_weights,
    log_change_and_residual,
    weighted_tables,
)
from batchfix.correction.lacking_genes import set_lacking, unless_lacking, unshifted
from batchfix.correction.library_shift import LibrarySums, library_shift
from batchfix.correction.mean_shifts import MeanShiftSums, group_shrink, mean_shift
from batchfix.correction.reduction import Block, OrderedSums
from batchfix.correction.reference_cells import LogReferenceCellSums, ReferenceCellSums
from batchfix.correction.regional import RegionalShift
from batchfix.correction.state_groups import LatentSample, StateGroups, fit_groups, group_codes
from batchfix.nn.attention import fused_attention

log = logging.getLogger(__name__)
LATENT_CACHE_BYTES = 1 << 30  # the estimate pass keeps the latents it encodes up to this size (8.9 M cells of 30)


@dataclass(frozen=True)
class Estimates:
    """Everything a correction reduces from all input cells; what correcting any row range reads besides the model.

    statistics: each batch code's location and spread (the counterfactual output; the log output reads them);
    count_tables: one `CountTables` per gene set of the bound model (corrected counts); state: the state shrink
    (state_dependence < 1); regional: the regional shift's smoother and mean shifts (reference cells' offsets
    included); shift_prior_sd: per gene set, each batch code's prior sd of its shifts across genes (the evidence
    weights', batchfix.correction.evidence, held in the tables); state_groups: the latent's groups the state
    shrink's means (and the counts' evidence weights) are also taken in; log_shift_weight: (codes, G) the weight of
    each batch's change of each gene (the log output's evidence weights), which is 0 for the genes a batch lacks
    (`log_lacking` (codes, G) bool, batchfix.correction.lacking_genes). None (or empty) where the output does not
    use it."""

    statistics: calibration.Statistics | None = None
    count_tables: tuple[CountTables, ...] = ()
    shift_prior_sd: tuple[np.ndarray, ...] = ()
    state: counterfactual.StateShrink | None = None
    regional: RegionalShift | None = None
    state_groups: StateGroups | None = None
    log_shift_weight: np.ndarray | None = None
    log_lacking: np.ndarray | None = None

    def summary(self, batch_names: list[str]) -> dict:
        """What was estimated, for uns[key_added]['estimates']; `batch_names` by batch code."""
        shrink = self.state if self.state is not None else self.regional
        with_mean = [] if shrink is None else np.flatnonzero(shrink.estimated.numpy() > 0)
        regional = "none" if self.regional is None else "reference_cells" if self.regional.offset is not None \
            else "whole_change" if self.regional.whole else "decoder_term"
        groups = 0 if self.state_groups is None else len(self.state_groups.centroids)
        return {"gene_sets_with_count_tables": len(self.count_tables), "state_shrink": self.state is not None,
                "state_groups": groups, "regional_split": regional,
                "batches_with_mean_shift": [batch_names[c] for c in with_mean],
                **({"shift_evidence": self.evidence_summary(batch_names)} if self.shift_prior_sd else {}),
                **({"depth_shift": self.depth_summary(batch_names)} if self.depth is not None else {})}

    @property
    def n_state_groups(self) -> int:
        """The latent's state groups the estimates are also taken in (1 without groups)."""
        return 1 if self.state_groups is None else len(self.state_groups.centroids)

    @property
    def depth(self):
        """Each batch's depth shift (correction.depth=reference; the same in every gene set's tables), or None."""
        return self.count_tables[0].depth if self.count_tables else None

    def depth_summary(self, batch_names: list[str]) -> dict:
        """Per batch with cells: its log depth shift to the reference, that shift's sampling sd and the share of it
        applied (batchfix.correction.library_shift)."""
        depth = self.depth
        weight = np.ones_like(depth.shift) if depth.weight is None else depth.weight
        return {batch_names[code]: {"log_shift": round(float(depth.shift[code]), 4),
                                    "sd": round(float(np.sqrt(depth.variance[code])), 4),
                                    "weight": round(float(weight[code]), 4)}
                for code in range(min(len(batch_names), len(depth.shift))) if depth.cells[code] > 0}

    def evidence_summary(self, batch_names: list[str]) -> dict:
        """Per batch: its shifts' prior sd across the modelled genes, over every corrected gene its shift's median
        weight, the share of shifts more than halved (evidence) and the genes it lacks as biology (lacking_genes);
        with state groups, the share of (group, gene) pairs whose group's evidence raised the weight."""
        weights = self.log_shift_weight if self.log_shift_weight is not None else \
            np.hstack([tables.shift_weight for tables in self.count_tables])  # (codes, all genes)
        raised = None if self.state_groups is None or not self.count_tables else np.concatenate(
            [(t.state_weight > t.shift_weight[:, None, :]).reshape(len(weights), -1) for t in self.count_tables],
            axis=1)  # (codes, groups * all genes)
        lacked = [t.lacking for t in self.count_tables if t.lacking is not None] + \
            ([] if self.log_lacking is None else [self.log_lacking])  # (codes, genes) of each gene set
        return {name: {"prior_sd": round(float(self.shift_prior_sd[0][code]), 4),
                       "median_weight": round(float(np.median(weights[code])), 4),
                       "share_more_than_halved": round(float((weights[code] < 0.5).mean()), 4),
                       "genes_lacked": sum(int(gone[code].sum()) for gone in lacked),
                       **({} if raised is None else {"share_raised_in_state_groups": round(float(
                           raised[code].mean()), 4)})}
                for code, name in enumerate(batch_names)}


@dataclass(frozen=True)
class Part:
    """The input rows [start, stop) one process reads in the estimate pass (cut at a forward batch's start), and
    `gather`: its sums' blocks -> every process's blocks in order (batchfix.correction.reduction)."""

    start: int
    stop: int
    gather: Callable[[list[Block]], Sequence[list[Block]]]


def estimate(bound, rows, n_obs: int, part: Part | None = None) -> tuple[Estimates, np.ndarray | None]:
    """(the estimates of the bound model's output over the input's `rows`, the (cells, latent) latents the pass
    encoded, or None: a cache the correction may reuse instead of encoding again). With `part`, this process reads
    only its rows (the latents of the others are left unset) and its sums meet the other processes' through
    `part.gather`: the same estimates, bit for bit, as one process reading every row. Nothing is estimated for the
    denoised output."""
    if bound.settings.output_mode != "counterfactual":
        return Estimates(), None
    part = part or Part(0, n_obs, lambda blocks: [blocks])
    regional = bound.settings.regional_shift != "apply"
    if regional and all(c is None for c in bound.trained.module.hparams.chromosome):
        log.info("regional_shift=%s: no modelled gene has genomic coordinates, so no part of the shift is "
                 "regional: all of it is removed (as with regional_shift=apply).", bound.settings.regional_shift)
        regional = False
    with bound.clock.stage("estimate"), fused_attention(bound.net), torch.no_grad():
        first = estimate_unseen(bound, rows, part, n_obs)
        if regional or bound.settings.state_dependence < 1 or bound.settings.shrink == "evidence" \
                or moves_depth(bound):
            return estimate_mean_shift(bound, first, rows, n_obs, part, regional)
    return first, None


def first_pass_batches(bound, rows, part: Part, every_row: bool):
    """(global forward-batch index, its cells' indices, for its cells of unseen batches: model input, the count gene
    sets' inputs, codes (None where it has none), and with `every_row` its input rows (else None)) of every forward
    batch of the part's rows, in order."""
    n_training = bound.batches.n_training
    for start, stop in bound.chunks(part.start, part.stop):
        codes = bound.batches.codes[start:stop]
        unseen = codes >= n_training
        chunk = rows.rows(start, stop) if unseen.any() or every_row else None
        for rows_of_batch, cells in bound.forward_batches(stop - start, start):
            own_rows = chunk[rows_of_batch] if every_row else None
            picked = np.flatnonzero(unseen[rows_of_batch]) + rows_of_batch.start
            if not len(picked):
                yield bound.batch_index(cells[0]), cells, None, own_rows
                continue
            x = bound.model_input(chunk[picked], cells[0])
            inputs = [x] + [genes.observed(chunk[picked]) for genes in bound.gene_sets[1:]]
            yield bound.batch_index(cells[0]), cells, (x, inputs, codes[picked]), own_rows


def detects_absence(bound) -> bool:
    """Whether the genes a whole batch lacks as biology are found (batchfix.correction.evidence: not shifted, not
    given by its depth, left out of the average reference): the counterfactual output (counts or log-scale) with
    evidence weights."""
    return bound.settings.output_mode == "counterfactual" and bound.settings.shrink == "evidence"


def moves_depth(bound) -> bool:
    """Whether each batch's depth is brought to the reference's (batchfix.correction.library_shift): the corrected
    counts with correction.depth=reference."""
    return bound.counts_output and bound.settings.depth == "reference"


def weighs_states(bound) -> bool:
    """Whether the correction is also estimated per state group of the latent (batchfix.correction.state_groups):
    the counterfactual output (counts or log-scale) with evidence weights and some state dependence (at
    state_dependence=0 every cell of a batch takes one shift, its batch's mean)."""
    return bound.settings.shrink == "evidence" and bound.settings.state_dependence > 0


def estimate_unseen(bound, rows, part: Part, n_obs: int) -> Estimates:
    """The statistics (log output) and, for the counts, each gene set's tables: the training batches' from the
    checkpoint, the unseen batches' ratios and dispersions from their cells; with `detects_absence`, the genes each
    batch lacks and each gene's average reference members; with `weighs_states`, the latent's state groups."""
    n_genes, n_unseen, n_sets = len(bound.trained.genes), len(bound.batches.unseen), len(bound.gene_sets)
    sums = [calibration.ResidualSums(n_genes) for _ in range(n_unseen)]
    count_sums = [counts.CountSums(len(genes.present)) for genes in bound.gene_sets for _ in range(n_unseen)]
    detection = DetectionSums(bound.batches.n_training + n_unseen, len(bound.corrected_mask)) \
        if detects_absence(bound) else None
    sample = LatentSample(n_obs, bound.latent_dim) if weighs_states(bound) else None
    extra = [s for s in (detection, sample) if s is not None]
    ordered = OrderedSums([*sums, *count_sums, *extra])
    if n_unseen or extra:
        for index, cells, unseen, own_rows in first_pass_batches(bound, rows, part, bool(extra)):
            batch_sums = ordered.fresh()
            if unseen is not None:
                add_unseen(bound, unseen, batch_sums[:n_unseen], batch_sums[n_unseen:n_unseen * (1 + n_sets)])
            if detection is not None:
                batch_sums[n_unseen * (1 + n_sets)].add(bound.batches.codes[cells], own_rows)
            picked = None if sample is None else sample.picked(bound.cell_keys[cells])
            if picked is not None and picked.any():
                batch_sums[-1].add(bound.cell_keys[cells][picked],
                                   bound.net.encode(bound.model_input(own_rows[picked], cells[0]))[0].numpy())
            ordered.push(index, batch_sums)
        totals = ordered.totals(part.gather)
        sums, count_sums = totals[:n_unseen], totals[n_unseen:n_unseen * (1 + n_sets)]
        detection = totals[n_unseen * (1 + n_sets)] if detection else None
        sample = totals[-1] if sample else None
    by_set = [count_sums[i * n_unseen:(i + 1) * n_unseen] for i in range(n_sets)]
    settings = bound.settings
    lacking = None if detection is None else detection.lacking(calibration.MIN_UNSEEN_CELLS, bound.sex_linked)

    def reference_members(genes) -> np.ndarray | None:  # each gene's average reference's batches
        if lacking is None or genes is None or bound.reference is not None:
            return None
        return DetectionSums.members(genes, lacking, bound.batches.n_training)

    members = [reference_members(genes) for genes in bound.gene_sets]
    log_genes = None if bound.counts_output else bound.log_genes()
    log_members = reference_members(log_genes)
    statistics = calibration.Statistics(bound.trained.tables, bound.reference, sums, bound.present.numpy(),
                                        settings.spread, settings.residual_weight, log_members)
    tables = tuple(count_output.count_tables(bound.trained, genes, set_sums, bound.reference, settings.spread, chosen)
                   for genes, set_sums, chosen in zip(bound.gene_sets, by_set, members))
    if lacking is not None:  # the genes each batch lacks: no shift, no depth (evidence.weighted_tables)
        tables = tuple(dataclasses.replace(t, lacking=set_lacking(g, lacking)) for t, g in zip(tables, bound.gene_sets))
    groups = None if sample is None else fit_groups(sample)
    log_lacking = None if lacking is None or log_genes is None else set_lacking(log_genes, lacking)
    return Estimates(statistics=statistics, count_tables=tables, state_groups=groups, log_lacking=log_lacking)


def add_unseen(bound, cells: tuple, sums: list, count_sums: list) -> None:
    """One forward batch's cells of unseen batches (x, the count gene sets' inputs, codes) into their batches'
    residual sums and each gene set's count sums (`count_sums`: by gene set, then unseen batch)."""
    x, inputs, codes = cells
    net, n_training, n_unseen = bound.net, bound.batches.n_training, len(sums)
    mu, _ = net.encode(x)
    r = calibration.residual(net, x, mu, None, bound.present).numpy()
    for code in np.unique(codes):
        sums[code - n_training].add(r[codes == code])
    for i, (genes, values) in enumerate(zip(bound.gene_sets, inputs)):
        mean = (net.mean_fractions(mu, None, genes.present, genes.extra)
                * values[:, genes.present].sum(-1, keepdim=True)).numpy()
        for code in np.unique(codes):
            count_sums[i * n_unseen + code - n_training].add(values.numpy()[codes == code], mean[codes == code])


def batch_terms(bound, first: Estimates, x: torch.Tensor, mu: torch.Tensor, codes: np.ndarray, whole: bool):
    """(the term whose batch means are estimated, the whole change or None, what the evidence weights read) for one
    forward batch: the decoder term, with `whole` the floored output's change, and the output's terms (values,
    input, reference decoding) (log output); the log-mean shift and the own batch's mean fractions (counts)."""
    code_tensor = torch.from_numpy(codes)
    if bound.counts_output:
        shift, own = counterfactual.log_mean_shift(bound.net, mu, code_tensor, bound.reference, bound.present,
                                                   members=first.count_tables[0].reference_members)
        return shift.numpy(), None, own
    values, decoder, observed, reference_values = counterfactual.output_terms(
        bound.net, x, mu, code_tensor, bound.reference, first.statistics, bound.present)
    change = (values.clamp_min(0.0).masked_fill(x.eq(0), 0.0) - observed).numpy() if whole else None
    return decoder.numpy(), change, (values, observed, reference_values)


def estimate_mean_shift(bound, first: Estimates, rows, n_obs: int, part: Part,
                        regional: bool) -> tuple[Estimates, np.ndarray | None]:
    """`first` with each batch code's mean term over its cells (for state_dependence, counterfactual.StateShrink)
    and, with `regional`, the mean that regional_shift splits against (RegionalShift); and the (cells, latent)
    latents encoded on the way (None above `latent_cache`'s size)."""
    n_codes = bound.batches.n_training + len(bound.batches.unseen)
    mode = bound.settings.regional_shift if regional else "apply"
    whole = mode == "keep_input" and not bound.counts_output
    ordered = OrderedSums(mean_shift_templates(bound, first, n_codes, regional, whole))
    evidence = bound.counts_output and bound.settings.shrink == "evidence"
    latents = latent_cache(n_obs, bound.latent_dim)  # this part's rows set, the others' left unset
    for start, stop in bound.chunks(part.start, part.stop):
        chunk = rows.rows(start, stop)
        x = bound.model_input(chunk, start)
        inputs = [x] + [genes.observed(chunk) for genes in bound.gene_sets[1:]] if evidence else []
        for rows_of_batch, cells in bound.forward_batches(stop - start, start):
            batch_sums = ordered.fresh()
            own_rows = chunk[rows_of_batch] if moves_depth(bound) else None  # the depth reads whole rows
            mu = add_mean_shift(bound, first, batch_sums, x[rows_of_batch],
                                [values[rows_of_batch] for values in inputs], cells, whole, own_rows)
            if latents is not None:
                latents[cells] = mu
            ordered.push(bound.batch_index(cells[0]), batch_sums)
    sums, group_sums, normal, log_evidence, library, count_evidence = by_role(ordered.totals(part.gather))
    state, shift = mean_shift(bound, sums, mode, regional)
    if group_sums is not None:
        state = group_shrink(state, sums, group_sums, first.state_groups)
    if shift is not None and normal is not None:
        shift = dataclasses.replace(shift, offset=normal.offset())
    if log_evidence is not None:
        log_weight, prior_sd = log_evidence.weights(bound.present.numpy())
        log_weight = unless_lacking(log_weight, unshifted(first.log_lacking, bound.reference))
        return dataclasses.replace(first, log_shift_weight=log_weight, shift_prior_sd=(prior_sd,), state=state,
                                   regional=shift), latents
    tables, prior_sd = weighted_tables(bound, with_depth(bound, first, library), count_evidence)
    return dataclasses.replace(first, count_tables=tables, shift_prior_sd=prior_sd, state=state,
                               regional=shift), latents


def mean_shift_templates(bound, first: Estimates, n_codes: int, regional: bool, whole: bool) -> list:
    """The mean-shift pass's zero sums, in `by_role`'s order."""
    templates = [MeanShiftSums(n_codes, len(bound.trained.genes), whole)]
    n_groups = first.n_state_groups
    if first.state_groups is not None and bound.settings.state_dependence < 1:  # the state shrink's group means
        templates.append(MeanShiftSums(n_codes * n_groups, len(bound.trained.genes), False))
    if regional and bound.normal is not None:
        templates.append((ReferenceCellSums if bound.counts_output else LogReferenceCellSums)(bound, first, n_codes))
    if bound.counts_output and bound.settings.shrink == "evidence":
        by = [1] if first.state_groups is None else [1, n_groups]  # by batch, by group
        templates += [ShiftEvidenceSums(n_codes * n, len(genes.present)) for n in by for genes in bound.gene_sets]
    elif bound.settings.shrink == "evidence":  # the log output: by batch alone (batchfix.correction.evidence)
        templates.append(LogShiftEvidenceSums(n_codes, len(bound.trained.genes)))
    if moves_depth(bound):  # each batch's depth, by state group (batchfix.correction.library_shift)
        templates.append(LibrarySums(n_codes * n_groups))
    return templates


def with_depth(bound, first: Estimates, library: LibrarySums | None) -> Estimates:
    """`first` with each gene set's tables holding the batches' depth shift (evidence-weighed); as is without sums."""
    if library is None:
        return first
    depth = library_shift(library, first.n_state_groups, bound.batches.n_training, bound.reference)
    if bound.settings.shrink == "evidence":
        depth = dataclasses.replace(depth, weight=depth_weights(depth.shift, depth.variance))
    return dataclasses.replace(first, count_tables=tuple(dataclasses.replace(t, depth=depth)
                                                         for t in first.count_tables))


def latent_cache(n_obs: int, latent_dim: int) -> np.ndarray | None:
    """(cells, latent) float32, unset, for the latents the estimate pass encodes, which the correction then reads
    instead of encoding every cell again (the same values); None above LATENT_CACHE_BYTES, so that memory stays flat
    in the number of cells: the correction encodes them again."""
    size = n_obs * latent_dim * np.dtype(np.float32).itemsize
    if size > LATENT_CACHE_BYTES:
        log.info("%d cells: their latents (%.1f GB) are encoded again while correcting, not kept from the estimate "
                 "pass.", n_obs, size / 1e9)
        return None
    return np.empty((n_obs, latent_dim), dtype=np.float32)


def add_mean_shift(bound, first: Estimates, sums: list, x: torch.Tensor, inputs: list[torch.Tensor],
                   cells: np.ndarray, whole: bool, own_rows) -> np.ndarray:
    """One forward batch (input `x`, each count gene set's counts `inputs`, its input rows `own_rows`, None where
    no sum reads them) into its fresh `sums` (`by_role`); returns its (B, latent) latent means."""
    codes = bound.batches.codes[cells]
    mu, _ = bound.net.encode(x)  # (B, latent)
    term, change, own = batch_terms(bound, first, x, mu, codes, whole)
    mean_sums, group_sums, normal, log_evidence, library, count_evidence = by_role(sums)
    mean_sums.add(codes, term, change)
    if library is not None:  # by (batch, state group)
        library.add(codes if first.state_groups is None else group_codes(codes, first.state_groups, mu), own_rows)
    if group_sums is not None:
        group_sums.add(group_codes(codes, first.state_groups, mu), term, None)
    if normal is not None:
        normal.add(x, torch.from_numpy(term) if bound.counts_output else mu, codes, cells[0])
    if log_evidence is not None:
        log_evidence.add(codes, *log_change_and_residual(first, own, codes))
    if count_evidence:
        add_evidence(bound, first, count_evidence, inputs, mu, codes, (term, own))
    return mu.numpy()


def by_role(sums: list) -> tuple:
    """The mean-shift pass's sums (`estimate_mean_shift`'s order) by role: (MeanShiftSums, those by state group or
    None, the reference cells' or None, the log output's evidence or None, the depth's LibrarySums or None, each
    count gene set's evidence)."""
    mean_sums, *rest = sums
    library = rest.pop() if rest and isinstance(rest[-1], LibrarySums) else None
    group_sums = rest.pop(0) if rest and isinstance(rest[0], MeanShiftSums) else None
    normal = rest.pop(0) if rest and isinstance(rest[0], ReferenceCellSums) else None
    log_evidence = rest.pop(0) if rest and isinstance(rest[0], LogShiftEvidenceSums) else None
    return mean_sums, group_sums, normal, log_evidence, library, rest
