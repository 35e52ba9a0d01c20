"""The `correction` config group: named entries in train, correct and the API, and a checkpoint that remembers
the correction it was trained with."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import anndata as ad
import pytest
import torch
from hydra import compose, initialize_config_module

import batchfix
from batchfix.cli.common import check_overrides
from batchfix.cli.summary import run_summary
from batchfix.config import (
    CorrectConfig,
    CorrectionChoice,
    CorrectionOptions,
    TrainConfig,
    preset_names,
    preset_options,
    validated,
)
from batchfix.correction import recommendation
from batchfix.errors import ConfigError
from batchfix.training.trained import load_trained

TINY_CLI = ["data.n_top_genes=200", "model.genes_per_token=16", "model.d_model=16", "model.n_layers=1",
            "model.latent_dim=8", "model.decoder_hidden=32", "fit.batch_size=64", "threads=1",
            "trainer.max_epochs=1", "trainer.enable_progress_bar=false", "evaluate=false"]
TRAINED_WITH = "protocols"


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "batchfix", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)


def expected(name: str) -> dict:
    return asdict(CorrectionOptions(**preset_options(name)))


@pytest.fixture(scope="module")
def run(subset_h5ad, tmp_path_factory) -> Path:
    """A run folder trained on the command line with correction=protocols."""
    folder = tmp_path_factory.mktemp("preset-run")
    result = cli(["train", f"data.path={subset_h5ad}", f"correction={TRAINED_WITH}", f"hydra.run.dir={folder / 'run'}",
                  *TINY_CLI], folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run"


def test_the_group_holds_the_default_and_the_readmes_recipes():
    assert set(preset_names()) == {"default", "protocols", "patient_cnv", "conditions", "depths"}
    assert preset_options("default") == {}
    assert expected("protocols")["spread"] == "gene" and expected("protocols")["state_dependence"] == 0.5
    assert expected("patient_cnv")["regional_shift"] == "keep_input"
    assert expected("conditions")["state_dependence"] == 0.0
    assert preset_options("depths") == {"depth": "reference"}


@pytest.mark.parametrize("name", preset_names())
def test_every_entry_composes_in_train_and_correct_and_options_override_it(name):
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        train = validated(compose("train", [f"correction={name}"]), TrainConfig)
        correct = validated(compose("correct", [f"correction={name}", "checkpoint=x", "correction.state_dependence=0.3"]),
                            CorrectConfig)
    assert asdict(train.correction) == expected(name)
    assert asdict(correct.correction) == {**expected(name), "state_dependence": 0.3}


def test_an_unknown_preset_and_an_old_spelling_are_refused_with_the_name_meant():
    with pytest.raises(ConfigError, match=r"Unknown correction preset `protocol`; did you mean `protocols`\? "
                                          r"The entries of conf/correction/: \["):
        CorrectionChoice("protocol").resolve()
    for old, meant in (("batch_key", "data.batch_key"), ("regional_shift", "correction.regional_shift"),
                       ("chunk_size", "inference.chunk_size")):
        with pytest.raises(ConfigError, match=rf"Unknown option `{old}`; did you mean `{meant}`\?"):
            check_overrides([f"{old}=x"], "correct")
    with pytest.raises(ConfigError, match=r"Unknown option `counts_layer`; did you mean `data.counts_layer`\?"):
        check_overrides(["counts_layer=x"], "attention")


@pytest.mark.slow  # the module's run folder: a train in a fresh process (17 s); with the slow checks, which CI runs
def test_train_with_a_preset_then_correct_applies_it(run, subset_h5ad, tmp_path):
    remembered = load_trained(run / "model.ckpt").correction
    assert remembered == {"preset": TRAINED_WITH, "options": expected(TRAINED_WITH)}
    assert ad.read_h5ad(run / "corrected.h5ad").uns["batchfix"]["correction_preset"] == TRAINED_WITH
    result = cli(["correct", f"input={subset_h5ad}", f"output={tmp_path / 'out.h5ad'}",
                  f"checkpoint={run / 'model.ckpt'}", "progress=false", "threads=1"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    info = ad.read_h5ad(tmp_path / "out.h5ad").uns["batchfix"]
    assert info["correction_preset"] == TRAINED_WITH
    assert info["params"]["state_dependence"] == 0.5 and info["params"]["regional_shift"] == "keep"
    assert info["params"]["spread"] == "gene"  # on counts: the reference's per-gene dispersion


# Each preset's command-line correction is a fresh process (5-6 s), with the slow checks, which CI runs (the API test
# below applies every preset in this process).
@pytest.mark.slow
@pytest.mark.parametrize("name", preset_names())
def test_correct_on_the_command_line_applies_every_entry(run, subset_h5ad, tmp_path, name):
    result = cli(["correct", f"input={subset_h5ad}", f"output={tmp_path / 'out.h5ad'}", f"correction={name}",
                  f"checkpoint={run / 'model.ckpt'}", "progress=false", "threads=1"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    info = ad.read_h5ad(tmp_path / "out.h5ad").uns["batchfix"]
    applied = {key: value for key, value in expected(name).items()
               if key not in info["options_not_applied"] and value not in (None, [])}
    assert info["correction_preset"] == name
    assert {key: info["params"][key] for key in applied} == applied


@pytest.mark.slow  # the module's run folder: a train in a fresh process (17 s); with the slow checks, which CI runs
@pytest.mark.parametrize("name", preset_names())
def test_the_api_applies_every_entry_and_its_keywords_override_it(run, subset, name):
    torch.set_num_threads(1)
    adata = subset[:200].copy()
    batchfix.correct(adata, run / "model.ckpt", correction=name, regional_window=50)
    info = adata.uns["batchfix"]
    assert info["correction_preset"] == name and info["params"]["regional_window"] == 50
    assert info["params"]["regional_shift"] == expected(name)["regional_shift"]


@pytest.mark.slow  # the module's run folder: a train in a fresh process (17 s); with the slow checks, which CI runs
def test_the_api_keeps_the_models_correction_unless_told(run, subset):
    torch.set_num_threads(1)
    adata = subset[:200].copy()
    batchfix.correct(adata, run / "model.ckpt", residual_weight=0.5)
    info = adata.uns["batchfix"]
    assert info["correction_preset"] == TRAINED_WITH and info["params"]["state_dependence"] == 0.5
    with pytest.raises(ConfigError, match=r"Unknown option 'chunksize' of batchfix.correct; did you mean "
                                          r"\['chunk_size'"):
        batchfix.correct(adata, run / "model.ckpt", chunksize=10)
    with pytest.raises(ConfigError, match="Unknown correction preset `nope`"):
        batchfix.train(adata, correction="nope")


def test_the_api_trains_a_model_that_remembers_its_correction(subset):
    torch.set_num_threads(1)
    model = batchfix.train(subset, correction="protocols", state_dependence=0.6, n_top_genes=200, genes_per_token=16,
                           d_model=16, n_layers=1, latent_dim=8, decoder_hidden=32, batch_size=64, threads=1,
                           enable_progress_bar=False, max_epochs=1)
    assert model.correction == {"preset": "protocols", "options": {**expected("protocols"), "state_dependence": 0.6}}


TINY_API = dict(n_top_genes=200, genes_per_token=16, d_model=16, n_layers=1, latent_dim=8, decoder_hidden=32,
                batch_size=64, threads=1, max_epochs=2, enable_progress_bar=False, seed=0)


def test_training_recommends_the_default_where_batches_share_their_states(subset, tmp_path):
    """Five batches holding the same cell lines: the default, with the measurements and why; the record travels in
    the checkpoint."""
    model = batchfix.train(subset, batch_key="batch", label_key="cell_type", **TINY_API)
    advice = model.recommendation
    assert advice["preset"] == "default" and advice["command"] == ""
    assert advice["confined_cells"] == 0.0 and advice["states"] == "labels"
    assert "gene-wise batch effect" in advice["reason"] and advice["gene_effect"] > 0
    # the plates and platforms' depths differ about twofold within the lines: named with the option that moves them
    assert advice["depth_ratio"] >= recommendation.DEPTH_RATIO and "correction.depth=reference" in advice["reason"]
    assert load_trained(model.save(tmp_path / "model.ckpt")).recommendation == advice


def test_training_recommends_patient_cnv_where_each_batch_holds_its_own_cell_line(bundled_adata, _subset_index):
    """Each batch one cell line of its own, as patients with their own tumour clones: states confined to batches and
    the lines' copy-number differences as regional batch shifts: patient_cnv, with the call that applies it."""
    own = {"sc_celseq2_5cl_p1": "A549", "sc_celseq2_5cl_p2": "H838", "sc_celseq2_5cl_p3": "H1975",
           "sc_celseq2": "H2228", "sc_dropseq": "HCC827"}
    obs = bundled_adata.obs
    patients = bundled_adata[[own[b] == line for b, line in zip(obs["batch"].astype(str), obs["cell_type"].astype(str))]]
    patients = patients[:, _subset_index[1]].copy()
    model = batchfix.train(patients, batch_key="batch", label_key="cell_type", **TINY_API)
    advice = model.recommendation
    assert advice["preset"] == "patient_cnv", advice
    assert advice["confined_cells"] == 1.0 and advice["regional_shift"] >= recommendation.CNV_SHIFT
    assert advice["command"] == 'batchfix.correct(adata, model, correction="patient_cnv")'
    assert "normal_key" in advice["reason"]


def test_the_run_summary_prints_the_recommendation_and_its_command():
    advice = {"preset": "protocols", "reason": "gene-wise batch effect 0.80 ...: chemistry-sized",
              "command": "python -m batchfix correct checkpoint=run/model.ckpt correction=protocols"}
    text = run_summary("train", {"recommendation": advice}, ".", [])
    assert "recommended correction: protocols: gene-wise batch effect 0.80" in text
    assert "apply it to this model: python -m batchfix correct checkpoint=run/model.ckpt correction=protocols" in text


def test_a_log_scale_model_is_measured_on_its_log1p_scale(log_scale_subset):
    """A Gaussian model's per-batch means are its decoded log1p values: a gene-wise effect on the same scale as the
    counts model's log means (the bundled batches share their lines: the default)."""
    model = batchfix.train(log_scale_subset, batch_key="batch", label_key="cell_type", scale="log", **TINY_API)
    advice = model.recommendation
    assert advice["preset"] == "default" and 0 < advice["gene_effect"] < recommendation.PROTOCOL_EFFECT


def test_a_chromosome_fragment_is_not_a_regional_shift():
    """A window cut at a chromosome holding two modelled genes is those genes' own effect: not counted."""
    from batchfix.correction.regional import GenomeSmoother

    chromosome = ["1"] * 60 + ["Y"] * 2 + [None]
    full = recommendation.full_windows(GenomeSmoother(chromosome, recommendation.REGIONAL_WINDOW))
    assert full[:60].eq(1).all() and full[60:].eq(0).all()


def test_a_batch_wide_regional_shift_is_named_with_the_call_that_keeps_it():
    preset, reason = recommendation.rule(0.3, 0.9, "donor_F", 0.0, "labels")
    assert preset == "default" and "donor_F carries a copy-number-sized regional shift in all its cells" in reason
    assert "the default fits\"" not in reason and not reason.endswith("the default fits")
    assert recommendation.rule(0.3, 0.1, "donor_F", 0.0, "labels")[1].endswith("the default fits")


def test_the_printed_command_is_complete_and_quoted(tmp_path):
    """Run as printed, the recommended command corrects the training file (not the bundled one), with the run's
    data options, paths quoted for a shell."""
    import shlex

    from batchfix.config import TrainConfig, validated
    from batchfix.tasks.training import correct_command

    data = tmp_path / "my data {1}.h5ad"
    cfg = validated({"data": {"path": str(data), "batch_key": "donor id", "counts_layer": "counts"}}, TrainConfig)
    command = correct_command(cfg, tmp_path / "run").format(preset="protocols")
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "batchfix", "correct"]
    assert f"input={data}" in words and f"checkpoint={tmp_path / 'run' / 'model.ckpt'}" in words
    assert {"correction=protocols", "data.batch_key=donor id", "data.counts_layer=counts"} <= set(words)
    assert f"output={tmp_path / 'run' / 'corrected.recommended.h5ad'}" in words
