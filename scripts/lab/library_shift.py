"""Each batch's depth brought to the reference's (correction.depth=reference, batchfix.correction.library_shift),
measured on the same trained models against each cell keeping its library (depth=keep).

Rows (layers['batchfix_counts'] of one default model per seed, trained on the cells, every gene):

    batchfix                         depth=keep: each cell keeps its library, only its genes' shares move
    batchfix, depth=reference        each batch's depth (within state groups) a part of every gene's shift
    ComBat                           on the same log values (scripts.lab.count_draws.scores)
    noise floor                      the share of the within-label spread that shuffled batch labels leave

Scored as scripts/lab/count_draws.py scores (removal and gene lines on log_cp10k over every gene, on the HVGs; scIB
on the HVGs' log_cp10k), paired against depth=keep:

    python -m scripts.lab.library_shift data/cellbench5.h5ad --batches sc_celseq2_5cl_p1 sc_celseq2_5cl_p2 \\
        sc_celseq2_5cl_p3 --seeds 0 1 2
"""
from __future__ import annotations

import pandas as pd
import scipy.sparse as sp

import batchfix
from scripts.lab.evidence_forms import paired_runs

FORMS = {"batchfix": {"depth": "keep"}, "batchfix, depth=reference": {"depth": "reference"}}


def batchfix_rows(cells, batch_key: str, label_key: str, seed: int) -> dict[str, sp.csr_matrix]:
    """Each form's layers['batchfix_counts'] (every gene), from one default model trained on `cells`."""
    model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                           enable_progress_bar=False)
    return {name: sp.csr_matrix(batchfix.correct(cells, model, copy=True, progress=False, **options)
                                .layers["batchfix_counts"]) for name, options in FORMS.items()}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return paired_runs(argv, __doc__, batchfix_rows, "batchfix")


if __name__ == "__main__":
    main()
