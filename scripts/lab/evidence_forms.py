"""The evidence weights' two choices, measured on the same trained models: the shift's variance with or without its
covariance with the reference (which holds the batch's own level), and the weight as the posterior median (shipped:
exactly 0 where no shift is at least as likely as any) or the posterior mean (before).

Rows (layers['batchfix_counts'] of one default model per seed, trained on the cells, every gene):

    batchfix                           the default: posterior median, the shift's variance against the reference
    batchfix, posterior mean           the mean of the same posterior
    batchfix, mean without covariance  the form before: each batch's level's variance taken as its shift's
    batchfix, shrink=none              every shift applied in full
    ComBat                             on the same log values (scripts.lab.count_draws.scores)
    noise floor                        the share of the within-label spread that shuffled batch labels leave
                                       (batchfix.eval.removal.noise_floor): what no correction removes without
                                       fitting noise

Scored as scripts/lab/count_draws.py scores (removal and gene lines on log_cp10k over every gene, on the HVGs; scIB
on the HVGs' log_cp10k):

    python -m scripts.lab.evidence_forms data/cellbench5.h5ad --batches sc_celseq2 sc_dropseq --seeds 0 1 2
"""
from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pandas as pd
import scipy.sparse as sp

import batchfix
from batchfix.correction import evidence
from batchfix.data.normalize import log_cp10k
from batchfix.eval import removal
from scripts.lab.count_draws import seed_runs


def posterior_mean(size, variance, share, posterior, steps=None):
    """The posterior mean in place of evidence.posterior_median: each component's mean, by its probability."""
    return size * (posterior * share).sum(axis=1)


FORMS = {
    "batchfix": [],
    "batchfix, posterior mean": [mock.patch.object(evidence, "posterior_median", posterior_mean)],
    "batchfix, mean without covariance": [
        mock.patch.object(evidence, "posterior_median", posterior_mean),
        mock.patch.object(evidence.ShiftEvidenceSums, "shift_variance", lambda self, variance, *_: variance)],
}


def corrected_forms(cells, model, forms: dict[str, list], layer: str = "batchfix_counts") -> dict[str, sp.csr_matrix]:
    """Each form's `layer` (every gene) of `cells` by `model`, the form's patches applied."""
    rows = {}
    for name, patches in forms.items():
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            corrected = batchfix.correct(cells, model, copy=True, progress=False)
        rows[name] = sp.csr_matrix(corrected.layers[layer])
    return rows


def batchfix_rows(cells, batch_key: str, label_key: str, seed: int) -> dict[str, sp.csr_matrix]:
    """Each form's layers['batchfix_counts'] (every gene), from one default model trained on `cells`."""
    model = batchfix.train(cells, batch_key=batch_key, label_key=label_key, seed=seed, threads=1,
                           enable_progress_bar=False)
    rows = corrected_forms(cells, model, FORMS)
    corrected = batchfix.correct(cells, model, copy=True, shrink="none", progress=False)
    rows["batchfix, shrink=none"] = sp.csr_matrix(corrected.layers["batchfix_counts"])
    return rows


def floor_row(raw: sp.csr_matrix, hvg: np.ndarray, obs: pd.DataFrame, batch_key: str, label_key: str,
              seed: int) -> pd.DataFrame:
    """The noise floor of the removal scores, on the same log values as the rows."""
    floor = removal.noise_floor(np.asarray(log_cp10k(raw)[:, hvg].toarray()), obs[batch_key], obs[label_key], seed)
    return pd.DataFrame({"left_log": floor["floor_log"], "left_mean": floor["floor_mean"]}, index=["noise floor"])


def paired(runs: pd.DataFrame, against: str = "batchfix, mean without covariance") -> pd.DataFrame:
    """Per batchfix form: its difference from `against` on the same seed's model, mean and standard error over
    seeds, of each score (the CSV of `main`, or several seeds' concatenated)."""
    runs = runs.drop(index="noise floor", errors="ignore").set_index("seed", append=True)
    base = runs.xs(against, level=0)
    rows = {}
    for form in dict.fromkeys(name for name in runs.index.get_level_values(0) if name.startswith("batchfix")):
        difference = runs.xs(form, level=0) - base
        mean, se = difference.mean(), difference.std(ddof=1) / np.sqrt(len(difference))
        rows[form] = mean.map("{:+.3f}".format) + se.map(" ({:.3f})".format)
    return pd.DataFrame(rows).T


def paired_runs(argv: list[str] | None, description: str, rows_of_seed, against: str) -> pd.DataFrame:
    """`seed_runs` of `rows_of_seed` with the noise floor's row, then each form's paired difference from `against`
    printed; every seed's rows returned."""
    runs = seed_runs(argv, description, rows_of_seed, floor_row)
    print(f"paired, less {against}\n{paired(runs, against=against).to_string()}")
    return runs


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return paired_runs(argv, __doc__, batchfix_rows, "batchfix, mean without covariance")


if __name__ == "__main__":
    main()
