"""Attention numerics (fp16 guards, backends, masking) and the genomic-coordinate encoding.

fp16 inputs are built so that the unguarded formula really overflows (checked in each test),
and the guarded outputs are compared with a float64 reference computed from the same fp16 values.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batchfix.data.genome import CHROMOSOME_CODE, UNPLACED
from batchfix.nn.attention import (
    EntropyMeter,
    GenomicCoordinateEncoding,
    GenomicDistanceBias,
    MultiHeadSelfAttention,
    guarded_attention,
    in_query_blocks,
    sdpa_attention,
    sinusoidal_genomic_encoding,
)

BACKENDS = {"guarded": guarded_attention, "sdpa": sdpa_attention}
FP16_MAX = torch.finfo(torch.float16).max


def reference_attention(q, k, v, key_padding_mask=None, bias=None):
    """softmax(q k^T / sqrt(d) + bias) v in float64 (zeros for rows whose keys are all masked)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.double()
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return torch.nan_to_num(out, nan=0.0)


def exp_overflow_inputs(seed=0, batch=2, heads=2, length=16, head_dim=64):
    """fp16 q, k, v whose scaled scores reach ~15-20: exp() of them overflows fp16 (max exp arg ~11.1)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, heads, length, head_dim, generator=g) * 2.2).half()
    k = (torch.randn(batch, heads, length, head_dim, generator=g) * 2.2).half()
    v = torch.randn(batch, heads, length, head_dim, generator=g).half()
    return q, k, v


def product_overflow_inputs(seed=0, batch=2, heads=2, length=16, head_dim=64):
    """fp16 q, k whose raw product q k^T exceeds the fp16 range (but q k^T / sqrt(d) does not).

    Keys come in identical pairs matching the queries, so each query attends to a tied pair of keys
    and the right answer is the mean of that pair's values (a non-trivial softmax).
    """
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, heads, length // 2, head_dim, generator=g) * 40.0
    k = base.repeat_interleave(2, dim=2).half()  # keys 2j and 2j+1 identical
    q = base.repeat_interleave(2, dim=2).half()
    v = torch.randn(batch, heads, length, head_dim, generator=g).half()
    return q, k, v


# ---------------------------------------------------------------- fp16 guards


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fp16_exp_overflow_is_guarded(backend):
    q, k, v = exp_overflow_inputs()
    scaled = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    # The unguarded variant (exp without subtracting the row maximum) overflows in fp16.
    unguarded_exp = scaled.exp()
    assert torch.isinf(unguarded_exp).any()
    unguarded = (unguarded_exp / unguarded_exp.sum(-1, keepdim=True)) @ v
    assert not torch.isfinite(unguarded).all()

    out = BACKENDS[backend](q, k, v)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    expected = reference_attention(q, k, v)
    # The softmax is far from one-hot here (the test would miss a wrong scale otherwise).
    weights = torch.softmax(scaled.double(), -1)
    assert weights.max(-1).values.median() < 0.9
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fp16_product_overflow_is_guarded(backend):
    q, k, v = product_overflow_inputs()
    raw = q @ k.transpose(-2, -1)
    assert torch.isinf(raw).any(), "inputs must overflow the unscaled product"
    # Unguarded: product first, then scale and softmax -> inf / inf = NaN.
    unguarded = torch.softmax(raw / math.sqrt(q.shape[-1]), dim=-1) @ v
    assert torch.isnan(unguarded).any()

    out = BACKENDS[backend](q, k, v)
    assert torch.isfinite(out).all()
    expected = reference_attention(q, k, v)
    pair_mean = v.double().view(*v.shape[:2], -1, 2, v.shape[-1]).mean(-2).repeat_interleave(2, dim=2)
    torch.testing.assert_close(expected, pair_mean, atol=1e-6, rtol=0)  # the reference sees the tie
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fp16_backward_is_finite_and_matches_reference(backend):
    # torch on CPU runs fp16 autograd for both backends; gradients are taken in fp16 itself.
    q, k, v = exp_overflow_inputs(seed=1, length=8)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = BACKENDS[backend](*leaves)
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(out.shape, generator=g)
    (out.float() * upstream).sum().backward()

    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    (reference_attention(*ref_leaves) * upstream.double()).sum().backward()
    for name, got, ref in zip("qkv", leaves, ref_leaves):
        assert got.grad.dtype == torch.float16
        assert torch.isfinite(got.grad).all(), f"d{name} has inf/NaN"
        scale = ref.grad.abs().max().item()
        err = (got.grad.double() - ref.grad).abs().max().item()
        assert err <= 2e-2 * scale + 1e-3, f"d{name}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fp16_backward_through_product_overflow_is_finite(backend):
    q, k, v = product_overflow_inputs(seed=3, length=8)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    BACKENDS[backend](*leaves).float().sum().backward()
    for name, leaf in zip("qkv", leaves):
        assert torch.isfinite(leaf.grad).all(), f"d{name} has inf/NaN"


# ---------------------------------------------------------------- backends and masking


def random_qkv(seed=0, batch=3, heads=2, length=10, head_dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, head_dim, generator=g, dtype=dtype) for _ in range(3)]


def padding_mask(batch=3, length=10):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -3:] = True  # partly padded
    mask[2, 1::2] = True  # padding scattered inside
    return mask


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding-mask"])
def test_backends_agree_float32(masked):
    q, k, v = random_qkv()
    mask = padding_mask() if masked else None
    guarded = guarded_attention(q, k, v, mask)
    fused = sdpa_attention(q, k, v, mask)
    expected = reference_attention(q, k, v, mask)
    torch.testing.assert_close(guarded, fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(guarded.double(), expected, atol=1e-5, rtol=1e-5)
    if masked:  # the mask matters: without it the answer differs
        assert not torch.allclose(guarded, guarded_attention(q, k, v), atol=1e-3)


def test_masked_keys_do_not_influence_output():
    q, k, v = random_qkv(seed=4)
    mask = padding_mask()
    k2, v2 = k.clone(), v.clone()
    k2[mask[:, None, :, None].expand_as(k2)] = 1e3  # garbage in the padded slots
    v2[mask[:, None, :, None].expand_as(v2)] = -1e3
    for attend in BACKENDS.values():
        torch.testing.assert_close(attend(q, k2, v2, mask), attend(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_multihead_module_backends_agree():
    torch.manual_seed(0)
    guarded = MultiHeadSelfAttention(d_model=16, n_heads=4, backend="guarded")
    fused = MultiHeadSelfAttention(d_model=16, n_heads=4, backend="sdpa")
    fused.load_state_dict(guarded.state_dict())
    x = torch.randn(3, 10, 16)
    mask = padding_mask()
    for m in (None, mask):
        torch.testing.assert_close(guarded(x, m), fused(x, m), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fully_masked_row_gives_zeros(backend, dtype):
    q, k, v = random_qkv(seed=5, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    mask = padding_mask()
    mask[1] = True  # every key of cell 1 is padding
    out = BACKENDS[backend](*leaves, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    torch.testing.assert_close(out[[0, 2]].double(), reference_attention(q, k, v, mask)[[0, 2]],
                               atol=1e-2 if dtype == torch.float16 else 1e-5, rtol=1e-2)
    out.float().sum().backward()
    for name, leaf in zip("qkv", leaves):
        assert torch.isfinite(leaf.grad).all(), f"d{name} has NaN with a fully masked row"


# ---------------------------------------------------------------- genomic-coordinate encoding


def cosine_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return 1.0 - (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("d_model", [32, 64])
def test_nearby_loci_closer_than_distant_loci(d_model):
    rng = np.random.default_rng(0)
    anchors = rng.uniform(1e6, 1.8e8, size=300).round()
    here = sinusoidal_genomic_encoding(anchors, d_model)
    near = sinusoidal_genomic_encoding(anchors + 1e4, d_model)  # 10 kb away
    far = sinusoidal_genomic_encoding(anchors + 5e7, d_model)  # 50 Mb away
    for distance in (cosine_distance, lambda a, b: np.linalg.norm(a - b, axis=-1)):
        d_near, d_far = distance(here, near), distance(here, far)
        assert (d_near < d_far).all(), f"{(d_near >= d_far).sum()} anchors have a 10 kb neighbour farther than 50 Mb"
        assert d_far.min() > 1.2 * d_near.max()
        # Sinusoids: the distance depends on the offset only, not on where on the chromosome the pair lies.
        np.testing.assert_allclose(d_near, d_near[0], rtol=1e-6)


def test_encoding_distance_grows_with_genomic_distance():
    positions = np.array([5e7])
    offsets = np.array([1e2, 1e3, 1e4, 1e5, 1e6, 1e7])
    here = sinusoidal_genomic_encoding(positions, 64)
    dist = [np.linalg.norm(here - sinusoidal_genomic_encoding(positions + o, 64)) for o in offsets]
    # Averaged over the sinusoids the squared distance rises with offset; on this log grid it is monotone.
    assert all(a < b for a, b in zip(dist, dist[1:])), dist


def test_distinct_positions_give_distinct_encodings():
    rng = np.random.default_rng(1)
    positions = np.unique(rng.integers(0, 2.5e8, size=400))
    # 1 bp neighbours at the far end of chromosome 1: a float32 angle (spacing 16 bp there) would merge them.
    positions = np.concatenate([positions, [2.4e8, 2.4e8 + 1, 2.4e8 + 2]])
    chromosome = np.full(len(positions), CHROMOSOME_CODE["1"])
    enc = GenomicCoordinateEncoding(positions, chromosome, d_model=64).sinusoid.numpy()  # float32 buffer
    diffs = np.linalg.norm(enc[:, None, :] - enc[None, :, :], axis=-1)
    np.fill_diagonal(diffs, np.inf)
    assert diffs.min() > 1e-3, f"closest pair of distinct positions is only {diffs.min():.2e} apart"


def test_encoding_values_match_float64_formula():
    positions = np.array([0.0, 1234.0, 2.48e8])
    enc = sinusoidal_genomic_encoding(positions, 8, min_wavelength=1e3, max_wavelength=3e8)
    wavelengths = np.geomspace(1e3, 3e8, 4)
    for i, p in enumerate(positions):
        for j, lam in enumerate(wavelengths):
            angle = math.fmod(p, lam) / lam * 2 * math.pi  # exact reduction first
            assert enc[i, 2 * j] == pytest.approx(math.sin(angle), abs=1e-6)
            assert enc[i, 2 * j + 1] == pytest.approx(math.cos(angle), abs=1e-6)


def chromosome_layout():
    """Ten tokens: seven on chr1/chr2/X and three unplaced (position 0) trailing."""
    position = np.array([1e6, 5e6, 3e7, 2e6, 8e7, 1.5e8, 4e6, 0.0, 0.0, 0.0])
    chromosome = np.array([CHROMOSOME_CODE[c] for c in ["1", "1", "1", "2", "2", "2", "X"]] + [UNPLACED] * 3)
    return position, chromosome


def test_unplaced_tokens_get_no_sinusoid():
    position, chromosome = chromosome_layout()
    enc = GenomicCoordinateEncoding(position, chromosome, d_model=16)
    unplaced = chromosome == UNPLACED
    assert torch.equal(enc.sinusoid[unplaced], torch.zeros(int(unplaced.sum()), 16))
    assert (enc.sinusoid[~unplaced].abs().sum(-1) > 0).all()
    with torch.no_grad():
        out = enc()
    # The unplaced tokens' encoding is exactly their learned 'unplaced' chromosome vector.
    unplaced_vector = enc.chromosome_embedding.weight[UNPLACED]
    torch.testing.assert_close(out[unplaced], unplaced_vector.expand(int(unplaced.sum()), -1), atol=0, rtol=0)
    # Placed tokens: sinusoid plus their chromosome's vector.
    placed_codes = torch.as_tensor(chromosome[~unplaced])
    expected = enc.sinusoid[~unplaced] + enc.chromosome_embedding.weight[placed_codes]
    torch.testing.assert_close(out[~unplaced], expected.detach())


def test_shuffled_mode_permutes_tokens():
    position, chromosome = chromosome_layout()
    real = GenomicCoordinateEncoding(position, chromosome, d_model=16, mode="real")
    shuffled = GenomicCoordinateEncoding(position, chromosome, d_model=16, mode="shuffled", seed=0)
    real_rows = [tuple(r) for r in np.column_stack([real.sinusoid.numpy(), real.chromosome.numpy()])]
    shuffled_rows = [tuple(r) for r in np.column_stack([shuffled.sinusoid.numpy(), shuffled.chromosome.numpy()])]
    assert sorted(shuffled_rows) == sorted(real_rows)  # same (sinusoid, chromosome) pairs ...
    assert shuffled_rows != real_rows  # ... assigned to other tokens
    moved = sum(a != b for a, b in zip(real_rows, shuffled_rows))
    assert moved >= 3
    # Deterministic for a seed, different for another.
    again = GenomicCoordinateEncoding(position, chromosome, d_model=16, mode="shuffled", seed=0)
    assert torch.equal(again.sinusoid, shuffled.sinusoid)
    other = GenomicCoordinateEncoding(position, chromosome, d_model=16, mode="shuffled", seed=1)
    assert not torch.equal(other.sinusoid, shuffled.sinusoid)


def test_none_mode_gives_zeros_and_no_gradient():
    position, chromosome = chromosome_layout()
    enc = GenomicCoordinateEncoding(position, chromosome, d_model=16, mode="none")
    out = enc()
    assert out.shape == (len(position), 16)
    assert torch.equal(out, torch.zeros_like(out))
    assert not out.requires_grad or out.grad_fn is None


def test_unknown_mode_is_refused():
    position, chromosome = chromosome_layout()
    with pytest.raises(ValueError, match="position_encoding"):
        GenomicCoordinateEncoding(position, chromosome, d_model=16, mode="sorted")


# ---------------------------------------------------------------- query blocks, distance bias, checkpointing


def blocked(backend: str, q, k, v, mask=None, bias=None, block_size=None, recompute=False):
    """The module's per-block attention (backend, observer, dropout) over query blocks of the given q, k, v."""
    attention = MultiHeadSelfAttention(d_model=8, n_heads=2, backend=backend)  # projections unused here
    return in_query_blocks(attention.attend, q, k, v, mask, bias, block_size, recompute)


def table_bias(heads: int, length: int, seed: int = 0, scale: float = 3.0):
    """A ScoreBias over a fixed random (H, L, L) table: bias(first, stop) -> rows first..stop."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(heads, length, length, generator=g) * scale
    return (lambda first, stop: full[:, first:stop]), full


@pytest.mark.parametrize("block_size", [None, 1, 3, 4, 10])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_query_blocks_with_bias_and_mask_match_float64_reference(backend, block_size):
    q, k, v = random_qkv(seed=6)
    mask = padding_mask()
    bias, full = table_bias(heads=2, length=10)
    for m, b, full_b in ((None, None, None), (mask, None, None), (None, bias, full), (mask, bias, full)):
        out = blocked(backend, q, k, v, m, b, block_size)
        torch.testing.assert_close(out.double(), reference_attention(q, k, v, m, full_b), atol=1e-5, rtol=1e-5)
    # The bias matters: without it the answer differs.
    assert not torch.allclose(blocked(backend, q, k, v, None, bias, block_size), blocked(backend, q, k, v))


@pytest.mark.parametrize("block_size", [None, 5, 16])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fp16_overflow_is_guarded_in_blocks_with_a_distance_bias(backend, block_size):
    bias, full = table_bias(heads=2, length=16, seed=7, scale=2.0)
    q, k, v = exp_overflow_inputs()
    scaled = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1) + full.half()
    assert torch.isinf(scaled.exp()).any(), "exp of the biased scores must overflow fp16 unguarded"
    out = blocked(backend, q, k, v, bias=bias, block_size=block_size)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, bias=full.half()), atol=1e-2, rtol=1e-2)

    # Scaled scores of ~1e4 here, where fp16 steps by 8: a bias equal for the two keys of each tied pair
    # keeps the tie, so the right answer stays the pair's mean value.
    q, k, v = product_overflow_inputs()
    assert torch.isinf(q @ k.transpose(-2, -1)).any(), "inputs must overflow the unscaled product"
    pair_bias = full[..., ::2].repeat_interleave(2, dim=-1)  # (H, L, L), keys 2j and 2j+1 alike
    out = blocked(backend, q, k, v, bias=lambda first, stop: pair_bias[:, first:stop], block_size=block_size)
    assert torch.isfinite(out).all()
    expected = reference_attention(q, k, v, bias=pair_bias)
    pair_mean = v.double().view(*v.shape[:2], -1, 2, v.shape[-1]).mean(-2).repeat_interleave(2, dim=2)
    torch.testing.assert_close(expected, pair_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fp16_backward_in_recomputed_blocks_matches_reference(backend):
    bias, full = table_bias(heads=2, length=8, seed=8, scale=2.0)
    q, k, v = exp_overflow_inputs(seed=1, length=8)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = blocked(backend, *leaves, bias=bias, block_size=3, recompute=True)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * upstream).sum().backward()
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    (reference_attention(*ref_leaves, bias=full.half()) * upstream.double()).sum().backward()
    for name, got, ref in zip("qkv", leaves, ref_leaves):
        assert torch.isfinite(got.grad).all(), f"d{name} has inf/NaN"
        err = (got.grad.double() - ref.grad).abs().max().item()
        assert err <= 2e-2 * ref.grad.abs().max().item() + 1e-3, f"d{name}: max error {err:.3g}"


def test_checkpointed_blocks_give_the_same_gradients():
    torch.manual_seed(0)
    plain = MultiHeadSelfAttention(d_model=16, n_heads=4).double()
    blocked_module = MultiHeadSelfAttention(d_model=16, n_heads=4, block_size=3, checkpoint_blocks=True).double()
    blocked_module.load_state_dict(plain.state_dict())
    bias, _ = table_bias(heads=4, length=10)
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    grads = []
    for module in (plain, blocked_module):
        module.zero_grad()
        out = module(x, padding_mask(), lambda first, stop: bias(first, stop).double())
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def distance_layout():
    """Tokens on chr1 at 0, 500 bp, 5 kb, 50 Mb; one on chr2 at 0; two unplaced."""
    position = np.array([1e6, 1e6 + 500, 1e6 + 5e3, 5.1e7, 1e6, 0.0, 0.0])
    chromosome = np.array([CHROMOSOME_CODE[c] for c in ["1", "1", "1", "1", "2"]] + [UNPLACED] * 2)
    return position, chromosome


def test_distance_buckets_follow_base_pair_distance_and_chromosomes():
    position, chromosome = distance_layout()
    bias = GenomicDistanceBias(position, chromosome, n_heads=2, n_buckets=8, min_bp=1e3, max_bp=1e8)
    buckets = bias.buckets()
    other, unplaced = 8, 9
    assert buckets[0, 0] == 0 and buckets[0, 1] == 0  # itself, and 500 bp: closer than min_bp
    # log-spaced from 1 kb to 100 Mb over buckets 1..7 (5 decades / 7 buckets each)
    expected = [1 + int(math.log(d / 1e3) / math.log(1e5) * 7) for d in (5e3 - 500, 5e3, 5e7)]
    assert [buckets[1, 2], buckets[0, 2], buckets[0, 3]] == expected
    assert buckets[0, 2] < buckets[0, 3]  # farther apart, higher bucket
    assert buckets[0, 4] == other and buckets[4, 3] == other  # same position, other chromosome
    assert (buckets[5:] == unplaced).all() and (buckets[:, 5:] == unplaced).all()
    assert torch.equal(buckets, buckets.T)
    # Blocks of queries give the rows of the whole matrix; the bias reads the learned table.
    torch.testing.assert_close(bias.buckets(2, 5), buckets[2:5])
    with torch.no_grad():
        bias.table.copy_(torch.arange(20.0).view(10, 2))
    assert bias(0, 2).shape == (2, 2, 7)
    torch.testing.assert_close(bias()[1], (2 * buckets + 1).float())


def test_distance_bias_is_a_trainable_prior_in_the_encoder():
    from batchfix.config import ModelConfig
    from batchfix.data.genome import GeneCoordinates, make_windows
    from batchfix.nn.network import LocusEncoder

    n = 30
    coords = GeneCoordinates(np.array(["1"] * 12 + ["2"] * 12 + [None] * 6, dtype=object),
                             np.r_[np.arange(24) * 20000, np.zeros(6)].astype(np.int64),
                             np.r_[np.arange(24) * 20000 + 900, np.zeros(6)].astype(np.int64))
    windows = make_windows(coords, 3)
    config = dict(genes_per_token=3, d_model=16, n_heads=2, n_layers=2, latent_dim=4, distance_bias=True)
    encoders = {mode: LocusEncoder(ModelConfig(**config, position_encoding=mode), windows, n)
                for mode in GenomicCoordinateEncoding.MODES}
    # Coordinates (real or shuffled) feed the bias; none and learned use no coordinate at all.
    assert encoders["none"].distance_bias is None and encoders["learned"].distance_bias is None
    real, shuffled = encoders["real"].distance_bias, encoders["shuffled"].distance_bias
    assert not torch.equal(real.buckets(), shuffled.buckets())
    mu, _ = encoders["real"](torch.randn(5, n))
    mu.square().sum().backward()
    assert real.table.grad is not None and real.table.grad.abs().sum() > 0


def test_entropy_meter_matches_the_formula():
    meter = EntropyMeter(n_layers=2, n_heads=2)
    uniform = torch.full((3, 2, 4, 8), 1 / 8)
    one_hot = torch.zeros(3, 2, 4, 8)
    one_hot[..., 0] = 1.0
    meter.add(0, uniform)
    meter.add(1, torch.cat([uniform[:, :1], one_hot[:, :1]], dim=1), first=0)
    meter.add(1, torch.cat([uniform[:, :1], one_hot[:, :1]], dim=1)[:, :, :2], first=4)
    torch.testing.assert_close(meter.mean(), torch.tensor([[math.log(8)] * 2, [math.log(8), 0.0]],
                                                          dtype=torch.float64))
