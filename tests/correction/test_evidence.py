"""Evidence-weighted shifts (correction.shrink=evidence, batchfix.correction.evidence): a shift within its own noise
is not applied, a well-measured one passes; on a random split of one real batch the counts stay as they were, and a
gene emptied from a whole batch is not given back to its cells."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch

import batchfix
from batchfix.correction.count_output import CountTables
from batchfix.correction.evidence import ShiftEvidenceSums
from batchfix.data.normalize import log_cp10k
from scripts import donor_biology, null_split

TINY = dict(n_top_genes=300, genes_per_token=16, max_epochs=2, enable_progress_bar=False, seed=0)


def test_a_shift_within_its_noise_gets_no_weight_and_a_measured_one_passes():
    """Three batches of 100 cells over 200 genes, batch 2 the reference (measured on 10^6 counts a gene): batch 0's
    shifts are pure noise around 0 (its mean shift squared matches its variance), batch 1's a real shift of +-1 on
    genes of thousands of counts."""
    rng = np.random.default_rng(0)
    n_genes, n_cells = 200, 100
    sums = ShiftEvidenceSums(3, n_genes)
    counts = np.full(n_genes, 20.0)  # per batch: 20 counts a gene in total
    noise_sd = np.sqrt(1.0 / (counts + 0.5))
    sums.shift[0] = rng.normal(0.0, noise_sd) * n_cells
    sums.counts[0], sums.means[0], sums.mean_squares[0] = counts, counts, counts**2 / n_cells
    sums.shift[1] = rng.choice([-1.0, 1.0], n_genes) * n_cells
    sums.counts[1], sums.means[1], sums.mean_squares[1] = 5000.0, 5000.0, 5000.0**2 / n_cells
    sums.counts[2], sums.means[2], sums.mean_squares[2] = 1e6, 1e6, 1e12 / n_cells
    sums.n_cells[:] = n_cells
    tables = CountTables(theta=np.full((3, n_genes), 10.0), ratio=np.ones((3, n_genes)),
                         reference_ratio=np.ones(n_genes), reference_theta=None)
    present = np.ones(n_genes, dtype=bool)
    present[-1] = False
    weight, prior_sd = sums.weights(tables, present, min_cells=10, reference=2, n_training=3)
    assert prior_sd[0] < 0.1 and weight[0, :-1].max() < 0.3  # noise: (almost) nothing applied
    assert 0.8 < prior_sd[1] < 1.2 and weight[1, :-1].min() > 0.99  # a measured shift passes
    assert (weight[:, -1] == 1.0).all()  # a gene the input lacks: untouched


def test_the_fast_prior_fit_and_median_match_the_log_domain_em_and_bisection():
    """The weights' EM (likelihoods taken once) and posterior median (safeguarded Newton) against the plain forms
    written out here: the responsibilities in logs every step, and 40 bisection steps, on 3,000 genes of shifts
    from pure noise to far beyond it, with variances over four orders of magnitude."""
    from scipy import special

    from batchfix.correction import evidence

    rng = np.random.default_rng(1)
    variance = 10.0 ** rng.uniform(-4, 0, 3000)
    shift = rng.normal(0.0, np.sqrt(variance)) + np.where(rng.random(3000) < 0.3, rng.normal(0.0, 1.0, 3000), 0.0)
    weight, prior_sd = evidence.shrinkage(shift, variance)
    spread = np.sqrt(np.maximum(np.square(shift) - variance, 0.0).max())
    floor = np.sqrt(variance.min()) / 10
    n_grid = int(np.ceil(2 * np.log2(2 * spread / floor))) + 1
    sigma = np.concatenate([[0.0], floor * np.sqrt(2.0) ** np.arange(n_grid)])
    total = sigma**2 + variance[:, None]
    log_likelihood = -0.5 * (np.log(2 * np.pi * total) + np.square(shift)[:, None] / total)
    mix = np.full(len(sigma), 1.0 / len(sigma))
    for _ in range(evidence.EM_STEPS):
        mix = evidence.responsibilities(log_likelihood, mix).mean(axis=0)
    assert np.allclose(evidence.mixture_weights(log_likelihood, evidence.EM_STEPS), mix, rtol=1e-9, atol=0)
    posterior, share = evidence.responsibilities(log_likelihood, mix), sigma**2 / total
    size = np.abs(shift)
    mean, sd = share[:, 1:] * size[:, None], np.sqrt(share[:, 1:] * variance[:, None])
    low, high = np.zeros_like(size), size.copy()
    for _ in range(40):
        middle = (low + high) / 2
        above = posterior[:, 0] + (posterior[:, 1:] * special.ndtr((middle[:, None] - mean) / sd)).sum(axis=1) < 0.5
        low, high = np.where(above, middle, low), np.where(above, high, middle)
    searched = posterior[:, 0] + (posterior[:, 1:] * special.ndtr(-mean / sd)).sum(axis=1) < 0.5
    bisected = np.where(searched, (low + high) / 2, 0.0) / size
    assert ((weight == 0) == ~searched).all() and 0.2 < searched.mean() < 0.9
    assert np.abs(weight - bisected).max() < 1e-9 and prior_sd == pytest.approx(np.sqrt((mix * sigma**2).sum()))


@pytest.mark.parametrize("reference", [None, 1])
def test_shift_variance_is_the_variance_of_the_reference_less_the_batch(reference):
    """Levels measured with known variances (three training batches, the first without input cells: its level is
    taken as known; one unseen batch): the variance of each shift from the reference over 200,000 simulated
    measurements matches shift_variance, for the average reference and a reference batch."""
    rng = np.random.default_rng(1)
    level_variance = np.array([[0.5], [0.2], [0.05], [0.3]])  # (codes, 1): training 0-2, unseen 3
    sums = ShiftEvidenceSums(4, 1)
    sums.n_cells[:] = [0, 50, 50, 50]
    members = np.ones((3, 1), dtype=bool)
    measured = np.sqrt(level_variance[:, 0]) * (sums.n_cells > 0)
    levels = rng.normal(0.0, measured, size=(200_000, 4))
    weights = np.array([1 / 3, 1 / 3, 1 / 3, 0.0]) if reference is None else np.eye(4)[reference]
    shifts = (levels @ weights)[:, None] - levels  # (draws, codes)
    expected = sums.shift_variance(level_variance, reference, members)[:, 0]
    empirical = shifts.var(axis=0)
    compared = (sums.n_cells > 0) & (np.arange(4) != reference)  # shifts of batches with cells, not the reference's
    assert np.allclose(empirical[compared], expected[compared], rtol=0.02)
    if reference is None:  # two measured members of three: each holds 1/3 of its own level
        assert expected[1] == pytest.approx(0.2 * (1 - 2 / 3) + (0.2 + 0.05) / 9)


@pytest.fixture(scope="module")
def null_set(bundled_adata, subset):
    """A random 50/50 split of the bundled batch sc_celseq2 (240 cells, the subset's 600 genes): nothing to
    correct."""
    split = null_split.null_split(bundled_adata[:, subset.var_names], "sc_celseq2", [0.5, 0.5], seed=0)
    split.X = sp.csr_matrix(split.X, dtype=np.float32)
    torch.set_num_threads(1)
    return split, batchfix.train(split, batch_key="batch", label_key="cell_type", **TINY)


def changed_share(raw, corrected) -> tuple[float, float]:
    """(share of nonzero raw counts changed, share of raw zeros made positive)."""
    raw, corrected = sp.csr_matrix(raw), sp.csr_matrix(corrected)
    changed = (corrected != raw).multiply(raw > 0).nnz / raw.nnz
    positive = corrected > 0
    raised = (positive.nnz - positive.multiply(raw > 0).nnz) / (np.prod(raw.shape) - raw.nnz)
    return changed, raised


def test_a_random_split_of_one_batch_is_left_as_it_was(null_set):
    split, model = null_set
    out = batchfix.correct(split, model, copy=True)
    changed, raised = changed_share(split.X, out.layers["batchfix_counts"])
    assert changed <= 0.01 and raised <= 0.001, (changed, raised)
    evidence = out.uns["batchfix"]["estimates"]["shift_evidence"]
    assert set(evidence) == {"sc_celseq2_a", "sc_celseq2_b"}
    assert all(entry["median_weight"] < 0.5 for entry in evidence.values())
    # every shift applied in full moves counts that nothing calls for
    full = batchfix.correct(split, model, copy=True, shrink="none")
    assert changed_share(split.X, full.layers["batchfix_counts"])[0] > 0.02


@pytest.fixture(scope="module")
def donor_set(subset):
    """The real 5-batch subset with genes of several detection levels emptied in every cell of one batch."""
    donor = donor_biology.build(subset, "sc_celseq2_5cl_p1", seed=0)
    donor.X = sp.csr_matrix(donor.X, dtype=np.float32)
    torch.set_num_threads(1)
    return donor, batchfix.train(donor, batch_key="batch", label_key="cell_type", **{**TINY, "n_top_genes": 200})


def test_a_gene_emptied_from_a_whole_batch_is_neither_given_back_nor_taken_from_the_others(donor_set):
    """The emptied batch's cells get none of the genes (<= 5 %), the other batches keep >= 0.8 of their
    expressing cells; with every shift applied in full, both fail."""
    donor, model = donor_set
    genes = list(donor.uns["donor_biology"]["genes"])
    emptied = (donor.obs["batch"].astype(str) == "sc_celseq2_5cl_p1").to_numpy()
    columns = donor.var_names.get_indexer(genes)
    raw = sp.csr_matrix(donor.X)[:, columns].toarray() > 0
    for shrink in ("evidence", "none"):
        counts = batchfix.correct(donor, model, copy=True, shrink=shrink).layers["batchfix_counts"]
        expressed = sp.csr_matrix(counts)[:, columns].toarray() > 0
        given = expressed[emptied].mean(axis=0)
        kept = expressed[~emptied].mean(axis=0) / raw[~emptied].mean(axis=0)
        if shrink == "evidence":
            assert given.max() <= 0.05 and kept.min() >= 0.8, (dict(zip(genes, given.round(3))), kept.round(3))
        else:
            assert given.max() > 0.05 or kept.min() < 0.8


def test_a_batch_without_a_gene_is_out_of_its_reference_so_the_others_keep_their_level(donor_set):
    """The emptied batch is left out of each emptied gene's average reference, the decoder's average included: the
    other batches' corrected counts of those genes keep their raw total (within 15 %; measured 0.94); with it in
    the decoder's average they kept 0.55 of it on this model."""
    from unittest import mock

    from batchfix.correction import estimates

    donor, model = donor_set
    columns = donor.var_names.get_indexer(list(donor.uns["donor_biology"]["genes"]))
    others = (donor.obs["batch"].astype(str) != "sc_celseq2_5cl_p1").to_numpy()
    raw = sp.csr_matrix(donor.X)[others][:, columns].sum()
    levels = {}
    for name, absence in (("out", True), ("in", False)):
        with mock.patch.object(estimates, "detects_absence", lambda bound: absence and bound.reference is None):
            counts = batchfix.correct(donor, model, copy=True).layers["batchfix_counts"]
        levels[name] = sp.csr_matrix(counts)[others][:, columns].sum() / raw
    assert 0.85 <= levels["out"] <= 1.15 and levels["in"] < levels["out"], levels


def test_the_weights_reach_the_file_and_the_run_summary(null_set, tmp_path):
    from batchfix.cli.summary import run_summary
    from batchfix.config import ResolvedCorrection
    from batchfix.correction.writers import correct_file
    from batchfix.tasks.training import estimate_entries

    split, model = null_set
    split.write_h5ad(tmp_path / "split.h5ad")
    correct_file(tmp_path / "split.h5ad", tmp_path / "out.h5ad", model, ResolvedCorrection(), progress=False)
    evidence = estimate_entries(tmp_path / "out.h5ad", "batchfix")["shift_evidence"]
    assert set(evidence) == {"sc_celseq2_a", "sc_celseq2_b"}
    text = run_summary("train", {"shift_evidence": evidence}, tmp_path, [])
    line = next(line for line in text.splitlines() if "shifts weighted by their evidence (correction.shrink)" in line)
    median = float(line.split("median weight sc_celseq2_a ")[1].split(",")[0])
    assert median == pytest.approx(evidence["sc_celseq2_a"]["median_weight"], abs=0.005) and median < 0.1


def test_the_log_scale_output_of_a_random_split_moves_less_than_every_change_applied(null_set):
    """The log-scale model's output is weighted alike: on the null split (log1p values per 10k), the default
    changes the values far less than every change applied in full, and records its weights (by batch alone) and
    its state groups (the state shrink's means)."""
    split, _ = null_set
    log_split = split.copy()
    log_split.X = sp.csr_matrix(np.asarray(log_cp10k(split.X.toarray()), dtype=np.float32))
    torch.set_num_threads(1)
    model = batchfix.train(log_split, batch_key="batch", label_key="cell_type", scale="log", **TINY)
    raw = log_split.X.toarray()
    nonzero = raw > 0
    moved, outputs = {}, {}
    for shrink in ("evidence", "none"):
        out = outputs[shrink] = batchfix.correct(log_split, model, copy=True, shrink=shrink)
        corrected = out.layers["batchfix"].toarray()[:, out.var["batchfix_modelled"].to_numpy()]
        modelled = raw[:, out.var["batchfix_modelled"].to_numpy()]
        assert (corrected[modelled == 0] == 0).all()  # an input zero stays zero
        moved[shrink] = np.abs(corrected - modelled)[modelled > 0].mean()
    assert nonzero.any() and moved["evidence"] < 0.5 * moved["none"], moved
    estimates = outputs["evidence"].uns["batchfix"]["estimates"]
    assert set(estimates["shift_evidence"]) == {"sc_celseq2_a", "sc_celseq2_b"}
    assert estimates["state_groups"] >= 2  # the state shrink's means by state group
    assert all("share_raised_in_state_groups" not in entry for entry in estimates["shift_evidence"].values())
    assert "shift_evidence" not in outputs["none"].uns["batchfix"]["estimates"]


@pytest.fixture(scope="module")
def ambient_donor_set(bundled_adata, subset):
    """The donor set of the subset's cells and genes and XIST, with ambient counts: 2 % of the emptied batch's cells
    (at least one) keep one count of each emptied gene."""
    xist = bundled_adata.var_names[bundled_adata.var["gene_symbol"].astype(str).to_numpy() == "XIST"]
    cells = bundled_adata[subset.obs_names][:, subset.var_names.append(xist)].copy()
    cells.X = np.asarray(sp.csr_matrix(cells.X).toarray(), dtype=np.float32)
    donor = donor_biology.build(cells, "sc_celseq2_5cl_p1", seed=0, ambient=0.02)
    donor.X = sp.csr_matrix(donor.X, dtype=np.float32)
    torch.set_num_threads(1)
    return donor, batchfix.train(donor, batch_key="batch", label_key="cell_type", **{**TINY, "n_top_genes": 200})


def test_a_sex_linked_gene_a_batch_holds_at_an_ambient_level_is_not_given_to_it(ambient_donor_set):
    """XIST emptied from one batch but for one count in 2 % of its cells (a donor of the other sex beside ambient
    RNA): the batch's cells get it no more than they had it (<= 5 %) and the others keep >= 0.8 of theirs; judged by
    its counts alone (no sex-linked rule) the few counts measure a shift far beyond its noise and the batch gets it."""
    from unittest import mock

    from batchfix.correction import lacking_genes

    donor, model = ambient_donor_set
    manifest = donor.uns["donor_biology"]
    xist = donor.var_names.get_loc(list(manifest["genes"])[list(manifest["levels"]).index("sex chromosome")])
    emptied = (donor.obs["batch"].astype(str) == "sc_celseq2_5cl_p1").to_numpy()
    raw = sp.csr_matrix(donor.X)[:, xist].toarray().ravel() > 0
    assert 0 < raw[emptied].mean() <= 0.03
    shares = {}
    lacked = {}
    for rule in (True, False):
        with mock.patch.object(lacking_genes, "AMBIENT_SHARE", 0.1 if rule else 0.0):
            out = batchfix.correct(donor, model, copy=True)
        expressed = sp.csr_matrix(out.layers["batchfix_counts"])[:, xist].toarray().ravel() > 0
        shares[rule] = (expressed[emptied].mean(), expressed[~emptied].mean() / raw[~emptied].mean())
        lacked[rule] = out.uns["batchfix"]["estimates"]["shift_evidence"]["sc_celseq2_5cl_p1"]["genes_lacked"]
    assert shares[True][0] <= 0.05 and shares[True][1] >= 0.8, shares
    assert shares[False][0] > 0.05, shares
    assert lacked[True] == lacked[False] + 1, lacked  # XIST, beside the genes of no count
    from batchfix.cli.summary import run_summary
    evidence = out.uns["batchfix"]["estimates"]["shift_evidence"]
    text = run_summary("correct", {"shift_evidence": evidence}, ".", [])  # the last correction's: without the rule
    assert "lacks as biology (no count in any cell, or chrY / XIST at an ambient level), kept as they are" in text
    assert f"sc_celseq2_5cl_p1 {lacked[False]}," in text, text


def test_the_sex_linked_sets_are_found_by_chromosome_and_name_and_judged_by_their_share():
    """chrY genes (placed by the genome table) and XIST (by symbol) form the two sets; a batch holding a set at
    under a tenth of the most expressing batch's share lacks all of it, a batch at half (donors of both sexes) and a
    batch of too few cells do not."""
    from batchfix.correction.lacking_genes import lacking_sex_linked, sex_linked_sets

    var = pd.DataFrame({"gene_symbol": ["RPS4Y1", "DDX3Y", "XIST", "ACTB", "GAPDH"]},
                       index=["ENSG00000129824", "ENSG00000067048", "ENSG00000229807", "ENSG00000075624", "G5"])
    sets = sex_linked_sets(var, "GRCh38")
    assert [list(columns) for columns in sets] == [[0, 1], [2]]
    counts = np.array([[40.0, 20, 0, 5000, 3000],   # male: chrY, no XIST
                       [1.0, 0, 30, 5000, 3000],    # female: an ambient chrY count
                       [20.0, 10, 15, 5000, 3000],  # both sexes
                       [0.0, 0, 0, 50, 30]])        # too few cells to judge
    lacking = lacking_sex_linked(counts, np.array([100, 100, 100, 5]), sets, min_cells=20)
    assert lacking.tolist() == [[False, False, True, False, False], [True, True, False, False, False],
                                [False] * 5, [False] * 5]


@pytest.mark.parametrize("genome, par_start", [("GRCh38", 2_691_133), ("GRCh38", 56_900_000), ("mm10", 90_784_738)])
def test_a_pseudoautosomal_gene_placed_on_chry_is_not_the_donors_sex(genome, par_start):
    """An annotation that places a pseudoautosomal gene (CD99 here, expressed from X and Y in both sexes) on chrY
    (the input's own coordinates) leaves it out of the chrY set: a female batch's ambient chrY counts still make
    her lack the set, where the gene's counts on both sexes would have hidden them."""
    from batchfix.correction.lacking_genes import lacking_sex_linked, sex_linked_sets

    var = pd.DataFrame({"chromosome": ["Y", "Y", "Y", "7"], "start": [2_841_486, 12_904_108, par_start, 5_527_148],
                        "end": [2_932_000, 12_920_478, par_start + 50_000, 5_563_902]},
                       index=["RPS4Y1", "DDX3Y", "CD99", "ACTB"])
    sets = sex_linked_sets(var, genome)
    assert [list(columns) for columns in sets] == [[0, 1]]
    counts = np.array([[40.0, 20, 900, 5000],   # male
                       [1.0, 0, 900, 5000]])    # female: an ambient chrY count, CD99 as the male's
    lacking = lacking_sex_linked(counts, np.array([100, 100]), sets, min_cells=20)
    assert lacking.tolist() == [[False] * 4, [True, True, False, False]]
    with_par = lacking_sex_linked(counts, np.array([100, 100]), [np.array([0, 1, 2])], min_cells=20)
    assert not with_par.any()  # the failure the regions prevent: CD99 makes her chrY share the male's


def test_a_reference_batch_without_a_gene_takes_it_from_no_other_batch(donor_set):
    """Every cell expressed as the batch that lacks the genes (correction.reference): the other batches are not
    shifted toward its absence (they keep >= 0.8 of their expressing cells of those genes), and it is given none."""
    donor, model = donor_set
    columns = donor.var_names.get_indexer(list(donor.uns["donor_biology"]["genes"]))
    emptied = (donor.obs["batch"].astype(str) == "sc_celseq2_5cl_p1").to_numpy()
    raw = sp.csr_matrix(donor.X)[:, columns].toarray() > 0
    counts = batchfix.correct(donor, model, copy=True, reference="sc_celseq2_5cl_p1").layers["batchfix_counts"]
    expressed = sp.csr_matrix(counts)[:, columns].toarray() > 0
    kept = expressed[~emptied].mean(axis=0) / raw[~emptied].mean(axis=0)
    assert expressed[emptied].mean(axis=0).max() <= 0.05 and kept.min() >= 0.8, kept.round(3)


@pytest.mark.slow  # a log-scale model trained (15 s): CI's slow step
def test_the_log_scale_output_keeps_a_gene_a_batch_lacks_to_the_batches_that_have_it(donor_set):
    """The log-scale model's output alike: the emptied batch is out of each emptied gene's average reference, so
    the other batches keep their level of it (within 15 %; measured 0.93); with it in the average they keep less
    (0.88: the evidence weights pass part of that pull); a reference batch that lacks the genes leaves every
    batch's values of them as they were (it pulled them to 0.11-0.24 of their level on a default model)."""
    from unittest import mock

    from batchfix.correction import estimates

    donor, _ = donor_set
    log_donor = donor.copy()
    log_donor.X = sp.csr_matrix(np.asarray(log_cp10k(donor.X.toarray()), dtype=np.float32))
    torch.set_num_threads(1)
    model = batchfix.train(log_donor, batch_key="batch", label_key="cell_type", scale="log",
                           **{**TINY, "n_top_genes": 200})
    modelled = set(model.genes)
    genes = [g for g in donor.uns["donor_biology"]["genes"] if g in modelled]
    columns = donor.var_names.get_indexer(genes)
    others = (donor.obs["batch"].astype(str) != "sc_celseq2_5cl_p1").to_numpy()
    raw = log_donor.X[:, columns].toarray()
    levels = {}
    for name, absence in (("out", True), ("in", False)):
        with mock.patch.object(estimates, "detects_absence", lambda bound: absence and bound.reference is None):
            values = batchfix.correct(log_donor, model, copy=True).layers["batchfix"][:, columns].toarray()
        assert (values[~others] == 0).all()
        levels[name] = values[others].sum() / raw[others].sum()
    assert genes and 0.85 <= levels["out"] <= 1.15 and levels["in"] < levels["out"], (genes, levels)
    named = batchfix.correct(log_donor, model, copy=True, reference="sc_celseq2_5cl_p1").layers["batchfix"]
    assert np.array_equal(named[:, columns].toarray(), raw)
