"""Each batch's depth brought to the reference's (correction.depth=reference, batchfix.correction.library_shift): the
shift within state groups and its variance, and on real counts a plate at half the depth raised to the others' while
a random split of one batch is left as it was."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import batchfix
from batchfix.correction.evidence import depth_weights
from batchfix.correction.library_shift import LibrarySums, library_shift
from scripts import null_split

TINY = dict(n_top_genes=300, genes_per_token=16, max_epochs=2, enable_progress_bar=False, seed=0)


def sums_of(levels: np.ndarray, n_cells: np.ndarray, spread: float = 0.5) -> LibrarySums:
    """LibrarySums whose codes hold `n_cells` cells with mean log library `levels` and this sd."""
    sums = LibrarySums(len(levels))
    sums.n_cells[:] = n_cells
    sums.log_library[:] = levels * n_cells
    sums.log_library_squares[:] = n_cells * (np.square(levels) + spread**2 * (n_cells - 1) / np.maximum(n_cells, 1))
    return sums


def test_the_sums_read_the_log_library_of_each_code():
    rows = sp.csr_matrix(np.array([[1.0, 3.0], [0.0, 0.0], [10.0, 0.0], [2.0, 2.0]]))
    sums = LibrarySums(2)
    sums.add(np.array([0, 0, 1, -1]), rows)  # an empty cell and a cell without a batch add nothing
    assert sums.n_cells.tolist() == [1, 1]
    assert sums.log_library == pytest.approx([np.log(4.0), np.log(10.0)])
    assert sums.log_library_squares == pytest.approx([np.log(4.0) ** 2, np.log(10.0) ** 2])


@pytest.mark.parametrize("reference", [None, 1])
def test_a_batch_at_half_the_depth_is_shifted_by_log_2_against_the_reference(reference):
    """Two training batches, one group, the second at half the depth: the average reference lies halfway (each
    moves by log 2 / 2), a reference batch stays where it is and the other moves by all of log 2."""
    depth = library_shift(sums_of(np.array([np.log(2e4), np.log(1e4)]), np.array([300, 300])), 1, 2, reference)
    expected = [-np.log(2) / 2, np.log(2) / 2] if reference is None else [-np.log(2), 0.0]
    assert depth.shift == pytest.approx(expected)


def test_a_batch_rich_in_a_deeper_type_is_not_taken_for_a_deeper_batch():
    """Group 1 holds cells of twice the library; batch 0 has most of its cells there, batch 1 most in group 0, both
    at the same depth within each group: no depth shift. A group only batch 0 holds (group 2) adds nothing."""
    levels = np.log(np.array([[1e4, 2e4, 5e4], [1e4, 2e4, 1.0]])).ravel()  # (batch, group) codes; batch 1 has no
    n_cells = np.array([[50, 250, 40], [250, 50, 0]]).ravel()  # cell in group 2
    depth = library_shift(sums_of(levels, n_cells), 3, 2, None)
    assert depth.shift == pytest.approx([0.0, 0.0], abs=1e-12)
    merged = LibrarySums(2)  # the same cells without their groups: batch 0 looks deeper
    for name in LibrarySums.SUMMED:
        setattr(merged, name, getattr(sums_of(levels, n_cells), name).reshape(2, 3).sum(axis=1))
    assert library_shift(merged, 1, 2, None).shift[0] < -0.2


def test_a_depth_difference_within_its_noise_is_not_applied_and_a_plates_is():
    """The weight of one number per batch: 0 within about 2.6 sampling sds (a random split's), nearly 1 for a
    plate at another depth, 0 for a batch whose depth was not measured."""
    shift = np.array([0.04, -0.07, 0.5, 0.0])
    weight = depth_weights(shift, np.array([0.03, 0.03, 0.03, 0.0]) ** 2)
    assert weight[:2].tolist() == [0.0, 0.0] and 0.99 < weight[2] <= 1.0 and weight[3] == 0.0
    assert 0.0 < depth_weights(np.array([0.12]), np.array([0.03**2]))[0] < 1.0  # 4 sds: partly


@pytest.mark.parametrize("reference", [None, 0])
def test_the_variance_is_that_of_the_reference_less_the_batch(reference):
    """Mean log libraries measured with their sampling noise (three training batches in two groups, one unseen
    batch): the variance of each batch's shift over 100,000 simulated measurements matches library_shift's."""
    rng = np.random.default_rng(0)
    n_cells = np.array([[40, 60], [80, 20], [30, 30], [50, 50]])  # (codes, groups)
    spread = 0.5
    level_sd = spread / np.sqrt(n_cells)
    draws = rng.normal(0.0, level_sd, size=(100_000, *n_cells.shape))
    shifts = []
    for draw in draws[:2000]:  # the formula's shift for each simulated measurement
        shifts.append(library_shift(sums_of(draw.ravel(), n_cells.ravel(), spread), 2, 3, reference).shift)
    expected = library_shift(sums_of(np.zeros(8), n_cells.ravel(), spread), 2, 3, reference).variance
    empirical = np.var(np.array(shifts), axis=0)
    compared = np.arange(4) != (reference if reference is not None else -1)
    assert np.allclose(empirical[compared], expected[compared], rtol=0.1)
    if reference is not None:
        assert expected[reference] == pytest.approx(0.0, abs=1e-15)


@pytest.fixture(scope="module")
def thinned_plate(subset):
    """The real 5-batch subset with one plate (sc_celseq2_5cl_p1) thinned to half its counts (binomially, every
    count): a depth difference and nothing else, and a default model trained on it."""
    rng = np.random.default_rng(0)
    thinned = subset.copy()
    counts = sp.csr_matrix(thinned.X, dtype=np.float32)
    plate = (thinned.obs["batch"].astype(str) == "sc_celseq2_5cl_p1").to_numpy()
    rows = np.repeat(np.arange(counts.shape[0]), np.diff(counts.indptr))
    halved = plate[rows]
    counts.data[halved] = rng.binomial(counts.data[halved].astype(np.int64), 0.5)
    counts.eliminate_zeros()
    thinned.X = counts
    torch.set_num_threads(1)
    return thinned, plate, batchfix.train(thinned, batch_key="batch", label_key="cell_type", **TINY)


@pytest.mark.slow  # trains a model of its own: in the slow run, which CI runs too
def test_a_plate_at_half_the_depth_is_raised_to_the_others(thinned_plate):
    """With depth=keep the thinned plate keeps its half depth; with depth=reference its median library moves to
    within 25 % of the other plates' (same cell lines, the plates' own depths differ too), recorded per batch."""
    thinned, plate, model = thinned_plate
    siblings = thinned.obs["batch"].astype(str).isin(["sc_celseq2_5cl_p2", "sc_celseq2_5cl_p3"]).to_numpy()

    def plate_over_siblings(matrix) -> float:
        library = np.asarray(sp.csr_matrix(matrix).sum(axis=1)).ravel()
        return np.median(library[plate]) / np.median(library[siblings])

    raw = plate_over_siblings(thinned.X)
    kept = batchfix.correct(thinned, model, copy=True, depth="keep")
    moved = batchfix.correct(thinned, model, copy=True, depth="reference")
    assert plate_over_siblings(kept.layers["batchfix_counts"]) == pytest.approx(raw, rel=0.05)
    assert 0.8 <= plate_over_siblings(moved.layers["batchfix_counts"]) <= 1.25, raw
    shifts = moved.uns["batchfix"]["estimates"]["depth_shift"]
    assert shifts["sc_celseq2_5cl_p1"]["log_shift"] > 0.15 and shifts["sc_celseq2_5cl_p1"]["weight"] > 0.95
    assert "depth_shift" not in kept.uns["batchfix"]["estimates"]
    from batchfix.cli.summary import run_summary

    text = run_summary("train", {"depth_shift": shifts}, ".", [])
    applied = shifts["sc_celseq2_5cl_p1"]["log_shift"] * shifts["sc_celseq2_5cl_p1"]["weight"]
    assert f"sc_celseq2_5cl_p1 {applied:+.2f}" in text and "correction.depth" in text


@pytest.mark.slow  # trains a model of its own: in the slow run, which CI runs too
def test_a_random_split_of_one_batch_is_left_as_it_was_with_its_depth_too(subset, bundled_adata):
    """A 50/50 split of one real batch: the pseudo-batches' depths differ by their sampling noise alone, so
    depth=reference changes at most 1 % of the nonzero counts, as depth=keep does."""
    split = null_split.null_split(bundled_adata[:, subset.var_names], "sc_celseq2", [0.5, 0.5], seed=1)
    split.X = sp.csr_matrix(split.X, dtype=np.float32)
    torch.set_num_threads(1)
    model = batchfix.train(split, batch_key="batch", label_key="cell_type", **TINY)
    counts = sp.csr_matrix(batchfix.correct(split, model, copy=True, depth="reference").layers["batchfix_counts"])
    raw = sp.csr_matrix(split.X)
    changed = (counts != raw).multiply(raw > 0).nnz / raw.nnz
    assert changed <= 0.01, changed
