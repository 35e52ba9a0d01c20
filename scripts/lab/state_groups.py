"""State groups (batchfix.correction.state_groups), measured on the same trained models: the state shrink and the
evidence weights taken per (batch, k-means group of the latent), against the form before, per batch alone.

Rows (layers['batchfix_counts'] of one default model per seed, trained on the cells, every gene):

    batchfix                     the default: each cell's shift drawn toward its batch's mean in its state group,
                                 and weighted by its batch's or its group's evidence, whichever is the stronger
    batchfix, group means only   toward its batch's mean in its state group, weighted by its batch's evidence
    batchfix, by batch           the form before: toward its batch's mean, weighted by its batch's evidence
    ComBat                       on the same log values (scripts.lab.count_draws.scores)
    noise floor                  the share of the within-label spread that shuffled batch labels leave

Scored as scripts/lab/count_draws.py scores, paired against the form before:

    python -m scripts.lab.state_groups data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2

With --log-scale (first), the same forms of the log-scale model's output (whose evidence weights are by batch alone, so
"group means only" is its default), and the default with every change applied in full (shrink=none): the model
trained with data.scale=log on log1p(counts per 10k) over every gene, restricted to
the 2,000 HVGs the rows are scored on (all of them modelled), its layers['batchfix'] in those columns, every other
gene's log value as it was:

    python -m scripts.lab.state_groups --log-scale data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2
"""
from __future__ import annotations

import sys
from unittest import mock

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

import batchfix
from batchfix.correction import estimates
from batchfix.correction.evidence import ShiftEvidenceSums
from batchfix.data.normalize import log_cp10k
from scripts.benchmark import select_genes
from scripts.lab.count_draws import seed_runs
from scripts.lab.evidence_forms import corrected_forms, floor_row, paired


def batch_weights_in_every_group(sums, *arguments) -> np.ndarray:
    """(codes, groups, genes) every state group given its batch's evidence weights (the last argument, (codes,
    genes)): the groups' means without their own weights."""
    batch_weight = arguments[-1]
    return np.repeat(batch_weight[:, None, :], len(sums.n_cells) // len(batch_weight), axis=1)


FORMS = {
    "batchfix": [],
    "batchfix, group means only": [mock.patch.object(ShiftEvidenceSums, "state_weights",
                                                     batch_weights_in_every_group)],
    "batchfix, by batch": [mock.patch.object(estimates, "fit_groups", lambda sample: None)],
}


def batchfix_rows(cells, batch_key: str, label_key: str, seed: int) -> dict[str, sp.csr_matrix]:
    """Each form's layers['batchfix_counts'] (every gene), from one default model trained on `cells`."""
    model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                           enable_progress_bar=False)
    return corrected_forms(cells, model, FORMS)


def log_scale_rows(cells, batch_key: str, label_key: str, seed: int) -> dict[str, sp.csr_matrix]:
    """Each form's log values (cells, every gene): a log-scale model's layers['batchfix'] in the 2,000 HVGs' columns,
    the input's log1p(counts per 10k) elsewhere."""
    hvg = cells.var_names.get_indexer(select_genes(cells, batch_key, 2000).var_names)
    values = sp.csr_matrix(log_cp10k(sp.csr_matrix(cells.X, dtype=np.float64)), dtype=np.float32)
    modelled = ad.AnnData(values[:, hvg], obs=cells.obs.copy(), var=cells.var.iloc[hvg].copy())
    model = batchfix.train(modelled, batch_key=batch_key, label_key=label_key, scale="log", seed=seed, threads=1,
                           enable_progress_bar=False)
    assert len(model.genes) == len(hvg), "every HVG is modelled"
    order = np.arange(values.shape[1])
    order[hvg] = values.shape[1] + np.arange(len(hvg))  # each HVG's column from the corrected block
    layers = corrected_forms(modelled, model, FORMS, layer="batchfix")
    layers["batchfix, shrink=none"] = sp.csr_matrix(batchfix.correct(modelled, model, copy=True, shrink="none",
                                                                     progress=False).layers["batchfix"])
    return {name: sp.csr_matrix(sp.hstack([values, layer]))[:, order] for name, layer in layers.items()}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    argv = list(sys.argv[1:] if argv is None else argv)
    log_scale = "--log-scale" in argv
    if log_scale:
        argv.remove("--log-scale")
    runs = seed_runs(argv, __doc__, log_scale_rows if log_scale else batchfix_rows, floor_row, log_rows=log_scale)
    print(f"paired, less the form before\n{paired(runs, against='batchfix, by batch').to_string()}")
    return runs


if __name__ == "__main__":
    main()
