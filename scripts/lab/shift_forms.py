"""Two structured forms of the counterfactual output's batch shift, beside the decoder's own and its state shrink.

The counterfactual output (batchfix/correction/counterfactual.py) is, for cell c of batch b,

    corrected = max(0, decoded_ref(z_c) + location_ref + k_b * (observed(c) - decoded_b(z_c) - location_b))

decoded_b(z) = log1p(e_b(z)), e_b the decoder's expected counts per 10k in batch b, and decoded_ref(z) = log1p(m(z)),
m the mean of the e_b over the training batches. Its marker loss under strong gene-wise effects is the state
dependence of the shift decoded_ref(z) - decoded_b(z) (docs/genewise_spread.md). Two forms that keep a state
dependence but constrain it, each built from one model's terms (`marker_loss.counterfactual_terms`):

    factor, state W     the own batch's term through one multiplicative factor per gene and batch, as a
                        chemistry's capture of each gene is (and as scripts/stress_set.py makes its effects):
                        decoded_b(z) -> log1p(f(b, g) m(z)) + W (decoded_b(z) - log1p(f(b, g) m(z))), with
                        f(b, g) = sum over b's cells of e_b(z) / sum over b's cells of m(z). At W = 0 the shift
                        depends on the cell's state only through the gene's expected level. The location and
                        one spread per batch are estimated again from the new residuals (all cells);
                        "default, recalibrated" is the default with that re-estimate alone.
    log-mean reference  decoded_ref(z) -> the mean over the training batches of decoded_b(z) (the log of the
    [, state 0.5]       geometric mean of the e_b): the shifts of the batches then sum to 0 at every state, so the
                        output's label-vs-rest differences, averaged over batches as the gene scores average them,
                        lose the state-dependent gap log(mean e_b) - mean(log e_b) the arithmetic reference adds.
                        The gap is >= 0, so this reference also lowers every gene's level: more values reach the
                        floor at 0.
    log-mean reference, the log-mean reference plus each gene's mean gap over the input's cells: only the gap's
    level kept [, 0.5]  state dependence is taken out, the gene's level stays the arithmetic reference's.

Beside them: the default (checked against batchfix.correct, regional_shift=apply) and correction.state_dependence
0.5 (the decoder term shrunk toward its batch mean). Scored as scripts/lab/decoding_scale.py scores its rows, with the
same options (--truth-layer, --model-dir, --out, --seeds).

    nice python -m scripts.lab.shift_forms data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2
    nice python -m scripts.lab.shift_forms stress_sd1.h5ad --truth-layer truth --seeds 0 1 2 --model-dir models/sd1
"""
from __future__ import annotations

import sys
from pathlib import Path

import anndata as ad
import numpy as np
import torch

import batchfix
from batchfix.nn.attention import fused_attention
from scripts.lab.decoding_scale import batch_means, main, trained_model
from scripts.lab.harness import BATCH_SIZE, Terms, counterfactual_terms, recalibration
from scripts.lab.marker_loss import check_shipped, reference_rows

FACTOR_STATES = (0.0, 0.25, 0.5)  # W: the share of the decoder's own-batch term's departure from the factor form kept
STATE = 0.5  # correction.state_dependence of the rows shrunk toward the batch mean


def factor_own(terms: Terms) -> np.ndarray:
    """(cells, G) log1p(f(b, g) m(z_c)) for each cell's batch b."""
    n_batches = int(terms.codes.max()) + 1
    expected_ref, expected_own = np.expm1(terms.reference), np.expm1(terms.own)
    factor = batch_means(expected_own, terms.codes, n_batches) / np.maximum(
        batch_means(expected_ref, terms.codes, n_batches), np.finfo(np.float32).tiny)  # (batches, G)
    return np.log1p(factor[terms.codes] * expected_ref)


def with_own(terms: Terms, own: np.ndarray) -> np.ndarray:
    """Floored values with decoded_b = `own`, the location and one spread per batch estimated again from
    observed - own (`harness.recalibration`)."""
    location, scale = recalibration(terms, own)
    return np.maximum(terms.reference + location.mean(axis=0) + scale * (terms.observed - own - location[terms.codes]),
                      0.0)


@torch.no_grad()
def log_mean_reference(adata: ad.AnnData, model: batchfix.BatchfixModel) -> np.ndarray:
    """(cells, G) the mean over the training batches of decoded_b(z_c), float64."""
    net = model.net
    counts = np.asarray(adata[:, model.genes].X, dtype=np.float32)
    blocks = []
    with fused_attention(net):
        for start in range(0, len(counts), BATCH_SIZE):
            mu, _ = net.encode(torch.from_numpy(counts[start:start + BATCH_SIZE]))
            blocks.append(sum(net.decoded(mu, b) for b in range(net.n_batches)).numpy() / net.n_batches)
    return np.concatenate(blocks).astype(np.float64)


def shrunk(terms: Terms, decoder: np.ndarray, weight: float) -> np.ndarray:
    """Floored values with the decoder term `decoder` shrunk toward its batch mean (`Terms.state_shrunk`)."""
    return np.maximum(terms.unclipped(decoder=terms.state_shrunk(decoder, weight)), 0.0)


def shift_rows(adata: ad.AnnData, batch_key: str, seed: int, model_path: Path | None) -> tuple[list, np.ndarray, dict]:
    """(modelled genes, counts on them, {row: corrected matrix}): uncorrected, ComBat, the default, state 0.5, the
    factor form at each of FACTOR_STATES and the log-mean reference, with and without its level kept."""
    model = trained_model(adata, batch_key, seed, model_path)
    terms = counterfactual_terms(adata, model, batch_key)
    default = np.maximum(terms.unclipped(), 0.0)
    check_shipped(default, adata, model, batch_key, "default")
    decoder = terms.decoder
    rows = {"default": default, f"state {STATE:g}": shrunk(terms, decoder, STATE),
            "default, recalibrated": with_own(terms, terms.own)}
    structured = factor_own(terms)
    for w in FACTOR_STATES:
        rows[f"factor, state {w:g}"] = with_own(terms, structured + w * (terms.own - structured))
    log_mean = log_mean_reference(adata, model)
    level_kept = log_mean + (terms.reference - log_mean).mean(axis=0)  # (cells, G) + (G,)
    for name, reference in (("log-mean reference", log_mean), ("log-mean reference, level kept", level_kept)):
        decoder = terms.decoder_term(reference=reference)
        rows[name] = np.maximum(terms.unclipped(decoder=decoder), 0.0)
        rows[f"{name}, state {STATE:g}"] = shrunk(terms, decoder, STATE)
    counts, uncorrected = reference_rows(adata, model.genes, batch_key)
    return list(model.genes), counts, {**uncorrected, **rows}


if __name__ == "__main__":
    sys.exit(main(build=shift_rows, doc=__doc__))
