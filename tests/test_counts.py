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
# The layers a real trained model writes (the tiny model of tests/test_correct.py's trained_run)


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


def test_counts_layer_log_layer_and_flags_of_a_real_correction(trained, subset, tmp_path):
    import batchfix

    model, _ = trained
    out = batchfix.correct(subset, model, copy=True)
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
    assert set(info["options_not_applied"]) == {"residual_weight"}


def test_streamed_in_memory_repeated_and_reordered_runs_give_the_same_counts(trained, subset, tmp_path):
    import batchfix
    from batchfix.config import CorrectionSettings
    from batchfix.correction.writers import correct_file

    model, path = trained
    in_memory = batchfix.correct(subset, model, copy=True).layers["batchfix_counts"]
    streamed = ad.read_h5ad(correct_file(path, tmp_path / "out.h5ad", model, CorrectionSettings(chunk_size=37),
                                         progress=False)).layers["batchfix_counts"]
    assert (streamed != in_memory).nnz == 0
    order = np.random.default_rng(5).permutation(subset.n_obs)
    shuffled = batchfix.correct(subset[order].copy(), model, copy=True).layers["batchfix_counts"]
    assert (shuffled != in_memory[order]).nnz == 0


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


def test_threads_map_the_same_counts_as_one_call(mapped):
    m = mapped
    threaded = counts.quantile_map_threads(m["y"], m["own_mean"], m["ref_mean"], m["own_theta"], m["ref_theta"],
                                           m["u"], workers=2)
    np.testing.assert_array_equal(threaded, m["out"])


def test_spread_batch_keeps_each_batchs_dispersion_and_spread_gene_maps_to_the_references(trained, subset,
                                                                                        monkeypatch):
    """correction.spread on counts: batch (the default) moves only the mean, each count keeping its batch's NB
    dispersion; gene maps it to the reference's per-gene dispersion (theta_g for the average reference)."""
    import batchfix

    model, _ = trained
    seen = {}
    original = counts.quantile_map_threads

    def recording(y, own_mean, ref_mean, own_theta, ref_theta, u, workers):
        seen.setdefault("same", []).append(np.array_equal(own_theta, ref_theta))
        return original(y, own_mean, ref_mean, own_theta, ref_theta, u, workers)

    monkeypatch.setattr(counts, "quantile_map_threads", recording)
    batchfix.correct(subset, model, copy=True)
    assert all(seen.pop("same"))
    batchfix.correct(subset, model, copy=True, spread="gene")
    assert not any(seen["same"])
