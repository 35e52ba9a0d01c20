"""Where in its quantile interval a positive count is mapped from: a draw (shipped) or the middle.

The corrected counts move each observed count to the same quantile of the reference's NB
(batchfix.correction.count_output). A zero's quantile is a draw in [0, F(0)]; a positive count k's can be a draw in
[F(k-1), F(k)] (`drawn`, every count's quantile drawn: the batch's mapped counts follow the reference exactly) or
the middle of that interval (`middle`, deterministic, as ComBat-seq maps). Under a small shift the middle keeps a
small count where it is, so part of a low-count gene's batch effect stays. Each row is scored on the batch-aware
2,000 HVGs by the batch effect left within each label (batchfix.eval.removal) and the gene lines
(batchfix.eval.fidelity) on log_cp10k over every gene (the layer a user makes; ComBat on the same values), and by
scIB on the PCA of log_cp10k over the HVGs (the benchmark's matrix; ComBat on those values):

    batchfix drawn / middle           layers['batchfix_counts'] of a default model trained on the cells (all genes)
    batchfix drawn / middle, shrink=none   the same model with every shift applied in full

    python -m scripts.lab.count_draws data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

import batchfix
from batchfix.correction import count_output
from batchfix.data.normalize import log_cp10k
from batchfix.eval import fidelity, metrics, removal
from scripts import baselines
from scripts.benchmark import add_data_arguments, load, select_genes

SCIB_COLUMNS = ["KMeans NMI", "iLISI", "KBET", "PCR comparison", "Batch correction", "Bio conservation", "Total"]


@contextlib.contextmanager
def middle_form():
    """count_output.mapped_counts with every positive count taken at the middle of its quantile interval."""
    shipped = count_output.mapped_counts

    def mapped(net, genes, tables, x, mu, codes, cell_keys, reference, seed, *options, **keywords):
        observed = x[:, genes.model_index]
        drawn = count_output.interval_points(seed, cell_keys, genes.keys)
        with mock.patch.object(count_output, "interval_points",
                               lambda *_: torch.where(observed == 0, drawn, 0.5)):
            return shipped(net, genes, tables, x, mu, codes, cell_keys, reference, seed, *options, **keywords)

    with mock.patch.object(count_output, "mapped_counts", mapped):
        yield


def batchfix_rows(cells, batch_key: str, label_key: str, seed: int) -> dict[str, sp.csr_matrix]:
    """Each form's layers['batchfix_counts'] (every gene), from one default model trained on `cells`."""
    model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                           enable_progress_bar=False)
    rows = {}
    for shrink in ("evidence", "none"):
        for form, patched in (("drawn", contextlib.nullcontext), ("middle", middle_form)):
            with patched():
                corrected = batchfix.correct(cells, model, copy=True, shrink=shrink, progress=False)
            name = f"batchfix {form}" + ("" if shrink == "evidence" else ", shrink=none")
            rows[name] = sp.csr_matrix(corrected.layers["batchfix_counts"])
    return rows


def scores(raw: sp.csr_matrix, rows: dict[str, sp.csr_matrix], hvg: np.ndarray, obs: pd.DataFrame, batch_key: str,
           label_key: str, truth: sp.csr_matrix | None = None, log_rows: bool = False) -> pd.DataFrame:
    """Removal and gene lines (log_cp10k over every gene, on the HVGs) and scIB (log_cp10k over the HVGs) of every
    row's counts (cells, every gene), and of ComBat on each scale, against the raw counts `raw` (the gene lines
    against `truth` where given: a stress set's untouched counts). With `log_rows` the rows are log values already
    (a log-scale model's output, cells x every gene), scored as they are on both scales."""
    batch, labels = obs[batch_key].astype(str).to_numpy(), obs[label_key].astype(str).to_numpy()
    against = raw if truth is None else truth
    library = np.asarray(against.sum(axis=1)).ravel()
    user = {name: sp.csr_matrix(values[:, hvg] if log_rows else log_cp10k(values)[:, hvg])
            for name, values in rows.items()}
    benchmark = dict(user) if log_rows else {name: sp.csr_matrix(log_cp10k(counts[:, hvg]))
                                              for name, counts in rows.items()}
    raw_user, raw_benchmark = np.asarray(log_cp10k(raw)[:, hvg].toarray()), np.asarray(log_cp10k(raw[:, hvg]).toarray())
    user["ComBat"] = baselines.combat(raw_user, obs, batch_key)
    benchmark["ComBat"] = baselines.combat(raw_benchmark, obs, batch_key)
    table = {}
    for name, values in user.items():
        genes = fidelity.gene_fidelity(against[:, hvg], values, batch, labels, library=library)
        table[name] = {**removal.removal_scores(raw_user, values, batch, labels),
                       **{metric: genes[metric] for metric in fidelity.GENE_METRICS}}
    embeddings = {name: metrics.pca_embedding(values) for name, values in benchmark.items()}
    scib = metrics.score_embeddings(obs, embeddings, metrics.pca_embedding(raw_benchmark), batch_key, label_key,
                                    neighbors="exact")
    for name in user:
        table[name].update({column: float(scib.loc[name, column]) for column in SCIB_COLUMNS})
    return pd.DataFrame(table).T


def seed_runs(argv: list[str] | None, description: str, rows_of_seed, extra_rows=None,
              log_rows: bool = False) -> pd.DataFrame:
    """The command line the per-seed lab scripts share: the data's cells and 2,000 HVGs, then for each --seeds seed
    the rows `rows_of_seed(cells, batch_key, label_key, seed)` scored by `scores` (as log values with `log_rows`;
    and the rows `extra_rows(raw, hvg, obs, batch_key, label_key, seed)` appended), each seed's table and the mean
    printed, every
    seed's rows written to --out and returned."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    add_data_arguments(parser)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", help="CSV of every seed's rows")
    parser.add_argument("--truth-layer", help="score the gene lines against this layer (a stress set's untouched "
                                              "counts, scripts.stress_set) instead of X")
    args = parser.parse_args(argv)
    cells = load(args.data, args.batch_key, args.label_key, None, args.batches)
    hvg = cells.var_names.get_indexer(select_genes(cells, args.batch_key, 2000).var_names)
    raw = sp.csr_matrix(cells.X, dtype=np.float64)
    truth = None if args.truth_layer is None else sp.csr_matrix(cells.layers[args.truth_layer], dtype=np.float64)
    frames = []
    for seed in args.seeds:
        rows = rows_of_seed(cells, args.batch_key, args.label_key, seed)
        frame = scores(raw, rows, hvg, cells.obs, args.batch_key, args.label_key, truth, log_rows)
        if extra_rows is not None:
            frame = pd.concat([frame, extra_rows(raw, hvg, cells.obs, args.batch_key, args.label_key, seed)])
        frames.append(seed_printed(frame, seed))
    return seeds_written(frames, args.out)


def seed_printed(frame: pd.DataFrame, seed: int) -> pd.DataFrame:
    """One seed's rows with their 'seed' column, printed."""
    print(f"seed {seed}\n{frame.to_string(float_format='%.3f')}", flush=True)
    return frame.assign(seed=seed)


def seeds_written(frames: list[pd.DataFrame], out: str | None) -> pd.DataFrame:
    """Every seed's rows (`seed_printed`) in one frame, their mean over seeds printed and the frame written to `out`
    (CSV) where given."""
    runs = pd.concat(frames)
    print(f"mean of {runs['seed'].nunique()} seeds\n"
          f"{runs.groupby(level=0, sort=False).mean().drop(columns='seed').to_string(float_format='%.3f')}")
    if out:
        runs.to_csv(out, float_format="%.4f")
    return runs


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return seed_runs(argv, __doc__, batchfix_rows)


if __name__ == "__main__":
    main()
