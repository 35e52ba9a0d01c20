"""Attention numerics (fp16 guards, backends, masking) and the genomic-coordinate encoding.

fp16 inputs are built so that the unguarded formula really overflows (checked in each test),
and the guarded outputs are compared with a float64 reference computed from the same fp16 values.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batchfix.attention import (
    GenomicCoordinateEncoding,
    MultiHeadSelfAttention,
    guarded_attention,
    sdpa_attention,
    sinusoidal_genomic_encoding,
)
from batchfix.genome import CHROMOSOME_CODE, UNPLACED

BACKENDS = {"guarded": guarded_attention, "sdpa": sdpa_attention}
FP16_MAX = torch.finfo(torch.float16).max


def reference_attention(q, k, v, key_padding_mask=None):
    """softmax(q k^T / sqrt(d)) v in float64 (zeros for rows whose keys are all masked)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
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
