"""The corrected counts (batchfix.correction.counts and the counts output): the quantile mapping against scipy's
negative binomial, its draws, the per-batch dispersions, and the layers a real trained model writes."""
from __future__ import annotations

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy import stats

from batchfix.correction import counts
from batchfix.data.normalize import log_cp10k

RNG = np.random.default_rng(0)


def nb_sample(mean: np.ndarray, theta: np.ndarray, seed: int = 1) -> np.ndarray:
    return stats.nbinom(theta, theta / (theta + mean)).rvs(random_state=seed).astype(np.float64)


@pytest.fixture(scope="module")
def mapped():
    """200,000 NB counts mapped to shifted means and other dispersions."""
    n = 200_000
    own_mean, own_theta = RNG.gamma(0.5, 4.0, n), RNG.uniform(0.3, 8.0, n)
    ref_mean, ref_theta = own_mean * np.exp(RNG.normal(0.0, 0.7, n)), RNG.uniform(0.3, 8.0, n)
    y = nb_sample(own_mean, own_theta)
    u = counts.counter_uniform(3, np.arange(n, dtype=np.uint64), np.array([7], dtype=np.uint64))[:, 0]
    out = counts.quantile_map(y, own_mean, ref_mean, own_theta, ref_theta, u)
    return dict(y=y, own_mean=own_mean, own_theta=own_theta, ref_mean=ref_mean, ref_theta=ref_theta, u=u, out=out)


def test_each_count_goes_to_scipys_quantile_of_the_reference(mapped):
    """The mapped count is scipy's inverse of the reference NB at the randomised PIT of the observed count."""
    m = mapped
    own = stats.nbinom(m["own_theta"], m["own_theta"] / (m["own_theta"] + m["own_mean"]))
    ref = stats.nbinom(m["ref_theta"], m["ref_theta"] / (m["ref_theta"] + m["ref_mean"]))
    low = np.where(m["y"] > 0, own.cdf(m["y"] - 1), 0.0)
    expected = ref.ppf(low + m["u"] * (own.cdf(m["y"]) - low))
    np.testing.assert_array_equal(m["out"], expected)
    assert (m["out"] == np.round(m["out"])).all() and (m["out"] >= 0).all()


def test_mapped_counts_follow_the_reference_distribution(mapped):
    m = mapped
    ref_zero = np.power(m["ref_theta"] / (m["ref_theta"] + m["ref_mean"]), m["ref_theta"])
    assert abs((m["out"] == 0).mean() - ref_zero.mean()) < 0.005
    assert abs(m["out"].mean() / m["ref_mean"].mean() - 1) < 0.02


def test_same_distribution_is_the_identity_and_zeros_stay_where_the_reference_expects_fewer_counts(mapped):
    m = mapped
    same = counts.quantile_map(m["y"], m["own_mean"], m["own_mean"], m["own_theta"], m["own_theta"], m["u"])
    np.testing.assert_array_equal(same, m["y"])
    lower = counts.quantile_map(m["y"], m["own_mean"], m["own_mean"] / 2, m["own_theta"], m["own_theta"], m["u"])
    assert not lower[m["y"] == 0].any(), "a zero became positive where the reference expects the gene less"


def test_the_pmf_walk_gives_scipys_tails_and_quantiles():
    """The small-count path (walk_tails, walk_quantile) against scipy's cdf, pmf and ppf."""
    n = 50_000
    mean, theta = RNG.gamma(0.5, 6.0, n), RNG.uniform(0.2, 20.0, n)
    p, q = theta / (theta + mean), mean / (theta + mean)
    y = np.minimum(nb_sample(mean, theta, seed=5), counts.WALK_STEPS)
    nb = stats.nbinom(theta, p)
    below, mass = counts.walk_tails(y, theta, p, q)
    np.testing.assert_allclose(below, np.where(y > 0, nb.cdf(y - 1), 0.0), rtol=1e-10, atol=1e-300)
    np.testing.assert_allclose(mass, nb.pmf(y), rtol=1e-10, atol=1e-300)
    target = RNG.uniform(0.0, 0.999, n)
    walked = counts.walk_quantile(target, theta, p, q)
    reached = ~np.isnan(walked)
    assert reached.mean() > 0.95
    quantiles = nb.ppf(target)
    np.testing.assert_array_equal(walked[reached], quantiles[reached])
    assert (quantiles[~reached] > counts.WALK_STEPS).all()


def test_large_counts_keep_their_quantile_through_the_survival_function():
    """Counts far in the upper tail (1 - F rounds to 0 in float64 there) still move by the mean's ratio."""
    y = np.array([100_000.0, 50_000.0, 2_000.0])
    out = counts.quantile_map(y, y, 2 * y, np.full(3, 10.0), np.full(3, 10.0), np.array([0.3, 0.5, 0.999]))
    np.testing.assert_allclose(out / (2 * y), 1.0, rtol=0.05)


def scipy_quantile_map(y, own_mean, ref_mean, own_theta, ref_theta, u):
    """(the map by scipy's nbinom cdf, sf, pmf, ppf and isf, its target): the float64 route's definition."""
    own = stats.nbinom(own_theta, own_theta / (own_theta + own_mean))
    ref = stats.nbinom(ref_theta, ref_theta / (ref_theta + ref_mean))
    low = np.where(y > 0, own.cdf(y - 1), 0.0)
    survival = low > 0.5
    target = np.where(survival, own.sf(y) + (1 - u) * own.pmf(y), low + u * own.pmf(y))
    with np.errstate(invalid="ignore"):
        mapped = np.where(survival, ref.isf(target), ref.ppf(target))
    moved = (y > 0) | (u * own.pmf(0) > ref.pmf(0))
    return np.where(moved, mapped, 0.0), np.where(moved, target, 1.0)


def test_counts_whose_target_does_not_underflow_keep_scipys_quantile():
    """On a grid like the bundled data's (means 1e-3..50, thetas 0.05..50, one count in 50 an outlier up to 1e4
    times its mean), every count whose target is a normal float64 maps to scipy's inverse, entry by entry: the
    log-space route takes only the others."""
    rng = np.random.default_rng(11)
    n = 100_000
    own_mean, own_theta = np.exp(rng.uniform(np.log(1e-3), np.log(50), n)), np.exp(rng.uniform(np.log(0.05), 4, n))
    ref_mean = own_mean * np.exp(rng.normal(0.0, 0.7, n))
    ref_theta = np.where(rng.random(n) < 0.5, own_theta, np.exp(rng.uniform(np.log(0.05), 4, n)))
    y = nb_sample(own_mean, own_theta, seed=4)
    y[::50] = np.round(own_mean[::50] * 10 ** rng.uniform(0, 4, len(y[::50])))
    u = np.where(y == 0, rng.random(n), 0.5)
    out = counts.quantile_map(y, own_mean, ref_mean, own_theta, ref_theta, u)
    expected, target = scipy_quantile_map(y, own_mean, ref_mean, own_theta, ref_theta, u)
    normal = target >= np.finfo(np.float64).tiny
    assert normal.mean() > 0.99 and (~normal).sum() > 100, "the grid reaches the far tails, not only them"
    np.testing.assert_array_equal(out[normal], expected[normal])
    assert np.isfinite(out).all() and (out >= 0).all() and (out == np.round(out)).all()


def mp_upper_tail(k, theta, mean):
    import mpmath

    return mpmath.betainc(k + 1, theta, 0, mpmath.mpf(mean) / (mpmath.mpf(theta) + mpmath.mpf(mean)), regularized=True)


def test_far_tail_counts_go_to_the_exact_quantile():
    """Counts whose tail underflows float64 (S ~ 1e-70 to 1e-90000) map to the smallest k with S_ref(k) <= the
    target, checked in 40-digit arithmetic (mpmath), not just near it."""
    import mpmath

    mpmath.mp.dps = 40
    rng = np.random.default_rng(1)
    for _ in range(8):
        mean, theta = 10 ** rng.uniform(-2, 0), 10 ** rng.uniform(-1, 1)
        ref_mean, ref_theta = mean * 2 ** rng.uniform(-1, 1), theta * 2 ** rng.uniform(-1, 1)
        y = float(round(mean * 10 ** rng.uniform(3, 5.5)))
        out = counts.quantile_map(np.array([y]), np.array([mean]), np.array([ref_mean]), np.array([theta]),
                                  np.array([ref_theta]), np.array([0.5]))[0]
        p, q = mpmath.mpf(theta) / (theta + mpmath.mpf(mean)), mpmath.mpf(mean) / (theta + mpmath.mpf(mean))
        log_mass = mpmath.loggamma(y + theta) - mpmath.loggamma(theta) - mpmath.loggamma(y + 1)
        mass = mpmath.exp(log_mass) * p ** theta * q ** y
        target = mp_upper_tail(int(y), theta, mean) + mass / 2
        k = int(out)
        assert out == k and mp_upper_tail(k, ref_theta, ref_mean) <= target < mp_upper_tail(k - 1, ref_theta, ref_mean)


@pytest.mark.parametrize("own_mean", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("theta", [0.1, 1.0, 10.0])
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_outlier_counts_map_to_finite_counts_along_the_tails_asymptote(own_mean, theta, factor):
    """y = 10 ... 1e6 (a lowly expressed gene's typical nonzero count is 1) map to finite integers, monotone in y.

    Far out log S(k) = k log q + (theta - 1) log k + c (q = mean / (theta + mean)), so the same quantile of the
    reference is k ~ y log q_b / log q_ref: y times the means' ratio only where mean >> theta (log q ~ -theta / mean);
    for mean << theta it is nearer y (1.11 y for a ratio of 2 at mean 0.01, theta 10). The constant and the
    logarithm shift k by at most (|c_b - c_ref| + |theta - 1| |log(k / y)|) / |log q_ref| counts: below 1% of k
    from y = 1e4 on over this grid (the bound is evaluated, plus one count for the rounding)."""
    y = np.array([10.0, 100.0, 1e3, 1e4, 1e5, 1e6])
    ref_mean = own_mean * factor
    n = len(y)
    out = counts.quantile_map(y, np.full(n, own_mean), np.full(n, ref_mean), np.full(n, theta), np.full(n, theta),
                              np.full(n, 0.5))
    assert np.isfinite(out).all() and (out >= 0).all() and (out == np.round(out)).all()
    assert (np.diff(out) > 0).all(), "monotone in the observed count"
    p, q = theta / (theta + own_mean), own_mean / (theta + own_mean)
    ref_p, ref_q = theta / (theta + ref_mean), ref_mean / (theta + ref_mean)
    asymptote = y * np.log(q) / np.log(ref_q)
    constants = abs(theta * np.log(p / ref_p) - np.log((1 - q) / (1 - ref_q)))
    bound = (constants + abs(theta - 1) * abs(np.log(out / y)) + 2.0) / abs(np.log(ref_q)) + 1.0
    assert (np.abs(out - asymptote) <= bound).all()
    far = y >= 1e4
    assert (np.abs(out[far] / asymptote[far] - 1) < 0.01).all()
    if own_mean >= 10 * theta:  # the gamma limit: the means' ratio
        np.testing.assert_allclose(out[far] / y[far], factor, rtol=0.05)


def test_counts_beyond_float32_are_clipped_and_a_corrupt_librarys_counts_stay_counts():
    """3e38 (what float32 can hold, and more once moved up) maps to at most float32's largest value; the small
    counts of a cell whose library such a count made 1e30 x its genes' fractions (lower tails of 1e-1000) map to
    finite counts >= 0 (they were -1: scipy's ppf(0))."""
    largest = float(np.finfo(np.float32).max)
    y = np.array([3e38, 3e38, 3e38, 1.0, 5.0, 1000.0])
    own_mean, theta = np.array([0.05, 1.0, 1e36, 1e30, 1e30, 1e30]), np.array([50.0, 0.1, 50.0, 50.0, 50.0, 50.0])
    out = counts.quantile_map(y, own_mean, own_mean * 2, theta, theta, np.full(6, 0.5))
    assert np.isfinite(out).all() and (out >= 0).all() and (out == np.round(out)).all()
    q, ref_q = own_mean[0] / (theta[0] + own_mean[0]), 2 * own_mean[0] / (theta[0] + 2 * own_mean[0])
    np.testing.assert_allclose(out[0], y[0] * np.log(q) / np.log(ref_q), rtol=1e-6)  # 3.33e38: held
    np.testing.assert_array_equal(out[1:3], largest)  # 5.8e38 and 6e38: clipped
    assert np.isfinite(out.astype(np.float32)).all()
    assert (np.diff(out[3:]) > 0).all()


def test_draws_depend_on_seed_cell_and_gene_alone():
    cells, genes = counts.name_keys([f"cell{i}" for i in range(6)]), counts.name_keys(["CD3E", "MS4A1", "LYZ"])
    full = counts.counter_uniform(0, cells, genes)
    np.testing.assert_array_equal(counts.counter_uniform(0, cells[[4, 1]], genes[[2, 0]]), full[[4, 1]][:, [2, 0]])
    assert not np.array_equal(counts.counter_uniform(1, cells, genes), full)
    assert ((full > 0) & (full < 1)).all()


def test_a_batchs_dispersion_is_estimated_on_many_cells_and_shrunk_on_few():
    mean = RNG.gamma(2.0, 3.0, (5000, 4))
    theta = np.array([0.5, 2.0, 8.0, 30.0])
    sums = counts.DispersionSums(4)
    sums.add(nb_sample(mean, np.broadcast_to(theta, mean.shape), seed=2), mean)
    np.testing.assert_allclose(sums.theta(np.full(4, 1.0)), theta, rtol=0.25)
    few = counts.DispersionSums(4)
    few.add(nb_sample(mean[:3], np.broadcast_to(theta, (3, 4)), seed=3), mean[:3])
    shrunk = few.theta(np.full(4, 1.0))
    assert (np.abs(np.log(shrunk)) < np.abs(np.log(theta))).all(), "three cells pull theta toward the shared one"


# --------------------------------------------------------------------------------------------
# The layers a real trained model writes (the tiny model of tests/correction/test_correct.py's trained_run)


@pytest.fixture(scope="module")
def trained(subset, tmp_path_factory):
    """A 1-epoch model on the real subset, with the extra genes' decoder; and the file it corrects."""
    import batchfix

    torch.set_num_threads(1)
    model = batchfix.train(subset, n_top_genes=200, genes_per_token=16, max_epochs=1, enable_progress_bar=False,
                           threads=1)
    path = tmp_path_factory.mktemp("counts") / "input.h5ad"
    subset.write_h5ad(path)
    return model, path


def test_counts_layer_log_layer_and_flags_of_a_real_correction(trained, subset, tmp_path, caplog):
    """... and an option the counts do not read, given, is warned about with the output that reads it."""
    import batchfix

    model, _ = trained
    with caplog.at_level("WARNING", logger="batchfix"):
        out = batchfix.correct(subset, model, copy=True, residual_weight=0.5)
    assert ("correction.residual_weight=0.5 does nothing on the corrected counts (a counts model's counterfactual "
            "output): a count is mapped whole, not as a location and a residual. It is read by a log-scale model's "
            "counterfactual output (data.scale=log).") in caplog.text
    counts_layer, log_layer = out.layers["batchfix_counts"], out.layers["batchfix"]
    assert sp.issparse(counts_layer) and (counts_layer.data == np.round(counts_layer.data)).all()
    np.testing.assert_allclose(log_layer.toarray(), log_cp10k(counts_layer).toarray(), rtol=1e-6, atol=1e-6)
    corrected = out.var["batchfix_corrected"].to_numpy()
    detected = np.asarray((subset.X > 0).sum(axis=0)).ravel()
    assert corrected[detected >= 3].all(), "every gene detected in 3 training cells is corrected"
    raw = sp.csr_matrix(subset.X)
    assert (counts_layer[:, ~corrected] != raw[:, ~corrected]).nnz == 0, "the others keep their counts"
    empty_in_both = np.flatnonzero(detected == 0)
    assert not counts_layer[:, empty_in_both].nnz, "a gene without counts gets none"
    info = out.uns["batchfix"]
    assert info["n_corrected_genes"] == corrected.sum() and 0 <= info["n_zeros_made_positive"] <= info[
        "n_observed_zeros"]
    assert set(info["options_not_applied"]) == {"residual_weight"} and "residual_weight" not in info["params"]


def test_streamed_in_memory_repeated_and_reordered_runs_give_the_same_counts(trained, subset, tmp_path):
    import batchfix
    from batchfix.config import ResolvedCorrection
    from batchfix.correction.writers import correct_file

    model, path = trained
    in_memory = batchfix.correct(subset, model, copy=True).layers["batchfix_counts"]
    streamed = ad.read_h5ad(correct_file(path, tmp_path / "out.h5ad", model, ResolvedCorrection(chunk_size=37),
                                         progress=False)).layers["batchfix_counts"]
    assert (streamed != in_memory).nnz == 0
    order = np.random.default_rng(5).permutation(subset.n_obs)
    shuffled = batchfix.correct(subset[order].copy(), model, copy=True).layers["batchfix_counts"]
    assert (shuffled != in_memory[order]).nnz == 0


def test_a_checkpoint_keeping_its_calibration_tables_on_the_network_loads_them(trained, subset, tmp_path):
    """Checkpoints written before the tables left the network hold them as `net.count_theta`, ...: they load into the
    model's tables, and correct bit for bit as the same model saved now."""
    import batchfix
    from batchfix.training.tables import TABLES

    model, _ = trained
    path = model.save(tmp_path / "model.ckpt")
    state = torch.load(path, weights_only=True)
    state["state_dict"] = {(f"net.{k[len('tables.'):]}" if k.startswith("tables.") else k): v
                           for k, v in state["state_dict"].items()}
    assert sum(k.startswith("net.") and k[4:] in TABLES for k in state["state_dict"]) == 8  # extra genes' two too
    torch.save(state, tmp_path / "earlier.ckpt")
    earlier = batchfix.BatchfixModel.load(tmp_path / "earlier.ckpt")
    for name in TABLES:
        assert torch.equal(getattr(earlier.tables, name), getattr(model.tables, name)), name
    ours, theirs = (batchfix.correct(subset, m, copy=True).layers["batchfix_counts"] for m in (model, earlier))
    assert (ours != theirs).nnz == 0


def test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line(trained, tmp_path):
    from batchfix.errors import CheckpointFormatError
    from batchfix.training.trained import load_trained

    model, _ = trained
    path = model.save(tmp_path / "model.ckpt")
    state = torch.load(path, weights_only=True)
    state["state_dict"] = {k: v for k, v in state["state_dict"].items() if not k.endswith("count_theta")}
    torch.save(state, tmp_path / "old.ckpt")
    with pytest.raises(CheckpointFormatError, match="checkpoint format 1") as err:
        load_trained(tmp_path / "old.ckpt")
    assert "\n" not in str(err.value)


def test_the_output_carries_coordinates_as_infercnvpy_reads_them(trained, subset):
    """var['chromosome'] as 'chr1'..., 'start' and 'end', placed from var and the genome's table."""
    import batchfix

    model, _ = trained
    assert not subset.var["chromosome"].dropna().astype(str).str.startswith("chr").any()  # '1', 'X' in the input
    out = batchfix.correct(subset, model, copy=True)
    chromosome = out.var["chromosome"]
    placed = chromosome.notna().to_numpy()
    assert placed.mean() > 0.8 and chromosome[placed].astype(str).str.match(r"^chr(\d+|X|Y|M)$").all()
    assert (out.var["end"][placed] >= out.var["start"][placed]).all()
    assert subset.var["chromosome"].dropna().iloc[0] in chromosome.dropna().iloc[0]  # same place, infercnvpy's name


def test_a_corrected_file_goes_into_infercnvpy_with_its_reference_from_the_layer(trained, tmp_path):
    """The corrected file, read back, into infercnvpy.tl.infercnv with no extra step: reference cells named by obs,
    the expression and the reference both from the log layer (the `cnv` extra's infercnvpy reads the reference
    from the layer it is given, not from X's raw counts)."""
    import infercnvpy
    from infercnvpy.tl import _infercnv

    import batchfix

    model, path = trained
    out = tmp_path / "corrected.h5ad"
    batchfix.correct(ad.read_h5ad(path), model, copy=True).write_h5ad(out)
    corrected = ad.read_h5ad(out)
    reference = _infercnv._get_reference(corrected, "cell_type", ["H1975"], None, "batchfix")
    normal = (corrected.obs["cell_type"] == "H1975").to_numpy()
    np.testing.assert_allclose(np.ravel(reference), np.ravel(corrected.layers["batchfix"][normal].mean(axis=0)),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.ravel(reference), np.ravel(corrected.X[normal].mean(axis=0)))  # not X's raw counts
    infercnvpy.tl.infercnv(corrected, layer="batchfix", reference_key="cell_type", reference_cat=["H1975"],
                           window_size=20, step=5)
    scores = corrected.obsm["X_cnv"]
    assert scores.shape[0] == corrected.n_obs and scores.shape[1] > 10
    assert set(corrected.uns["cnv"]["chr_pos"]) <= {f"chr{c}" for c in [*range(1, 23), "X", "Y"]}


def test_spread_batch_keeps_each_batchs_dispersion_and_spread_gene_maps_to_the_references(trained, subset,
                                                                                        monkeypatch):
    """correction.spread on counts: batch (the default) moves only the mean, each count keeping its batch's NB
    dispersion; gene maps it to the reference's per-gene dispersion (theta_g for the average reference)."""
    import batchfix

    model, _ = trained
    from batchfix.correction import device_map

    seen = {}
    original = device_map.quantile_map_torch

    def recording(y, own_mean, ref_mean, own_theta, ref_theta, u):
        seen.setdefault("same", []).append(torch.equal(own_theta, ref_theta))
        return original(y, own_mean, ref_mean, own_theta, ref_theta, u)

    monkeypatch.setattr(device_map, "quantile_map_torch", recording)
    batchfix.correct(subset, model, copy=True)
    assert all(seen.pop("same"))
    batchfix.correct(subset, model, copy=True, spread="gene")
    assert not any(seen["same"])


def test_outlier_counts_of_lowly_expressed_genes_stay_finite_in_a_corrected_file(trained, subset, tmp_path):
    """A copy of the real subset with one cell's count of a lowly expressed gene set to 1,000 and another's to
    100,000 (a plasma cell's IGKC, a blood-contaminated cell's HBB), corrected from disk: every value of both
    layers is finite, each outlier maps to a large finite count, and the cells' log rows keep every count."""
    from batchfix.config import ResolvedCorrection
    from batchfix.correction.writers import correct_file
    from batchfix.data.io import OutputKeys
    from batchfix.eval.matrix_scores import corrected_matrix_scores
    from batchfix.eval.metrics import modelled_genes

    model, _ = trained
    x = np.asarray(subset.X)
    detected, largest = (x > 0).sum(axis=0), x.max(axis=0)
    low = np.flatnonzero((detected >= 3) & (largest <= 8))
    genes = low[np.argsort(x[:, low].mean(axis=0), kind="stable")[:2]]  # the two least expressed such genes
    assert x[:, genes].mean(axis=0).max() < 0.2 and largest[genes].max() <= 8
    cells, outliers = np.array([3, 117]), np.array([1000.0, 100_000.0])
    adata = subset.copy()
    adata.X[cells, genes] = outliers
    adata.write_h5ad(tmp_path / "outliers.h5ad")
    out = ad.read_h5ad(correct_file(tmp_path / "outliers.h5ad", tmp_path / "out.h5ad", model,
                                    ResolvedCorrection(), progress=False))
    assert out.var["batchfix_corrected"].to_numpy()[genes].all()
    counts_layer, log_layer = sp.csr_matrix(out.layers["batchfix_counts"]), sp.csr_matrix(out.layers["batchfix"])
    assert np.isfinite(counts_layer.data).all() and np.isfinite(log_layer.data).all()
    assert (counts_layer.data >= 0).all() and (counts_layer.data == np.round(counts_layer.data)).all()
    mapped = counts_layer[cells, genes].A1
    assert (mapped >= outliers / 10).all() and (mapped <= outliers * 10).all(), mapped
    for cell in cells:
        row, log_row = counts_layer[cell], log_layer[cell]
        assert log_row.nnz == row.nnz and (log_row.data > 0).all(), "the cell's log row keeps every count"
    np.testing.assert_allclose(log_layer[cells].toarray(), log_cp10k(counts_layer[cells]).toarray(), rtol=1e-5)
    scores = corrected_matrix_scores(out, "batchfix", modelled_genes(out, OutputKeys("batchfix")), "batch",
                                     "cell_type")
    assert scores["nonfinite_values"] == 0 and scores["negative_values"] == 0


def test_evaluate_counts_nonfinite_and_negative_values_of_a_corrected_layer(caplog):
    from batchfix.eval.matrix_scores import bad_values

    layer = sp.csr_matrix(np.array([[np.inf, 1.0, 0.0], [np.nan, -2.0, 3.0]], dtype=np.float32))
    with caplog.at_level("WARNING"):
        assert bad_values(layer, "batchfix") == {"nonfinite_values": 2, "negative_values": 1}
    assert "layers['batchfix'] holds 2 NaN or infinite and 1 negative values" in caplog.text


def test_an_option_the_denoised_output_does_not_read_names_the_outputs_that_do(caplog):
    from batchfix.correction.provenance import output_kind_name, warn_not_applied

    assert [output_kind_name(mode, likelihood) for mode, likelihood in [("counterfactual", "nb"), (
        "counterfactual", "gaussian"), ("denoised", "nb")]] == ["counts", "log_counterfactual", "denoised"]
    with caplog.at_level("WARNING", logger="batchfix"):
        warn_not_applied({"spread": "gene", "key_added": "fixed"}, "denoised")
    assert len(caplog.records) == 1 and ("correction.spread=gene does nothing on the denoised output "
                                         "(output_mode=denoised): the denoised output decodes the latent alone. It is "
                                         "read by the corrected counts (a counts model's counterfactual output) and a "
                                         "log-scale model's counterfactual output (data.scale=log).") in caplog.text


def test_a_checkpoint_remembering_a_retired_option_corrects_as_its_successor(trained, subset, tmp_path, caplog):
    """A checkpoint of the earlier release remembers regional_shift=keep_all and the ablations among its correction
    options: it loads, and corrects as keep_input (the same corrected counts), bit for bit."""
    import batchfix

    model, _ = trained
    earlier = batchfix.BatchfixModel.load(model.save(tmp_path / "model.ckpt"))
    options = {**earlier.correction["options"], "regional_shift": "keep_all", "regional_order": "genome",
               "regional_seed": 0}
    earlier.remember_correction({"preset": "default", "options": options})
    reloaded = batchfix.BatchfixModel.load(earlier.save(tmp_path / "earlier.ckpt"))
    with caplog.at_level("WARNING", logger="batchfix"):
        out = batchfix.correct(subset, reloaded, copy=True)
    assert "regional_shift=keep_all, which this release names keep_input" in caplog.text
    successor = batchfix.correct(subset, model, copy=True, regional_shift="keep_input")
    assert out.uns["batchfix"]["params"]["regional_shift"] == "keep_input"
    for layer in ("batchfix", "batchfix_counts"):
        assert (out.layers[layer] != successor.layers[layer]).nnz == 0, layer


def test_latents_encoded_again_above_the_cache_size_give_the_same_correction(trained, subset, monkeypatch, caplog):
    """Above estimates.LATENT_CACHE_BYTES the correction encodes the cells again instead of keeping the estimate
    pass's latents (memory flat in the number of cells): the same layers and latent, bit for bit."""
    import batchfix
    from batchfix.correction import estimates

    model, _ = trained
    kept = batchfix.correct(subset, model, copy=True)
    monkeypatch.setattr(estimates, "LATENT_CACHE_BYTES", 0)
    with caplog.at_level("INFO", logger="batchfix"):
        again = batchfix.correct(subset, model, copy=True)
    assert f"{subset.n_obs} cells: their latents" in caplog.text
    for key, layer in kept.layers.items():
        assert (layer != again.layers[key]).nnz == 0, key
    np.testing.assert_array_equal(kept.obsm["X_batchfix"], again.obsm["X_batchfix"])
