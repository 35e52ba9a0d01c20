"""The apply step: one class per output kind turns a row range of the input into its latent and layers.

Each kind reads the bound model (batchfix.correction.corrector), the frozen estimates of the whole input
(batchfix.correction.estimates) and the rows it is given, nothing else, so any row range can be corrected on its
own and in any order: `apply(chunk, first_cell)` returns a `ChunkOutput` whose `Tallies` (zeros raised, values
clipped, empty cells) add up over chunks. `corrected_chunks` runs one kind over a file chunk by chunk.

- `CountsOutput`: the NB model's counterfactual output, corrected counts and their log layer (count_output).
- `LogOutput`: the log-scale model's counterfactual output (counterfactual.corrected).
- `DenoisedOutput`: every cell decoded from its latent as the reference.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

from batchfix import signals
from batchfix.correction import count_output, counterfactual, counts, layers
from batchfix.correction.corrector import BoundModel
from batchfix.correction.count_output import ModelChecks
from batchfix.correction.estimates import Estimates
from batchfix.correction.state_groups import sampled
from batchfix.errors import InputError
from batchfix.nn.attention import fused_attention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tallies:
    """What a correction counts as it goes, summed over chunks: cells without counts in any gene (`n_empty`) and
    in the modelled genes (`n_empty_modelled`); the counts' observed zeros and those made positive; the log
    output's values raised to its floor; the counts' model checks."""

    n_empty: int = 0
    n_empty_modelled: int = 0
    n_zeros: int = 0
    n_zeros_raised: int = 0
    n_clipped: int = 0
    checks: ModelChecks | None = None  # the counts' checks against the model (count_output.ModelChecks)

    COUNTS = ("n_empty", "n_empty_modelled", "n_zeros", "n_zeros_raised", "n_clipped")

    def __add__(self, other: Tallies) -> Tallies:
        checks = other.checks if self.checks is None else self.checks if other.checks is None else \
            self.checks + other.checks
        return Tallies(**{name: getattr(self, name) + getattr(other, name) for name in self.COUNTS}, checks=checks)

    def counts(self) -> dict[str, int]:
        """The tallies' counts by name (the checks apart)."""
        return {name: getattr(self, name) for name in self.COUNTS}


@dataclass(frozen=True)
class ChunkOutput:
    """One row range's outputs: latent (cells, latent_dim), layers by kind ('counts' and 'log', or 'log'), tallies."""

    latent: np.ndarray
    layers: dict[str, sp.csr_matrix]
    tallies: Tallies


def empty_cells(chunk, x: torch.Tensor) -> Tallies:
    """The chunk's cells without counts, in every gene and in the modelled genes."""
    nonzero_per_cell = np.asarray((chunk != 0).sum(axis=1)).ravel()
    return Tallies(n_empty=int((nonzero_per_cell == 0).sum()), n_empty_modelled=int((x == 0).all(dim=1).sum()))


class OutputKind:
    """An output kind: `apply` a row range (fused attention, inference mode), `rows_output` the same as the model
    was trained (the guarded softmax)."""

    def __init__(self, bound: BoundModel, estimates: Estimates, latents: np.ndarray | None = None):
        self.bound, self.estimates = bound, estimates
        self.latents = latents  # (cells, latent) of the estimate pass, a cache: without it the rows are encoded

    @torch.inference_mode()
    def apply(self, chunk, first_cell: int = 0) -> ChunkOutput:
        with fused_attention(self.bound.net):
            return self.rows_output(chunk, first_cell)

    def rows_output(self, chunk, first_cell: int) -> ChunkOutput:
        raise NotImplementedError

    def latents_of(self, x: torch.Tensor, cells: np.ndarray) -> torch.Tensor:
        """(B, latent) the latent means of the cells at `cells`: from the cache, else encoded now."""
        return self.bound.net.encode(x)[0] if self.latents is None else torch.from_numpy(self.latents[cells])

    def log_values(self, chunk, first_cell: int, values_of) -> ChunkOutput:
        """The log layer of the modelled genes, from `values_of(x, cells) -> (latent mean, values (B, genes),
        clipped)` per forward batch."""
        bound, clock = self.bound, self.bound.clock
        with clock.stage("read"):
            x = bound.model_input(chunk, first_cell)
        tallies = empty_cells(chunk, x)
        latent = np.empty((x.shape[0], bound.latent_dim), dtype=np.float32)
        values = np.empty((x.shape[0], bound.n_out), dtype=np.float32)
        n_clipped = 0
        for part, cells in bound.forward_batches(x.shape[0], first_cell):
            with clock.stage("decode"):
                mu, expression, clipped = values_of(x[part], cells)
            latent[part] = mu.numpy()
            values[part] = expression.numpy()[:, bound.out_model]
            n_clipped += clipped
        with clock.stage("layers"):
            log_layer = layers.modelled_layer(values, bound.out_columns, bound.n_vars)
        return ChunkOutput(latent, {"log": log_layer}, tallies + Tallies(n_clipped=n_clipped))


class DenoisedOutput(OutputKind):
    """Every cell decoded from its latent as the reference batch (log1p expression per 10k)."""

    def rows_output(self, chunk, first_cell: int) -> ChunkOutput:
        return self.log_values(chunk, first_cell,
                               lambda x, cells: (*self.bound.net.corrected(x, self.bound.reference), 0))


class LogOutput(OutputKind):
    """The log-scale counterfactual output: each value with only what its batch explains removed."""

    def rows_output(self, chunk, first_cell: int) -> ChunkOutput:
        return self.log_values(chunk, first_cell, self.counterfactual_batch)

    def counterfactual_batch(self, x: torch.Tensor, cells: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(latent mean, values, raised to 0) of a forward batch; with evidence weights (correction.shrink), each
        batch's change of each gene times its weight."""
        bound, estimates = self.bound, self.estimates
        codes = torch.from_numpy(bound.batches.codes[cells])
        mu, values, n_clipped = counterfactual.corrected(bound.net, x, codes, bound.reference, estimates.statistics,
                                                         bound.present, estimates.regional, estimates.state,
                                                         mu=self.latents_of(x, cells))
        if estimates.log_shift_weight is not None:
            observed = bound.net.log_expression(x)
            weight = torch.from_numpy(estimates.log_shift_weight[codes.clamp_min(0).numpy()]).to(values.dtype)
            weight = torch.where((codes < 0)[:, None], torch.ones_like(weight), weight)  # denoised: not weighted
            values = observed + weight * (values - observed)  # an input zero stays zero, values stay >= 0
        return mu, values, n_clipped


class CountsOutput(OutputKind):
    """Corrected counts: each observed count of every corrected gene moved from its batch's NB to the reference's
    (batchfix.correction.counts; the cell's library kept, the shift after every option), each gene set with its
    decoder (count_output); and their log layer."""

    def forward_batches(self, x: torch.Tensor, first_cell: int) -> Iterator[tuple[slice, np.ndarray, torch.Tensor,
                                                                                   torch.Tensor]]:
        """(rows of the chunk `x`, their cells' indices, batch codes, latents) for each forward batch of it."""
        for part, cells in self.bound.forward_batches(x.shape[0], first_cell):
            with self.bound.clock.stage("decode"):
                mu = self.latents_of(x[part], cells)
            yield part, cells, torch.from_numpy(self.bound.batches.codes[cells]), mu

    def rows_output(self, chunk, first_cell: int) -> ChunkOutput:
        bound, estimates, clock = self.bound, self.estimates, self.bound.clock
        with clock.stage("read"):
            x = bound.model_input(chunk, first_cell)
            inputs = [x] + [genes.observed(chunk) for genes in bound.gene_sets[1:]]
        latent = np.empty((x.shape[0], bound.latent_dim), dtype=np.float32)
        columns = np.sort(np.concatenate([genes.columns for genes in bound.gene_sets]))  # the sets' are disjoint
        places = [np.searchsorted(columns, genes.columns) for genes in bound.gene_sets]
        corrected = np.empty((x.shape[0], len(columns)), dtype=np.float32)  # (cells, corrected genes), in place
        n_zeros = n_raised = 0
        checks = self.no_checks()
        for part, cells, codes, mu in self.forward_batches(x, first_cell):
            latent[part] = mu.numpy()
            distributions = []  # each gene set's NB of these cells; the first set's (the modelled genes) is checked
            for genes, tables, values, place in zip(bound.gene_sets, estimates.count_tables, inputs, places):
                nb, mapped = count_output.mapped_counts(
                    bound.net, genes, tables, values[part], mu, codes, bound.cell_keys[cells], bound.reference,
                    bound.settings.quantile_seed, estimates.state, estimates.regional, clock=clock)
                corrected[part, place] = mapped
                n_zeros += int((nb.observed == 0).sum())
                n_raised += int(((nb.observed == 0) & (mapped > 0)).sum())
                distributions.append(nb)
            with clock.stage("checks"):
                self.add_checks(checks, cells, codes, mu, distributions[0], corrected[part], places[0])
        with clock.stage("layers"):
            chunk_layers = layers.count_layers(chunk, corrected, columns, bound.corrected_mask)
        return ChunkOutput(latent, chunk_layers, empty_cells(chunk, x) + Tallies(n_zeros=n_zeros,
                                                                                 n_zeros_raised=n_raised,
                                                                                 checks=checks))

    def no_checks(self) -> ModelChecks:
        """Empty model checks of the modelled genes, by batch code and state group."""
        return ModelChecks.empty(self.estimates.count_tables[0].theta.shape[0], self.estimates.n_state_groups,
                                 len(self.bound.gene_sets[0].columns))

    def add_checks(self, checks: ModelChecks, cells: np.ndarray, codes: torch.Tensor, mu: torch.Tensor,
                   nb: count_output.CountDistributions, corrected: np.ndarray, modelled: np.ndarray) -> None:
        """Add the checked cells (state_groups.sampled; with a batch) of a forward batch to `checks`: `mu` (B,
        latent) their latents, `nb` the modelled genes' NB of the forward batch's cells (those their counts were
        mapped with, not decoded again), `corrected` (B, corrected genes) their counts, the modelled genes at columns
        `modelled` (only the checked cells' are taken: most batches have none). The PIT's draws are keyed by
        (quantile_seed + 1, cell, gene), the calibrated detection's by + 2."""
        bound, estimates = self.bound, self.estimates
        keys = bound.cell_keys[cells]
        picked = np.flatnonzero(sampled(keys, len(bound.cell_keys)) & (codes.numpy() >= 0))
        if not len(picked):
            return
        genes, seed, nb = bound.gene_sets[0], bound.settings.quantile_seed, nb.rows(picked)
        groups = estimates.state_groups
        state = np.zeros(len(picked), dtype=np.int64) if groups is None else groups.assign(mu[torch.from_numpy(picked)])
        pit_draws, detection_draws = (counts.counter_uniform(seed + k, keys[picked], genes.keys) for k in (1, 2))
        checks.add(codes.numpy()[picked], state, nb.own_pit(pit_draws), nb.reference_nonzero(), nb.observed,
                   corrected[picked][:, modelled], detection_draws)


def output_kind(bound: BoundModel, estimates: Estimates, latents: np.ndarray | None = None) -> OutputKind:
    """The output kind of the bound model's settings, reading `estimates` (and the latents cache, if any)."""
    kind = {"counts": CountsOutput, "log_counterfactual": LogOutput, "denoised": DenoisedOutput}[bound.kind]
    return kind(bound, estimates, latents)


def check_empty_cells(bound: BoundModel, tallies: Tallies, n_obs: int) -> None:
    """After the last chunk: refuse an input whose every cell is empty in the modelled genes (nothing to
    correct); warn with the count when some are."""
    if n_obs and tallies.n_empty_modelled == n_obs:
        what = "in any gene" if tallies.n_empty == n_obs else f"in any of the model's {len(bound.trained.genes)} genes"
        raise InputError(f"All {n_obs} cells of the input ({bound.source}) have no counts {what}: there is no "
                         "expression to correct. Is this the right file (and counts_layer)?")
    if tallies.n_empty_modelled:
        key = bound.settings.key_added
        what = (f"their layers['{key}'] values are what the model decodes from an empty cell (the same for every "
                "such cell of a batch), not a measurement" if bound.kind == "denoised" else
                f"their corrected values stay zero, but their obsm['X_{key}'] is the latent of an empty cell (the same "
                "for every such cell), so they cluster together")
        log.warning("%d of %d cells have no counts in any of the model's genes (%d of them in no gene at all): %s. "
                    "Remove them first, e.g. scanpy.pp.filter_cells(adata, min_counts=1).", tallies.n_empty_modelled,
                    n_obs, tallies.n_empty, what)


def corrected_chunks(output: OutputKind, rows, n_obs: int, chunk_size: int,
                     progress: bool) -> Iterator[tuple[int, int, ChunkOutput]]:
    """(start, stop, the chunk's outputs) for consecutive chunks of cells, with a cells/s progress bar."""
    started = time.perf_counter()
    with tqdm(total=n_obs, unit="cell", unit_scale=True, desc="batchfix correct", disable=not progress,
              mininterval=1.0, smoothing=0.1) as bar:
        for start in range(0, n_obs, chunk_size):
            signals.raise_pending()
            stop = min(start + chunk_size, n_obs)
            with output.bound.clock.stage("read"):
                chunk = rows.rows(start, stop)
            yield start, stop, output.apply(chunk, start)
            bar.update(stop - start)
    seconds = time.perf_counter() - started
    log.info("Corrected %d cells x %d genes in %.1f s (%.0f cells/s).", n_obs,
             int(output.bound.corrected_mask.sum()), seconds, n_obs / max(seconds, 1e-9))
