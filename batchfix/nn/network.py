"""The batchfix network in pure torch: locus-token encoder -> batch-free latent -> batch-conditioned decoder."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from batchfix.config import ModelConfig
from batchfix.data.genome import LocusWindows
from batchfix.data.normalize import LIBRARY_SIZE, log_cp10k
from batchfix.nn.attention import GenomicCoordinateEncoding, GenomicDistanceBias, TransformerBlock


class GradientReversal(torch.autograd.Function):
    """Identity forward; gradient multiplied by -1 backward (adversarial batch training)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class LocusEncoder(nn.Module):
    """Per-cell standardized log expression -> (mu, logvar) of the latent posterior."""

    def __init__(self, cfg: ModelConfig, windows: LocusWindows, n_genes: int):
        super().__init__()
        n_tokens, per_token = windows.gene_index.shape
        self.register_buffer("gene_index", torch.as_tensor(windows.gene_index.reshape(-1)), persistent=False)
        self.register_buffer("slot_mask", torch.as_tensor(~windows.pad_mask, dtype=torch.float32), persistent=False)
        self.n_tokens, self.per_token, self.n_genes = n_tokens, per_token, n_genes
        self.checkpointing = cfg.gradient_checkpointing
        self.shared_values = cfg.token_identity == "coordinates"
        if not self.shared_values:
            # A window's embedding = sum over its genes of value x gene-specific vector (grouped linear layer).
            self.gene_vectors = nn.Parameter(torch.randn(n_tokens, per_token, cfg.d_model) / per_token ** 0.5)
            self.token_bias = nn.Parameter(torch.zeros(n_tokens, cfg.d_model))
        else:
            # One vector per window slot shared by every token: only the position encoding tells tokens apart.
            self.value_vectors = nn.Parameter(torch.randn(per_token, cfg.d_model) / per_token ** 0.5)
        self.coordinates = GenomicCoordinateEncoding(
            windows.position, windows.chromosome, cfg.d_model, cfg.position_encoding,
            cfg.min_wavelength, cfg.max_wavelength, seed=cfg.shuffle_seed or 0,
        )
        self.distance_bias = None
        if cfg.distance_bias and cfg.position_encoding in GenomicCoordinateEncoding.COORDINATE_MODES:
            self.distance_bias = GenomicDistanceBias(self.coordinates.position, self.coordinates.chromosome,
                                                     cfg.n_heads, cfg.distance_buckets, cfg.min_wavelength,
                                                     cfg.max_wavelength)
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.attention, block_size=cfg.attention_block_size,
                             checkpoint_blocks=cfg.gradient_checkpointing)
            for _ in range(cfg.n_layers)
        )
        self.norm = nn.LayerNorm(cfg.d_model)
        self.to_latent = nn.Linear(cfg.d_model, 2 * cfg.latent_dim)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, G) standardized values -> (B, T, D) token embeddings with their position encoding."""
        batch = x.shape[0]
        padded = F.pad(x, (0, 1))  # (B, G + 1): the last column is the zero used by padding slots
        slots = padded[:, self.gene_index].view(batch, self.n_tokens, self.per_token)  # (B, T, p)
        if self.shared_values:
            return torch.einsum("btp,pd->btd", slots, self.value_vectors) + self.coordinates()  # (B, T, D)
        weights = self.gene_vectors * self.slot_mask[..., None]  # (T, p, D), padding slots zeroed
        return torch.einsum("btp,tpd->btd", slots, weights) + self.token_bias + self.coordinates()  # (B, T, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.embed(x)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, None, self.distance_bias, use_reentrant=False)
            else:
                tokens = block(tokens, bias=self.distance_bias)
        pooled = self.norm(tokens).mean(dim=1)  # (B, D)
        mu, logvar = self.to_latent(pooled).chunk(2, dim=-1)
        return mu, logvar.clamp(-10.0, 10.0)

    @contextmanager
    def observing(self, observer: Callable[[int, torch.Tensor, int], None]) -> Iterator[None]:
        """Within the `with`, every block of queries of every layer calls observer(layer, weights (B, H, Q, L), first
        query): how training measures attention entropy and `attention` draws its maps."""
        for layer, block in enumerate(self.blocks):
            block.attn.observer = partial(observer, layer)
        try:
            yield
        finally:
            for block in self.blocks:
                block.attn.observer = None


class ExpressionDecoder(nn.Module):
    """(z, batch) -> per-gene expression: NB mean fractions (softmax) or Gaussian means."""

    def __init__(self, cfg: ModelConfig, n_genes: int, n_batches: int):
        super().__init__()
        self.n_batches = n_batches
        self.hidden = nn.Linear(cfg.latent_dim + n_batches, cfg.decoder_hidden)
        self.norm = nn.LayerNorm(cfg.decoder_hidden)
        self.out = nn.Linear(cfg.decoder_hidden + n_batches, n_genes)
        self.log_theta = nn.Parameter(torch.zeros(n_genes))  # NB inverse dispersion per gene

    def forward(self, z: torch.Tensor, batch_index: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(batch_index, self.n_batches).to(z.dtype)  # (B, n_batches)
        h = F.relu(self.norm(self.hidden(torch.cat([z, onehot], dim=-1))))
        return self.out(torch.cat([h, onehot], dim=-1))  # (B, G) logits or means


def negative_binomial_log_likelihood(counts: torch.Tensor, mean: torch.Tensor, log_theta: torch.Tensor) -> torch.Tensor:
    """Per-cell NB log-likelihood summed over genes; mean (B, G), log_theta (G,)."""
    theta = log_theta.exp()
    eps = 1e-8
    log_theta_mu = torch.log(theta + mean + eps)
    ll = (
        theta * (torch.log(theta + eps) - log_theta_mu)
        + counts * (torch.log(mean + eps) - log_theta_mu)
        + torch.lgamma(counts + theta) - torch.lgamma(theta) - torch.lgamma(counts + 1.0)
    )
    return ll.sum(-1)


class BatchfixNet(nn.Module):
    """Encoder (no batch input) + batch-conditioned decoder + optional batch adversary on z."""

    def __init__(self, cfg: ModelConfig, windows: LocusWindows, n_genes: int, n_batches: int,
                 gene_mean: np.ndarray, gene_std: np.ndarray):
        super().__init__()
        self.cfg, self.n_genes, self.n_batches = cfg, n_genes, n_batches
        self.register_buffer("gene_mean", torch.as_tensor(gene_mean, dtype=torch.float32))
        self.register_buffer("gene_std", torch.as_tensor(gene_std, dtype=torch.float32))
        self.encoder = LocusEncoder(cfg, windows, n_genes)
        self.decoder = ExpressionDecoder(cfg, n_genes, n_batches)
        self.adversary = nn.Sequential(nn.Linear(cfg.latent_dim, 64), nn.ReLU(), nn.Linear(64, n_batches))
        self.extra_decoder: ExpressionDecoder | None = None  # the genes the encoder does not read (`add_extra_genes`)

    def add_extra_genes(self, n_extra: int) -> None:
        """A second NB decoder for `n_extra` genes the encoder does not read (fitted after the main fit with the
        encoder frozen: batchfix.correction.extra_genes; their dispersions and ratios: training.tables)."""
        self.extra_decoder = ExpressionDecoder(self.cfg, n_extra, self.n_batches)

    def log_expression(self, x: torch.Tensor) -> torch.Tensor:
        """Counts -> log1p(counts per 10k); log-scale input passes through."""
        return x if self.cfg.likelihood == "gaussian" else log_cp10k(x)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        standardized = (self.log_expression(x) - self.gene_mean) / self.gene_std
        return self.encoder(standardized)

    def loss(self, x: torch.Tensor, batch_index: torch.Tensor, kl_scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Negative ELBO (+ adversarial term) per cell, averaged over the minibatch."""
        mu, logvar = self.encode(x)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if self.training else mu
        out = self.decoder(z, batch_index)
        if self.cfg.likelihood == "nb":
            library = x.sum(-1, keepdim=True)
            mean = torch.softmax(out.float(), dim=-1) * library
            reconstruction = -negative_binomial_log_likelihood(x, mean, self.decoder.log_theta)
        else:
            target = (x - self.gene_mean) / self.gene_std
            reconstruction = 0.5 * ((out.float() - target) ** 2).sum(-1)
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar).sum(-1)
        total = reconstruction + kl_scale * self.cfg.kl_weight * kl
        # elbo: the negative ELBO at full KL weight, comparable across epochs (early stopping watches it).
        losses = {"reconstruction": reconstruction.mean(), "kl": kl.mean(), "elbo": (reconstruction + kl).mean()}
        if self.cfg.adversarial_weight > 0:
            logits = self.adversary(GradientReversal.apply(z))
            adversarial = F.cross_entropy(logits.float(), batch_index)
            losses["adversarial"] = adversarial
            losses["loss"] = total.mean() + self.cfg.adversarial_weight * adversarial
        else:
            losses["loss"] = total.mean()
        return losses

    def decoded(self, mu: torch.Tensor, batch: int | torch.Tensor | None = None,
                present: torch.Tensor | None = None, members: torch.Tensor | None = None) -> torch.Tensor:
        """Expected log expression (log1p per 10k, or the log input's scale) of latents `mu` (B, latent) decoded
        as one training batch (an int), as each cell's own batch ((B,) codes), or, if None, averaged over the
        training batches (each gene's over its `members`, as `average_and_own_fractions`; the mean of the NB means,
        then log1p). `present` (G,) bool: genes the input holds; the NB means are then per 10k counts of those
        genes, as the cell's observed values are."""
        mean = self.mean_fractions(mu, batch, present, members=members)
        if self.cfg.likelihood == "gaussian":
            return mean * self.gene_std + self.gene_mean
        return torch.log1p(mean * LIBRARY_SIZE)

    def mean_fractions(self, mu: torch.Tensor, batch: int | torch.Tensor | None = None,
                       present: torch.Tensor | None = None, extra: bool = False,
                       members: torch.Tensor | None = None) -> torch.Tensor:
        """(B, G) the decoder's NB mean fractions (each cell's expected share of its library per gene; of the
        `present` genes' library when given) as in `decoded`; the Gaussian model's standardized means. With
        `extra`, the extra genes' decoder's fractions of their own library."""
        n_cells = mu.shape[0]
        if batch is None:
            return self.average_and_own_fractions(mu, None, present, extra, members)[0]
        if isinstance(batch, int):
            batch = torch.full((n_cells,), batch, dtype=torch.long, device=mu.device)
        return self._of_present(self._decoder_means(mu, batch, extra), present, extra)

    def average_and_own_fractions(self, mu: torch.Tensor, codes: torch.Tensor | None, present: torch.Tensor | None,
                                  extra: bool = False, members: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean fractions averaged over the training batches, each cell's own batch's; None without `codes`),
        each (B, G) as `mean_fractions` gives them, from one decoder pass per training batch: a cell's own batch is
        one of those passes. Cells whose code is not a training batch get the average over every batch as their
        own. `members` (n_batches, G) of 0 / 1: the batches each gene's average is taken over (None: all)."""
        total, chosen, own = 0.0, 0.0, None
        for b in range(self.n_batches):
            out = self._decoder_means(mu, torch.full((mu.shape[0],), b, dtype=torch.long, device=mu.device), extra)
            total = total + out
            if members is not None:
                chosen = chosen + out * members[b]
            if codes is not None:
                own = torch.empty_like(out) if own is None else own
                own[codes == b] = out[codes == b]
        average = total / self.n_batches
        reference = average if members is None else chosen / members.sum(0)
        if codes is not None:
            unknown = (codes < 0) | (codes >= self.n_batches)
            own[unknown] = average[unknown]
            own = self._of_present(own, present, extra)
        return self._of_present(reference, present, extra), own

    def _decoder_means(self, mu: torch.Tensor, codes: torch.Tensor, extra: bool) -> torch.Tensor:
        """(B, G) the decoder's means for batch `codes`: softmax fractions (NB, extra genes) or standardized means."""
        decoder = self.extra_decoder if extra else self.decoder
        out = decoder(mu, codes).float()  # (B, G)
        return torch.softmax(out, -1) if extra or self.cfg.likelihood == "nb" else out

    def _of_present(self, mean: torch.Tensor, present: torch.Tensor | None, extra: bool) -> torch.Tensor:
        """NB fractions renormalised to the `present` genes' library (the Gaussian model's means as they are)."""
        if present is not None and (extra or self.cfg.likelihood == "nb"):
            return mean / mean[:, present].sum(-1, keepdim=True)
        return mean

    @torch.no_grad()
    def corrected(self, x: torch.Tensor, reference: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent mean, denoised log1p expression per 10k): every cell decoded as batch `reference` or, if
        None, averaged over all training batches."""
        mu, _ = self.encode(x)
        return mu, self.decoded(mu, reference)
