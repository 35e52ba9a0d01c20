"""correction.regional_shift: the counterfactual output can leave a cell's regional (copy-number-like) shift in.

The smoother is checked on constructed values; the option on a tiny model trained on the real 200-cell
subset with an injected clone (scripts/inject_clones.py) in one cell line of one batch.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import batchfix
from batchfix.api import train_config
from batchfix.counterfactual import GenomeSmoother, genome_smoother
from batchfix.errors import ConfigError
from batchfix.normalize import log_cp10k

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import inject_clones  # noqa: E402

TINY = dict(n_top_genes=None, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8,
            decoder_hidden=32, batch_size=64, max_epochs=30, threads=1, enable_progress_bar=False)


def test_the_smoother_averages_neighbours_within_each_chromosome_only():
    chromosome = ["1"] * 5 + ["2"] * 3 + [None] * 2
    smoother = GenomeSmoother(chromosome, window=3)
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 9.0, 9.0]])
    assert smoother(values).tolist() == [[1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 0.0, 0.0]]  # unplaced: no region
    spike = torch.zeros(1, 10)
    spike[0, 2] = 3.0
    assert smoother(spike)[0].tolist() == pytest.approx([0, 1, 1, 1, 0, 0, 0, 0, 0, 0])


def test_a_shuffled_order_smooths_over_unrelated_genes():
    chromosome = ["1"] * 50 + ["2"] * 50
    regional = torch.cat([torch.ones(1, 50), -torch.ones(1, 50)], dim=1)  # a whole-chromosome shift
    real = genome_smoother(chromosome, "keep", 20, seed=0)(regional)
    shuffled = [genome_smoother(chromosome, "keep_shuffled", 20, seed=s)(regional) for s in (1, 2)]
    assert torch.allclose(real, regional)
    assert all(s.abs().mean() < 0.5 for s in shuffled)  # mixed chromosomes average out
    assert not torch.allclose(shuffled[0], shuffled[1])  # each seed its own order


def test_the_option_is_checked():
    with pytest.raises(ConfigError, match="regional_shift must be one of"):
        train_config(regional_shift="maybe")
    with pytest.raises(ConfigError, match="regional_window must be >= 2"):
        train_config(regional_window=1)


@pytest.fixture(scope="module")
def cloned(subset):
    """The real subset with a clone (gain chr1, loss chr2) in one line of one batch, and a tiny model of it."""
    labels, batch = subset.obs["cell_type"].astype(str), subset.obs["batch"].astype(str)
    table = (labels + "|" + batch).value_counts()
    label, own = table.index[0].split("|")
    placed = subset[:, subset.var["chromosome"].notna().to_numpy()].copy()
    clone = inject_clones.Clone(label, [own], gain="1", loss="2")
    injected = inject_clones.inject(placed, clone, "cell_type", "batch", seed=0)
    model = batchfix.train(injected, batch_key="batch", seed=0, **TINY)
    return placed, injected, clone, model


def test_keeping_the_regional_shift_keeps_more_of_a_confounded_clone(cloned):
    placed, injected, clone, model = cloned
    matrices = {}
    for mode in ("apply", "keep"):
        corrected = batchfix.correct(injected, model, regional_shift=mode, copy=True)
        assert corrected.uns["batchfix"]["params"]["regional_shift"] == mode
        matrices[mode] = np.asarray(corrected.layers["batchfix"].toarray())
    original, after = np.asarray(log_cp10k(placed.X)), np.asarray(log_cp10k(injected.X))
    matrices["uncorrected"] = after
    scores = inject_clones.clone_scores(matrices, original, after, injected.obs, placed.var, clone, "confounded",
                                        "cell_type", "batch")
    kept = {name: np.mean(list(by_segment.values())) for name, by_segment in scores.items()}
    assert kept["uncorrected"] > 0.8
    assert kept["keep"] > kept["apply"] + 0.05
    # Per gene, the part left in averages to 0 over a batch's cells: the batch-wide shift is still removed.
    batch = injected.obs["batch"].to_numpy()
    for b in np.unique(batch):
        rows = batch == b
        unclipped = (matrices["apply"][rows] > 0).all(axis=0) & (matrices["keep"][rows] > 0).all(axis=0)
        assert unclipped.sum() >= 10
        gap = matrices["keep"][rows][:, unclipped].mean(axis=0) - matrices["apply"][rows][:, unclipped].mean(axis=0)
        assert np.abs(gap).max() < 1e-4
