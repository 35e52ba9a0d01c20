"""Guarded multi-head self-attention over locus tokens, and the genomic-coordinate encoding.

The two fp16 guards: q is scaled by 1/sqrt(d_k) *before* QK^T (so the product stays inside
fp16's range), and the row maximum is subtracted before exp (so exp never overflows).
Masked keys get -inf; a row whose keys are all masked yields zeros, not NaN.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from batchfix.config import ATTENTION_BACKENDS, POSITION_ENCODINGS, ModelConfig
from batchfix.data.genome import CHROMOSOMES, UNPLACED

BACKENDS = ATTENTION_BACKENDS  # batchfix.config holds the choices


def attention_weights(
    q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k) + bias) written out with both fp16 guards.

    q: (B, H, Q, Dh) (a block of queries, or all of them); k: (B, H, L, Dh); key_padding_mask: (B, L) bool,
    True = padding; bias: (H, Q, L), added to the scores before the row maximum is taken, so guard 2
    covers it too. Returns (B, H, Q, L); a row whose keys are all masked is zeros.
    """
    q = q * (q.shape[-1] ** -0.5)  # guard 1: scale before the product
    scores = q @ k.transpose(-2, -1)  # (B, H, Q, L)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)  # (H, Q, L) broadcast over cells
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    row_max = scores.amax(-1, keepdim=True)  # guard 2: subtract the row maximum before exp
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.softmax(scores - row_max.detach(), dim=-1)
    if key_padding_mask is not None:
        all_masked = key_padding_mask.all(-1)[:, None, None, None]  # (B, 1, 1, 1)
        weights = weights.masked_fill(all_masked, 0.0)
    return weights


def guarded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention written out with both fp16 guards (`attention_weights`).

    q: (B, H, Q, Dh); k, v: (B, H, L, Dh); key_padding_mask: (B, L); bias: (H, Q, L). Returns (B, H, Q, Dh).
    """
    weights = attention_weights(q, k, key_padding_mask, bias)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention through torch's fused kernel (its kernels apply the same guards)."""
    attn_mask = None
    if bias is not None:
        attn_mask = bias.to(q.dtype)[None]  # (1, H, Q, L) added to the scores
        if key_padding_mask is not None:
            attn_mask = attn_mask.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))  # (B, H, Q, L)
    elif key_padding_mask is not None:
        attn_mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, L) True = attend
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if key_padding_mask is not None:
        out = out.masked_fill(key_padding_mask.all(-1)[:, None, None, None], 0.0)
    return out


# A score bias for a block of queries: bias(first query, stop) -> (H, stop - first, L).
ScoreBias = Callable[[int, int], torch.Tensor]
# Sees the weights of every attention block: observer(weights (B, H, Q, L), first query).
Observer = Callable[[torch.Tensor, int], None]


def in_query_blocks(
    attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None, bias: ScoreBias | None = None, block_size: int | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """attend(q block, k, v, key_padding_mask, bias, first query) over blocks of block_size queries.

    q, k, v: (B, H, L, Dh). Only a (B, H, block, L) score tensor exists at a time; with recompute (and
    gradients on) each block is recomputed in the backward pass rather than kept. Returns (B, H, L, Dh).
    """
    length = q.shape[2]
    block = block_size or length
    recompute = recompute and block < length and torch.is_grad_enabled()
    outs = []
    for first in range(0, length, block):
        args = (q[:, :, first:first + block], k, v, key_padding_mask, bias, first)  # q block: (B, H, Q, Dh)
        outs.append(checkpoint(attend, *args, use_reentrant=False) if recompute else attend(*args))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, L, Dh)


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection, a choice of backend, and optional query blocks.

    block_size bounds the (B, H, Q, L) score tensor for long token sequences (per-gene tokens); with
    checkpoint_blocks each block is recomputed in the backward pass instead of kept, so training memory
    too stays at one block. Both fp16 guards act row by row, so they hold inside each block.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, backend: str = "guarded",
                 block_size: int | None = None, checkpoint_blocks: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.d_model ({d_model}) must be divisible by model.n_heads ({n_heads}).")
        if backend not in BACKENDS:
            raise ValueError(f"model.attention must be one of {BACKENDS}, got '{backend}'.")
        self.n_heads, self.dropout, self.backend = n_heads, dropout, backend
        self.block_size, self.checkpoint_blocks = block_size, checkpoint_blocks
        self.observer: Observer | None = None
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                bias: ScoreBias | None = None) -> torch.Tensor:
        batch, length, d_model = x.shape
        # (B, L, 3D) -> (B, L, 3, H, Dh) -> (3, B, H, L, Dh)
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        out = in_query_blocks(self.attend, qkv[0], qkv[1], qkv[2], key_padding_mask, bias, self.block_size,
                              self.checkpoint_blocks)  # (B, H, L, Dh)
        # (B, H, L, Dh) -> (B, L, H, Dh) -> (B, L, D)
        return self.out(out.transpose(1, 2).reshape(batch, length, d_model))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
               bias: ScoreBias | None, first: int) -> torch.Tensor:
        """One block of queries (B, H, Q, Dh) against every key -> (B, H, Q, Dh).

        With an observer the weights are written out (attention_weights) for either backend: same values.
        """
        block_bias = None if bias is None else bias(first, first + q.shape[2])  # (H, Q, L)
        dropout_p = self.dropout if self.training else 0.0
        if self.observer is None:
            attend = guarded_attention if self.backend == "guarded" else sdpa_attention
            return attend(q, k, v, key_padding_mask, dropout_p, block_bias)
        weights = attention_weights(q, k, key_padding_mask, block_bias)  # (B, H, Q, L): the observer needs them
        self.observer(weights.detach(), first)
        return F.dropout(weights, p=dropout_p) @ v


@contextmanager
def fused_attention(net: nn.Module) -> Iterator[None]:
    """Within the `with`, `net`'s attention runs through torch's fused kernel (`sdpa_attention`) whatever its
    backend; restored after.

    For inference in float32 (correction): the same values up to float rounding (~1e-6), 1.2-1.5x the
    cells/s of the written-out guarded softmax on CPU. An attached observer still sees the weights.
    """
    guarded = [m for m in net.modules() if isinstance(m, MultiHeadSelfAttention) and m.backend == "guarded"]
    for module in guarded:
        module.backend = "sdpa"
    try:
        yield
    finally:
        for module in guarded:
            module.backend = "guarded"


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, backend: str, mlp_ratio: int = 2,
                 block_size: int | None = None, checkpoint_blocks: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadSelfAttention(d_model, n_heads, dropout, backend, block_size, checkpoint_blocks)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model),
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                bias: ScoreBias | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask, bias))
        return x + self.drop(self.mlp(self.norm2(x)))


class EntropyMeter:
    """Mean entropy (nats) of the attention rows, per layer and head, over the cells it was shown."""

    def __init__(self, n_layers: int, n_heads: int):
        self.total = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.rows = torch.zeros(n_layers, dtype=torch.float64)

    def add(self, layer: int, weights: torch.Tensor, first: int = 0) -> None:
        """An Observer (with its layer bound first): weights (B, H, Q, L)."""
        entropy = torch.special.entr(weights.double()).sum(-1)  # (B, H, Q); entr(0) = 0
        self.total[layer] += entropy.sum((0, 2)).cpu()
        self.rows[layer] += weights.shape[0] * weights.shape[2]

    def mean(self) -> torch.Tensor:
        """(layers, heads) mean entropy per attention row."""
        return self.total / self.rows.clamp(min=1.0)[:, None]


def sinusoidal_genomic_encoding(
    position_bp: np.ndarray, d_model: int, min_wavelength: float = ModelConfig.min_wavelength,
    max_wavelength: float = ModelConfig.max_wavelength,
) -> np.ndarray:
    """Sinusoids of base-pair position with geometric wavelengths from 1 kb to 300 Mb.

    Computed in float64: a float32 angle at 2.5e8 bp with a 1 kb wavelength would be off by ~0.1 rad.
    Returns (len(position_bp), d_model).
    """
    n_freq = d_model // 2
    wavelengths = np.geomspace(min_wavelength, max_wavelength, n_freq)
    angles = np.asarray(position_bp, dtype=np.float64)[:, None] * (2.0 * math.pi / wavelengths)[None, :]
    encoding = np.zeros((len(position_bp), d_model))
    encoding[:, 0 : 2 * n_freq : 2] = np.sin(angles)
    encoding[:, 1 : 2 * n_freq : 2] = np.cos(angles)
    return encoding


class GenomicCoordinateEncoding(nn.Module):
    """One position vector per token: fixed sinusoids of its base-pair coordinate plus a learned chromosome vector.

    Unplaced tokens get no sinusoid; their learned 'unplaced' chromosome vector is their encoding.
    mode: 'real' (true coordinates), 'shuffled' (coordinates permuted across tokens), 'none' (no position
    at all), 'learned' (a learned vector per token, no coordinates): the last three are ablations.
    `position` and `chromosome` hold the coordinates as the model sees them (permuted when shuffled).
    """

    MODES = POSITION_ENCODINGS  # batchfix.config holds the choices
    COORDINATE_MODES = ("real", "shuffled")  # the modes that tell the model genomic coordinates

    def __init__(self, position_bp: np.ndarray, chromosome: np.ndarray, d_model: int, mode: str = "real",
                 min_wavelength: float = ModelConfig.min_wavelength, max_wavelength: float = ModelConfig.max_wavelength,
                 seed: int = 0):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"model.position_encoding must be one of {self.MODES}, got '{mode}'.")
        self.mode = mode
        if mode == "shuffled":
            permutation = np.random.default_rng(seed).permutation(len(position_bp))
            position_bp, chromosome = position_bp[permutation], chromosome[permutation]
        self.position = np.asarray(position_bp)
        sinusoid = sinusoidal_genomic_encoding(position_bp, d_model, min_wavelength, max_wavelength)
        sinusoid[chromosome == UNPLACED] = 0.0
        self.register_buffer("sinusoid", torch.tensor(sinusoid, dtype=torch.float32), persistent=False)
        self.register_buffer("chromosome", torch.as_tensor(chromosome, dtype=torch.long), persistent=False)
        if mode == "learned":
            self.table = nn.Parameter(torch.randn(len(position_bp), d_model) * 0.02)
        else:
            self.chromosome_embedding = nn.Embedding(len(CHROMOSOMES), d_model)
            nn.init.normal_(self.chromosome_embedding.weight, std=0.02)

    def forward(self) -> torch.Tensor:
        """(tokens, d_model) encoding; zeros in mode 'none'."""
        if self.mode == "none":
            return torch.zeros_like(self.sinusoid)
        if self.mode == "learned":
            return self.table
        return self.sinusoid + self.chromosome_embedding(self.chromosome)


class GenomicDistanceBias(nn.Module):
    """A learned score bias per head for the base-pair distance between two tokens (a locality prior).

    Same-chromosome pairs fall into `n_buckets` buckets: closer than min_bp, then log-spaced up to
    max_bp (the last one open-ended). Pairs on different chromosomes share one more learned term, and
    pairs with an unplaced token another. It starts at zero, so any locality is learned from the data;
    with shuffled coordinates it is learned over the wrong pairs. Called as a ScoreBias.
    """

    def __init__(self, position_bp: np.ndarray, chromosome: torch.Tensor | np.ndarray, n_heads: int,
                 n_buckets: int = 16, min_bp: float = 1e3, max_bp: float = 3e8):
        super().__init__()
        self.n_buckets = n_buckets
        self.log_min, self.log_span = math.log(min_bp), math.log(max_bp / min_bp)
        # Integer base pairs: a dtype cast of the model (.half(), .double()) leaves them exact.
        self.register_buffer("position", torch.as_tensor(np.round(position_bp), dtype=torch.long), persistent=False)
        self.register_buffer("chromosome", torch.as_tensor(chromosome, dtype=torch.long), persistent=False)
        self.table = nn.Parameter(torch.zeros(n_buckets + 2, n_heads))  # distance buckets, other chromosome, unplaced

    def buckets(self, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """(Q, L) bucket of each (query, key) pair for queries first..stop."""
        position, chromosome = self.position, self.chromosome
        distance = (position[first:stop, None] - position[None, :]).abs().float()  # (Q, L) bp
        scaled = (distance.clamp(min=1.0).log() - self.log_min) / self.log_span  # 0 at min_bp, 1 at max_bp
        bucket = (scaled * (self.n_buckets - 1)).floor().long().add(1).clamp(0, self.n_buckets - 1)
        query_chromosome = chromosome[first:stop, None]  # (Q, 1)
        bucket = torch.where(query_chromosome == chromosome[None, :], bucket, self.n_buckets)
        unplaced = (query_chromosome == UNPLACED) | (chromosome[None, :] == UNPLACED)
        return torch.where(unplaced, self.n_buckets + 1, bucket)

    def forward(self, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """(H, Q, L) bias for queries first..stop."""
        return self.table[self.buckets(first, stop)].permute(2, 0, 1)  # (Q, L, H) -> (H, Q, L)
