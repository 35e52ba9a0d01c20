"""The Python API: the README's example as written, the same numbers as the command line, and the
trained-model object's checkpoint shared with the command line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pytest

import batchfix
from batchfix.api import train_config
from batchfix.errors import ConfigError, InputError, OutputError
from batchfix.training import extra_decoder

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "tiny_run_seed0.npz"
# The options of the regression run (tests/verbs/tiny_run_seed0.npz): the test_training.py tiny model, 4 epochs.
TINY = dict(n_top_genes=200, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8, decoder_hidden=32,
            batch_size=64, learning_rate=2e-3, threads=1, enable_progress_bar=False, max_epochs=4, seed=0,
            precision="32-true")  # recorded in float32 (a CPU with bf16 units would train bf16-mixed by default)


def readme_example() -> str:
    """The README's Python example: its first python code block."""
    return re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


@pytest.mark.slow  # trains and corrects every gene of the bundled file (35-90 s): with the slow checks, which CI runs
def test_the_readme_example_runs_as_written(tmp_path, monkeypatch):
    """As written, but for the training budget: the example trains the default 500 steps (minutes on a 2-core
    CPU); here 2 epochs, and the extra genes' decoder 50 steps."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(extra_decoder, "MAX_STEPS", 50)
    train = batchfix.train
    monkeypatch.setattr(batchfix, "train", lambda *args, **options: train(*args, **{"max_epochs": 2, **options}))
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    adata, model, corrected = namespace["adata"], namespace["model"], namespace["corrected"]
    assert isinstance(model, batchfix.BatchfixModel) and (tmp_path / "model.ckpt").is_file()
    modelled = adata.var["batchfix_modelled"].to_numpy()
    assert modelled.sum() == len(model.genes) == 2000
    assert adata.obsm["X_batchfix"].shape == (adata.n_obs, 30)
    assert corrected.uns["bf"]["reference_batch"] == "sc_dropseq" and "bf" not in adata.layers
    assert namespace["counts"].shape == adata.shape and adata.layers["batchfix"].shape == adata.shape


def test_api_training_gives_the_recorded_regression_values(small_adata):
    """Same data, options and seed as tests/verbs/tiny_run_seed0.npz, recorded with the command-line route
    (tasks.train on the file) before the configuration and API were reorganised: the same numbers. The
    recording holds the denoised output (the only one then)."""
    golden = np.load(GOLDEN)
    model = batchfix.train(small_adata, batch_key="batch", **TINY)
    assert model.genes == list(golden["genes"])
    corrected = batchfix.correct(small_adata, model, output_mode="denoised", copy=True)  # the output then
    columns = corrected.var_names.get_indexer(model.genes)
    np.testing.assert_allclose(corrected.layers["batchfix"].toarray()[:, columns], golden["corrected"], atol=2e-3)
    np.testing.assert_allclose(corrected.obsm["X_batchfix"], golden["latent"], atol=2e-3)


@pytest.mark.slow  # a command-line train in a fresh process (12-32 s): with the slow checks, which CI runs
def test_a_saved_model_is_a_checkpoint_the_command_line_reads(small_adata, small_h5ad, tmp_path, counts_nearly_equal):
    model = batchfix.train(small_adata, batch_key="batch", **{**TINY, "max_epochs": 1})
    in_memory = batchfix.correct(small_adata, model, copy=True)
    assert in_memory.uns["batchfix"]["checkpoint"] == "(in memory, not saved)"
    path = model.save(tmp_path / "api.ckpt")
    with pytest.raises(FileExistsError, match="overwrite=true"):
        model.save(path)
    reloaded = batchfix.BatchfixModel.load(path)
    assert reloaded.genes == model.genes and reloaded.batch_categories == model.batch_categories
    out = tmp_path / "cli.h5ad"
    run = subprocess.run([sys.executable, "-m", "batchfix", "correct", f"input={small_h5ad}", f"output={out}",
                          f"checkpoint={path}", "progress=false", "threads=1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    from_cli = ad.read_h5ad(out)
    counts_nearly_equal(from_cli.layers["batchfix_counts"], in_memory.layers["batchfix_counts"])  # measured: none
    np.testing.assert_allclose(from_cli.obsm["X_batchfix"], in_memory.obsm["X_batchfix"], atol=1e-5)
    assert from_cli.uns["batchfix"]["checkpoint"] == str(path.resolve())


def test_options_mirror_the_config_with_its_defaults_and_validation():
    cfg = train_config(n_heads=8, max_epochs=3, batch_key="sample", reference="b1")
    assert (cfg.model.n_heads, cfg.trainer.max_epochs, cfg.data.batch_key, cfg.correction.reference) == (
        8, 3, "sample", "b1")
    assert cfg.model.d_model == 64 and cfg.fit.batch_size == 128  # the schema's defaults
    with pytest.raises(ConfigError, match=r"fit.batch_size: Value 'abc'"):
        train_config(batch_size="abc")
    with pytest.raises(ConfigError, match=r"model.latent_dim must be >= 1, got 0"):
        train_config(latent_dim=0)
    with pytest.raises(ConfigError, match=r"Unknown option 'n_head'; did you mean \['n_heads'"):
        train_config(n_head=2)
    with pytest.raises(ConfigError, match="'path' is not an option of batchfix.train"):
        train_config(path="x.h5ad")


def test_api_errors_are_user_errors_and_leave_the_anndata_unchanged(small_adata):
    before = small_adata.copy()
    with pytest.raises(ConfigError, match="batch_size"):
        batchfix.correct(small_adata, "nowhere.ckpt", batch_size=0)
    with pytest.raises(ConfigError, match="trainer.max_epochs must be >= 1"):
        batchfix.train(small_adata, max_epochs=-1)
    assert not small_adata.layers and not small_adata.obsm and small_adata.var.equals(before.var)


def test_tab_completion_offers_the_public_api():
    """IPython completes `batchfix.<Tab>` from dir(): the lazy names too, and each of them resolves."""
    names = dir(batchfix)
    assert {"train", "correct", "evaluate", "BatchfixModel", "bundled_dataset", "settings"} <= set(names)
    assert all(getattr(batchfix, name) is not None for name in names)


@pytest.mark.slow  # a fresh Python process that trains (~10-40 s): with the slow checks, which CI runs
def test_the_recommendation_reaches_a_notebook(small_h5ad):
    """A notebook shows warnings, not info lines: a recommendation other than the trained correction is a warning,
    seen on stderr by a Python session that configured no logging."""
    script = (f"import anndata as ad, batchfix; from batchfix.training import extra_decoder; "
              f"extra_decoder.MAX_STEPS = 50; adata = ad.read_h5ad({str(small_h5ad)!r}); "
              f"batchfix.train(adata, correction='conditions', **{TINY!r})")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batchfix recommends correction='default' for these data (trained with 'conditions')" in result.stderr


def test_correct_refuses_the_command_lines_shard_option(small_adata):
    with pytest.raises(ConfigError, match="'shard' is not an option of batchfix.correct: parts of a file"):
        batchfix.correct(small_adata, "model.ckpt", shard="0/2")


def test_train_refuses_normal_values_no_cell_has_before_training(small_adata):
    with pytest.raises(InputError, match=r"normal_values=\['no_such_type'\]: no cell of obs column 'cell_type'"):
        batchfix.train(small_adata, regional_shift="reference_cells", normal_key="cell_type",
                       normal_values=["no_such_type"], max_epochs=1,
                       threads=1, enable_progress_bar=False, n_top_genes=200, genes_per_token=16)


@pytest.mark.parametrize("verb", ["train", "correct", "evaluate"])
def test_the_api_refuses_what_is_no_anndata_in_one_line(verb):
    call = {"train": lambda data: batchfix.train(data), "correct": lambda data: batchfix.correct(data, "model.ckpt"),
            "evaluate": lambda data: batchfix.evaluate(data)}[verb]
    with pytest.raises(InputError, match=rf"batchfix\.{verb} takes an AnnData \(cells x genes\), got ndarray"):
        call(np.ones((3, 3)))


@pytest.mark.parametrize("model", [None, 3])
def test_correct_refuses_a_model_that_is_neither_a_model_nor_a_path(small_adata, model):
    with pytest.raises(ConfigError, match=rf"model must be a BatchfixModel .* or a checkpoint's path, got "
                                          rf"{type(model).__name__}\."):
        batchfix.correct(small_adata, model, copy=True)


@pytest.mark.parametrize("n_cells", [0, 5])
def test_evaluate_names_a_file_of_too_few_cells_not_a_single_batch(small_adata, n_cells):
    few = small_adata[:n_cells].copy()  # the first cells share one batch
    few.layers["batchfix"] = few.X.copy()
    few.obsm["X_batchfix"] = np.zeros((n_cells, 2), dtype=np.float32)
    with pytest.raises(InputError, match=rf"Scoring needs at least 90 cells .* the file has {n_cells}\."):
        batchfix.evaluate(few, label_key=None)


def test_evaluate_refuses_an_out_dir_that_is_a_file_before_scoring(small_adata, tmp_path):
    taken = tmp_path / "metrics.h5ad"
    taken.write_bytes(b"kept")
    with pytest.raises(OutputError, match=rf"out_dir {taken} is a file: name a folder"):
        batchfix.evaluate(small_adata, label_key=None, out_dir=taken)
    assert taken.read_bytes() == b"kept"
