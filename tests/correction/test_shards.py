"""Correction beyond one process: parts written as shard files by independent jobs or torchrun ranks, then merged,
give the one-process output entry for entry (batchfix.correction.shards).

A tiny model is trained once on three of the five batches of the real subset (200 cells), so the estimate pass
also estimates two unseen batches; chunks of 64 cells and forward batches of 24 make the parts' cut fall inside a
chunk, between two forward batches.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch

from batchfix.config import CorrectionChoice, ResolvedCorrection
from batchfix.correction import shards
from batchfix.correction.estimates import Part, estimate
from batchfix.correction.stages import STAGES
from batchfix.correction.writers import bind_file, correct_file
from batchfix.data import ondisk
from batchfix.errors import InputError
from batchfix.training.trained import load_trained
from scripts.bench.bench_correct import stage_seconds

FORWARD = ["inference.chunk_size=64", "inference.batch_size=24", "progress=false", "threads=1"]


def cli(args: list[str], cwd: Path, runner: tuple[str, ...] = ("-m",)) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *runner, "batchfix", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)


def correct_args(files: dict, output: Path, *extra: str) -> list[str]:
    return ["correct", f"input={files['input']}", f"checkpoint={files['checkpoint']}", f"output={output}",
            *FORWARD, *extra]


@pytest.fixture(scope="module")
def files(subset, tmp_path_factory) -> dict:
    """The subset on disk, a model trained on its first three batches, and the one-process correction."""
    from hydra import compose, initialize_config_module

    from batchfix import tasks
    from batchfix.config import TrainConfig, validated

    folder = tmp_path_factory.mktemp("shards")
    seen = sorted(subset.obs["batch"].astype(str).unique())[:3]
    subset[subset.obs["batch"].astype(str).isin(seen)].copy().write_h5ad(folder / "train.h5ad")
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        cfg = compose("train", overrides=[
            f"data.path={folder / 'train.h5ad'}", "data.n_top_genes=300", "model.genes_per_token=16",
            "trainer.max_epochs=1", "trainer.enable_progress_bar=false", "evaluate=false", "threads=1"])
    torch.set_num_threads(1)
    tasks.train(validated(cfg, TrainConfig), folder / "run")
    subset.write_h5ad(folder / "input.h5ad")
    trained = load_trained(folder / "run" / "model.ckpt")
    single = correct_file(folder / "input.h5ad", folder / "single.h5ad", trained, command_line_settings(trained),
                          progress=False)
    return {"input": folder / "input.h5ad", "checkpoint": folder / "run" / "model.ckpt", "trained": trained,
            "single": single}


def command_line_settings(trained, **changed) -> ResolvedCorrection:
    """The settings `correct` resolves for FORWARD (the checkpoint's correction), with `changed` options."""
    preset, options = CorrectionChoice().resolve(trained.correction)
    return ResolvedCorrection(**{**asdict(options), **changed}, chunk_size=64, batch_size=24, preset=preset)


def plain(value):
    """uns values as comparable Python objects."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value.tolist() if isinstance(value, np.ndarray) else value


def assert_same_correction(merged: Path, single: Path, n_shards: int) -> None:
    """Every layer, entry, obsm, obs and var, and the provenance but for its shard count, as one process wrote."""
    one, many = ad.read_h5ad(single), ad.read_h5ad(merged)
    assert list(many.obs_names) == list(one.obs_names) and list(many.layers) == list(one.layers)
    pd.testing.assert_frame_equal(many.obs, one.obs)
    pd.testing.assert_frame_equal(many.var, one.var)
    for name in one.layers:
        a, b = many.layers[name], one.layers[name]
        assert sp.issparse(a) and a.dtype == b.dtype and a.nnz == b.nnz and (a != b).nnz == 0, name
    assert set(many.obsm) == set(one.obsm)
    for name in one.obsm:
        np.testing.assert_array_equal(many.obsm[name], one.obsm[name])
    np.testing.assert_array_equal(many.X, one.X)
    info = plain(many.uns["batchfix"])
    assert info.pop("n_shards") == n_shards and "n_shards" not in one.uns["batchfix"]
    assert info == plain(one.uns["batchfix"])


@pytest.mark.slow  # two correct processes and a merge (~20 s): in the slow run, which CI runs too
def test_independent_jobs_and_their_merge_write_the_one_process_file(files, tmp_path):
    output = tmp_path / "out.h5ad"
    jobs = [subprocess.Popen([sys.executable, "-m", "batchfix", *correct_args(files, output, f"inference.shard={i}/2")],
                             cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                             stderr=subprocess.PIPE) for i in range(2)]
    for job in jobs:
        assert job.wait(timeout=600) == 0, job.stderr.read()[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.h5ad.shard-0-of-2", "out.h5ad.shard-1-of-2"]
    result = cli(correct_args(files, output, "inference.shard=merge/2"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["out.h5ad"]  # the shards are removed once merged
    assert_same_correction(output, files["single"], 2)


def test_the_parts_start_where_one_process_starts_a_forward_batch_and_cover_every_cell_once():
    settings = ResolvedCorrection(chunk_size=64, batch_size=24)
    parts = [shards.part_rows(200, settings, i, 2) for i in range(2)]
    assert parts == [(0, 112), (112, 200)]  # 112 = the chunk at 64 + 2 forward batches: the first start >= 100
    for n_obs, count in ((200, 3), (1000, 7), (5, 4), (0, 2)):
        parts = [shards.part_rows(n_obs, settings, i, count) for i in range(count)]
        assert parts[0][0] == 0 and parts[-1][1] == n_obs and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(start == n_obs or (start % 64) % 24 == 0 for start, _ in parts)


class Recorded(Exception):
    """A part's blocks were recorded for a gather no part has reached yet."""


def estimates_of_parts(bound, rows, n_obs: int, count: int) -> list:
    """Each of `count` parts' estimates as ranks would compute them, in one process: every part is run until
    it reaches a gather none has passed, its blocks recorded, until every part completes with every part's blocks."""
    parts = [shards.part_rows(n_obs, bound.settings, index, count) for index in range(count)]
    rounds: list[list] = []  # per gather call: every part's blocks, in order
    while True:
        results, pending = [], []
        for start, stop in parts:
            known = iter(rounds)

            def gather(blocks, known=known):
                everyone = next(known, None)
                if everyone is None:
                    pending.append(blocks)
                    raise Recorded
                return everyone

            try:
                estimates, latents = estimate(bound, rows, n_obs, Part(start, stop, gather))
            except Recorded:
                continue
            results.append(estimates)
        if not pending:
            return results
        rounds.append(pending)


@pytest.mark.parametrize("options", [{}, {"shrink": "none", "state_dependence": 1.0}, {"regional_shift": "keep_input"},
                                     pytest.param({"depth": "reference"}, marks=pytest.mark.slow)])
def test_ranks_estimating_their_own_rows_hold_one_process_estimates_bit_for_bit(files, options):
    """Unseen batches' tables, the mean shifts and the evidence weights, each part summing only its rows."""
    trained = files["trained"]
    settings = command_line_settings(trained, **options)
    torch.set_num_threads(1)
    with ondisk.open_anndata(files["input"]) as src:
        bound, rows, n_obs = bind_file(src, files["input"], trained, settings, None, None, False)
        assert bound.batches.unseen, "the input holds batches the model never saw"
        one_process = leaves(estimate(bound, rows, n_obs)[0])
        for count in (2, 3):
            for part in estimates_of_parts(bound, rows, n_obs, count):
                compared = leaves(part)
                assert compared.keys() == one_process.keys()
                for path, value in one_process.items():
                    assert np.array_equal(compared[path], value, equal_nan=True), (count, path)


@pytest.mark.slow
def test_the_log_scale_outputs_state_groups_over_parts_are_one_process_bits(log_scale_subset, tmp_path):
    """The log-scale model's estimates (its state groups and the state shrink's group means included), each part
    summing only its rows, equal one process's bit for bit."""
    import batchfix

    torch.set_num_threads(1)
    model = batchfix.train(log_scale_subset, batch_key="batch", seed=0, scale="log", likelihood="gaussian",
                           n_top_genes=None, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8,
                           decoder_hidden=32, batch_size=64, max_epochs=2, threads=1, enable_progress_bar=False)
    log_scale_subset.write_h5ad(tmp_path / "log.h5ad")
    settings = command_line_settings(model)
    with ondisk.open_anndata(tmp_path / "log.h5ad") as src:
        bound, rows, n_obs = bind_file(src, tmp_path / "log.h5ad", model, settings, None, None, False)
        one_process = estimate(bound, rows, n_obs)[0]
        assert one_process.state_groups is not None and one_process.state.groups is not None
        expected = leaves(one_process)
        for part in estimates_of_parts(bound, rows, n_obs, 2):
            compared = leaves(part)
            assert compared.keys() == expected.keys()
            for path, value in expected.items():
                assert np.array_equal(compared[path], value, equal_nan=True), path


def leaves(value, path: str = "") -> dict:
    """{path: numpy array} of every array, tensor and number reachable from an estimates object."""
    if isinstance(value, torch.Tensor):
        return {path: value.numpy()}
    if isinstance(value, (np.ndarray, int, float, bool)) or value is None:
        return {path: np.asarray(value if value is not None else np.nan)}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) \
        else vars(value).items() if hasattr(value, "__dict__") else ()
    return {key: leaf for name, item in items for key, leaf in leaves(item, f"{path}.{name}").items()}


def test_the_denoised_output_in_three_parts_is_the_one_process_file(files, tmp_path):
    """The denoised output has no estimate pass: each part encodes its own cells, in the one-process batches."""
    trained, settings = files["trained"], command_line_settings(files["trained"], output_mode="denoised")
    torch.set_num_threads(1)
    single = correct_file(files["input"], tmp_path / "single.h5ad", trained, settings, progress=False)
    job = shards.FileJob(files["input"], tmp_path / "out.h5ad", progress=False)
    for index in (2, 0, 1):
        shards.correct_shard(job, trained, settings, index, 3)
    assert_same_correction(shards.merge_shards(job, trained, settings, 3), single, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.h5ad", "single.h5ad"]


@pytest.mark.slow
def test_torchrun_ranks_write_the_one_process_file(files, tmp_path):
    output = tmp_path / "out.h5ad"
    result = cli(correct_args(files, output), tmp_path,
                 runner=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["out.h5ad"]
    assert_same_correction(output, files["single"], 2)
    # where the time went: a line per rank's part, as the benchmark reads them, and one for the merge
    stages = stage_seconds(result.stdout + result.stderr)
    assert sorted(line["what"] for line in stages) == [
        "cells 0-112 of 200, shard 1 of 2", "cells 112-200 of 200, shard 2 of 2", "the merge of 2 shards: read = reading them"]
    for line in stages:
        assert set(line) == {"what", "total", *STAGES}
        assert 0 < sum(line[name] for name in STAGES) <= line["total"] + 0.1 * len(STAGES)  # rounded to 0.1 s each
        assert (line["estimate"] > 0) == line["what"].startswith("cells")  # the merge estimates nothing


def test_a_missing_or_foreign_shard_is_refused_by_the_merge_naming_it(files, tmp_path):
    job = shards.FileJob(files["input"], tmp_path / "out.h5ad", progress=False)
    trained, settings = files["trained"], command_line_settings(files["trained"])
    torch.set_num_threads(1)
    shards.correct_shard(job, trained, settings, 0, 2)
    with pytest.raises(InputError, match=r"^Cannot merge 2 shards into out.h5ad: out.h5ad.shard-1-of-2 missing; "
                                         r"write each with inference.shard=i/2 first.$"):
        shards.merge_shards(job, trained, settings, 2)
    shards.correct_shard(job, trained, command_line_settings(trained, quantile_seed=7), 1, 2)
    with pytest.raises(InputError, match=r"^Cannot merge: out.h5ad.shard-1-of-2 was written from another input, "
                                         r"checkpoint or options"):
        shards.merge_shards(job, trained, settings, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.h5ad.shard-0-of-2", "out.h5ad.shard-1-of-2"]


@pytest.mark.parametrize("spec", ["2/2", "1of2", "merge/0"])
def test_a_bad_shard_spec_is_refused_in_one_line(files, tmp_path, spec):
    result = cli(correct_args(files, tmp_path / "out.h5ad", f"inference.shard={spec}"), tmp_path)
    assert result.returncode == 1 and list(tmp_path.iterdir()) == []
    assert result.stderr.strip().splitlines() == [
        f"batchfix correct: error: inference.shard must be i/N with 0 <= i < N (e.g. 0/4), or merge/N; got '{spec}'."]
