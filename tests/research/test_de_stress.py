"""The DE stress set (scripts/de_stress.py) on a real slice, and the pseudobulk DE benchmark
(scripts/de_benchmark.py, bench extra) on a small generated file."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from scripts import de_stress

ROOT = Path(__file__).resolve().parents[2]




@pytest.fixture(scope="module")
def source(bundled_adata):
    """The largest real batch's cells and its 300 most-detected genes."""
    return de_stress.source_cells(bundled_adata, "batch", None, 300)


def make(source, **options):
    return de_stress.de_stress_set(source, de_stress.DEStress(n_genes=300, **options))


def test_one_real_batch_is_split_and_the_condition_balanced(source, bundled_adata):
    out = make(source, seed=1)
    largest = bundled_adata.obs["batch"].astype(str).value_counts().index[0]
    assert out.uns["de_stress"]["source_batch"] == largest and out.n_obs == source.n_obs
    X = sp.csr_matrix(out.X)
    assert np.all(X.data == np.round(X.data)) and X.data.min() > 0
    table = pd.crosstab([out.obs["batch"], out.obs["cell_type"]], out.obs["condition"])
    assert (table.sub(table.mean(axis=1), axis=0).abs() <= 0.5).all().all()  # halves within batch x cell type
    samples = out.obs.groupby("sample", observed=True)[["batch", "condition"]].nunique()
    assert len(samples) == 3 * 2 * 3 and (samples == 1).all().all()
    var = out.var
    assert var["de"].sum() == 30 and (var.loc[var["de"], "de_log2fc"].abs().between(1, 2)).all()
    assert (var.loc[~var["de"], "de_log2fc"] == 0).all() and var["null_gene"].sum() == 150
    assert (out.uns["de_stress"]["log_factors"][..., var["null_gene"].to_numpy()] == 0).all()


def test_null_genes_are_untouched_by_batch_and_planted_genes_move_by_their_fold_change(source):
    out = make(source, seed=2, sd=1.0)
    truth, X = sp.csr_matrix(out.layers["truth"]), sp.csr_matrix(out.X)
    null = out.var["null_gene"].to_numpy()
    assert (truth[:, null] != X[:, null]).nnz == 0  # no batch step on the null genes
    assert (X.toarray() <= truth.toarray()).all()  # batch effects only thin
    # the condition's fold change, read off the source counts of the well-expressed planted genes
    before = np.asarray(source.X.sum(axis=0)).ravel()
    b_cells = (out.obs["condition"] == "B").to_numpy()
    sums = {c: np.asarray(truth[mask].sum(axis=0)).ravel() / np.asarray(source.X[mask].sum(axis=0)).ravel()
            for c, mask in (("A", ~b_cells), ("B", b_cells))}
    planted = out.var["de"].to_numpy() & (before > 500)
    observed = np.log2(sums["B"][planted] / sums["A"][planted])
    assert np.abs(observed - out.var["de_log2fc"].to_numpy()[planted]).max() < 0.3


def test_the_state_design_gives_each_cell_type_its_own_batch_factors(source):
    multiplicative = make(source, seed=0).uns["de_stress"]["log_factors"]
    state = make(source, seed=0, design="state").uns["de_stress"]["log_factors"]
    assert np.all(multiplicative == multiplicative[:1]) and not np.all(state == state[:1])
    with pytest.raises(ValueError, match="design"):
        make(source, design="other")


@pytest.mark.bench
def test_de_benchmark_on_a_small_stress_set(tmp_path, source):
    pytest.importorskip("pydeseq2", reason="pydeseq2 is in the bench extra: pip install -e '.[bench]'")
    pytest.importorskip("inmoose", reason="inmoose is in the bench extra: pip install -e '.[bench]'")
    out = make(source, seed=0, sd=1.0)
    out.layers["same"] = out.X.copy()
    path, table = tmp_path / "de.h5ad", tmp_path / "de.csv"
    out.write_h5ad(path)
    run = subprocess.run([sys.executable, "-m", "scripts.de_benchmark", str(path), "--layer", "same",
                          "--out", str(table)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = pd.read_csv(table).set_index("method")
    assert list(rows.index) == ["raw+covariate", "raw", "combat-seq", "combat-seq+group", "same", "same+covariate"]
    assert rows.loc["raw+covariate", "recall"] > 0.5 and rows.loc["raw+covariate", "precision"] > 0.8
    assert (rows["calls_zero_raw"] == 0).all()
    assert rows.loc["raw", "detection_zeros_raised"] == 0 and rows.loc["same", "recall"] == rows.loc["raw", "recall"]
    assert rows.loc["same+covariate", "null_false_de"] == rows.loc["raw+covariate", "null_false_de"]
    assert rows.loc["same+covariate", "null_p_below_0.05"] == rows.loc["raw+covariate", "null_p_below_0.05"]
    assert 0.0 < rows.loc["raw+covariate", "null_p_below_0.05"] < 0.15
