"""The extra genes' decoder fitted on frozen latents: (latent, batch) -> NB mean fractions of the genes the encoder
does not read (batchfix.correction.extra_genes chooses them, encodes the cells and calibrates the result).

The latents are fixed, so the problem is small: Adam on minibatches of the fitting cells, stopped early on held-out
cells, the decoder of the lowest held-out NB loss kept. Seeded: the same fit for the same cells and seed.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from batchfix.nn.network import negative_binomial_log_likelihood

MAX_STEPS = 600  # optimizer steps of the extra decoder's fit at most (the latents are fixed: a small problem)
BATCH_SIZE = 256
LEARNING_RATE = 1e-2
# Early stopping: the fit holds out a share of its cells and keeps the decoder of the lowest held-out NB loss,
# checked every CHECK_EVERY steps, stopping after PATIENCE checks without a lower one. Measured on the bundled
# data (1,021 cells): a fixed 600 steps overfits (held-out loss 13,135 per cell against 12,754 at 150 steps).
HELD_OUT_SHARE, MAX_HELD_OUT_CELLS = 0.1, 2000
CHECK_EVERY, PATIENCE = 25, 4


def held_out_split(n_cells: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(fitting rows, held-out rows) of n_cells: HELD_OUT_SHARE of them held out (none below 20 cells)."""
    order = torch.randperm(n_cells, generator=generator)
    n_held = min(int(n_cells * HELD_OUT_SHARE), MAX_HELD_OUT_CELLS) if n_cells >= 20 else 0
    return order[n_held:], order[:n_held]


class SparseCounts:
    """The fitting cells' extra-gene counts, kept sparse (tens of thousands of cells x genes would not fit dense):
    `matrix` (cells, extra genes) CSR float32 and `library` (cells, 1) each cell's sum."""

    def __init__(self, matrix):
        self.matrix = sp.csr_matrix(matrix, dtype=np.float32)
        self.library = torch.from_numpy(np.asarray(self.matrix.sum(axis=1), dtype=np.float32))

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), extra genes) dense counts of the cells at `rows`."""
        return torch.from_numpy(self.matrix[rows.numpy()].toarray())


def nb_loss(decoder, latents: torch.Tensor, codes: torch.Tensor, counts_dense: torch.Tensor,
            library: torch.Tensor) -> torch.Tensor:
    """Mean NB negative log-likelihood per cell of the decoder's means at each cell's extra-gene library."""
    mean = F.softmax(decoder(latents, codes).float(), dim=-1) * library  # (cells, extra genes)
    return -negative_binomial_log_likelihood(counts_dense, mean, decoder.log_theta).mean()


def fit_decoder(net, latents: torch.Tensor, codes: torch.Tensor, extra_counts: SparseCounts,
                seed: int) -> tuple[float, int]:
    """Fit net.extra_decoder on (latent, batch) -> counts (cells, extra genes), stopped early on held-out cells;
    returns the kept decoder's held-out loss per cell (its last training loss where no cell is held out) and the
    steps taken."""
    generator = torch.Generator().manual_seed(seed)
    decoder = net.extra_decoder
    optimizer = torch.optim.Adam(decoder.parameters(), lr=LEARNING_RATE)
    library = extra_counts.library
    fitting, held = held_out_split(len(latents), generator)
    held_counts = extra_counts.rows(held)
    best, best_state, checks_since_best = float("inf"), None, 0
    loss, step = torch.zeros(()), 0
    with torch.enable_grad():
        for step in range(1, MAX_STEPS + 1):
            decoder.train()
            rows = fitting[torch.randint(len(fitting), (min(BATCH_SIZE, len(fitting)),), generator=generator)]
            loss = nb_loss(decoder, latents[rows], codes[rows], extra_counts.rows(rows), library[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if len(held) == 0 or step % CHECK_EVERY:
                continue
            decoder.eval()
            with torch.no_grad():
                held_loss = float(nb_loss(decoder, latents[held], codes[held], held_counts, library[held]))
            if held_loss < best:
                best, checks_since_best = held_loss, 0
                best_state = {name: value.clone() for name, value in decoder.state_dict().items()}
            else:
                checks_since_best += 1
                if checks_since_best >= PATIENCE:
                    break
    decoder.eval()
    if best_state is None:
        return float(loss.detach()), step
    decoder.load_state_dict(best_state)
    return best, step
