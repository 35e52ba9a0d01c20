"""What a new user meets: a typo is refused with the option meant, a model remembers its data, an empty input
is refused, each verb's --help, the end-of-run summary and one line per error.

Data: the real 200 x 600 subset (conftest), its batch column renamed to `sample` and its counts moved to
`layers['counts']`, so that only a model that remembers its data options finds them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hydra import compose, initialize_config_module

import batchfix
from batchfix import config
from batchfix.config import TrainConfig, validated
from batchfix.errors import ConfigError, InputError
from batchfix.training.trained import LEGACY_DATA_OPTIONS, load_trained

TINY = dict(n_top_genes=200, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8, decoder_hidden=32,
            batch_size=64, threads=1, enable_progress_bar=False, max_epochs=1, seed=0)
TINY_CLI = ["data.n_top_genes=200", "model.genes_per_token=16", "model.d_model=16", "model.n_layers=1",
            "model.latent_dim=8", "model.decoder_hidden=32", "fit.batch_size=64", "threads=1",
            "trainer.max_epochs=1", "trainer.enable_progress_bar=false"]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "batchfix", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)


def composed(name: str, overrides: list[str]):
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        return compose(name, overrides=overrides)


@pytest.fixture(scope="module")
def sample_adata(subset) -> ad.AnnData:
    """The subset with its batches in obs['sample'] and its raw counts in layers['counts'] (X: log1p)."""
    adata = subset.copy()
    adata.obs = adata.obs.rename(columns={"batch": "sample"})
    adata.layers["counts"] = adata.X.copy()
    adata.X = np.log1p(adata.X)
    return adata


@pytest.fixture(scope="module")
def model(sample_adata) -> batchfix.BatchfixModel:
    """A tiny model trained (1 epoch) with batch_key='sample', counts_layer='counts', label_key='cell_type'."""
    torch.set_num_threads(1)
    return batchfix.train(sample_adata, batch_key="sample", counts_layer="counts", label_key="cell_type", **TINY)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory) -> Path:
    return model.save(tmp_path_factory.mktemp("model") / "model.ckpt")


# --------------------------------------------------------------------------------------------
# 1. Unknown options


@pytest.mark.parametrize("override, meant", [("+model.n_head=4", "`model.n_heads`"),
                                             ("+fit.learning_rat=0.5", "`fit.learning_rate`"),
                                             ("+n_heads=4", "`model.n_heads`"),
                                             ("+foo=1", None)])
def test_an_added_unknown_key_is_refused_with_the_option_meant(override, meant):
    cfg = composed("train", [override])  # Hydra accepts an added key ...
    with pytest.raises(ConfigError, match=r"Unknown option `") as err:  # ... the schema does not
        validated(cfg, TrainConfig)
    assert (meant in str(err.value)) if meant else "did you mean" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["train", "model.n_head=4"], "Unknown option `model.n_head`; did you mean `model.n_heads`?"),
    (["train", "+model.n_head=4"], "Unknown option `model.n_head`; did you mean `model.n_heads`?"),
    (["train", "+fit.learning_rat=0.5"], "did you mean `fit.learning_rate`?"),
    (["correct", "checkpoint=x", "bach_key=b"], "Unknown option `bach_key`; did you mean `data.batch_key`?"),
    (["correct", "checkpoint=x", "model.n_heads=4"], "Unknown option `model.n_heads`"),
])
def test_the_command_line_refuses_unknown_keys_in_one_line(args, message, tmp_path):
    result = cli(args, tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(f"batchfix {args[0]}: error: ")
    assert message in result.stderr and "+model" not in result.stderr  # no hint to add the key with +
    assert list(tmp_path.iterdir()) == []


def test_the_api_refuses_unknown_and_ineffective_options(sample_adata):
    with pytest.raises(ConfigError, match=r"Unknown option 'n_head'; did you mean \['n_heads'"):
        batchfix.train(sample_adata, batch_key="sample", n_head=4)
    for option in ("resume", "overwrite"):
        with pytest.raises(ConfigError, match=rf"'{option}' is not an option of batchfix\.train"):
            batchfix.train(sample_adata, batch_key="sample", **{option: "x"})


# --------------------------------------------------------------------------------------------
# 2. The checkpoint remembers its data


def test_the_checkpoint_records_its_data_options(model, checkpoint):
    assert load_trained(checkpoint).data_options == {"batch_key": "sample", "counts_layer": "counts",
                                                     "label_key": "cell_type", "genome": "GRCh38", "scale": "counts"}


def test_correct_takes_batch_key_and_counts_layer_from_the_checkpoint(sample_adata, checkpoint, tmp_path):
    source = tmp_path / "in.h5ad"
    sample_adata.write_h5ad(source)
    before = sha256(source)
    result = cli(["correct", f"input={source}", f"output={tmp_path / 'out.h5ad'}", f"checkpoint={checkpoint}",
                  "progress=false", "threads=1"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("Wrote") + result.stderr.count("Wrote") == 1
    out = ad.read_h5ad(tmp_path / "out.h5ad")
    assert out.uns["batchfix"]["params"]["batch_key"] == "sample"
    assert out.uns["batchfix"]["params"]["counts"] == "layers['counts']"
    assert out.uns["batchfix"]["params"]["counts_layer"] == "counts"
    assert list(out.uns["batchfix"]["unseen_batches_estimated"]) == []
    assert sha256(source) == before


@pytest.mark.slow  # ~40 s on 2 cores (two command-line corrections): in the slow run, which CI runs too
def test_correct_reads_x_with_counts_layer_x_and_says_so_when_the_trained_layer_is_missing(sample_adata, checkpoint,
                                                                                          tmp_path):
    """A model trained on layers['counts'] meets a file with its counts in X: the error names data.counts_layer=X
    (not null, which means the trained layer again), and data.counts_layer=X (as `correct --help` lists it) reads X."""
    adata = sample_adata.copy()
    adata.X = adata.layers.pop("counts")
    source = tmp_path / "in.h5ad"
    adata.write_h5ad(source)
    base = ["correct", f"input={source}", f"output={tmp_path / 'out.h5ad'}", f"checkpoint={checkpoint}",
            "progress=false", "threads=1"]
    for told in ([], ["data.counts_layer=null"]):
        refused = cli([*base, *told], tmp_path)
        assert refused.returncode == 1 and "Layer 'counts' not found" in refused.stderr
        assert "data.counts_layer=X reads X" in refused.stderr and "=null to read X" not in refused.stderr
    result = cli([*base, "data.counts_layer=X"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ad.read_h5ad(tmp_path / "out.h5ad").uns["batchfix"]["params"]["counts"] == "X"


def test_a_group_option_set_to_null_is_one_line(tmp_path):
    for verb, meant in (("correct", "leave correction out for the checkpoint's"), ("train", "for the default")):
        result = cli([verb, "correction=null"], tmp_path)
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
        assert "correction= names one of conf/correction/ (conditions, default," in result.stderr
        assert meant in result.stderr


def test_a_checkpoint_without_data_options_loads_with_the_old_defaults(checkpoint, tmp_path):
    saved = torch.load(checkpoint, weights_only=True)
    del saved["hyper_parameters"]["data"]
    torch.save(saved, tmp_path / "old.ckpt")
    old = load_trained(tmp_path / "old.ckpt")
    assert old.data_options == {**LEGACY_DATA_OPTIONS, "scale": "counts"}
    assert old.data_options["batch_key"] == "batch"


@pytest.mark.slow  # a correct in a fresh process (5 s): with the slow checks, which CI runs
def test_a_batch_column_without_one_training_batch_is_refused(sample_adata, checkpoint, tmp_path):
    source = tmp_path / "in.h5ad"
    sample_adata.write_h5ad(source)
    result = cli(["correct", f"input={source}", f"output={tmp_path / 'out.h5ad'}", f"checkpoint={checkpoint}",
                  "data.batch_key=cell_type", "progress=false", "threads=1"], tmp_path)
    assert result.returncode == 1 and result.stderr.count("error:") == 1, result.stderr[-2000:]
    assert "None of the" in result.stderr and "obs column 'cell_type'" in result.stderr
    assert "'sample'" in result.stderr and "all_batches_new=true" in result.stderr  # the columns, the way out
    assert not (tmp_path / "out.h5ad").exists()
    adata = sample_adata.copy()
    with pytest.raises(InputError, match=r"None of the \d+ values of obs column 'cell_type'"):
        batchfix.correct(adata, checkpoint, batch_key="cell_type")
    assert "batchfix" not in adata.layers
    batchfix.correct(adata, checkpoint, batch_key="cell_type", all_batches_new=True)
    assert len(adata.uns["batchfix"]["unseen_batches_estimated"]) > 0


# --------------------------------------------------------------------------------------------
# 3. Empty cells


@pytest.mark.slow  # a train and a correct in fresh processes (5 s): with the slow checks, which CI runs
def test_an_input_of_empty_cells_is_refused_and_writes_nothing(sample_adata, checkpoint, tmp_path):
    empty = sample_adata.copy()
    empty.layers["counts"] = sp.csr_matrix(empty.shape, dtype=np.float32)
    source = tmp_path / "empty.h5ad"
    empty.write_h5ad(source)
    result = cli(["correct", f"input={source}", f"output={tmp_path / 'out.h5ad'}", f"checkpoint={checkpoint}",
                  "progress=false", "threads=1"], tmp_path)
    assert result.returncode == 1 and result.stderr.count("error:") == 1, result.stderr[-2000:]
    assert f"All {empty.n_obs} cells of the input (layers['counts']) have no counts in any gene" in result.stderr
    assert not (tmp_path / "out.h5ad").exists()
    modelled_zero = sample_adata.copy()  # counts only in genes the model does not use
    unused = ~modelled_zero.var_names.isin(load_trained(checkpoint).genes)
    modelled_zero.layers["counts"][:, ~unused] = 0
    with pytest.raises(InputError, match=r"have no counts in any of the model's 200 genes"):
        batchfix.correct(modelled_zero, checkpoint)
    assert "batchfix" not in modelled_zero.layers


def test_some_empty_cells_are_counted_and_their_values_explained(sample_adata, checkpoint, caplog):
    adata = sample_adata.copy()
    adata.layers["counts"][:7] = 0
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        batchfix.correct(adata, checkpoint)
    assert "7 of 200 cells have no counts in any of the model's genes (7 of them in no gene at all)" in caplog.text
    assert adata.uns["batchfix"]["n_cells_without_counts"] == 7
    # the corrected counts say what they hold: zeros, and a latent that is the same for each empty cell
    said = "their corrected values stay zero, but their obsm['X_batchfix'] is the latent of an empty cell"
    assert said in caplog.text
    assert "decodes" not in caplog.text and adata.layers["batchfix_counts"][:7].sum() == 0
    assert np.ptp(adata.obsm["X_batchfix"][:7], axis=0).max() < 1e-5
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        denoised = batchfix.correct(adata, checkpoint, output_mode="denoised", key_added="bf", copy=True)
    assert "their layers['bf'] values are what the model decodes from an empty cell" in caplog.text
    assert (denoised.layers["bf"][:7].sum(axis=1) > 0).all()


# --------------------------------------------------------------------------------------------
# 6. The console


@pytest.mark.slow  # a command-line train in a fresh process (12-32 s): with the slow checks, which CI runs
def test_train_ends_with_its_summary_and_errors_print_once(subset_h5ad, tmp_path):
    run = tmp_path / "run"
    result = cli(["train", f"data.path={subset_h5ad}", "evaluate=false", f"hydra.run.dir={run}", *TINY_CLI],
                 tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout[result.stdout.index("batchfix train: done."):]
    assert "200 cells, 200 genes, 1 epochs" in summary and "final negative ELBO" in summary
    assert f"wrote {run}/: model.ckpt, corrected.h5ad, metrics.json" in summary
    noise = result.stdout + result.stderr
    for tip in ("Tip:", "litlogger", "does not have many workers", "DeprecationWarning", "GPU available"):
        assert tip not in noise, tip
    again = cli(["train", f"data.path={subset_h5ad}", f"hydra.run.dir={run}", *TINY_CLI], tmp_path)
    assert again.returncode == 1
    assert (again.stdout + again.stderr).count("holds a run") == 1, again.stdout + again.stderr


def test_a_missing_input_is_reported_before_torch_is_imported(tmp_path):
    result = cli(["correct", f"input={tmp_path / 'no.h5ad'}", "checkpoint=x"], tmp_path)
    assert result.returncode == 1 and f"Input file not found: {tmp_path / 'no.h5ad'}" in result.stderr
    probe = ("import sys, runpy; sys.argv = ['x', 'input=/nonexistent.h5ad', 'checkpoint=x']\n"
             "try:\n    runpy.run_module('batchfix.cli.correct', run_name='__main__')\n"
             "except SystemExit:\n    print('torch' in sys.modules)")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert imported.stdout.strip() == "False", imported.stderr[-2000:]


def test_verbosity_shows_batchfix_lines_in_a_notebook(sample_adata, checkpoint, capfd):
    logger = logging.getLogger("batchfix")
    level, handlers = logger.level, list(logger.handlers)  # as the session had them: other tests read its lines
    try:
        batchfix.settings.verbosity = "info"
        batchfix.correct(sample_adata.copy(), checkpoint)
        assert "batchfix: Corrected 200 cells" in capfd.readouterr().err
        batchfix.settings.verbosity = "warning"
        batchfix.correct(sample_adata.copy(), checkpoint)
        assert "Corrected" not in capfd.readouterr().err
        with pytest.raises(ConfigError, match="verbosity must be one of"):
            batchfix.settings.verbosity = "loud"
    finally:
        logger.setLevel(level)
        logger.handlers[:] = handlers


# --------------------------------------------------------------------------------------------
# 5. Help


@pytest.mark.parametrize("verb", list(config.SCHEMAS))
def test_each_verbs_help_lists_its_options_with_descriptions_and_defaults(verb):
    from batchfix.__main__ import VERBS
    from batchfix.cli.help import verb_help

    text = verb_help(verb, VERBS[verb])
    described = config.option_descriptions(config.SCHEMAS[verb])
    assert all(described.values()), [name for name, line in described.items() if not line]
    lines = text.splitlines()
    for name in described:
        assert sum(line.startswith(f"  {name}=") for line in lines) == 1, name
    assert "schema" not in text and "hydra" not in text.lower()
    others = {name for v, s in config.SCHEMAS.items() if v != verb for name in config.dotted_options(s)}
    for name in others - set(described):
        assert f"  {name}=" not in text, name


def test_help_shows_the_presets_defaults_and_prints_without_hydras_dump(tmp_path):
    result = cli(["train", "--help"], tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert "  data.label_key=cell_type" in result.stdout  # the bundled data's preset, not the schema's null
    assert "  model.n_heads=2" in result.stdout and "attention heads; must divide d_model" in result.stdout
    assert "== Config ==" not in result.stdout and "Powered by Hydra" not in result.stdout
    correct = cli(["correct", "--help"], tmp_path).stdout
    assert "  all_batches_new=false" in correct and "  model." not in correct and "  data.batch_key=null" in correct


def test_the_api_train_signature_is_every_train_option_that_has_an_effect():
    import inspect

    from batchfix.api import CORRECTION_OPTIONS, NOT_API_OPTIONS

    parameters = inspect.signature(batchfix.train).parameters
    explicit = [name for name, p in parameters.items()
                if p.kind is not p.VAR_KEYWORD and name not in ("adata", "correction")]
    names = config.flat_option_names(TrainConfig)
    ablations = {name for name, dotted in names.items() if dotted.startswith("ablation.")}
    assert set(explicit) == set(names) - set(NOT_API_OPTIONS) - set(CORRECTION_OPTIONS) - ablations | {"seed"}
    for name in ablations & {f.name for f in fields(config.ModelAblations)}:  # keywords, listed after the others
        assert f"    {name}\n        " in batchfix.train.__doc__, name
    with pytest.raises(ConfigError, match=r"\['regional_order'\] have no effect in batchfix.train"):
        batchfix.train(ad.AnnData(np.ones((3, 3), dtype=np.float32)), regional_order="shuffled")
    defaults = TrainConfig()
    for name in explicit:  # the schema's defaults, and each documented from config.py
        group, _, last = names[name].rpartition(".")
        assert parameters[name].default == getattr(getattr(defaults, group) if group else defaults, last), name
        assert f"    {name}\n        " in batchfix.train.__doc__, name


@pytest.mark.slow  # scores a corrected file twice (9-10 s): with the slow checks, which CI runs
def test_api_evaluate_scores_a_corrected_anndata_as_the_command_line(sample_adata, checkpoint, tmp_path):
    """... with the model's checks (PIT, detection against its reference) that `correct` stored: its checkpoint
    gone, and the model= of earlier releases ignored with a warning."""
    import shutil

    adata = sample_adata.copy()
    moved = Path(shutil.copy(checkpoint, tmp_path / "moved.ckpt"))
    model = batchfix.BatchfixModel.load(moved)
    batchfix.correct(adata, model)
    moved.unlink()
    with pytest.warns(FutureWarning, match=r"model=\.\.\.\) is no longer needed"):
        result = batchfix.evaluate(adata, batch_key="sample", counts_layer="counts", out_dir=tmp_path / "scores",
                                   neighbors="exact", model=model)
    total = result["scores"]["batchfix corrected expression (PCA)"]["Total"]
    assert 0 < total < 1 and result["label_key"] == "cell_type"  # the command line's default label column
    assert result["matrix_scores"]["PIT fails"] is not None and result["matrix_scores"]["model_checks_cells"] > 0
    assert sorted(p.name for p in (tmp_path / "scores").iterdir()) == ["metrics.json", "metrics.md", "umap.png"]
    with pytest.raises(ConfigError, match="evaluation.neighbors must be one of"):
        batchfix.evaluate(adata, neighbors="fast")


def test_a_skipped_first_step_of_fp16_training_is_not_reported_as_a_scheduler_mistake():
    """Lightning's 16-mixed skips the first steps whose fp16 gradients overflow while the schedule steps: torch then
    warns as if the scheduler were called first. batchfix's fit hides that one warning (not others)."""
    import warnings

    import torch

    from batchfix.console import quiet_warnings

    parameter = torch.nn.Parameter(torch.zeros(1))
    schedule = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([parameter]), lambda step: 1.0)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_warnings()
        schedule.step()  # no optimizer step before it, as when the loss scaler skipped it
        warnings.warn("another warning")
    assert [str(w.message) for w in shown] == ["another warning"]


def test_the_run_summary_names_a_high_model_misfit_and_what_to_do(tmp_path):
    """A model that misfits many gene x batch pairs (PIT not uniform) is named in the summary with the genes failing
    in the most batches; the bundled data's 0.5 % is not."""
    from batchfix.cli.summary import run_summary

    failing = {"b1": ["MALAT1", "ACTB", "TMSB4X"], "b2": ["ACTB", "GAPDH"], "b3": ["ACTB", "TMSB4X"]}
    evaluation = {"scores": {}, "gene_fidelity": {}, "matrix_scores": {"PIT fails": 0.12, "pit_failing_genes": failing}}
    summary = run_summary("evaluate", evaluation, tmp_path, [])
    line = next(line for line in summary.splitlines() if "model misfit" in line)
    assert "12.0% of gene x batch pairs" in line and "worst: ACTB, TMSB4X, MALAT1, GAPDH" in line
    assert "fit.target_steps" in line and "metrics.md" in line
    evaluation["matrix_scores"]["PIT fails"] = 0.005
    assert "model misfit" not in run_summary("evaluate", evaluation, tmp_path, [])


def test_the_run_summary_says_how_much_batch_effect_is_left_within_cell_types(tmp_path):
    """With labels, the summary gives the gene-level batch effect left (issue 52's score); without, no such line."""
    from batchfix.cli.summary import run_summary

    evaluation = {"scores": {}, "gene_fidelity": {}, "matrix_scores": {"Batch effect left (log)": 0.274}}
    line = next(line for line in run_summary("evaluate", evaluation, tmp_path, []).splitlines() if "left" in line)
    assert "batch effect left within cell types: 0.274" in line
    evaluation["matrix_scores"]["Batch effect left (log)"] = None
    assert "batch effect left" not in run_summary("evaluate", evaluation, tmp_path, [])


@pytest.mark.slow  # a train in a fresh process each (6 s): with the slow checks, which CI runs
@pytest.mark.parametrize("normal, message", [
    (["correction.regional_shift=reference_cells", "correction.normal_key=cell_type",
      "correction.normal_values=[no_such_type]"],
     "correction.normal_values=['no_such_type']: no cell of obs column 'cell_type' has one of them"),
    (["correction.regional_shift=reference_cells", "correction.normal_key=no_such_column",
      "correction.normal_values=[x]"],
     "correction.normal_key='no_such_column': obs has no such column")])
def test_train_refuses_normal_cells_the_input_lacks_before_training(subset_h5ad, tmp_path, normal, message):
    run = tmp_path / "run"
    result = cli(["train", f"data.path={subset_h5ad}", "evaluate=false", f"hydra.run.dir={run}", *TINY_CLI,
                  *normal], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"batchfix train: error: {message}" + result.stderr.split(message)[1]
                                                  .strip()]
    assert "Epoch" not in result.stdout + result.stderr and not run.exists()


@pytest.mark.parametrize("verb, option", [("correct", "input"), ("correct", "checkpoint"), ("train", "data.path"),
                                          ("evaluate", "input")])
def test_a_folder_named_as_an_input_file_is_one_line_naming_its_files(tmp_path, verb, option):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "model.ckpt").write_bytes(b"")
    result = cli([verb, f"{option}={folder}", *(["checkpoint=x"] if option == "input" and verb == "correct" else []),
                  f"hydra.run.dir={tmp_path / 'out'}"], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    what = "Checkpoint" if option == "checkpoint" else "Input file"
    assert result.stderr.strip() == (f"batchfix {verb}: error: {what} {folder} is a folder ({option}= names a file); "
                                     f"files in it: ['model.ckpt'].")


@pytest.mark.parametrize("verb, option", [("correct", "input"), ("train", "data.path"), ("attention", "input")])
def test_a_file_that_is_no_hdf5_is_named_as_such_by_every_verb(tmp_path, verb, option):
    text = tmp_path / "cells.h5ad"
    text.write_text("barcode,gene\n")
    run = [f"hydra.run.dir={tmp_path / 'run'}"] if verb == "train" else ["checkpoint=x"]
    result = cli([verb, f"{option}={text}", *run], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith(f"batchfix {verb}: error: {text} is not an .h5ad file (no HDF5 signature; got 8 "
                                    "leading bytes b'barcode,'). Convert it with anndata/scanpy first")
    assert text.read_text() == "barcode,gene\n" and not (tmp_path / "run").exists()


@pytest.mark.slow  # an attention in a fresh process (5 s): with the slow checks, which CI runs
def test_attention_on_a_file_of_no_cells_is_one_line_and_writes_nothing(sample_adata, checkpoint, tmp_path):
    empty = tmp_path / "empty.h5ad"
    sample_adata[:0].copy().write_h5ad(empty)
    result = cli(["attention", f"input={empty}", f"checkpoint={checkpoint}", "group_by=sample", "threads=1",
                  f"output={tmp_path / 'maps'}"], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip() == (f"batchfix attention: error: {empty} holds no cells: the attention maps average "
                                     "the attention of its cells.")
    assert not (tmp_path / "maps").exists()


@pytest.mark.parametrize("verb", ["train", "correct", "attention"])
def test_an_absurd_thread_count_is_refused_as_an_option_not_blamed_on_the_checkpoint(tmp_path, verb):
    result = cli([verb, "threads=100000", *(["checkpoint=x"] if verb != "train" else [])], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip() == f"batchfix {verb}: error: threads must be in [1, {4 * os.cpu_count()}], got 100000."
