"""State groups (batchfix.correction.state_groups), measured on the same trained models: the state shrink and the
evidence weights taken per (batch, k-means group of the latent), against the form before, per batch alone.

Rows (layers['batchfix_counts'] of one default model per seed, trained on the cells, every gene):

    batchfix                 the default: each cell's shift drawn toward its batch's mean in its state group, and
                             weighted by its batch's or its group's evidence, whichever is the stronger
    batchfix, by batch       the form before: toward its batch's mean, weighted by its batch's evidence
    ComBat                   on the same log values (scripts.lab.count_draws.scores)
    noise floor              the share of the within-label spread that shuffled batch labels leave

Scored as scripts/lab/count_draws.py scores, paired against the form before:

    python -m scripts.lab.state_groups data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2
"""
from __future__ import annotations

from unittest import mock

import pandas as pd
import scipy.sparse as sp

import batchfix
from batchfix.correction import estimates
from scripts.lab.count_draws import seed_runs
from scripts.lab.evidence_forms import corrected_forms, floor_row, paired

FORMS = {
    "batchfix": [],
    "batchfix, by batch": [mock.patch.object(estimates, "fit_groups", lambda sample: None)],
}


def batchfix_rows(cells, batch_key: str, label_key: str, seed: int) -> dict[str, sp.csr_matrix]:
    """Each form's layers['batchfix_counts'] (every gene), from one default model trained on `cells`."""
    model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                           enable_progress_bar=False)
    return corrected_forms(cells, model, FORMS)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    runs = seed_runs(argv, __doc__, batchfix_rows, floor_row)
    print(f"paired, less the form before\n{paired(runs, against='batchfix, by batch').to_string()}")
    return runs


if __name__ == "__main__":
    main()
