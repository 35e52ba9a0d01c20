"""The network's pieces against independent references: the NB likelihood, gradient reversal, the
decoder's batch averaging, and the data preparation the encoder sees."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributions import NegativeBinomial

from batchfix.config import DataConfig, DataKeys, ModelConfig
from batchfix.data.genome import GeneCoordinates, make_windows
from batchfix.data.io import expression_input, read_h5ad
from batchfix.data.normalize import LIBRARY_SIZE, log_cp10k
from batchfix.data.prepare import prepare
from batchfix.nn.network import BatchfixNet, GradientReversal, LocusEncoder, negative_binomial_log_likelihood


def test_negative_binomial_log_likelihood_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean = torch.rand(6, 50, generator=g, dtype=torch.float64) * 20 + 0.05
    log_theta = torch.randn(50, generator=g, dtype=torch.float64)
    theta = log_theta.exp()
    counts = NegativeBinomial(total_count=theta, logits=mean.log() - theta.log()).sample()
    expected = NegativeBinomial(total_count=theta, logits=mean.log() - theta.log()).log_prob(counts).sum(-1)
    ours = negative_binomial_log_likelihood(counts, mean, log_theta)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)  # eps=1e-8 inside the logs


def test_gradient_reversal_is_identity_forward_and_negates_gradients():
    x = torch.randn(4, 3, requires_grad=True)
    weights = torch.randn(4, 3)
    y = GradientReversal.apply(x)
    assert torch.equal(y, x)
    (y * weights).sum().backward()
    torch.testing.assert_close(x.grad, -weights)


def small_net(n_genes: int = 24, n_batches: int = 3) -> BatchfixNet:
    coords = GeneCoordinates(np.array(["1"] * n_genes, dtype=object), np.arange(n_genes) * 5000,
                             np.arange(n_genes) * 5000 + 100)
    model = ModelConfig(genes_per_token=4, d_model=16, n_heads=2, n_layers=1, latent_dim=5, decoder_hidden=16)
    torch.manual_seed(0)
    return BatchfixNet(model, make_windows(coords, 4), n_genes, n_batches, np.zeros(n_genes), np.ones(n_genes)).eval()


def test_corrected_expression_averages_the_decoder_over_batches_in_count_space():
    net = small_net()
    x = torch.poisson(torch.full((7, 24), 3.0))
    mu, average = net.corrected(x)
    per_batch = [torch.softmax(net.decoder(mu, torch.full((7,), b)), -1) * LIBRARY_SIZE for b in range(3)]
    torch.testing.assert_close(average, torch.log1p(torch.stack(per_batch).mean(0)))
    torch.testing.assert_close(net.corrected(x, reference=2)[1], torch.log1p(per_batch[2]))
    assert not torch.allclose(per_batch[0], per_batch[1]), "the batches decode differently: the average is not vacuous"
    # The latent is the encoder's posterior mean of log1p(CP10k), standardised: no batch enters it.
    torch.testing.assert_close(mu, net.encoder(log_cp10k(x))[0])


def test_prepare_orders_genes_genomically_and_computes_the_encoder_statistics(small_h5ad):
    inp = expression_input(read_h5ad(small_h5ad), DataKeys())
    prepared = prepare(inp, DataConfig(n_top_genes=150))
    coords = prepared.coordinates
    placed = coords.placed
    assert placed[: placed.sum()].all(), "unplaced genes trail"
    order = coords.genomic_order()
    np.testing.assert_array_equal(order, np.arange(len(order)), "already in genomic order")
    # Each column is the file's column of the gene it is named after.
    columns = inp.var.index.get_indexer(prepared.genes)
    assert (columns >= 0).all() and len(set(prepared.genes)) == 150
    np.testing.assert_array_equal(prepared.counts.toarray(), inp.counts[:, columns].toarray())
    # Standardisation statistics: mean and (population) sd of log1p(CP10k) over cells, sd floored by +0.01.
    values = log_cp10k(prepared.counts.toarray().astype(np.float64))
    np.testing.assert_allclose(prepared.gene_mean, values.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(prepared.gene_std, values.std(0) + 1e-2, rtol=1e-4, atol=1e-5)
    assert prepared.batch_categories == sorted(set(inp.batch))
    np.testing.assert_array_equal(np.asarray(prepared.batch_categories)[prepared.batch_index], inp.batch)


@pytest.mark.parametrize("weight", [0.0, 10.0])
def test_the_loss_adds_the_weighted_adversary_to_the_negative_elbo(weight):
    net = small_net()
    net.cfg = ModelConfig(**{**net.cfg.to_dict(), "adversarial_weight": weight})
    x, batch = torch.poisson(torch.full((9, 24), 2.0)), torch.tensor([0, 1, 2] * 3)
    losses = net.loss(x, batch, kl_scale=0.5)
    expected = losses["reconstruction"] + 0.5 * losses["kl"] + weight * losses.get("adversarial", 0.0)
    torch.testing.assert_close(losses["loss"], expected)
    assert ("adversarial" in losses) == (weight > 0)


def test_weight_decay_spares_biases_layernorm_and_dispersions():
    from batchfix.training.module import BatchfixModule

    module = BatchfixModule(model=ModelConfig(genes_per_token=4, d_model=16, n_heads=2).to_dict(),
                            genes=[f"g{i}" for i in range(12)], chromosome=["1"] * 12, start=list(range(12)),
                            end=list(range(1, 13)), batch_categories=["a", "b"], weight_decay=0.5)
    decayed, spared = module.parameter_groups()
    assert decayed["weight_decay"] == 0.5 and spared["weight_decay"] == 0.0
    names = {id(p): n for n, p in module.named_parameters()}
    spared_names = {names[id(p)] for p in spared["params"]}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    assert "net.decoder.log_theta" in spared_names
    assert {n for n in spared_names if not (n.endswith(".bias") or "norm" in n or n.endswith("log_theta"))} == set()
    assert "net.encoder.gene_vectors" in decayed_names and "net.decoder.out.weight" in decayed_names
    assert not any(n.endswith(".bias") or "norm" in n for n in decayed_names)
    assert len(decayed["params"]) + len(spared["params"]) == len(list(module.parameters()))


def encoder_for(n_genes: int = 24, **options) -> LocusEncoder:
    coords = GeneCoordinates(np.array(["1"] * n_genes, dtype=object), np.arange(n_genes) * 50_000,
                             np.arange(n_genes) * 50_000 + 900)
    model = ModelConfig(**{**dict(genes_per_token=4, d_model=16, n_heads=2, n_layers=2, latent_dim=5), **options})
    torch.manual_seed(0)
    return LocusEncoder(model, make_windows(coords, 4), n_genes).eval()


@pytest.mark.parametrize("identity, encoding, invariant", [
    ("coordinates", "none", True),  # nothing tells tokens apart: the encoder is a function of the set of windows
    ("coordinates", "real", False), ("coordinates", "learned", False), ("coordinates", "shuffled", False),
    ("learned", "none", False),  # per-token weights tell them apart whatever the encoding
])
def test_with_coordinate_identity_only_the_position_encoding_tells_tokens_apart(identity, encoding, invariant):
    encoder = encoder_for(token_identity=identity, position_encoding=encoding)
    assert hasattr(encoder, "token_bias") == (identity == "learned")
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    swapped = x.view(5, 6, 4)[:, [3, 0, 5, 1, 4, 2]].reshape(5, 24)  # (B, T, p): the windows' values moved
    with torch.no_grad():
        same = torch.allclose(encoder(x)[0], encoder(swapped)[0], atol=1e-5)
    assert same == invariant


def test_learned_position_encoding_is_a_trained_table():
    encoder = encoder_for(position_encoding="learned", token_identity="coordinates")
    table = encoder.coordinates.table
    assert table.shape == (6, 16) and not hasattr(encoder.coordinates, "chromosome_embedding")
    encoder.train()
    encoder(torch.randn(3, 24))[0].square().sum().backward()
    assert table.grad.abs().sum() > 0
