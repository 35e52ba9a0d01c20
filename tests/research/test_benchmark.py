"""The benchmark script end to end, on a small real subset, through the command line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_script_on_a_subset(tmp_path):
    pytest.importorskip("harmonypy", reason="the Harmony baseline is in the bench extra: pip install -e '.[bench]'")
    out = tmp_path / "results.csv"
    run = subprocess.run(
        [sys.executable, "-m", "scripts.benchmark", str(ROOT / "data" / "cellbench5.h5ad"),
         "--subset", "200", "--n-top-genes", "500", "--seeds", "0", "1",
         "--methods", "unintegrated", "harmony", "--balanced",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Harmony" in run.stdout and "Unintegrated PCA" in run.stdout

    rows = pd.read_csv(out).set_index("embedding")
    assert list(rows.index) == ["Unintegrated PCA", "Harmony"] * 2
    assert list(rows["seed"]) == [0, 0, 1, 1]
    scores = rows[["Batch correction", "Bio conservation", "Total"]]
    assert ((scores >= 0) & (scores <= 1)).all().all()
    balanced = rows[[f"{column} (balanced cells)" for column in scores.columns]]
    assert ((balanced >= 0) & (balanced <= 1)).all().all() and "composition-balanced cells" in run.stdout
    batch = rows.groupby(level=0)["Batch correction"].mean()
    assert batch["Harmony"] > batch["Unintegrated PCA"]
    assert (rows["fit_seconds"] >= 0).all() and rows["peak_mb"].notna().all()
    report = out.with_suffix(".md").read_text()
    assert "| Harmony | 2 |" in report and "Total sd" in report and "cpu_seconds" in report


@pytest.mark.slow
def test_benchmark_runs_batchfix_in_both_output_modes(tmp_path):
    out = tmp_path / "results.csv"
    run = subprocess.run(
        [sys.executable, "-m", "scripts.benchmark", str(ROOT / "data" / "cellbench5.h5ad"),
         "--subset", "200", "--n-top-genes", "300", "--seeds", "0", "--methods", "unintegrated", "batchfix",
         "--batchfix-override", "trainer.max_epochs=3", "model.genes_per_token=16", "threads=1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = pd.read_csv(out).set_index("embedding")
    # and the counterfactual output with its other spread (correction.spread=gene) and its other regional shifts,
    # from the same model
    modes = ["batchfix counterfactual (PCA)", "batchfix denoised (PCA)", "batchfix counterfactual_gene (PCA)",
             "batchfix counterfactual_regional_apply (PCA)",
             "batchfix counterfactual_regional_keep_input (PCA)", "batchfix counterfactual_state_1.0 (PCA)",
             "batchfix counterfactual_shrink_none (PCA)"]
    assert set(modes + ["batchfix latent", "Unintegrated PCA"]) == set(rows.index)
    # 200 cells leave no (batch, label) group of 30 cells: within-type neighbours are not scored.
    genes = ["DE-rank agreement", "Marker recall", "HVG conservation"]
    assert rows.loc[modes, genes].notna().all().all() and rows.loc["batchfix latent", genes].isna().all()
    # The counterfactual keeps more of each cell's own values than the denoised reconstruction.
    assert (rows.loc[modes[0], genes] > rows.loc[modes[1], genes]).all()
    assert (rows.loc[modes, "fit_seconds"] > 0).all()


@pytest.mark.slow  # ~20 s on 2 cores (the benchmark script started as a process): in the slow run, which CI runs too
def test_benchmark_names_the_obs_columns_when_the_batch_key_is_wrong(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "scripts.benchmark", str(ROOT / "data" / "cellbench5.h5ad"),
         "--batch-key", "sample", "--methods", "unintegrated", "--out", str(tmp_path / "r.csv")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert run.returncode != 0
    assert "'sample'" in run.stderr and "cell_type" in run.stderr
    assert not (tmp_path / "r.csv").exists()


def test_batches_keep_a_sub_problem_and_unknown_ones_are_named():
    from scripts import benchmark

    data = ROOT / "data" / "cellbench5.h5ad"
    pair = benchmark.load(data, "batch", "cell_type", None, ["sc_celseq2", "sc_dropseq"])
    assert sorted(pair.obs["batch"].cat.categories) == ["sc_celseq2", "sc_dropseq"]
    assert pair.n_obs == 450 and pair.n_vars == 11533
    with pytest.raises(SystemExit, match=r"\['nowhere'\] not in obs\['batch'\].*sc_celseq2_5cl_p1"):
        benchmark.load(data, "batch", "cell_type", None, ["sc_celseq2", "nowhere"])


def test_balanced_cells_give_every_batch_the_same_composition(bundled_adata):
    from scripts import benchmark

    obs = bundled_adata.obs
    rows = benchmark.balanced_cells(obs, "batch", "cell_type", seed=0)
    table = pd.crosstab(obs["cell_type"].iloc[rows], obs["batch"].iloc[rows])
    # A549 and H838 are missing from two batches: left out; the rest as often as in their smallest batch
    assert sorted(table.index) == ["H1975", "H2228", "HCC827"]
    full = pd.crosstab(obs["cell_type"], obs["batch"]).loc[table.index]
    assert (table.to_numpy() == full.min(axis=1).to_numpy()[:, None]).all()
    assert len(set(rows)) == len(rows) and list(rows) == sorted(rows)
    assert list(benchmark.balanced_cells(obs, "batch", "cell_type", seed=0)) == list(rows)
    assert list(benchmark.balanced_cells(obs, "batch", "cell_type", seed=1)) != list(rows)
    lonely = obs.assign(batch=obs["batch"].astype(str).where(obs["cell_type"] != "H1975", "only H1975"))
    with pytest.raises(SystemExit, match="no label of 'cell_type' is found in every batch"):
        benchmark.balanced_cells(lonely, "batch", "cell_type", seed=0)


def test_cellanova_returns_log_scale_values_of_the_input_shape():
    pytest.importorskip("cellanova", reason="the CellANOVA baseline is in the bench extra: pip install -e '.[bench]'")
    import anndata as ad
    import numpy as np
    import scanpy.external as sce

    from batchfix.data.normalize import log_cp10k
    from scripts import baselines

    data = ad.read_h5ad(ROOT / "data" / "cellbench5.h5ad")
    data = data[data.obs["batch"].isin(["sc_celseq2", "sc_dropseq"]).to_numpy()]  # 450 cells, 2 platforms
    counts = np.asarray(data.X.toarray() if hasattr(data.X, "toarray") else data.X)
    counts = counts[:, np.sort(np.argsort(-counts.sum(axis=0))[:300])]
    log_values = np.asarray(log_cp10k(counts), dtype=np.float32)
    scanpy_harmony = sce.pp.harmony_integrate

    corrected = baselines.cellanova(log_values, data.obs, "batch", seed=0)
    assert corrected.shape == log_values.shape and corrected.dtype == np.float32
    assert np.isfinite(corrected).all()
    # back on the log scale: the genes' means kept, each value near its uncorrected one
    assert np.abs(corrected.mean(axis=0) - log_values.mean(axis=0)).max() < 0.1
    assert np.corrcoef(corrected.ravel(), log_values.ravel())[0, 1] > 0.9
    assert sce.pp.harmony_integrate is scanpy_harmony  # scanpy's own is put back after the call
    again = baselines.cellanova(log_values, data.obs, "batch", seed=0)
    assert np.abs(again - corrected).max() < 0.05  # same seed, same values (up to ARPACK's start vectors)



@pytest.mark.slow
def test_sysvi_decodes_each_cell_in_every_batch_and_averages():
    pytest.importorskip("scvi", reason="the SysVI baseline is in the bench extra: pip install -e '.[bench]'")
    import anndata as ad
    import numpy as np

    from batchfix.data.normalize import log_cp10k
    from scripts import baselines

    if missing := baselines.sysvi_missing():
        pytest.skip(missing)
    data = ad.read_h5ad(ROOT / "data" / "cellbench5.h5ad")
    data = data[data.obs["batch"].isin(["sc_celseq2", "sc_dropseq"]).to_numpy()]  # 450 cells, 2 platforms
    counts = np.asarray(data.X.toarray() if hasattr(data.X, "toarray") else data.X)
    counts = counts[:, np.sort(np.argsort(-counts.sum(axis=0))[:300])]
    log_values = np.asarray(log_cp10k(counts), dtype=np.float32)

    model = baselines.sysvi_model(log_values, data.obs, "batch", seed=0)
    latent = np.asarray(model.get_latent_representation(), dtype=np.float32)
    codes = model.adata_manager.get_from_registry("batch").ravel()
    in_batch = {code: baselines.sysvi_decoded(model, latent, [code]) for code in (0, 1)}
    own = np.where((codes == 0)[:, None], in_batch[0], in_batch[1])
    # the library decodes each cell in its own batch, at latents drawn around the mean: close to the decoding
    # at the mean, and closer than the same cell decoded in the other batch
    library = np.mean([model.get_normalized_expression(return_numpy=True) for _ in range(20)], axis=0)
    other = np.where((codes == 0)[:, None], in_batch[1], in_batch[0])
    assert np.abs(library - own).mean() < 0.5 * np.abs(library - other).mean()
    averaged = baselines.sysvi_decoded(model, latent, [0, 1])
    assert averaged.shape == log_values.shape and np.isfinite(averaged).all()
    assert np.allclose(averaged, (in_batch[0] + in_batch[1]) / 2, atol=1e-5)


def test_a_method_whose_package_is_missing_names_the_bench_extra(monkeypatch, capsys):
    import importlib.util

    from scripts import benchmark

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cellanova" else find_spec(name, *a))
    with pytest.raises(SystemExit):
        benchmark.parse_args(["data.h5ad", "--methods", "unintegrated", "cellanova"])
    error = capsys.readouterr().err
    assert "--methods cellanova: cellanova is not installed" in error and 'pip install -e ".[bench]"' in error
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scvi" else find_spec(name, *a))
    with pytest.raises(SystemExit):
        benchmark.parse_args(["data.h5ad", "--methods", "sysvi"])
    assert "--methods sysvi: scvi is not installed" in capsys.readouterr().err
    assert benchmark.parse_args(["data.h5ad", "--methods", "unintegrated", "combat"]).methods == ["unintegrated", "combat"]


@pytest.mark.slow
def test_truth_errors_of_a_stress_set_fit_each_method_on_both_counts(subset):

    from batchfix.data.normalize import log_cp10k
    from scripts import benchmark
    from scripts.stress_set import (
        Stress,
        contrast_truth_error,
        group_truth_error,
        relative_group_truth_error,
        stress_set,
        truth_error,
    )

    stressed = stress_set(subset, "batch", Stress(sd=1.0, seed=0))
    truth = stressed.copy()
    truth.X = benchmark.dense_float32(stressed.layers.pop("truth"))
    stressed.X = benchmark.dense_float32(stressed.X)
    args = benchmark.parse_args(["stress.h5ad", "--methods", "unintegrated", "combat"])
    results, _ = benchmark.fit_methods(benchmark.prepare(stressed, "batch", 0), args)
    errors = benchmark.truth_errors(results, benchmark.prepare(truth, "batch", 0), args, "cell_type")

    assert set(errors) == {"Unintegrated PCA", "ComBat"}
    # the uncorrected level: log1p(counts per 10k) of the stressed counts against that of the truth
    uncorrected = log_cp10k(stressed.X), log_cp10k(truth.X)
    assert errors["Unintegrated PCA"][benchmark.TRUTH_ERROR] == pytest.approx(truth_error(*uncorrected))
    groups = (subset.obs["batch"].astype(str) + "/" + subset.obs["cell_type"].astype(str)).to_numpy()
    assert errors["Unintegrated PCA"][benchmark.TRUTH_GROUP_ERROR] == pytest.approx(
        group_truth_error(*uncorrected, groups))
    assert errors["Unintegrated PCA"][benchmark.TRUTH_RELATIVE_ERROR] == pytest.approx(
        relative_group_truth_error(*uncorrected, groups))
    assert errors["Unintegrated PCA"][benchmark.TRUTH_CONTRAST_ERROR] == pytest.approx(
        contrast_truth_error(*uncorrected, groups))
    # ComBat's per-gene, per-batch location and scale take out part of the added gene-wise effects; in group
    # means, where the counting noise averages out, far more of the error is gone
    for error in benchmark.TRUTH_ERRORS:
        assert 0 < errors["ComBat"][error] < errors["Unintegrated PCA"][error]
    assert (errors["ComBat"][benchmark.TRUTH_GROUP_ERROR] / errors["Unintegrated PCA"][benchmark.TRUTH_GROUP_ERROR]
            < errors["ComBat"][benchmark.TRUTH_ERROR] / errors["Unintegrated PCA"][benchmark.TRUTH_ERROR])
    # the gene-level scores against the truth: batchfix.eval.fidelity of each matrix with the truth counts as the
    # reference; the stressed counts' own log values no longer agree with it everywhere
    from batchfix.eval import fidelity

    against_truth = fidelity.gene_fidelity(truth.X, log_cp10k(stressed.X), subset.obs["batch"].to_numpy(),
                                           subset.obs["cell_type"].to_numpy())
    for column, metric in zip(benchmark.TRUTH_GENE_SCORES, fidelity.GENE_METRICS):
        expected = np.nan if against_truth[metric] is None else against_truth[metric]
        assert errors["Unintegrated PCA"][column] == pytest.approx(expected, nan_ok=True)
    assert errors["Unintegrated PCA"]["DE-rank agreement (truth)"] < 1.0


@pytest.mark.slow
def test_balanced_scores_score_the_rows_of_each_embedding(subset):
    from scripts import benchmark

    args = benchmark.parse_args(["data.h5ad", "--methods", "unintegrated", "combat", "--balanced"])
    data = benchmark.prepare(subset, "batch", 0)
    results, _ = benchmark.fit_methods(data, args)
    embeddings = {k: e for _, r in results.values() for k, e in r.embeddings.items()}
    scores = benchmark.balanced_scores(subset.obs, embeddings, data.unintegrated, args, seed=0)

    assert set(scores) == {"Unintegrated PCA", "ComBat"}
    for row in scores.values():
        assert set(row) == set(benchmark.BALANCED_COLUMNS.values())
        assert all(0 <= value <= 1 for value in row.values())
    batch = benchmark.BALANCED_COLUMNS["Batch correction"]
    assert scores["ComBat"][batch] > scores["Unintegrated PCA"][batch]


def test_companion_outputs_keep_the_variants_correction_options():
    from hydra import compose, initialize_config_module

    from batchfix.config import TrainConfig, validated
    from scripts import benchmark

    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        cfg = validated(compose("train", overrides=["correction.spread=gene", "correction.state_dependence=0.5",
                                                    "correction.residual_weight=0.75"]), TrainConfig)
    others = benchmark.companion_settings(cfg.correction)
    assert set(others) == {"denoised", "counterfactual_batch", "counterfactual_regional_apply",
                           "counterfactual_regional_keep_input",
                           "counterfactual_state_1.0", "counterfactual_shrink_none"}
    assert others["counterfactual_shrink_none"].shrink == "none" and others["denoised"].shrink == "evidence"
    assert others["counterfactual_batch"].spread == "batch"
    assert others["counterfactual_regional_apply"].regional_shift == "apply"
    for name, settings in others.items():  # the variant's options, but for the one the name changes
        assert settings.residual_weight == 0.75, name
        assert settings.state_dependence == (1.0 if name == "counterfactual_state_1.0" else 0.5), name
        assert settings.spread == ("batch" if name == "counterfactual_batch" else "gene"), name
        assert settings.regional_shift == (name.partition("regional_")[2] or "keep"), name


def test_the_preset_table_counts_the_lines_level_with_combat_or_above():
    """A preset meets a line where its paired difference from ComBat is >= -0.005 and within 2 standard errors of
    zero; the summary counts them and applies the recommendation's rule to each seed's measurements."""
    import pandas as pd

    from scripts import preset_table

    measured = {"gene_effect": 0.3, "regional_shift": 0.1, "regional_batch": "b", "confined_cells": 0.0,
                "states": "labels"}
    rows = []
    for seed, (noise, spread) in enumerate(((0.0, -0.006), (0.003, 0.008), (-0.003, -0.002))):
        lines = {line: 0.9 for line in preset_table.LINES}
        rows.append({"dataset": "d", "seed": seed, "matrix": "ComBat", **lines})
        rows.append({"dataset": "d", "seed": seed, "matrix": "default", **measured,
                     **{**lines, "Marker recall": 0.9 + noise}})  # around ComBat's: met
        rows.append({"dataset": "d", "seed": seed, "matrix": "protocols", **measured,
                     **{**lines, "Total": 0.88,  # beyond the margin
                        "Marker recall": 0.896 + noise / 10,  # within the margin, but many se below zero
                        "HVG conservation": 0.9 - 0.004 + spread}})  # -0.004 on average, within 2 se
    summary = preset_table.lines_met(pd.DataFrame(rows)).set_index("preset")
    assert summary.loc["default", "lines met"] == len(preset_table.LINES)
    assert not summary.loc["protocols", "Total met"] and not summary.loc["protocols", "Marker recall met"]
    assert summary.loc["protocols", "HVG conservation met"]
    assert summary.loc["protocols", "lines met"] == len(preset_table.LINES) - 2
    assert set(summary["recommended"]) == {"default"}
