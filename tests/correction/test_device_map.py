"""The quantile map in torch (batchfix.correction.device_map) against numpy/scipy's (batchfix.correction.counts):
the same draws bit for bit, and the same counts but for draws within float rounding of a quantile boundary (at most
one entry per million), on the bundled data's real counts and on a grid of counts up to 1e5."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from batchfix.correction import counts, device_map

MAX_DIFFERING_SHARE = 1e-6
RNG_SEED = 0


def as_tensors(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64).ravel()) for a in arrays]


def assert_nearly_all_equal(mapped: torch.Tensor, expected: np.ndarray) -> int:
    """At most one count per million differs, by 1 at most; returns how many differ."""
    differing = np.flatnonzero(mapped.numpy() != expected)
    assert len(differing) <= MAX_DIFFERING_SHARE * len(expected), f"{len(differing)} of {len(expected)} differ"
    assert (np.abs(mapped.numpy()[differing] - expected[differing]) <= 1).all()
    return len(differing)


def test_the_draws_are_numpys_bit_for_bit():
    rng = np.random.default_rng(RNG_SEED)
    cells = rng.integers(0, 2**64 - 1, 300, dtype=np.uint64, endpoint=True)
    genes = np.concatenate([rng.integers(0, 2**64 - 1, 200, dtype=np.uint64, endpoint=True),
                            np.array([0, 2**63, 2**64 - 1], dtype=np.uint64)])
    for seed in (0, 7, 2**63 + 11):
        expected = counts.counter_uniform(seed, cells, genes)
        drawn = device_map.counter_uniform_torch(seed, cells, genes)
        assert drawn.dtype == torch.float64 and drawn.shape == expected.shape
        np.testing.assert_array_equal(drawn.numpy().view(np.uint64), expected.view(np.uint64))
    as_int64 = torch.from_numpy(cells.view(np.int64))
    np.testing.assert_array_equal(device_map.counter_uniform_torch(3, as_int64, genes).numpy(),
                                  counts.counter_uniform(3, cells, genes))


def test_the_walks_are_numpys_bit_for_bit():
    rng = np.random.default_rng(RNG_SEED)
    n = 20_000
    mean, theta = rng.gamma(0.5, 6.0, n), np.exp(rng.uniform(np.log(0.1), np.log(50.0), n))
    p, q = theta / (theta + mean), mean / (theta + mean)
    y = np.sort(np.minimum(rng.negative_binomial(theta, p), counts.WALK_STEPS).astype(np.float64))
    p0 = np.exp(theta * np.log(p))
    below, mass = device_map.walk_tails_torch(*as_tensors(y, p0, theta, q))
    expected_below, expected_mass = counts.walk_tails(y, theta, p, q)
    np.testing.assert_array_equal(below.numpy(), expected_below)
    np.testing.assert_array_equal(mass.numpy(), expected_mass)
    target = rng.uniform(0.0, 0.9999, n)
    walked = device_map.walk_quantile_torch(*as_tensors(target, p0, theta, q)).numpy()
    expected = counts.walk_quantile(target, theta, p, q)
    np.testing.assert_array_equal(walked, expected)  # NaN (quantile above WALK_STEPS) in the same places
    assert np.isnan(expected).any() and (expected[~np.isnan(expected)] > 8).any()


def bundled_distributions(adata, genes: slice) -> dict[str, np.ndarray]:
    """(cells, genes) real counts with NB means from the data: the cell's library times its batch's per-gene share
    (own) or the pooled share (reference); per-gene dispersions log-uniform in 0.1-50, the reference's another
    draw; uniforms as the counts output takes them."""
    rng = np.random.default_rng(RNG_SEED)
    x = np.asarray(adata.X[:, genes], dtype=np.float64)
    batch = adata.obs["batch"].astype(str).to_numpy()
    library = x.sum(axis=1, keepdims=True)
    pooled = (x.sum(axis=0) + 0.5) / (x.sum() + 0.5 * x.shape[1])
    own_share = np.empty_like(x)
    for name in np.unique(batch):
        cells = batch == name
        own_share[cells] = (x[cells].sum(axis=0) + 0.5) / (x[cells].sum() + 0.5 * x.shape[1])
    theta = np.exp(rng.uniform(np.log(0.1), np.log(50.0), (2, x.shape[1])))
    drawn = counts.counter_uniform(0, counts.name_keys(adata.obs_names), counts.name_keys(adata.var_names[genes]))
    return dict(y=x, own_mean=library * own_share, ref_mean=library * pooled,
                own_theta=np.broadcast_to(theta[0], x.shape), ref_theta=np.broadcast_to(theta[1], x.shape),
                u=np.where(x == 0, drawn, 0.5))


ARGUMENTS = ("y", "own_mean", "ref_mean", "own_theta", "ref_theta", "u")


@pytest.mark.parametrize("kept_theta, gene_step", [
    ("half", 10), pytest.param("all", 1, marks=pytest.mark.slow), pytest.param("none", 1, marks=pytest.mark.slow)])
def test_the_bundled_counts_map_as_numpys(bundled_adata, kept_theta, gene_step):
    """Every tenth gene, the reference keeping the batch's dispersion (correction.spread=batch) for half of them; or
    every gene (slow; measured: none of 11,775,193 counts differ, with the dispersion kept for all or for none)."""
    nb = bundled_distributions(bundled_adata, slice(0, None, gene_step))
    kept = {"all": 1.0, "half": 0.5, "none": 0.0}[kept_theta] > np.linspace(0, 1, nb["y"].shape[1], endpoint=False)
    nb["ref_theta"] = np.where(kept, nb["own_theta"], nb["ref_theta"])
    arrays = [np.ascontiguousarray(nb[name]).ravel() for name in ARGUMENTS]
    expected = counts.quantile_map(*arrays)
    mapped = device_map.quantile_map_torch(*as_tensors(*arrays))
    assert mapped.dtype == torch.float64
    assert_nearly_all_equal(mapped, expected)
    y = arrays[0]
    assert ((y == 0) & (expected > 0)).sum() > 1000 // gene_step, "zeros that move are exercised"
    assert (y > counts.WALK_STEPS).sum() > 1000 // gene_step, "the exact path is exercised"


def synthetic_grid() -> list[np.ndarray]:
    """Flat arrays over a grid of means (1e-3 to 3e4), dispersions (0.1 to 1e3) and mean shifts (1/4 to 4), with
    counts from 0 to 1e5: each NB's draws, its far upper tail, and fixed counts."""
    rng = np.random.default_rng(RNG_SEED)
    mean, theta, shift = np.meshgrid(np.logspace(-3, 4.5, 24), np.logspace(-1, 3, 9), [0.25, 0.8, 1.0, 1.25, 4.0])
    mean, theta, shift = (np.repeat(a.ravel(), 60) for a in (mean, theta, shift))
    nb = stats.nbinom(theta, theta / (theta + mean))
    y = nb.rvs(random_state=rng).astype(np.float64)
    tail = rng.random(len(y)) < 0.2  # far upper tail: 1 - F below 1e-6
    y[tail] = nb.isf(10.0 ** rng.uniform(-12, -6, len(y)))[tail]
    fixed = rng.random(len(y)) < 0.2
    y[fixed] = np.round(10.0 ** rng.uniform(0, 5, len(y)))[fixed]
    ref_theta = np.where(rng.random(len(y)) < 0.5, theta, theta * np.exp(rng.normal(0, 1, len(y))))
    u = np.where(y == 0, rng.random(len(y)), np.where(rng.random(len(y)) < 0.5, 0.5, rng.random(len(y))))
    return [y, mean, mean * shift, theta, ref_theta, u]


@pytest.mark.parametrize("block", [device_map.CPU_BLOCK, 1000])
def test_a_grid_of_counts_up_to_1e5_maps_as_numpys(monkeypatch, block):
    monkeypatch.setattr(device_map, "CPU_BLOCK", block)  # 1000: many blocks, none a multiple of the grid's rows
    arrays = synthetic_grid()
    y = arrays[0]
    assert y.max() >= 1e5 and (y == 0).mean() > 0.05
    expected = counts.quantile_map(*arrays)
    assert_nearly_all_equal(device_map.quantile_map_torch(*as_tensors(*arrays)), expected)


def test_the_screen_keeps_every_zero_numpy_moves():
    """`may_move` drops only zeros that stay 0: every count numpy moves or keeps positive is kept."""
    y, own_mean, ref_mean, own_theta, ref_theta, u = synthetic_grid()
    moved = counts.quantile_map(y, own_mean, ref_mean, own_theta, ref_theta, u) > 0
    kept = device_map.may_move(*as_tensors(y, own_mean, ref_mean, own_theta, u)).numpy()
    assert kept[moved | (y > 0)].all()
    assert not kept[(y == 0) & ~moved].all(), "the screen settles zeros"


def test_nothing_to_move_and_empty_inputs():
    zeros = np.zeros(5)
    ones = np.ones(5)
    mapped = device_map.quantile_map_torch(*as_tensors(zeros, ones, ones / 2, ones, ones, ones / 2))
    assert mapped.tolist() == [0.0] * 5
    empty = torch.zeros(0, dtype=torch.float64)
    assert device_map.quantile_map_torch(*[empty] * 6).shape == (0,)
    with pytest.raises(TypeError, match="float64"):
        device_map.quantile_map_torch(*[torch.ones(3)] * 6)


@pytest.mark.bench
def test_the_benchmark_runs_on_a_tiny_chunk(capsys):
    from scripts.bench import bench_device_map

    bench_device_map.main(["--sizes", "2e4", "--repeats", "1", "--threads", "1"])
    printed = capsys.readouterr().out
    assert "20,000 entries (10 cells x 2000 genes)" in printed
    rows = [line.split("|")[1:-1] for line in printed.splitlines() if line.startswith("| numpy") or
            line.startswith("| torch")]
    cuda = ["torch, cuda"] if torch.cuda.is_available() else []
    assert [row[0].strip() for row in rows] == ["numpy, 1 worker", "torch, cpu, 1 thread", *cuda, "numpy",
                                                "torch, cpu", *cuda]
    assert all(row[-1].strip() == "0" for row in rows), "no count and no draw differs from numpy's"
