"""Which scale the counterfactual output's batch shift is taken on: the decoder's log of the mean, or the expected log.

The counterfactual output (batchfix/correction/counterfactual.py) is, for cell c of batch b,

    corrected = max(0, decoded_ref(z_c) + location_ref + k_b * (observed(c) - decoded_b(z_c) - location_b))

with decoded_b(z) = log1p(10k * v_b(z)), v_b the decoder's expression fractions: the log of the expected counts per
10k. The observations are log1p(10k * N / L), N ~ NB(v_b(z) L, theta_g) for a cell of L counts, and their
expectation is lower than the log of the mean by a gap that depends on the cell's state (the expected count), on
the batch's depth and on the gene's dispersion. location_b removes the gap's mean per gene and batch; what depends
on the state stays in the residual, so a batch's gene factors and depth still change the cell's within-batch
differences.

Here the own batch's term is replaced by the expected log, E[log1p(a_b N)], N ~ NB(v_b(z) L_b, theta_g) with L_b the
batch's median library (over the modelled genes) and a_b = 10k / L_b (`ExpectedLog`: tabulated per gene over a grid
of expected counts). The location and spread are estimated again from the new residuals on all cells. Rows, each
built from one model's terms (`marker_loss.counterfactual_terms`, checked against the package's log-scale output):

    default                          the package's log-scale output with regional_shift=apply
    state W                          correction.state_dependence=W (the batch mean of the decoder term plus W times
                                     the cell's deviation from it), W in STATE_WEIGHTS
    expected-log own [, state W]     decoded_b(z) the expected log at the batch's median depth; decoded_ref as before
    expected-log both [, state W]    decoded_ref(z) the mean over the training batches of their expected logs at
                                     their median depths as well

Scores: scib-metrics' Total of each matrix's PCA, the gene-level scores of batchfix.eval.fidelity, and with
--truth-layer (a stress set of scripts/stress_set.py) the truth error of the group contrasts
(stress_set.contrast_truth_error over (batch, label) groups; a second model per seed is trained on the truth counts
of the same genes and corrected the same way) and the gene-level scores against the truth counts instead of the
stressed ones (columns "... (truth)": which true markers, DE ranks, neighbours and HVGs a correction of the stressed
counts recovers; the stressed counts themselves no longer score 1). --model-dir keeps the trained models and reuses
them.

    nice python -m scripts.lab.decoding_scale data/cellbench5.h5ad --seeds 0 1 2 --model-dir models/bundled
    nice python -m scripts.lab.decoding_scale data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq \\
        --model-dir models/pair
    python -m scripts.stress_set data/cellbench5.h5ad stress_sd1.h5ad --sd 1.0
    nice python -m scripts.lab.decoding_scale stress_sd1.h5ad --truth-layer truth --seeds 0 1 2 --model-dir models/sd1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import torch
from scipy.stats import nbinom

import batchfix
from batchfix.data.normalize import LIBRARY_SIZE
from batchfix.eval import fidelity, metrics
from batchfix.nn.attention import fused_attention
from scripts.benchmark import dense_float32, load, select_genes
from scripts.lab.harness import BATCH_SIZE, Terms, counterfactual_terms, recalibration
from scripts.lab.marker_loss import check_shipped, matrix_scores, reference_rows, summary
from scripts.stress_set import contrast_truth_error

TRAIN_OPTIONS = dict(threads=1, enable_progress_bar=False, label_key=None, n_top_genes=None)
CONTRAST = "Truth error (group contrasts, relative)"
SCORES = [metrics.TOTAL_SCORE, metrics.BATCH_SCORE, metrics.BIO_SCORE, *fidelity.GENE_METRICS]
STATE_WEIGHTS = (0.5, 0.25)  # correction.state_dependence values rebuilt beside 1


class ExpectedLog:
    """h_g(m, a) = E[log1p(a N)], N ~ NB(mean m, theta_g), tabulated per gene on a grid of log m (and log a),
    read by bilinear interpolation of log h (exact where h is a power of m and a, as it is for small a m). Counts are summed exactly up to EXACT_COUNTS, then over bins 5% wide; below the
    grid's smallest m, h is linear in m (it is a N's P(N = 1) term there)."""

    EXACT_COUNTS, BIN_RATIO, MAX_COUNT = 100, 1.05, 1e8

    def __init__(self, theta: np.ndarray, a_range: tuple[float, float], m_range=(1e-4, 1e6), n_m=96, n_a=24):
        self.log_m = np.linspace(np.log(m_range[0]), np.log(m_range[1]), n_m)
        self.log_a = np.linspace(np.log(a_range[0]) - 0.05, np.log(a_range[1]) + 0.05, n_a)
        edges, counts = self.count_bins()
        m = np.exp(self.log_m)
        logs = np.log1p(np.exp(self.log_a)[None, :] * counts[:, None])  # (bins, n_a)
        table = np.empty((len(theta), n_m, n_a))
        for g, t in enumerate(theta):
            cdf = nbinom.cdf(edges[None, :] - 1, t, (t / (t + m))[:, None])  # (n_m, edges)
            table[g] = np.diff(cdf, axis=1) @ logs
        log_table = np.log(np.maximum(table, np.finfo(np.float64).tiny))
        self.table = torch.as_tensor(log_table.reshape(len(theta), n_m * n_a))  # (G, n_m * n_a)
        self.n_m, self.n_a = n_m, n_a

    @classmethod
    def count_bins(cls) -> tuple[np.ndarray, np.ndarray]:
        """(bin edges, each bin's count): unit bins up to EXACT_COUNTS, then bins BIN_RATIO wide (geometric mean)."""
        edges = list(range(cls.EXACT_COUNTS + 1))
        while edges[-1] < cls.MAX_COUNT:
            edges.append(max(edges[-1] + 1, int(np.ceil(edges[-1] * cls.BIN_RATIO))))
        edges = np.array(edges, dtype=np.float64)
        low, high = edges[:-1], edges[1:] - 1
        return edges, np.where(high > low, np.sqrt(np.maximum(low, 1) * high), low)

    def __call__(self, m: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """(B, G) expected log1p(a N) for expected counts m (B, G) and scales a (B, 1)."""
        m = m.double()
        smallest = float(np.exp(self.log_m[0]))
        step_m, step_a = self.log_m[1] - self.log_m[0], self.log_a[1] - self.log_a[0]
        fm = ((m.clamp_min(smallest).log() - self.log_m[0]) / step_m).clamp(0, self.n_m - 1 - 1e-9)
        fa = ((a.double().log() - self.log_a[0]) / step_a).clamp(0, self.n_a - 1 - 1e-9).expand_as(fm)
        im, ia = fm.floor().long(), fa.floor().long()
        wm, wa = fm - im, fa - ia

        def at(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return torch.gather(self.table, 1, (i * self.n_a + j).T).T  # (B, G)

        h = torch.exp((1 - wm) * (1 - wa) * at(im, ia) + wm * (1 - wa) * at(im + 1, ia)
                      + (1 - wm) * wa * at(im, ia + 1) + wm * wa * at(im + 1, ia + 1))
        return torch.where(m < smallest, h * m / smallest, h)


def batch_means(values: np.ndarray, codes: np.ndarray, n_batches: int) -> np.ndarray:
    """(batches, G) mean of each batch's rows."""
    return np.stack([values[codes == b].mean(axis=0) for b in range(n_batches)])


@torch.no_grad()
def expected_logs(counts: np.ndarray, model: batchfix.BatchfixModel, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(own, reference): each cell's expected log in its own batch at that batch's median depth, and the mean over
    the training batches of theirs, (cells, G) float64."""
    net = model.net
    library = counts.sum(axis=1)
    median = np.array([np.median(library[codes == b]) for b in range(net.n_batches)])
    table = ExpectedLog(net.decoder.log_theta.exp().double().numpy(), (LIBRARY_SIZE / median.max(),
                                                                       LIBRARY_SIZE / median.min()))
    scale = torch.as_tensor(LIBRARY_SIZE / median)[:, None]  # (batches, 1)
    own, reference = [], []
    with fused_attention(net):
        for start in range(0, len(counts), BATCH_SIZE):
            mu, _ = net.encode(torch.from_numpy(counts[start:start + BATCH_SIZE]))
            code = torch.from_numpy(codes[start:start + len(mu)]).long()
            by_batch = torch.stack([table(torch.softmax(net.decoder(mu, torch.full_like(code, b)).float(), -1)
                                          * float(median[b]), scale[b].expand(len(mu), 1))
                                    for b in range(net.n_batches)], dim=1)  # (B, batches, G)
            own.append(by_batch[torch.arange(len(mu)), code].numpy())
            reference.append(by_batch.mean(dim=1).numpy())
    return np.concatenate(own), np.concatenate(reference)


def recalibrated(terms: Terms, own: np.ndarray, reference: np.ndarray) -> dict[str, np.ndarray]:
    """Unclipped values with decoded_b = `own` and decoded_ref = `reference`, the location and the spread estimated
    again from the residuals observed - own (all cells); at full state dependence and at each of STATE_WEIGHTS."""
    location, scale = recalibration(terms, own)
    decoder = reference - scale * own
    mean = terms.batch_mean(decoder)
    rest = location.mean(axis=0) + scale * (terms.observed - location[terms.codes])
    return {"": decoder + rest, **{f", state {w:g}": mean + w * (decoder - mean) + rest for w in STATE_WEIGHTS}}


def trained_model(adata: ad.AnnData, batch_key: str, seed: int, model_path: Path | None) -> batchfix.BatchfixModel:
    """The model saved at `model_path`, or one trained now (and saved there if a path is given)."""
    if model_path is not None and model_path.exists():
        return batchfix.BatchfixModel.load(model_path)
    model = batchfix.train(adata, batch_key=batch_key, seed=seed, **TRAIN_OPTIONS)
    if model_path is not None:
        model.save(model_path)
    return model


def seed_matrices(adata: ad.AnnData, batch_key: str, seed: int, model_path: Path | None) -> tuple[list, np.ndarray, dict]:
    """(modelled genes, counts on them, {row: corrected matrix}) for one model, trained or read from `model_path`."""
    model = trained_model(adata, batch_key, seed, model_path)
    terms = counterfactual_terms(adata, model, batch_key)
    default = np.maximum(terms.unclipped(), 0.0)
    check_shipped(default, adata, model, batch_key, "default")
    decoder = terms.decoder
    mean = terms.batch_mean(decoder)
    counts, uncorrected = reference_rows(adata, model.genes, batch_key)
    rows = {**uncorrected, "default": default,
            **{f"state {w:g}": np.maximum(terms.unclipped(decoder=mean + w * (decoder - mean)), 0.0)
               for w in STATE_WEIGHTS}}
    own, reference = expected_logs(counts, model, terms.codes)
    for name, decoded_ref in (("expected-log own", terms.reference), ("expected-log both", reference)):
        rows.update({name + suffix: np.maximum(values, 0.0)
                     for suffix, values in recalibrated(terms, own, decoded_ref).items()})
    return list(model.genes), counts, rows


def seed_scores(adata: ad.AnnData, args: argparse.Namespace, seed: int, build=seed_matrices) -> pd.DataFrame:
    """Every row's scores for one seed (and, with a truth layer, its contrast truth error and its gene scores against
    the truth); `build` makes the rows (`seed_matrices`'s arguments and result)."""
    path = (lambda part: Path(args.model_dir) / f"{part}_{seed}.ckpt") if args.model_dir else (lambda part: None)
    genes, counts, rows = build(adata, args.batch_key, seed, path("model"))
    table = pd.DataFrame.from_dict(matrix_scores(adata, counts, rows, args.batch_key, args.label_key, seed),
                                   orient="index")[SCORES]
    if args.truth_layer:
        truth = adata.copy()
        truth.X = dense_float32(truth.layers[args.truth_layer])
        truth_genes, truth_counts, truth_rows = build(truth, args.batch_key, seed, path("truth"))
        assert truth_genes == genes, "the truth's model has other genes, or another order"
        groups = (adata.obs[args.batch_key].astype(str) + "/" + adata.obs[args.label_key].astype(str)).to_numpy()
        table[CONTRAST] = [contrast_truth_error(rows[name], truth_rows[name], groups) for name in table.index]
        batch, labels = adata.obs[args.batch_key].to_numpy(), adata.obs[args.label_key].to_numpy()
        against_truth = {name: fidelity.gene_fidelity(truth_counts, rows[name], batch, labels) for name in table.index}
        for metric in fidelity.GENE_METRICS:
            table[f"{metric} (truth)"] = [against_truth[name][metric] for name in table.index]
    print(f"seed {seed}:\n{table.round(4).to_string()}", flush=True)
    return table.assign(seed=seed)


def parse_args(argv: list[str] | None = None, doc: str = __doc__) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("data", help=".h5ad with raw counts in X")
    parser.add_argument("--batches", nargs="+", help="keep only these batches (a sub-problem)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type")
    parser.add_argument("--n-top-genes", type=int, default=2000, help="batch-aware HVGs selected on X, as benchmark")
    parser.add_argument("--truth-layer", help="layer of the untouched counts (a stress set): adds the truth error and "
                                               "the gene scores against the truth")
    parser.add_argument("--model-dir", help="folder of the trained models (model_SEED.ckpt, truth_SEED.ckpt): "
                                            "reused where there, written where not")
    parser.add_argument("--out", help="write every seed's scores to this CSV")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, build=seed_matrices, doc: str = __doc__) -> int:
    """Score the rows `build` makes (default: this script's) for every seed and print their mean ± sd."""
    args = parse_args(argv, doc)
    adata = load(args.data, args.batch_key, args.label_key, None, args.batches)
    if args.truth_layer and args.truth_layer not in adata.layers:
        raise SystemExit(f"--truth-layer: no layer '{args.truth_layer}' in {args.data}; layers: {list(adata.layers)}")
    adata = select_genes(adata, args.batch_key, args.n_top_genes)
    if args.model_dir:
        Path(args.model_dir).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    by_seed = pd.concat([seed_scores(adata, args, seed, build) for seed in args.seeds])
    if args.out:
        by_seed.to_csv(args.out)
    with pd.option_context("display.width", 250, "display.max_columns", None):
        print(f"\nMean ± sd over seeds {args.seeds}:\n{summary(by_seed).to_string()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
