"""Every bad option, input, output location and signal ends cleanly: one line, a non-zero exit, the input
untouched, nothing left behind.

The command-line cases are a table run through the real CLI in subprocesses (several at a time: each
start costs seconds of imports), one or a few rows for each way a command reports a failure (an
option's type, range or name, an input, an output location); the variants of each are tested
in-process against the layer that validates them. Signals are sent to real `train` and `correct`
processes, and the reused run folder is tried with them. Data: the real 200 x 600 subset (conftest)
and files derived from it.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchfix
from batchfix import runfolder, signals, tasks
from batchfix.api import train_config
from batchfix.cli import folder_check
from batchfix.cli.common import user_errors_reported
from batchfix.config import CorrectConfig, DataConfig, ResolvedCorrection, TrainConfig, flat_option_names, validated
from batchfix.correction.writers import correct_file
from batchfix.data import atomic, ondisk
from batchfix.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    Interrupted,
    OutputError,
    OutputExistsError,
    TrainingError,
)
from batchfix.tasks import inference
from batchfix.training import fitting
from batchfix.training.fitting import CellDataModule
from batchfix.training.trained import load_trained

TINY = ["data.n_top_genes=200", "model.genes_per_token=16", "model.d_model=16", "model.n_heads=2", "model.n_layers=1",
        "model.latent_dim=8", "model.decoder_hidden=32", "fit.batch_size=64", "evaluate=false", "threads=1",
        "trainer.enable_progress_bar=false"]
STEPS_PER_EPOCH = 3  # 180 training cells (200, validation_fraction 0.1) in minibatches of 64
HAS_SYS = Path("/sys/kernel").is_dir()  # /sys refuses new files, even to root: a read-only output folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(folder: Path) -> list[str]:
    """Every file and folder under `folder` (hidden ones too), relative."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def cli(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "batchfix", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def tiny_train_config(**options) -> TrainConfig:
    """TINY as a TrainConfig, plus `options` by their last name (`path=...`, `max_epochs=1`)."""
    names = flat_option_names(TrainConfig)
    nested: dict = {}
    for override in TINY:
        key, value = override.split("=")
        options.setdefault(key.rpartition(".")[2], value)
    for name, value in options.items():
        group, _, key = names[name].rpartition(".")
        (nested.setdefault(group, {}) if group else nested)[key] = value
    return validated(nested, TrainConfig)


# --------------------------------------------------------------------------------------------
# Files


def one_cell_batch(adata: ad.AnnData) -> tuple[ad.AnnData, str]:
    """`adata` with its first batch cut down to one cell, and that batch's name."""
    batch = adata.obs["batch"].astype(str).to_numpy()
    first = sorted(set(batch))[0]
    keep = np.ones(adata.n_obs, dtype=bool)
    keep[np.flatnonzero(batch == first)[1:]] = False
    return adata[keep].copy(), first


@pytest.fixture(scope="module")
def files(subset, tmp_path_factory) -> dict[str, Path]:
    """Input files (never to change), a folder posing as a file, and a tiny trained checkpoint."""
    data = tmp_path_factory.mktemp("data")
    subset.write_h5ad(data / "small.h5ad")
    duplicated = subset.copy()
    duplicated.var_names = [subset.var_names[0], *subset.var_names[:-1]]  # first gene named twice
    duplicated.write_h5ad(data / "dup_genes.h5ad")
    one_cell_batch(subset)[0].write_h5ad(data / "one_cell_batch.h5ad")
    (data / "folder.h5ad").mkdir()
    trained = tmp_path_factory.mktemp("trained")
    torch.set_num_threads(1)
    tasks.train(tiny_train_config(path=str(data / "small.h5ad"), max_epochs=1), trained / "run")
    paths = {p.stem: p for p in data.iterdir()}
    return {**paths, "data": data, "ckpt": trained / "run" / "model.ckpt"}


# --------------------------------------------------------------------------------------------
# The command line: one table, run a few processes at a time


@dataclass
class Case:
    id: str
    args: list[str]
    message: str  # a regex the one error line must match
    slow: bool = False  # another of a kind the default run checks: with the slow checks, which CI runs

    @property
    def verb(self) -> str:
        return self.args[0]


CASES = [
    # Options: type, range, combination (checked before anything is written)
    Case("train-max-epochs-negative", ["train", "trainer.max_epochs=-1"], message=r"trainer\.max_epochs must be >= 1"),
    Case("train-latent-dim-zero", ["train", "model.latent_dim=0"], message=r"model\.latent_dim must be >= 1", slow=True),
    Case("train-batch-size-text", ["train", "fit.batch_size=abc"], message=r"fit\.batch_size.*'abc'.*Integer", slow=True),
    Case("train-batch-size-zero", ["train", "fit.batch_size=0"], message=r"fit\.batch_size must be >= 1", slow=True),
    Case("train-threads-negative", ["train", "threads=-1"], message=r"threads must be >= 1", slow=True),
    Case("train-n-top-genes-zero", ["train", "data.n_top_genes=0"], message=r"data\.n_top_genes must be >= 1", slow=True),
    Case("train-unknown-option", ["train", "fit.bach_size=3"], message=r"fit\.bach_size"),
    Case("train-unknown-preset", ["train", "model=huge"], message=r"model/huge.*Available options"),
    Case("correct-key-added-null", ["correct", "correction.key_added=null", "checkpoint=x"], message=r"key_added"),
    Case("correct-batch-size-text", ["correct", "inference.batch_size=abc", "checkpoint=x"],
         message=r"batch_size.*'abc'"),
    Case("correct-no-checkpoint", ["correct", "input={small}"], message=r"correct needs checkpoint="),
    # Inputs, checkpoints (variants: in-process below; the default run folder must not be left behind)
    Case("train-input-missing", ["train", "data.path={data}/missing.h5ad"], message=r"Input file not found"),
    Case("evaluate-input-missing", ["evaluate", "input={data}/missing.h5ad"], message=r"Input file not found"),
    # Output locations
    *([Case("correct-output-read-only", ["correct", "input={small}", "output=/sys/batchfix-test/out.h5ad",
                                         "checkpoint={ckpt}"], message=r"Cannot write the output .*/sys/"),
       Case("train-run-folder-read-only", ["train", "hydra.run.dir=/sys/batchfix-test"],
            message=r"Cannot write the run folder /sys/batchfix-test")] if HAS_SYS else []),
]


def run_cases(cases: list[Case], files: dict[str, Path], tmp_path_factory) -> dict[str, dict]:
    """Run every case (three processes at a time), each in its own empty working folder."""
    before = {name: sha256(path) for name, path in files.items() if path.is_file()}
    data_listing = listing(files["data"])
    names = {name: str(path) for name, path in files.items()}

    def run(case: Case) -> tuple[str, dict]:
        cwd = tmp_path_factory.mktemp(case.id)
        process = cli([arg.format(**names) for arg in case.args], cwd)
        stdout, stderr = process.communicate(timeout=600)
        return case.id, {"status": process.returncode, "stdout": stdout, "stderr": stderr, "left": listing(cwd),
                         "cwd": cwd}

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(pool.map(run, cases))
    results["inputs"] = {"unchanged": before == {n: sha256(p) for n, p in files.items() if p.is_file()},
                         "listing": listing(files["data"]) == data_listing}
    return results


@pytest.fixture(scope="module")
def cli_results(files, tmp_path_factory) -> dict[str, dict]:
    return run_cases([case for case in CASES if not case.slow], files, tmp_path_factory)


@pytest.fixture(scope="module")
def slow_cli_results(files, tmp_path_factory) -> dict[str, dict]:
    return run_cases([case for case in CASES if case.slow], files, tmp_path_factory)


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case.slow else case for case in CASES],
                         ids=lambda case: case.id)
def test_cli_case(request, case):
    result = request.getfixturevalue("slow_cli_results" if case.slow else "cli_results")[case.id]
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert result["status"] == 1, result["stderr"][-3000:]
    line = last_line(result["stderr"])
    assert line.startswith(f"batchfix {case.verb}: error: "), result["stderr"][-3000:]
    assert re.search(case.message, line), line
    assert result["stderr"].count("error:") == 1, "more than one error line"
    assert result["left"] == [], "the run left files behind"


def test_cli_cases_leave_inputs_unchanged(cli_results):
    assert cli_results["inputs"] == {"unchanged": True, "listing": True}


# --------------------------------------------------------------------------------------------
# Signals


def signal_when_ready(started: dict) -> None:
    """Send each process its signal as soon as its `ready()` holds; fail if one ends before that."""
    waiting, deadline = dict(started), time.monotonic() + 600
    while waiting:
        for (verb, signum), (ready, process) in list(waiting.items()):
            if ready():
                process.send_signal(signum)
                del waiting[verb, signum]
            elif process.poll() is not None:
                pytest.fail(f"{verb} ended (status {process.returncode}) before it could be sent {signum.name}: "
                            f"{process.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, f"never ready: {list(waiting)}"
        time.sleep(0.05)


def checkpoint_progress(path: Path) -> tuple[int, int]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint["global_step"], checkpoint["epoch"]


@pytest.fixture(scope="module")
def slow_input(subset, tmp_path_factory) -> Path:
    """20,000 cells, corrected one cell at a time: minutes, however late a busy machine sends the signal."""
    path = tmp_path_factory.mktemp("slow") / "cells.h5ad"
    cells = ad.concat([subset] * 100, index_unique="-")
    cells.X = sp.csr_matrix(cells.X)
    cells.write_h5ad(path)
    return path


@pytest.fixture(scope="module")
def signalled(files, slow_input, tmp_path_factory) -> dict:
    """Signals sent to real processes, all started together: `train` (on the file with a one-cell batch) once
    it saved a checkpoint, and `correct` once its temporary output exists."""
    work = tmp_path_factory.mktemp("signals")
    inputs = {path: sha256(path) for path in (files["one_cell_batch"], slow_input)}
    started = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        run_dir = work / signum.name
        started["train", signum] = (runfolder.last_checkpoint(run_dir).is_file, cli(
            ["train", f"data.path={files['one_cell_batch']}", *TINY, "fit.early_stopping_patience=0",
             "trainer.max_epochs=100000", f"hydra.run.dir={run_dir}"], work))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        started["correct", signum] = (lambda name=signum.name: any(work.glob(f".{name}.h5ad.*.tmp")), cli(
            ["correct", f"input={slow_input}", f"output={signum.name}.h5ad", f"checkpoint={files['ckpt']}",
             "inference.chunk_size=1", "inference.batch_size=1", "progress=false", "threads=1"], work))
    signal_when_ready(started)
    results = {"work": work, "inputs": inputs}
    for key, (_, process) in started.items():
        _, stderr = process.communicate(timeout=300)
        results[key] = {"status": process.returncode, "stderr": stderr}
    return results


@pytest.mark.slow  # real processes signalled mid-run (train to 100,000 epochs, 20,000 cells corrected): CI's slow step
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_train_with_a_checkpoint(signalled, signum):
    result, run_dir = signalled["train", signum], signalled["work"] / signum.name
    assert result["status"] == 128 + signum
    assert "Traceback" not in result["stderr"]
    line = last_line(result["stderr"])
    assert re.fullmatch(rf"batchfix train: error: interrupted by {signum.name} after (\d+) training steps; saved "
                        rf"{re.escape(str(runfolder.last_checkpoint(run_dir)))} \(resume={re.escape(str(run_dir))} "
                        r"continues it\)", line), line
    step, _ = checkpoint_progress(runfolder.last_checkpoint(run_dir))
    assert step == int(re.search(r"after (\d+) training", line).group(1)) > 0
    assert not (run_dir / "model.ckpt").exists() and not (run_dir / "metrics.json").exists()
    logged = pd.read_csv(run_dir / "logs" / "metrics.csv")  # the losses logged until the signal are kept
    assert step - 5 <= logged["step"].max() <= step  # logged every 5 steps (trainer.log_every_n_steps)


@pytest.mark.slow  # real processes signalled mid-run (train to 100,000 epochs, 20,000 cells corrected): CI's slow step
def test_interrupted_run_is_refused_then_resumed_or_overwritten(signalled, files, subset):
    work = signalled["work"]
    resumed, replaced = work / "SIGTERM", work / "SIGINT"
    last = runfolder.last_checkpoint(resumed)
    kept = {p: sha256(p) for p in (last, resumed / ".hydra" / "config.yaml")}
    step, epoch = checkpoint_progress(last)
    data = f"data.path={files['one_cell_batch']}"  # and no early stopping: the number of steps is known

    # Training into it again is refused before Hydra rewrites its .hydra/ files.
    again = cli(["train", data, *TINY, f"hydra.run.dir={resumed}"], work)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 1 and "Traceback" not in stderr
    assert re.search(r"already holds a run .*resume=.*overwrite=true", last_line(stderr))
    assert {p: sha256(p) for p in kept} == kept

    # resume= into the same folder continues it; overwrite=true starts the other afresh.
    epochs = epoch + 2
    processes = [cli(["train", data, *TINY, "fit.early_stopping_patience=0", f"trainer.max_epochs={epochs}",
                      f"resume={resumed}", f"hydra.run.dir={resumed}"], work),
                 cli(["train", data, *TINY, "trainer.max_epochs=1", "overwrite=true", f"hydra.run.dir={replaced}"],
                     work)]
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    # The run is complete although one batch has a single cell (that once crashed the gene selection).
    assert f"{one_cell_batch(subset)[1]} (1 cell)" in outputs[0][0] + outputs[0][1]
    metrics = json.loads((resumed / "metrics.json").read_text())
    assert metrics["n_cells"] == 161 and metrics["steps"] == epochs * STEPS_PER_EPOCH > step
    assert (resumed / "model.ckpt").is_file() and (resumed / "corrected.h5ad").is_file()
    assert checkpoint_progress(runfolder.last_checkpoint(resumed))[0] == epochs * STEPS_PER_EPOCH
    assert checkpoint_progress(runfolder.last_checkpoint(replaced))[0] == STEPS_PER_EPOCH
    assert sorted(p.name for p in (replaced / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]


@pytest.mark.slow  # real processes signalled mid-run (train to 100,000 epochs, 20,000 cells corrected): CI's slow step
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_correct_without_output(signalled, signum):
    result = signalled["correct", signum]
    assert result["status"] == 128 + signum and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert last_line(result["stderr"]) == (f"batchfix correct: error: interrupted by {signum.name}; "
                                           f"{signum.name}.h5ad was not written")
    assert not any(signalled["work"].glob(f"*{signum.name}.h5ad*")), "an output or a temporary file is left"


H5PY_ERRORS_OF_A_SIGNAL = [OSError("Can't write data (interrupted)"),  # a read or a write
                           TypeError("Operation not defined for data type class"),  # an attribute written
                           SystemError("error return without exception set")]  # an attribute iterated


@pytest.mark.parametrize("error", H5PY_ERRORS_OF_A_SIGNAL, ids=lambda e: type(e).__name__)
def test_an_h5py_error_while_a_signal_is_pending_is_reported_as_the_signal(files, tmp_path, monkeypatch, error):
    """A signal landing inside h5py's C code comes out as another error of the call it interrupted: with the
    signal pending, correct reports the interruption; without one, the error stays what it is."""
    def interrupted_write(*args, **kwargs):
        raise error

    monkeypatch.setattr(inference, "correct_file", interrupted_write)
    cfg = validated(dict(input=str(files["small"]), checkpoint=str(files["ckpt"]),
                         output=str(tmp_path / "out.h5ad")), CorrectConfig)
    with signals.interrupts_raised():
        with pytest.raises(type(error), match=re.escape(str(error))):
            tasks.correct(cfg)
        monkeypatch.setitem(signals._state, "pending", signal.SIGTERM)
        with pytest.raises(Interrupted) as err:
            tasks.correct(cfg)
    assert err.value.exit_status == 128 + signal.SIGTERM and str(err.value).endswith("out.h5ad was not written")


def test_train_reports_an_h5py_error_while_a_signal_is_pending_as_the_signal(files, tmp_path, monkeypatch):
    """train alike, with its own account of what was saved: an error while reading the data after a signal came is
    the interruption (nothing saved); without a signal the error stays what it is."""
    def interrupted_read(*args, **kwargs):
        raise TypeError("Operation not defined for data type class")

    monkeypatch.setattr(fitting, "read_training_file", interrupted_read)
    cfg = tiny_train_config(path=str(files["small"]), max_epochs=1)
    with signals.interrupts_raised():
        with pytest.raises(TypeError):
            tasks.train(cfg, tmp_path / "run")
        monkeypatch.setitem(signals._state, "pending", signal.SIGTERM)
        with pytest.raises(Interrupted) as err:
            tasks.train(cfg, tmp_path / "run")
    assert str(err.value) == "interrupted by SIGTERM while reading the data, before training: nothing was saved"


@pytest.mark.parametrize("error", H5PY_ERRORS_OF_A_SIGNAL, ids=lambda e: type(e).__name__)
def test_any_verb_reports_an_error_after_a_signal_as_the_signal(monkeypatch, capsys, error):
    """Outside correct (train's outputs, evaluate) the command line's one-line report does the same: exit
    128 + the signal; with no signal pending the error keeps its traceback (a bug)."""
    with signals.interrupts_raised():
        with pytest.raises(type(error)), user_errors_reported("train"):
            raise error
        monkeypatch.setitem(signals._state, "pending", signal.SIGINT)
        with pytest.raises(SystemExit) as exited, user_errors_reported("train"):
            raise error
    assert exited.value.code == 128 + signal.SIGINT
    assert last_line(capsys.readouterr().err) == "batchfix train: error: interrupted by SIGINT"


@pytest.mark.slow  # real processes signalled mid-run (train to 100,000 epochs, 20,000 cells corrected): CI's slow step
def test_a_killed_correct_leaves_a_temporary_file_the_next_run_removes(signalled, files, caplog):
    assert signalled["correct", signal.SIGKILL]["status"] == -signal.SIGKILL
    work = signalled["work"]
    (stale,) = work.glob(".SIGKILL.h5ad.batchfix-*.tmp")
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        correct_file(files["small"], work / "SIGKILL.h5ad", load_trained(files["ckpt"]), ResolvedCorrection(),
                     progress=False)
    assert f"Removed {stale}" in caplog.text
    assert [p.name for p in work.glob("*SIGKILL.h5ad*")] == ["SIGKILL.h5ad"]


@pytest.mark.slow  # real processes signalled mid-run (train to 100,000 epochs, 20,000 cells corrected): CI's slow step
def test_inputs_of_signalled_and_resumed_runs_are_unchanged(signalled):
    assert {path: sha256(path) for path in signalled["inputs"]} == signalled["inputs"]


def test_a_signal_inside_a_destructor_is_raised_just_after(capfd):
    """Python ignores (and prints) an exception raised in a destructor: the signal must not be lost there."""
    class Dying:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(10_000))  # the handler runs here, inside the destructor

    with pytest.raises(Interrupted) as err, signals.interrupts_raised():
        Dying()
        for _ in range(1000):  # ordinary code, where the signal is raised again
            time.sleep(0.01)
    assert err.value.signum == signal.SIGINT
    assert "Exception ignored" not in capfd.readouterr().err
    signals.raise_pending()  # raises nothing: leaving interrupts_raised() forgot the signal


# --------------------------------------------------------------------------------------------
# Options, in-process: every kind the schemas refuse


@pytest.mark.parametrize("options, message", [
    ({"learning_rate": float("inf")}, r"fit\.learning_rate must be a finite number > 0"),
    ({"kl_weight": float("nan")}, r"model\.kl_weight must be >= 0"),
    ({"adversarial_weight": float("inf")}, r"model\.adversarial_weight must be >= 0"),
    ({"gradient_clip_val": float("nan")}, r"trainer\.gradient_clip_val"),
    ({"max_wavelength": float("inf")}, r"min_wavelength and model\.max_wavelength"),
    ({"dropout": 1.0}, r"model\.dropout must be in \[0\.0, 1\.0\)"),
    ({"validation_fraction": float("nan")}, r"fit\.validation_fraction"),
    ({"seed": -1}, r"seed must be in \[0, 4294967295\]"),
    ({"seed": 2**40}, r"seed must be in"),
    ({"n_heads": 3}, r"divisible by model\.n_heads"),
    ({"batch_size": 2.5}, r"fit\.batch_size.*could not be converted"),
    ({"batch_size": True}, r"fit\.batch_size.*could not be converted"),
    ({"max_epochs": 0}, r"trainer\.max_epochs must be >= 1"),
    ({"devices": "abc"}, r"trainer\.devices"),
    ({"precision": "8-bit"}, r"trainer\.precision"),
    ({"batch_key": ""}, r"data\.batch_key must name something"),
    ({"label_key": "batch"}, r"both name obs column 'batch'"),
    ({"likelihood": "gaussian"}, r"data\.scale=log"),
    ({"max_auto_epochs": 2, "min_auto_epochs": 5}, r"fit\.max_auto_epochs"),
    ({"overwrite": True}, r"'overwrite' is not an option of batchfix\.train"),
    ({"n_head": 2}, r"Unknown option 'n_head'; did you mean \['n_heads'"),
])
def test_train_options_are_refused_with_their_name(options, message):
    with pytest.raises(ConfigError, match=message):
        train_config(**options)


@pytest.mark.parametrize("options, message", [
    ({"batch_size": "abc"}, r"batch_size.*could not be converted"),
    ({"key_added": None}, r"key_added"),
    ({"key_added": "a/b"}, r"must not contain '/'"),
    ({"chunk_size": 0}, r"chunk_size must be >= 1"),
    ({"max_missing_fraction": float("nan")}, r"max_missing_fraction"),
])
def test_api_correct_options_are_refused_and_adata_unchanged(files, subset, options, message):
    adata = subset.copy()
    with pytest.raises(ConfigError, match=message):
        batchfix.correct(adata, files["ckpt"], **options)
    assert list(adata.layers) == [] and list(adata.obsm) == [] and "batchfix" not in adata.uns


def test_api_train_refuses_a_bad_option_before_training(subset):
    adata = subset.copy()
    with pytest.raises(ConfigError, match=r"fit\.batch_size.*'abc'"):
        batchfix.train(adata, batch_size="abc")
    assert list(adata.obs.columns) == ["batch", "cell_type"]


@pytest.mark.parametrize("options", [{"accelerator": "tpu"}, {"strategy": "no-such-strategy"}])
def test_trainer_options_lightning_refuses_are_config_errors(options, tmp_path):
    with pytest.raises(ConfigError, match=r"Lightning refused the trainer\.\* options"):
        fitting.build_trainer(tiny_train_config(**options), tmp_path, has_validation=True)


# --------------------------------------------------------------------------------------------
# Inputs, in-process


def prepared(adata: ad.AnnData, **data):
    return fitting.load_training_data(DataConfig(**{"n_top_genes": 200, **data}), adata)


def with_values(subset: ad.AnnData, change) -> ad.AnnData:
    adata = subset.copy()
    change(adata)
    return adata


def set_obs(adata: ad.AnnData, key: str, value, row: int | None = None) -> None:
    """obs[key] = value, or only its `row`-th value."""
    if row is None:
        adata.obs[key] = value
        return
    column = adata.obs[key].copy()
    column.iloc[row] = value
    adata.obs[key] = column


BAD_INPUTS = {
    "no cells": (lambda a: a[:0].copy(), r"no non-empty cells or genes \(0 x 600\)"),
    "all zero": (lambda a: with_values(a, lambda b: setattr(b, "X", np.zeros_like(b.X))), r"no non-empty cells"),
    "constant": (lambda a: with_values(a, lambda b: setattr(b, "X", np.ones_like(b.X))),
                 r"Only 0 genes vary across the cells.*data\.n_top_genes=null"),
    "NaN": (lambda a: with_values(a, lambda b: b.X.__setitem__((0, 0), np.nan)), r"1 NaN or infinite values"),
    "inf": (lambda a: with_values(a, lambda b: b.X.__setitem__((0, slice(0, 3)), np.inf)), r"3 NaN or infinite"),
    "negative": (lambda a: with_values(a, lambda b: b.X.__setitem__((1, 1), -2)), r"1 negative"),
    "fractional": (lambda a: with_values(a, lambda b: b.X.__setitem__((1, 1), 0.5)), r"1 non-integer"),
    "overflows float32": (lambda a: ad.AnnData(a.X.astype(np.float64) * 1e300, obs=a.obs, var=a.var),
                          r"values beyond float32's range"),
    "text matrix": (lambda a: ad.AnnData(np.full((3, 2), "1", dtype=object), obs=pd.DataFrame(
        {"batch": ["a", "b", "a"]}, index=["c1", "c2", "c3"])), r"not real numbers"),
    "batch missing": (lambda a: with_values(a, lambda b: set_obs(b, "batch", np.nan, row=3)),
                      r"'batch' has 1 missing values"),
    "label missing": (lambda a: with_values(a, lambda b: set_obs(b, "cell_type", np.nan, row=0)),
                      r"'cell_type' has 1 missing values"),
    "one batch": (lambda a: with_values(a, lambda b: set_obs(b, "batch", "only")), r"found one: \['only'\]"),
    "duplicate genes": (lambda a: with_values(a, lambda b: setattr(b, "var_names", ["g"] * b.n_vars)),
                        r"1 gene names more than once.*var_names_make_unique"),
    "int and str gene names collide": (lambda a: ad.AnnData(a.X[:, :2], obs=a.obs, var=pd.DataFrame(
        index=pd.Index([1, "1"], dtype=object))), r"gene names more than once \(e\.g\. \['1'\]\)"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_are_refused_with_the_problem(subset, name):
    make, message = BAD_INPUTS[name]
    adata = make(subset)
    label = "cell_type" if "label" in name else None
    with pytest.raises(InputError, match=message):
        prepared(adata, label_key=label)


GOOD_INPUTS = {
    "csc": lambda a: setattr(a, "X", sp.csc_matrix(a.X)),
    "csr int64": lambda a: setattr(a, "X", sp.csr_matrix(a.X.astype(np.int64))),
    "dense int32": lambda a: setattr(a, "X", a.X.astype(np.int32)),
    "float64": lambda a: setattr(a, "X", a.X.astype(np.float64)),
    "unused categories": lambda a: set_obs(a, "batch", a.obs["batch"].cat.add_categories(["ghost"])),
    "integer batch labels": lambda a: set_obs(a, "batch", a.obs["batch"].cat.codes.astype(int)),
    "duplicate cell names": lambda a: setattr(a, "obs_names", ["cell"] * a.n_obs),
}


@pytest.mark.parametrize("name", GOOD_INPUTS)
def test_equivalent_inputs_give_the_same_training_data(subset, name):
    adata = subset.copy()
    GOOD_INPUTS[name](adata)
    reference, result = prepared(subset.copy()), prepared(adata)
    assert result.genes == reference.genes
    assert (result.counts != reference.counts).nnz == 0
    assert len(result.batch_categories) == 5 and np.array_equal(result.batch_index, reference.batch_index)


def test_a_one_cell_batch_is_trained_on_but_not_ranked(subset, caplog):
    adata, small = one_cell_batch(subset)
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        result = prepared(adata)
    assert f"{small} (1 cell)" in caplog.text and "ranked in the other 4 batches" in caplog.text
    assert result.batch_categories[0] == small and (result.batch_index == 0).sum() == 1
    assert len(result.genes) == 200


def test_batches_too_small_everywhere_are_pooled(subset, caplog):
    batch = subset.obs["batch"].astype(str).to_numpy()
    keep = np.concatenate([np.flatnonzero(batch == b)[:3] for b in sorted(set(batch))])
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        result = prepared(subset[keep].copy(), n_top_genes=50)
    assert "selected over all cells pooled" in caplog.text and len(result.genes) == 50


def test_log_scale_constant_matrix_is_refused_not_crashed(subset):
    adata = subset.copy()
    adata.X = np.full_like(adata.X, 0.5)
    with pytest.raises(InputError, match="genes vary"):
        prepared(adata, scale="log")


def test_a_batch_whose_cells_are_all_empty_is_named(subset, caplog):
    adata = subset.copy()
    gone = adata.obs["batch"].astype(str) == sorted(adata.obs["batch"].astype(str).unique())[-1]
    adata.X[gone.to_numpy()] = 0
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        result = prepared(adata)
    assert "hold only empty cells: they are not trained on" in caplog.text and len(result.batch_categories) == 4


@st.composite
def anndatas(draw) -> ad.AnnData:
    """Small AnnData of every shape, storage, dtype and naming, with counts that are sometimes not counts."""
    n_cells, n_genes = draw(st.integers(0, 30)), draw(st.integers(0, 25))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.poisson(draw(st.sampled_from([0.0, 0.3, 3.0, 1e4])), size=(n_cells, n_genes)).astype(np.float64)
    if n_cells and n_genes and draw(st.booleans()):
        values[rng.integers(n_cells), rng.integers(n_genes)] = draw(st.sampled_from([np.nan, np.inf, -1.0, 0.5]))
    dtype = draw(st.sampled_from([np.float32, np.float64, np.int64]))
    if dtype is np.int64:
        values = np.nan_to_num(values, posinf=0, neginf=0).round()
    matrix = values.astype(dtype)
    storage = draw(st.sampled_from(["dense", "csr", "csc"]))
    matrix = matrix if storage == "dense" else getattr(sp, f"{storage}_matrix")(matrix)
    batches = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=n_cells, max_size=n_cells))
    genes = [f"g{i}" for i in range(n_genes)]
    if n_genes > 1 and draw(st.booleans()):
        genes[-1] = genes[0]
    obs = pd.DataFrame({"batch": pd.Categorical(batches)}, index=[f"c{i}" for i in range(n_cells)])
    # Placed on two chromosomes in var (the genome module's own tests cover looking genes up).
    var = pd.DataFrame({"chromosome": ["1", "2"] * (n_genes // 2) + ["1"] * (n_genes % 2),
                        "start": np.arange(n_genes) * 1000, "end": np.arange(n_genes) * 1000 + 500}, index=genes)
    return ad.AnnData(matrix, obs=obs, var=var)


# The same 60 examples on every run (a CI failure reproduces), and no example database left in the work tree.
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(adata=anndatas(), n_top_genes=st.sampled_from([None, 1, 5, 20]), scale=st.sampled_from(["counts", "log"]))
def test_any_anndata_is_prepared_or_refused_with_an_input_error(adata, n_top_genes, scale):
    try:
        result = prepared(adata, n_top_genes=n_top_genes, scale=scale)
    except InputError:
        return
    assert result.counts.shape == (len(result.batch_index), len(result.genes)) and len(result.genes) >= 1
    assert set(result.genes) <= set(adata.var_names) and len(set(result.genes)) == len(result.genes)
    assert len(result.batch_categories) >= 2 and result.batch_index.max() < len(result.batch_categories)
    assert np.isfinite(result.counts.data).all() and np.isfinite(result.gene_std).all()


def test_validation_fraction_leaving_no_training_cells_is_refused(subset):
    with pytest.raises(ConfigError, match=r"fit\.validation_fraction=0\.999 holds out all 200 cells"):
        CellDataModule(prepared(subset), batch_size=64, validation_fraction=0.999)


def test_genes_per_token_above_a_chromosome_gives_the_same_windows(subset):
    data = prepared(subset)
    huge = fitting.build_module(tiny_train_config(genes_per_token=10**9), data, planned_steps=10)
    widest = fitting.build_module(tiny_train_config(genes_per_token=len(data.genes)), data, planned_steps=10)
    assert huge.windows.gene_index.shape == widest.windows.gene_index.shape
    assert huge.windows.gene_index.shape[1] < len(data.genes)


def test_diverging_training_stops_with_the_options_to_change(files, tmp_path):
    cfg = tiny_train_config(path=str(files["small"]), learning_rate=1e5, gradient_clip_val=None, max_epochs=5)
    with pytest.raises(TrainingError, match=r"Training diverged.*Lower fit\.learning_rate \(now 100000\)"):
        tasks.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "model.ckpt").exists()


def test_a_reference_that_is_not_a_training_batch_is_refused_before_training(files, tmp_path):
    cfg = tiny_train_config(path=str(files["small"]), reference="nope", max_epochs=1)
    with pytest.raises(InputError, match=r"Reference batch 'nope' is not one the model was trained on: \['sc_"):
        tasks.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_missing_checkpoint_or_a_folder_is_named(files, tmp_path):
    with pytest.raises(CheckpointError, match=rf"Checkpoint not found: {re.escape(str(tmp_path / 'no.ckpt'))}"):
        batchfix.correct(ad.read_h5ad(files["small"]), tmp_path / "no.ckpt")
    with pytest.raises(CheckpointError, match=r"is a folder: name the checkpoint file in it"):
        batchfix.correct(ad.read_h5ad(files["small"]), files["ckpt"].parent)


def test_a_file_without_encoding_attributes_trains_but_is_not_streamed(files, tmp_path):
    """anndata still reads files written before its on-disk encoding (0.8); streaming needs that encoding."""
    old = tmp_path / "old.h5ad"
    old.write_bytes(files["small"].read_bytes())
    with h5py.File(old, "r+") as f:
        for key in list(f.attrs):
            del f.attrs[key]
    assert fitting.load_training_data(DataConfig(path=str(old), n_top_genes=200)).counts.shape == (200, 200)
    with pytest.raises(InputError, match=r"written by an old anndata version .*write_h5ad"):
        correct_file(old, tmp_path / "out.h5ad", load_trained(files["ckpt"]), ResolvedCorrection())
    assert listing(tmp_path) == ["old.h5ad"]


def test_duplicate_modelled_genes_in_a_file_to_correct_are_refused(files, subset, tmp_path):
    genes = load_trained(files["ckpt"]).genes
    adata = subset.copy()
    adata.var_names = [genes[0] if name == genes[1] else name for name in adata.var_names]
    adata.write_h5ad(tmp_path / "in.h5ad")
    with pytest.raises(InputError, match=rf"in genes the model corrects, holds 1 gene names .*'{genes[0]}'"):
        correct_file(tmp_path / "in.h5ad", tmp_path / "out.h5ad", load_trained(files["ckpt"]), ResolvedCorrection())
    assert listing(tmp_path) == ["in.h5ad"]


# --------------------------------------------------------------------------------------------
# Output locations and run folders, in-process


def test_disk_full_while_correcting_is_one_error_and_leaves_nothing(files, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ondisk, "copy_file_except", full)
    target = tmp_path / "new" / "folder" / "out.h5ad"
    with pytest.raises(OutputError, match=rf"Cannot write the output {re.escape(str(target))}: No space left"):
        correct_file(files["small"], target, load_trained(files["ckpt"]), ResolvedCorrection(), progress=False)
    assert listing(tmp_path) == [], "the folders made for the output are removed again"


def test_output_that_is_a_folder_is_refused(files, tmp_path):
    with pytest.raises(InputError, match="is a folder; name an .h5ad file"):
        correct_file(files["small"], tmp_path, load_trained(files["ckpt"]), ResolvedCorrection())


def test_stale_temporary_files_are_removed_and_live_ones_named(tmp_path, caplog):
    target = tmp_path / "out.h5ad"
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = atomic._host()
    stale = tmp_path / f".out.h5ad.batchfix-{host}-{int(finished.stdout)}-abc123.tmp"
    live = tmp_path / f".out.h5ad.batchfix-{host}-{os.getpid()}-def456.tmp"
    elsewhere = tmp_path / f".out.h5ad.batchfix-otherhost-{int(finished.stdout)}-ghi789.tmp"
    unknown = tmp_path / ".out.h5ad.x1y2z3.tmp"
    for path in (stale, live, elsewhere, unknown):
        path.write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        with atomic.atomic_output(target, overwrite=False) as tmp:
            tmp.write_bytes(b"done")
    assert target.read_bytes() == b"done"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, elsewhere.name, unknown.name])
    assert f"Removed {stale}" in caplog.text
    for kept in (live, elsewhere, unknown):
        assert f"Left {kept} in place" in caplog.text


def test_a_signal_while_the_temporary_file_is_made_leaves_no_file(tmp_path, monkeypatch):
    """The signal lands just after mkstemp made the file, before atomic_output knows its name."""
    made = atomic.tempfile.mkstemp

    def mkstemp_then_signal(*args, **kwargs):
        result = made(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode
        return result

    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp_then_signal)
    with signals.interrupts_raised():
        with pytest.raises(Interrupted):
            with atomic.atomic_output(tmp_path / "out.h5ad", overwrite=False) as tmp:
                tmp.write_bytes(b"never")
    assert list(tmp_path.iterdir()) == []


def run_with(tmp_path: Path, *names: str) -> Path:
    run_dir = tmp_path / "run"
    for name in names:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    return run_dir


def test_a_run_folder_is_refused_cleared_or_continued(tmp_path):
    run_dir = run_with(tmp_path, "model.ckpt", "checkpoints/last.ckpt", "checkpoints/last-v1.ckpt", "notes.txt")
    with pytest.raises(OutputExistsError, match=r"already holds a run \(model\.ckpt, checkpoints\)"):
        runfolder.claim(run_dir, overwrite=False, resume=None)
    runfolder.claim(run_dir, overwrite=False, resume=str(run_dir))  # resume= in place: nothing deleted
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    with pytest.raises(ConfigError, match="overwrite=true would delete the checkpoints resume="):
        runfolder.claim(run_dir, overwrite=True, resume=str(run_dir))
    runfolder.claim(run_dir, overwrite=True, resume=str(tmp_path / "elsewhere"))
    assert listing(run_dir) == ["notes.txt"], "only the previous run's outputs are deleted"


def test_evaluating_into_a_run_or_an_evaluation_is_refused_unless_overwrite(tmp_path):
    run_dir = run_with(tmp_path, "model.ckpt", "metrics.json", ".hydra/config.yaml")
    with pytest.raises(OutputExistsError, match=r"already holds a run or an evaluation \(model\.ckpt, metrics\.json\)"
                                                 r".*overwrite=true"):
        runfolder.check_evaluation_folder(run_dir, overwrite=False)
    runfolder.check_evaluation_folder(run_dir, overwrite=True)
    runfolder.check_evaluation_folder(tmp_path / "new", overwrite=False)
    # Through the command line: refused before Hydra writes into the folder, which is left as it was.
    before = {p: sha256(p) for p in run_dir.rglob("*") if p.is_file()}
    process = cli(["evaluate", f"hydra.run.dir={run_dir}"], tmp_path)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert re.fullmatch(r"batchfix evaluate: error: Output folder .* already holds a run or an evaluation "
                        r"\(model\.ckpt, metrics\.json\).*overwrite=true\.", last_line(stderr)), last_line(stderr)
    assert {p: sha256(p) for p in run_dir.rglob("*") if p.is_file()} == before


def test_an_unused_run_folder_is_removed_but_nothing_else(tmp_path):
    made = tmp_path / "outputs" / "train"
    runfolder.make_run_folder(made / "run")
    run_dir = run_with(made, ".hydra/config.yaml", ".hydra/hydra.yaml", "train.log", "logs/metrics.csv")
    (run_dir / "checkpoints").mkdir()
    runfolder.remove_if_unused(run_dir)
    assert listing(tmp_path) == [], "the folders made for the run are gone too"

    kept = run_with(tmp_path, ".hydra/config.yaml", "mine.txt")
    runfolder.remove_if_unused(kept)
    assert listing(tmp_path) == ["run", "run/mine.txt"]
    trained = run_with(tmp_path / "trained", "checkpoints/last.ckpt", "train.log")
    runfolder.remove_if_unused(trained)
    assert (trained / "train.log").is_file()


@pytest.fixture
def held_elsewhere():
    """hold(folder) in another process, which keeps it until killed: yields a function starting one."""
    holders = []

    def start(folder: Path) -> subprocess.Popen:
        code = "import sys, time; from batchfix import runfolder; runfolder.hold(sys.argv[1]); print('held', flush=True); time.sleep(600)"
        holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
        holders.append(holder)
        assert holder.stdout.readline().strip() == "held"
        return holder

    yield start
    for holder in holders:
        holder.kill()
        holder.wait()


def test_a_folder_is_held_by_one_process_until_it_ends(tmp_path, held_elsewhere):
    folder = tmp_path / "run"
    folder.mkdir()
    holder = held_elsewhere(folder)
    with pytest.raises(runfolder.FolderInUseError, match=rf"{folder} is in use by another batchfix command \(process "
                                                         rf"{holder.pid}\), still running.*hydra\.run\.dir="):
        runfolder.hold(folder)
    with pytest.raises(runfolder.FolderInUseError):
        tasks.train(tiny_train_config(max_epochs=1), folder)
    holder.kill()
    holder.wait()  # killed: its lock is gone with it, though its file stays
    assert (folder / runfolder.IN_USE).is_file()
    with runfolder.held(folder):
        assert (folder / runfolder.IN_USE).read_text() == f"{os.getpid()}\n"
        with runfolder.held(folder):  # held already: kept held after the inner `with`
            pass
        assert (folder / runfolder.IN_USE).is_file()
    assert listing(folder) == [], "released: the file is gone"


def test_other_ranks_do_not_hold_the_run_folder(tmp_path, monkeypatch, held_elsewhere):
    held_elsewhere(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a DDP child of the command holding it
    assert runfolder.hold(tmp_path) is False


def composed_in(folder: Path, monkeypatch):
    """The train configuration with Hydra's own node, composed as the command line does, in `folder`."""
    from hydra import compose, initialize_config_module

    monkeypatch.chdir(folder)
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        return compose("train", overrides=TINY, return_hydra_config=True)


def test_a_default_run_folder_in_use_moves_to_the_next_free_one(tmp_path, monkeypatch, held_elsewhere):
    """Two commands started in the same second: the second takes <folder>-2, or <folder>-3 when -2 holds a run."""
    config = composed_in(tmp_path, monkeypatch)
    default = Path(str(config.hydra.run.dir))
    assert default.parent == Path("outputs/train")
    default.mkdir(parents=True)
    held_elsewhere(default)
    Path(f"{default}-2").mkdir()
    Path(f"{default}-2", "model.ckpt").write_text("a finished run")
    folder_check.RunFolderCheck().on_run_start(config)
    try:
        assert str(config.hydra.run.dir) == f"{default}-3"
        assert (tmp_path / f"{default}-3" / runfolder.IN_USE).read_text() == f"{os.getpid()}\n"
    finally:
        runfolder.release(f"{default}-3")


def test_a_named_run_folder_in_use_is_refused(tmp_path, subset_h5ad, held_elsewhere):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = held_elsewhere(run_dir)
    process = cli(["train", f"data.path={subset_h5ad}", f"hydra.run.dir={run_dir}", *TINY], tmp_path)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert re.fullmatch(rf"batchfix train: error: Folder {run_dir} is in use by another batchfix command \(process "
                        rf"{holder.pid}\), still running\. .*", last_line(stderr)), last_line(stderr)
    assert listing(run_dir) == [runfolder.IN_USE], "nothing written into it"


def test_a_default_sweep_folder_in_use_moves_to_the_next_free_one(tmp_path, monkeypatch, held_elsewhere):
    config = composed_in(tmp_path, monkeypatch)
    default = Path(str(config.hydra.sweep.dir))
    default.mkdir(parents=True)
    held_elsewhere(default)
    folder_check.RunFolderCheck().on_multirun_start(config)
    try:
        assert str(config.hydra.sweep.dir) == f"{default}-2"
        assert f"hydra.sweep.dir={default}-2" in list(config.hydra.overrides.hydra), "the jobs are composed with it"
    finally:
        runfolder.release(f"{default}-2")


def test_a_folder_that_cannot_be_locked_is_used_with_a_warning(tmp_path, monkeypatch, caplog):
    (tmp_path / runfolder.IN_USE).mkdir()  # not a file: cannot be opened for the lock
    assert runfolder.hold(tmp_path) is False
    assert f"Cannot lock {tmp_path}" in caplog.text
    (tmp_path / runfolder.IN_USE).rmdir()

    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runfolder.fcntl, "flock", no_locks)
    assert runfolder.hold(tmp_path) is False
    assert "No locks available" in caplog.text
