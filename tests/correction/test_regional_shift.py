"""correction.regional_shift: the counterfactual output can leave a cell's regional (copy-number-like) shift in.

The smoother is checked on constructed values; the option on a tiny model trained on the real 200-cell
subset with an injected clone (scripts/inject_clones.py) in one cell line of one batch. Reference cells
(correction.normal_key): tests/correction/test_reference_cells.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import batchfix
from batchfix.api import train_config
from batchfix.correction import calibration, counterfactual, counts
from batchfix.correction.regional import GenomeSmoother, genome_smoother
from batchfix.correction.state_groups import LatentSample
from batchfix.data.normalize import log_cp10k
from batchfix.errors import ConfigError
from scripts import inject_clones

TINY = dict(n_top_genes=None, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8,
            decoder_hidden=32, batch_size=64, max_epochs=30, threads=1, enable_progress_bar=False,
            scale="log", likelihood="gaussian")

@pytest.fixture(scope="module")
def subset(log_scale_subset):
    """The subset on a log scale (conftest): these tests check the log-scale formula of a log-scale model."""
    return log_scale_subset



def test_the_smoother_averages_neighbours_within_each_chromosome_only():
    chromosome = ["1"] * 5 + ["2"] * 3 + [None] * 2
    smoother = GenomeSmoother(chromosome, window=3)
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 9.0, 9.0]])
    assert smoother(values).tolist() == [[1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 0.0, 0.0]]  # unplaced: no region
    spike = torch.zeros(1, 10)
    spike[0, 2] = 3.0
    assert smoother(spike)[0].tolist() == pytest.approx([0, 1, 1, 1, 0, 0, 0, 0, 0, 0])


def test_a_shuffled_order_smooths_over_unrelated_genes():
    chromosome = ["1"] * 50 + ["2"] * 50
    regional = torch.cat([torch.ones(1, 50), -torch.ones(1, 50)], dim=1)  # a whole-chromosome shift
    real = genome_smoother(chromosome, "genome", 20, seed=0)(regional)
    shuffled = [genome_smoother(chromosome, "shuffled", 20, seed=s)(regional) for s in (1, 2)]
    assert torch.allclose(real, regional)
    assert all(s.abs().mean() < 0.5 for s in shuffled)  # mixed chromosomes average out
    assert not torch.allclose(shuffled[0], shuffled[1])  # each seed its own order


def test_the_option_is_checked():
    with pytest.raises(ConfigError, match="regional_shift must be one of"):
        train_config(regional_shift="maybe")
    with pytest.raises(ConfigError, match="regional_window must be >= 2"):
        train_config(regional_window=1)


@pytest.fixture(scope="module")
def tiny_model(subset):
    return batchfix.train(subset, batch_key="batch", seed=0, **TINY)


def test_the_regional_order_ablation_smooths_over_another_order_and_is_recorded(subset, tiny_model):
    """ablation.regional_order=shuffled (batchfix.correct's keyword regional_order): the same split over a random
    gene order, so another regional part is kept; uns records the ablation with the options."""
    genome = batchfix.correct(subset, tiny_model, copy=True)
    shuffled = batchfix.correct(subset, tiny_model, copy=True, regional_order="shuffled", regional_seed=3)
    assert genome.uns["batchfix"]["params"]["regional_order"] == "genome"
    assert shuffled.uns["batchfix"]["params"]["regional_order"] == "shuffled"
    assert shuffled.uns["batchfix"]["params"]["regional_seed"] == 3
    assert (genome.layers["batchfix"] != shuffled.layers["batchfix"]).nnz > 0


def in_model_order(adata, model, mode: str, **options) -> np.ndarray:
    """The corrected layer's modelled genes (cells, genes) in the model's (genomic) order, one forward pass; every
    change applied in full (shrink=none: the formula's terms, the evidence weights apart,
    tests/correction/test_evidence.py)."""
    options = {"shrink": "none", **options}
    out = batchfix.correct(adata, model, regional_shift=mode, batch_size=adata.n_obs, copy=True, **options)
    genes = out.var["batchfix_modelled"].to_numpy()
    # The layer holds the modelled genes in the input's order, the model in genomic order.
    column_of_model_gene = np.argsort(np.argsort([list(adata.var_names).index(g) for g in model.genes]))
    return np.asarray(out.layers["batchfix"][:, genes].toarray())[:, column_of_model_gene]


def test_a_regional_shift_of_one_state_is_kept_and_a_gene_wise_one_removed(subset, tiny_model, monkeypatch):
    """The decoder is made to shift one line of one batch by +0.5 on every chr1 gene (regional) and by +-0.5
    alternating on chr2 genes (gene by gene): `apply` removes both, `keep` leaves the regional one in, less the
    share the line holds of its batch (that part is the batch's mean shift), `keep_input` less its share of all
    cells."""
    labels, batch = subset.obs["cell_type"].astype(str).to_numpy(), subset.obs["batch"].astype(str).to_numpy()
    line, own = "H2228", "sc_celseq2"
    clone = (labels == line) & (batch == own)
    share = clone.sum() / (batch == own).sum()
    chromosome = np.array([str(c) for c in tiny_model.module.hparams.chromosome])
    on_chr2 = np.flatnonzero(chromosome == "2")
    regional = torch.as_tensor((chromosome == "1") * 0.5, dtype=torch.float32)
    gene_wise = torch.zeros(len(chromosome))
    gene_wise[on_chr2] = torch.as_tensor(np.where(np.arange(len(on_chr2)) % 2, 0.5, -0.5), dtype=torch.float32)
    unpatched = counterfactual.decoded_pair

    def shifted(net, mu, codes, reference, present=None, members=None):
        reference_values, own_values = unpatched(net, mu, codes, reference, present, members)
        assert len(mu) == len(clone)  # one pass over every cell (batch_size below), so rows are cells
        return reference_values, own_values + torch.as_tensor(clone)[:, None] * (regional + gene_wise)

    unpatched_terms, floored = counterfactual.output_terms, []

    def recording(*args, **kwargs):  # keep_input floors the values before its split: record where
        terms = unpatched_terms(*args, **kwargs)
        floored.append(terms[0].lt(0).numpy())
        return terms

    monkeypatch.setattr(counterfactual, "output_terms", recording)

    def corrected(mode):
        """(output, values raised to 0 before the regional split), each (cells, genes in model order)."""
        output = in_model_order(subset, tiny_model, mode, state_dependence=1.0)  # the split alone (state: below)
        return output, np.concatenate(floored)[-len(output):]  # the last pass over the cells is the correction's

    modes = ("apply", "keep", "keep_input")
    before = {mode: corrected(mode) for mode in modes}
    monkeypatch.setattr(counterfactual, "decoded_pair", shifted)
    after = {mode: corrected(mode) for mode in modes}
    changes = {}
    for mode in modes:
        (output_after, floored_after), (output_before, floored_before) = after[mode], before[mode]
        change = output_after[clone] - output_before[clone]  # (clone cells, genes in model order)
        unclipped = (np.minimum(output_after[clone], output_before[clone]) > 0).all(axis=0)
        if mode == "keep_input":
            unclipped &= ~(floored_after[clone] | floored_before[clone]).any(axis=0)
        chr1, chr2 = unclipped & (chromosome == "1"), on_chr2[unclipped[on_chr2]]
        assert chr1.sum() >= 5 and len(chr2) >= 5
        # keep_input keeps the regional mean over every gene, the floored ones included (the floor's lift is
        # taken from their neighbours); the other modes' regional part is per gene, read where no floor bit
        regional_change = change[:, chromosome == "1"].mean() if mode == "keep_input" else change[:, chr1].mean()
        changes[mode] = regional_change, change[:, chr2], gene_wise.numpy()[chr2]
    scale = -changes["apply"][0] / 0.5  # the batch's spread ratio k_b: the decoder's term enters as -k_b decoded_b
    assert 0.5 < scale < 2
    assert changes["keep"][0] == pytest.approx(-scale * 0.5 * share, abs=0.01)
    assert changes["keep_input"][0] == pytest.approx(-scale * 0.5 * clone.mean(), abs=0.015)  # the final floor lifts a little
    for mode in modes:
        gene_change, expected = changes[mode][1], -scale * changes[mode][2]
        if mode == "keep_input":  # each cell's share of its neighbours' floor lift is regional: compare gene to gene
            gene_change, expected = gene_change - gene_change.mean(axis=1, keepdims=True), expected - expected.mean()
        assert np.allclose(gene_change, expected, atol=0.02)


def test_keep_input_keeps_a_regional_shift_in_a_batch_location(subset, tiny_model, monkeypatch):
    """A regional shift in one batch's residual location (-0.5 on every chr1 gene, a CNV that all of a patient's
    cells carry and the decoder left to the location): `apply` and `keep` remove it with the
    location, `keep_input` keeps it less the batch's share of all cells (what the correction changes in every
    cell)."""
    own = "sc_celseq2"
    batch = subset.obs["batch"].astype(str).to_numpy()
    cells, share = batch == own, (batch == own).mean()
    chromosome = np.array([str(c) for c in tiny_model.module.hparams.chromosome])
    unpatched = calibration.Statistics.__init__

    def shifted(stats, net, *args, **kwargs):
        unpatched(stats, net, *args, **kwargs)
        stats.location[list(tiny_model.batch_categories).index(own), torch.as_tensor(chromosome == "1")] -= 0.5

    modes = ("apply", "keep", "keep_input")
    before = {mode: in_model_order(subset, tiny_model, mode)[cells] for mode in modes}
    monkeypatch.setattr(calibration.Statistics, "__init__", shifted)
    after = {mode: in_model_order(subset, tiny_model, mode)[cells] for mode in modes}
    change = {}
    for mode in modes:
        chr1 = (np.minimum(after[mode], before[mode]) > 0).all(axis=0) & (chromosome == "1")  # never clipped
        assert chr1.sum() >= 5
        if mode == "keep_input":  # its regional mean over every gene (the floor's lift is taken from neighbours)
            chr1 = chromosome == "1"
        change[mode] = (after[mode] - before[mode])[:, chr1].mean()
    scale = change["apply"] / 0.5  # the location enters as -k_b location_b
    assert 0.5 < scale < 2
    assert change["keep"] == pytest.approx(change["apply"], abs=0.01)
    assert change["keep_input"] == pytest.approx(scale * 0.5 * share, abs=0.01)


def test_an_input_zero_stays_zero_in_the_log_scale_output(subset, tiny_model):
    """A log-scale value of 0 is a gene not detected: the counterfactual output leaves it at 0, whatever the
    shift, and corrects the others."""
    zeroed = subset.copy()
    holes = np.random.default_rng(2).random(zeroed.shape) < 0.2
    zeroed.X = np.where(holes, 0.0, zeroed.X).astype(np.float32)
    output = in_model_order(zeroed, tiny_model, "keep")
    observed = np.asarray(zeroed[:, list(tiny_model.genes)].X)
    assert (output[observed == 0] == 0).all() and (observed == 0).sum() > 1000
    assert (output[observed > 0] > 0).mean() > 0.9


def test_a_regional_change_is_carried_by_the_nonzero_values_so_the_regions_mean_moves_by_it():
    """Constructed log values, one chromosome of 40 genes, half of them zero: the regional part of a change is
    taken out by the nonzero values alone, so zeros stay 0 and the mean over all the region's genes (what a CNV
    caller reads) loses that part (to the running windows' edges); an offset put in instead moves it by the offset."""
    smoother = GenomeSmoother(["1"] * 40, window=40)
    values = torch.full((1, 40), 2.0)
    zero = torch.zeros(1, 40, dtype=torch.bool)
    zero[0, ::2] = True
    values = values.masked_fill(zero, 0.0)
    change = torch.full((1, 40), 0.3)  # a regional shift of 0.3 in every gene of the region
    kept = counterfactual.without_regional_change(values, change, zero, smoother)
    assert (kept[zero] == 0).all()
    assert kept.mean().item() == pytest.approx(values.mean().item() - 0.3, abs=0.002)
    moved = counterfactual.without_regional_change(values, change, zero, smoother, offset=torch.full((1, 40), 0.1))
    assert moved.mean().item() == pytest.approx(values.mean().item() - 0.2, abs=0.002)


def default_terms(adata, model):
    """(batch codes (cells,), calibration.Statistics, then output_terms's values, decoder term, input and
    reference decoding, each (cells, G) in the model's order) of the default output (average reference)."""
    x = torch.from_numpy(np.asarray(adata[:, list(model.genes)].X.toarray(), dtype=np.float32))
    batch = adata.obs["batch"].astype(str).to_numpy()
    codes = torch.as_tensor([list(model.batch_categories).index(b) for b in batch])
    net = model.net.eval()
    with torch.no_grad():
        stats = calibration.Statistics(model.tables, None, [])
        return (codes, stats, *counterfactual.output_terms(net, x, net.encode(x)[0], codes, None, stats))


def test_state_dependence_applies_a_share_of_each_cells_deviation_from_its_batch_mean(subset, tiny_model):
    """state_dependence=w: the decoder term applied is its batch mean over the input's cells plus w times the
    cell's deviation (the documented formula, from the model's terms); w=0.5 is the default output, and w=0 gives
    every cell of a batch the same shift, so the output minus the input is the same for them wherever nothing
    was floored."""
    codes, stats, values, decoder, observed, _ = default_terms(subset, tiny_model)
    batch_mean = torch.stack([decoder[codes == b].mean(dim=0) for b in range(len(tiny_model.batch_categories))])
    deviation = decoder - batch_mean[codes]  # (cells, G)
    whole = in_model_order(subset, tiny_model, "apply", state_dependence=1.0)
    assert np.allclose(whole, values.clamp_min(0).numpy(), atol=1e-4)
    half = in_model_order(subset, tiny_model, "apply", state_dependence=0.5)
    assert np.array_equal(in_model_order(subset, tiny_model, "apply"), half)
    assert np.allclose(half, (values - 0.5 * deviation).clamp_min(0).numpy(), atol=1e-4)
    assert not np.allclose(half, whole, atol=1e-3)
    none = in_model_order(subset, tiny_model, "apply", state_dependence=0.0)
    change = none - observed.numpy()  # (cells, G): the shift plus the location and the rescaled residual
    k = stats.scale[codes].numpy()
    shift = change - (k - 1) * observed.numpy()  # what remains is the same for every cell of a batch
    for b in range(len(tiny_model.batch_categories)):
        rows = (codes == b).numpy()
        unfloored = (none[rows] > 0).all(axis=0)
        assert np.allclose(shift[rows][:, unfloored], shift[rows][:1, unfloored], atol=1e-4)
    with pytest.raises(ConfigError, match="state_dependence must be in"):
        train_config(state_dependence=1.5)


def test_residual_weight_keeps_that_share_of_each_cells_residual(subset, tiny_model):
    """residual_weight=a: the output is decoded_ref(z) + location_ref + a k_b (observed - decoded_b(z) - location_b)
    (the documented formula, from the model's terms); a=1 is the default, a=0 the reference's decoding plus
    its location for every cell, and a cell's distance from its batch's mean shrinks with a."""
    codes, stats, values, _, _, reference = default_terms(subset, tiny_model)
    base = reference + stats.ref_location  # (cells, G): what the decoder expects, as the reference
    whole = dict(state_dependence=1.0)  # the formula's decoder term is each cell's own (state: above)
    assert np.array_equal(in_model_order(subset, tiny_model, "apply", residual_weight=1.0, **whole),
                          in_model_order(subset, tiny_model, "apply", **whole))
    spread = {}  # mean within-batch sd of a gene, by weight
    for weight in (1.0, 0.5, 0.0):
        out = in_model_order(subset, tiny_model, "apply", residual_weight=weight, **whole)
        assert np.allclose(out, (base + weight * (values - base)).clamp_min(0).numpy(), atol=1e-4)
        spread[weight] = np.mean([out[(codes == b).numpy()].std(axis=0).mean()
                                  for b in range(len(tiny_model.batch_categories))])
    assert spread[0.0] < spread[0.5] < spread[1.0]
    with pytest.raises(ConfigError, match="residual_weight must be in"):
        train_config(residual_weight=-0.1)


def test_the_regional_correction_encodes_each_cell_once(subset, tiny_model, monkeypatch):
    """`keep` needs every batch's mean shift before the first cell is corrected: the pass that estimates it keeps
    the cells' latents, so the correction only decodes them, and gives the values a second encoding would. (The
    cells sampled for the state groups, here all 200, are encoded once more before that pass.)"""
    calls = []
    encode = type(tiny_model.net).encode

    def counted(net, x):
        calls.append(len(x))
        return encode(net, x)

    kept = batchfix.correct(subset, tiny_model, regional_shift="keep", batch_size=64, copy=True)
    monkeypatch.setattr(type(tiny_model.net), "encode", counted)
    again = batchfix.correct(subset, tiny_model, regional_shift="keep", batch_size=64, copy=True)
    keys = counts.name_keys(subset.obs_names)
    sampled = int(LatentSample(subset.n_obs, 8).picked(keys).sum())
    assert sampled == subset.n_obs and sum(calls) == subset.n_obs + sampled
    assert np.array_equal(kept.layers["batchfix"].toarray(), again.layers["batchfix"].toarray())
    calls.clear()
    unpatched = counterfactual.corrected

    def without_latents(*args, mu=None, **kwargs):
        return unpatched(*args, **kwargs)  # encodes the cells again

    monkeypatch.setattr(counterfactual, "corrected", without_latents)
    recomputed = batchfix.correct(subset, tiny_model, regional_shift="keep", batch_size=64, copy=True)
    assert sum(calls) == 2 * subset.n_obs + sampled
    assert np.allclose(recomputed.layers["batchfix"].toarray(), kept.layers["batchfix"].toarray(), atol=1e-5)


@pytest.mark.slow
def test_keeping_the_regional_shift_keeps_a_confounded_clone(bundled_adata):
    """A default model on the bundled data with a clone (gain chr7, loss chr17) in H2228 of sc_celseq2 only:
    with the whole state dependence applied, regional_shift=apply takes most of it for batch effect and keep leaves
    most of it in; the default output (keep, half the state dependence) keeps it too."""
    clone = inject_clones.Clone("H2228", ["sc_celseq2"])
    injected = inject_clones.inject(bundled_adata, clone, "cell_type", "batch", seed=0)
    model = batchfix.train(injected, batch_key="batch", seed=0, threads=1, enable_progress_bar=False)
    matrices = {}
    for mode, options in (("apply", dict(regional_shift="apply", state_dependence=1.0)),
                          ("keep", dict(regional_shift="keep", state_dependence=1.0)), ("default", {})):
        corrected = batchfix.correct(injected, model, copy=True, **options)
        genes = corrected.var["batchfix_modelled"].to_numpy()
        # normalised over the modelled genes, as the uncorrected references below are
        matrices[mode] = np.asarray(log_cp10k(corrected.layers["batchfix_counts"][:, genes]).toarray())
    original, after = (np.asarray(log_cp10k(np.asarray(a.X[:, genes]))) for a in (bundled_adata, injected))
    scores = inject_clones.clone_scores(matrices, original, after, injected.obs, bundled_adata.var[genes], clone,
                                        "confounded", "cell_type", "batch")
    kept = {name: np.mean(list(by_segment.values())) for name, by_segment in scores.items()}
    assert kept["keep"] > 0.8 and kept["apply"] < 0.5 and kept["default"] > 0.8, kept
