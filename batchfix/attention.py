"""Guarded multi-head self-attention over locus tokens, and the genomic-coordinate encoding.

The two fp16 guards: q is scaled by 1/sqrt(d_k) *before* QK^T (so the product stays inside
fp16's range), and the row maximum is subtracted before exp (so exp never overflows).
Masked keys get -inf; a row whose keys are all masked yields zeros, not NaN.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from batchfix.genome import CHROMOSOMES, UNPLACED

BACKENDS = ("guarded", "sdpa")


def guarded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Softmax attention written out with both fp16 guards.

    q, k, v: (B, H, L, Dh); key_padding_mask: (B, L) bool, True = padding. Returns (B, H, L, Dh).
    """
    q = q * (q.shape[-1] ** -0.5)  # guard 1: scale before the product
    scores = q @ k.transpose(-2, -1)  # (B, H, L, L)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    row_max = scores.amax(-1, keepdim=True)  # guard 2: subtract the row maximum before exp
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.softmax(scores - row_max.detach(), dim=-1)
    if key_padding_mask is not None:
        all_masked = key_padding_mask.all(-1)[:, None, None, None]  # (B, 1, 1, 1)
        weights = weights.masked_fill(all_masked, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The same attention through torch's fused kernel (its kernels apply the same guards)."""
    attn_mask = None
    if key_padding_mask is not None:
        attn_mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, L) True = attend
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if key_padding_mask is not None:
        out = out.masked_fill(key_padding_mask.all(-1)[:, None, None, None], 0.0)
    return out


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection and a choice of backend."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, backend: str = "guarded"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.d_model ({d_model}) must be divisible by model.n_heads ({n_heads}).")
        if backend not in BACKENDS:
            raise ValueError(f"model.attention must be one of {BACKENDS}, got '{backend}'.")
        self.n_heads, self.dropout, self.backend = n_heads, dropout, backend
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, d_model = x.shape
        # (B, L, 3D) -> (B, L, 3, H, Dh) -> (3, B, H, L, Dh)
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        attend = guarded_attention if self.backend == "guarded" else sdpa_attention
        out = attend(qkv[0], qkv[1], qkv[2], key_padding_mask, self.dropout if self.training else 0.0)
        # (B, H, L, Dh) -> (B, L, H, Dh) -> (B, L, D)
        return self.out(out.transpose(1, 2).reshape(batch, length, d_model))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, backend: str, mlp_ratio: int = 2):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadSelfAttention(d_model, n_heads, dropout, backend)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model),
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask))
        return x + self.drop(self.mlp(self.norm2(x)))


def sinusoidal_genomic_encoding(
    position_bp: np.ndarray, d_model: int, min_wavelength: float = 1e3, max_wavelength: float = 3e8,
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
    """Fixed sinusoidal base-pair encoding plus a learned chromosome encoding, one vector per token.

    Unplaced tokens get no sinusoid; their learned 'unplaced' chromosome vector is their encoding.
    mode: 'real' (true coordinates), 'shuffled' (positions permuted across tokens: an ablation),
    'none' (no coordinate encoding at all: an ablation).
    """

    MODES = ("real", "shuffled", "none")

    def __init__(self, position_bp: np.ndarray, chromosome: np.ndarray, d_model: int, mode: str = "real",
                 min_wavelength: float = 1e3, max_wavelength: float = 3e8, seed: int = 0):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"model.position_encoding must be one of {self.MODES}, got '{mode}'.")
        self.mode = mode
        if mode == "shuffled":
            permutation = np.random.default_rng(seed).permutation(len(position_bp))
            position_bp, chromosome = position_bp[permutation], chromosome[permutation]
        sinusoid = sinusoidal_genomic_encoding(position_bp, d_model, min_wavelength, max_wavelength)
        sinusoid[chromosome == UNPLACED] = 0.0
        self.register_buffer("sinusoid", torch.tensor(sinusoid, dtype=torch.float32), persistent=False)
        self.register_buffer("chromosome", torch.as_tensor(chromosome, dtype=torch.long), persistent=False)
        self.chromosome_embedding = nn.Embedding(len(CHROMOSOMES), d_model)
        nn.init.normal_(self.chromosome_embedding.weight, std=0.02)

    def forward(self) -> torch.Tensor:
        """(tokens, d_model) encoding; zeros in mode 'none'."""
        if self.mode == "none":
            return torch.zeros_like(self.sinusoid)
        return self.sinusoid + self.chromosome_embedding(self.chromosome)
