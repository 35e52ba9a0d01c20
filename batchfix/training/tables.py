"""What calibration measures on the training cells after the fit, owned by the trained model beside its network.

The network (batchfix.nn.network) is what the fit learns; these tables are what `batchfix.correction.calibration`
and the extra genes' fit measure afterwards with it frozen: the counterfactual output's residual location and spread
per training batch (and per gene), and each batch's NB dispersion and observed-over-decoded mean ratio per gene for
the corrected counts (and the same for the extra genes). They travel in the checkpoint as `tables.*`; a checkpoint
that kept them on the network (`net.*`) loads through `tables_from_network_keys`.
"""
from __future__ import annotations

import torch
from torch import nn

from batchfix.errors import CheckpointFormatError

CHECKPOINT_FORMAT = 2  # 2: per-batch NB dispersions (count_theta) for the corrected counts
# The tables' names, as buffers here and, in checkpoints written before they left the network, under `net.`
TABLES = ("residual_location", "residual_spread", "residual_gene_spread", "residual_cells", "count_theta",
          "count_ratio", "extra_count_theta", "extra_count_ratio")


class CalibrationTables(nn.Module):
    """Per training batch: the residual location (G,) and spread (a scalar; 0 = not calibrated), the residual's
    within-batch sd per gene and the cells it was estimated on (correction.spread=gene), and the NB inverse
    dispersion and observed-over-decoded mean ratio per gene (theta 0 = not calibrated); per extra gene, the last
    two once `add_extra_genes` made room for them."""

    def __init__(self, n_batches: int, n_genes: int):
        super().__init__()
        self.n_batches = n_batches
        self.register_buffer("residual_location", torch.zeros(n_batches, n_genes))
        self.register_buffer("residual_spread", torch.zeros(n_batches))
        self.register_buffer("residual_gene_spread", torch.zeros(n_batches, n_genes))
        self.register_buffer("residual_cells", torch.zeros(n_batches))
        self.register_buffer("count_theta", torch.zeros(n_batches, n_genes))
        self.register_buffer("count_ratio", torch.ones(n_batches, n_genes))
        self.register_buffer("extra_count_theta", None)  # (batches, extra genes) once `add_extra_genes` ran
        self.register_buffer("extra_count_ratio", None)

    def add_extra_genes(self, n_extra: int) -> None:
        """Room for the extra genes' dispersions and ratios (batchfix.correction.extra_genes)."""
        self.register_buffer("extra_count_theta", torch.zeros(self.n_batches, n_extra))
        self.register_buffer("extra_count_ratio", torch.ones(self.n_batches, n_extra))


def tables_from_network_keys(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook of the modules holding `net` and `tables`: a checkpoint written while the tables
    were buffers of the network (`net.count_theta`, ...) loads as `tables.*`; one of the format before per-batch
    dispersions is refused in one line."""
    for name in TABLES:
        if f"{prefix}net.{name}" in state_dict:
            state_dict[f"{prefix}tables.{name}"] = state_dict.pop(f"{prefix}net.{name}")
    if f"{prefix}net.decoder.log_theta" in state_dict and f"{prefix}tables.count_theta" not in state_dict:
        raise CheckpointFormatError(
            f"This checkpoint was written by an earlier batchfix (checkpoint format 1, before version "
            f"{CHECKPOINT_FORMAT}): it lacks the per-batch dispersions that corrected counts need. Train again "
            "with this version (docs/reference.md, 'Migrating from 0.1 outputs').")
