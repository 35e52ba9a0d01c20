"""Training end to end on a small real subset: run folder, loss, checkpoints, resume, seeding,
precision, and DDP with two CPU processes through the real CLI.

Models are tiny (200 genes, 16 genes per token, d_model 16, one layer) and runs last a few epochs.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_module

from batchfix import tasks
from batchfix.config import ResolvedCorrection, TrainConfig, validated
from batchfix.correction import calibration, counterfactual, counts
from batchfix.correction.evidence import shrinkage
from batchfix.correction.regional import GenomeSmoother, RegionalShift
from batchfix.correction.state_groups import LatentSample, fit_groups, group_codes
from batchfix.errors import InputError
from batchfix.training import fitting
from batchfix.training.module import BatchfixModule
from batchfix.training.tables import TABLES
from batchfix.training.trained import load_trained

N_TOP_GENES = 200
BATCH_SIZE = 64
N_TRAIN_CELLS = 180  # 200 cells, validation_fraction 0.1
STEPS_PER_EPOCH = math.ceil(N_TRAIN_CELLS / BATCH_SIZE)  # 3 on one process
LEARNING_RATE = 2e-3
CLI_EPOCHS = 6


CPU_DEFAULT_PRECISION = "bf16-mixed" if fitting.cpu_multiplies_bf16() else "32-true"  # this machine's default


def tiny_overrides(h5ad: Path) -> list[str]:
    return [
        f"data.path={h5ad}", f"data.n_top_genes={N_TOP_GENES}",
        "model.genes_per_token=16", "model.d_model=16", "model.n_heads=2", "model.n_layers=1",
        "model.latent_dim=8", "model.decoder_hidden=32",
        f"fit.batch_size={BATCH_SIZE}", f"fit.learning_rate={LEARNING_RATE}",
        "evaluate=false", "threads=1", "trainer.enable_progress_bar=false",
    ]


def compose_train(h5ad: Path, *extra: str) -> TrainConfig:
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        return validated(compose(config_name="train", overrides=[*tiny_overrides(h5ad), *extra]), TrainConfig)


def logged_epochs(run_dir: Path) -> pd.DataFrame:
    """One row per epoch: the epoch-level train_* and val_* columns of the CSV log."""
    log = pd.read_csv(run_dir / "logs" / "metrics.csv")
    train = log.dropna(subset=["train_loss"]).set_index("epoch")
    frames = [train[[c for c in train.columns if c.startswith("train_") or c == "step"]]]
    if "val_loss" in log:
        val = log.dropna(subset=["val_loss"]).set_index("epoch")
        frames.append(val[[c for c in val.columns if c.startswith("val_")]])
    return pd.concat(frames, axis=1).sort_index()


def run_cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, "-m", "batchfix", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def checkpoint_lr(path: Path) -> float:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint["optimizer_states"][0]["param_groups"][0]["lr"]


# ---------------------------------------------------------------- the real CLI, one process


@pytest.fixture(scope="module")
def cli_run(subset_h5ad, tmp_path_factory):
    work = tmp_path_factory.mktemp("cli")
    run_dir = work / "run"
    result = run_cli(["train", *tiny_overrides(subset_h5ad), f"trainer.max_epochs={CLI_EPOCHS}",
                      f"hydra.run.dir={run_dir}"], cwd=work)
    assert result.returncode == 0, result.stderr[-4000:]
    (work / "stdout.txt").write_text(result.stdout)  # captured: not a terminal, as under nohup or SLURM
    return run_dir


@pytest.mark.slow  # the shared CLI run takes 47 s: with the long checks, to keep the default run under 5 minutes
def test_cli_output_to_a_file_tells_the_progress_and_every_stage(cli_run):
    """Written to a file, a run shows its progress while it fits (steps, loss, elapsed, ETA) and each stage's start."""
    out = (cli_run.parent / "stdout.txt").read_text()
    steps = CLI_EPOCHS * STEPS_PER_EPOCH
    assert f"Fitting: {steps} steps planned" in out
    assert re.search(rf"Step {steps}/{steps} \(100%\), loss [0-9.]+, 0:00:\d\d elapsed, ETA 0:00:00", out), out
    assert len(re.findall(rf"Step \d+/{steps} ", out)) >= 5
    for stage in ("Preparing the data", "Calibrating the output", "Fitting the extra genes' decoder",
                  "Correcting the training file"):
        assert stage in out, f"no line for: {stage}"


def test_early_stopping_says_when_it_ends_the_fit(subset_h5ad, tmp_path, caplog):
    """A fit that early stopping ends (a learning rate far too high, patience 1) announces it in one line."""
    caplog.set_level("INFO", logger="batchfix")
    cfg = compose_train(subset_h5ad, "trainer.max_epochs=40", "fit.early_stopping_patience=1", "fit.learning_rate=0.3")
    epochs = fitting.fit(cfg, fitting.load_training_data(cfg.data), tmp_path).trainer.current_epoch
    assert epochs < 40
    stops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Early stopping")]
    assert len(stops) == 1 and f"after epoch {epochs} of 40" in stops[0] and "val_elbo" in stops[0]


@pytest.mark.slow  # the shared CLI run takes 47 s: with the long checks, to keep the default run under 5 minutes
def test_cli_train_writes_run_folder(cli_run, subset_h5ad):
    for name in (".hydra/config.yaml", "model.ckpt", "corrected.h5ad", "metrics.json", "checkpoints/last.ckpt",
                 "logs/metrics.csv"):
        assert (cli_run / name).is_file(), f"missing {name}"
    config = (cli_run / ".hydra" / "config.yaml").read_text()
    assert "d_model: 16" in config and f"max_epochs: {CLI_EPOCHS}" in config and str(subset_h5ad) in config

    metrics = json.loads((cli_run / "metrics.json").read_text())
    assert metrics["n_cells"] == 200 and metrics["n_genes"] == N_TOP_GENES
    assert metrics["epochs"] == CLI_EPOCHS
    assert metrics["steps"] == CLI_EPOCHS * STEPS_PER_EPOCH
    assert metrics["precision"] == CPU_DEFAULT_PRECISION
    assert all(math.isfinite(v) for v in metrics["losses"].values())
    assert {"train_loss", "val_loss"} <= set(metrics["losses"])

    trained = load_trained(cli_run / "model.ckpt")
    assert len(trained.genes) == N_TOP_GENES and len(trained.batch_categories) == 5
    corrected = ad.read_h5ad(cli_run / "corrected.h5ad")
    source = ad.read_h5ad(subset_h5ad)
    assert corrected.shape == source.shape
    assert corrected.obsm["X_batchfix"].shape == (200, 8)
    modelled = corrected.var["batchfix_modelled"].to_numpy()
    assert modelled.sum() == N_TOP_GENES
    assert set(corrected.var_names[modelled]) == set(trained.genes)


def evidence_weights(total: np.ndarray, own_mean: np.ndarray, x: np.ndarray, theta: np.ndarray, kept: np.ndarray,
                     rows: list[np.ndarray]) -> np.ndarray:
    """(len(rows), G) each batch's weight of each gene's shift over its cells `rows` (one per training batch, in
    order), from the cells' total log-mean shifts, own means and counts (batchfix.correction.evidence): the adaptive
    prior's posterior median against the shift's variance from the reference; 0 where the cells have no count."""
    observed = np.stack([x[chosen].sum(axis=0) for chosen in rows])  # (batches, G)
    mean_total = np.stack([total[chosen].sum(axis=0) / max(chosen.sum(), 1) for chosen in rows])
    means = np.stack([own_mean[chosen].sum(axis=0) for chosen in rows])
    squares = np.stack([np.square(own_mean[chosen]).sum(axis=0) for chosen in rows])
    level_variance = 1 / (observed + 0.5) + squares / (theta * (means + 0.5) ** 2)
    measured = np.array([chosen.any() for chosen in rows])[:, None]
    share = kept / kept.sum(axis=0)  # each batch's part of the average reference
    variance = level_variance * (1 - 2 * share) + (share**2 * level_variance * measured).sum(axis=0)
    weight = np.stack([shrinkage(mean_total[b], variance[b])[0] if chosen.any() else np.zeros(total.shape[1])
                       for b, chosen in enumerate(rows)])
    weight[observed == 0] = 0.0  # cells without any count of a gene keep their zeros
    return weight


@pytest.mark.slow  # the shared CLI run takes 47 s: with the long checks, to keep the default run under 5 minutes
def test_cli_corrected_file_matches_reloaded_checkpoint(cli_run, subset_h5ad, counts_nearly_equal):
    """The written correction equals what the reloaded model.ckpt computes on the same cells (the default
    state_dependence=0.5: half of each cell's deviation from the mean log-mean shift of its batch's cells in its
    state group is applied; the default regional_shift=keep: each batch's mean log-mean shift over its cells,
    smoothed along the genome; each count mapped from its batch's NB to the reference's at its randomised quantile;
    correction.shrink=evidence: each batch's shift of a gene weighted by its evidence, over the batch's cells or its
    group's cells, whichever is the stronger)."""
    trained = load_trained(cli_run / "model.ckpt")
    net = trained.net
    source = ad.read_h5ad(subset_h5ad)
    columns = source.var_names.get_indexer(trained.genes)
    assert (columns >= 0).all()
    x = torch.from_numpy(np.asarray(source.X[:, columns], dtype=np.float32))
    codes = torch.from_numpy(np.searchsorted(trained.batch_categories, source.obs["batch"].astype(str).to_numpy()))
    mu = net.encode(x)[0].detach()
    n_batches = len(trained.batch_categories)
    # The state groups: k-means of the latents (every cell sampled: 200 of at most 5,000), 10 groups
    sample = LatentSample(len(mu), mu.shape[1])
    sample.add(counts.name_keys(source.obs_names), mu.numpy())
    groups = fit_groups(sample)
    n_groups = len(groups.centroids)
    group = group_codes(codes.numpy(), groups, mu)  # (cells,) batch * groups + group
    # The average reference of each gene: over the batches with a count of it (a batch without any lacks it)
    batches = [codes.numpy() == b for b in range(n_batches)]
    observed = np.stack([x.double().numpy()[rows].sum(axis=0) for rows in batches])  # (batches, G)
    kept = (observed > 0) | (observed == 0).all(axis=0)
    shift, own = counterfactual.log_mean_shift(net, mu, codes, None, None, members=kept)  # the decoder's, (cells, G)
    mean_shift = torch.stack([shift[codes == b].mean(dim=0) for b in range(n_batches)])
    group_mean = torch.stack([shift[group == r].mean(dim=0) if (group == r).any() else mean_shift[r // n_groups]
                              for r in range(n_batches * n_groups)])
    assert all((codes == b).sum() >= calibration.MIN_UNSEEN_CELLS for b in range(n_batches))
    regional = RegionalShift(GenomeSmoother(list(trained.module.hparams.chromosome), 100), mean_shift,
                             torch.ones(n_batches))
    state = counterfactual.StateShrink(ResolvedCorrection().state_dependence, group_mean, torch.ones(n_batches),
                                       groups)  # the default 0.5, toward the batch's mean in the cell's group
    decoder_shift = shift.double().numpy()
    shift = counterfactual.applied_shift(shift, codes, mu, state, regional).double().numpy()
    ratio = trained.tables.count_ratio.double().numpy()  # each batch's observed / decoded mean
    own_mean = (own * x.sum(-1, keepdim=True)).double().numpy() * ratio[codes.numpy()]
    own_theta = trained.tables.count_theta.double().numpy()[codes.numpy()]
    # The reference's ratio: the geometric mean over the same batches
    reference_ratio = np.exp((np.log(ratio) * kept).sum(axis=0) / kept.sum(axis=0))
    ratio_shift = np.log(reference_ratio / ratio)  # (batches, G)
    # correction.shrink=evidence: each batch's shift of a gene times its posterior weight (correction.evidence)
    total, theta = decoder_shift + ratio_shift[codes.numpy()], trained.tables.count_theta.double().numpy()
    weight = evidence_weights(total, own_mean, x.double().numpy(), theta, kept, batches)
    by_group = [evidence_weights(total, own_mean, x.double().numpy(), theta, kept,
                                 [group == b * n_groups + k for b in range(n_batches)]) for k in range(n_groups)]
    weight = np.maximum(weight[:, None, :], np.stack(by_group, axis=1))  # (batches, groups, G)
    shift = (shift + ratio_shift[codes.numpy()]) * weight[codes.numpy(), group % n_groups]
    reference_theta = own_theta  # correction.spread=batch (the default): each count keeps its batch's dispersion
    uniform = counts.counter_uniform(ResolvedCorrection().quantile_seed, counts.name_keys(source.obs_names),
                                     counts.name_keys(trained.genes))  # every count's quantile drawn
    expected = counts.quantile_map(x.double().numpy().ravel(), own_mean.ravel(),
                                   (own_mean * np.exp(shift)).ravel(), own_theta.ravel(),
                                   reference_theta.ravel(), uniform.ravel()).reshape(x.shape)
    corrected = ad.read_h5ad(cli_run / "corrected.h5ad")
    counts_nearly_equal(corrected.layers["batchfix_counts"][:, columns], expected)  # measured: 0.008 % differ
    np.testing.assert_allclose(corrected.obsm["X_batchfix"], mu.numpy(), rtol=1e-5, atol=1e-5)


def test_cli_loss_falls(cli_run):
    epochs = logged_epochs(cli_run)
    assert list(epochs.index) == list(range(CLI_EPOCHS))
    first, last = epochs.iloc[0], epochs.iloc[-1]
    assert last["train_loss"] < 0.9 * first["train_loss"], epochs[["train_loss", "val_loss"]]
    assert last["train_reconstruction"] < first["train_reconstruction"]
    assert last["val_loss"] < first["val_loss"]
    assert list(epochs["step"]) == [STEPS_PER_EPOCH * (e + 1) - 1 for e in range(CLI_EPOCHS)]


def test_cli_without_verb_prints_usage(tmp_path):
    """Only the first argument selects a verb: an override in its place prints the usage."""
    result = run_cli(["trainer.max_epochs=1"], cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "usage: python -m batchfix" in result.stdout
    assert "'trainer.max_epochs=1' is not a verb" in result.stderr
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------- in-process runs through tasks.train


@pytest.fixture
def capture_module(monkeypatch):
    """Record the BatchfixModule that tasks.train builds (the in-memory trained model)."""
    built = []

    class Recorded(BatchfixModule):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(fitting, "BatchfixModule", Recorded)
    return built


def test_checkpoint_reload_reproduces_in_memory_model(subset_h5ad, tmp_path, capture_module):
    run_dir = tmp_path / "run"
    tasks.train(compose_train(subset_h5ad, "trainer.max_epochs=2"), run_dir)
    (module,) = capture_module
    module.eval()
    reloaded = load_trained(run_dir / "checkpoints" / "last.ckpt")
    assert not reloaded.module.training

    source = ad.read_h5ad(subset_h5ad)
    columns = source.var_names.get_indexer(reloaded.genes)
    x = torch.from_numpy(np.asarray(source.X[:, columns], dtype=np.float32))
    for reference in (None, 2):
        mu_mem, expr_mem = module.net.corrected(x, reference)
        mu_ckpt, expr_ckpt = reloaded.net.corrected(x, reference)
        assert torch.equal(mu_mem, mu_ckpt)
        assert torch.equal(expr_mem, expr_ckpt)
    # A freshly initialised model gives other outputs: the comparison above is not vacuous.
    fresh = BatchfixModule(**dict(reloaded.module.hparams)).eval()
    assert not torch.allclose(fresh.net.corrected(x)[0], mu_mem)
    # checkpoints/best.ckpt holds the epoch with the lowest validation negative ELBO, not simply the last one.
    saved = torch.load(run_dir / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=True)
    val_elbo = logged_epochs(run_dir)["val_elbo"]
    assert saved["epoch"] == int(val_elbo.idxmin())
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert float(state["best_model_score"]) == pytest.approx(val_elbo.min(), rel=1e-6)
    # model.ckpt is the best checkpoint plus the training batches' residual statistics and NB dispersions, and the
    # decoder of the genes the encoder does not read (fitted afterwards, the rest of the network unchanged).
    best, final = (load_trained(run_dir / name).module.state_dict() for name in ("checkpoints/best.ckpt", "model.ckpt"))
    calibration = {"tables.residual_location", "tables.residual_spread", "tables.residual_gene_spread",
                   "tables.residual_cells", "tables.count_theta", "tables.count_ratio"}
    extra = {k for k in final if k.startswith(("net.extra_", "tables.extra_"))}
    assert "tables.extra_count_theta" in extra and any(k.startswith("net.extra_decoder.") for k in extra)
    assert not any(k.startswith("net.") and k.split(".", 1)[1] in TABLES for k in final)  # none on the network
    assert best.keys() == final.keys() - extra and calibration <= set(final)
    assert all(torch.equal(best[k], final[k]) for k in best if k not in calibration)
    assert not best["tables.residual_spread"].any() and (final["tables.residual_spread"] > 0).all()
    assert final["tables.residual_location"].abs().sum() > 0
    assert not best["tables.count_theta"].any() and (final["tables.count_theta"] > 0).all()


@pytest.mark.slow  # two training runs of its own: in the slow run, which CI runs too
def test_resume_continues_step_count(subset_h5ad, tmp_path):
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first = tasks.train(compose_train(subset_h5ad, "trainer.max_epochs=1"), first_dir)
    assert first["steps"] == STEPS_PER_EPOCH
    second = tasks.train(compose_train(subset_h5ad, "trainer.max_epochs=2", f"resume={first_dir}"), second_dir)
    assert second["steps"] == 2 * STEPS_PER_EPOCH  # went on from step 3, not from 0
    assert second["epochs"] == 2
    epochs = logged_epochs(second_dir)
    assert list(epochs.index) == [1], "the resumed run retrained epoch 0"
    assert epochs.loc[1, "step"] == 2 * STEPS_PER_EPOCH - 1
    # The learning-rate plan follows the resumed run's 6 planned steps and ends at its floor (0.1 x lr),
    # rather than climbing back to the peak past the first run's 3-step plan.
    assert checkpoint_lr(first_dir / "checkpoints" / "last.ckpt") == pytest.approx(0.1 * LEARNING_RATE)
    assert checkpoint_lr(second_dir / "checkpoints" / "last.ckpt") == pytest.approx(0.1 * LEARNING_RATE)


@pytest.mark.slow  # a training run of its own (about 6 s): with the slow checks, which CI runs
def test_resume_refuses_other_genes(subset_h5ad, tmp_path):
    first_dir = tmp_path / "first"
    tasks.train(compose_train(subset_h5ad, "trainer.max_epochs=1"), first_dir)
    with pytest.raises(InputError, match="other genes"):
        tasks.train(compose_train(subset_h5ad, "trainer.max_epochs=2", f"resume={first_dir}",
                                  "data.n_top_genes=150"), tmp_path / "second")
    with pytest.raises(InputError, match="no checkpoint"):
        tasks.train(compose_train(subset_h5ad, f"resume={tmp_path / 'nowhere'}"), tmp_path / "third")


@pytest.mark.slow  # a minute of a worker: with the long checks, to keep the default run under 5 minutes
def test_same_seed_same_losses(subset_h5ad, tmp_path):
    def losses(seed: int, name: str) -> pd.DataFrame:
        run_dir = tmp_path / name
        tasks.train(compose_train(subset_h5ad, "trainer.max_epochs=2", f"seed={seed}"), run_dir)
        return logged_epochs(run_dir)[["train_loss", "train_kl", "val_loss"]]

    a, b, other = losses(3, "a"), losses(3, "b"), losses(4, "c")
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert not np.allclose(a.to_numpy(), other.to_numpy(), rtol=0, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback of 16-mixed")
def test_precision_16_mixed_runs_as_bf16_on_cpu(subset_h5ad, tmp_path, caplog):
    caplog.set_level("INFO", logger="batchfix")
    metrics = tasks.train(compose_train(subset_h5ad, "trainer.max_epochs=1", "trainer.precision=16-mixed"), tmp_path)
    assert metrics["precision"] == "bf16-mixed"
    assert json.loads((tmp_path / "metrics.json").read_text())["precision"] == "bf16-mixed"
    assert "Training precision: bf16-mixed on CPU" in caplog.text
    assert "Lightning runs bf16-mixed" in caplog.text
    assert all(math.isfinite(v) for v in metrics["losses"].values())


@pytest.mark.parametrize("bf16_units", [False, True], ids=["float32_cpu", "amx_cpu"])
def test_default_precision_follows_the_hardware(monkeypatch, bf16_units):
    monkeypatch.setattr(fitting, "cpu_multiplies_bf16", lambda: bf16_units)
    cpu_default = "bf16-mixed" if bf16_units else "32-true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fitting.resolve_precision(None) == cpu_default
    assert fitting.resolve_precision("bf16-mixed") == "bf16-mixed"
    assert fitting.resolve_precision("32-true") == "32-true"  # asked for: kept, bf16 units or not
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fitting.resolve_precision(None, "auto") == "16-mixed"
    assert fitting.resolve_precision(None, "gpu") == "16-mixed"
    # A GPU host told to train on its CPU: the CPU's default, and 16-mixed said to become bf16-mixed.
    assert fitting.resolve_precision(None, "cpu") == cpu_default
    assert fitting.resolve_precision("16-mixed", "cpu") == "bf16-mixed"


def test_bf16_probe_answers_no_when_torch_cannot_tell(monkeypatch):
    assert isinstance(fitting.cpu_multiplies_bf16(), bool)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert fitting.cpu_multiplies_bf16() is False

    def failing_probe():
        raise RuntimeError("cpuinfo unavailable")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", failing_probe, raising=False)
    assert fitting.cpu_multiplies_bf16() is False


# ---------------------------------------------------------------- DDP: two CPU processes (gloo)


@pytest.mark.slow  # two training processes through the command line: CI's slow step
@pytest.mark.parametrize("stream", [False, True], ids=["in_memory", "streamed"])
def test_ddp_two_cpu_processes_through_cli(subset_h5ad, tmp_path, stream):
    """Two processes, the cells in memory or streamed from disk (each process reading its own shard)."""
    run_dir = tmp_path / "ddp run"  # a space: the launcher must quote the run folder for the child
    ddp_batch = 32
    streaming = ["data.stream=true", "data.chunk_cells=64"] if stream else ["data.stream=false"]
    result = run_cli(["train", "trainer=ddp", "trainer.accelerator=cpu", "trainer.max_epochs=2",
                      *tiny_overrides(subset_h5ad), *streaming, f"fit.batch_size={ddp_batch}",
                      f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    # The second process was started by Lightning (python -m batchfix.cli.train <same overrides>).
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output
    assert "distributed_backend=gloo" in output
    child_log = run_dir / "train_ddp_process_1.log"
    assert child_log.is_file()
    assert "Modelling 200 genes" in child_log.read_text()
    assert ("Ranking highly variable genes on" in child_log.read_text()) is stream  # the child streams too

    # Each process took half the minibatches: 6 per epoch in all, 3 per process.
    per_process = math.ceil(math.ceil(N_TRAIN_CELLS / ddp_batch) / 2)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 * per_process
    assert metrics["streamed"] is stream
    assert metrics["precision"] == CPU_DEFAULT_PRECISION
    # The KL warm-up and learning-rate plan count the steps each process really takes.
    trained = load_trained(run_dir / "model.ckpt")
    assert trained.module.hparams.planned_steps == 2 * per_process
    assert checkpoint_lr(run_dir / "checkpoints" / "last.ckpt") == pytest.approx(0.1 * LEARNING_RATE)

    # Only rank 0 wrote the outputs.
    assert "Run folder:" in (run_dir / "train.log").read_text()
    assert "Run folder:" not in child_log.read_text()
    assert output.count("Run folder:") == 1
    assert ad.read_h5ad(run_dir / "corrected.h5ad").obsm["X_batchfix"].shape == (200, 8)
    assert not (run_dir / ".hydra" / "overrides.yaml").read_text().count("train_ddp_process")


# ---------------------------------------------------------------- a Hydra multirun sweep


@pytest.mark.slow  # a minute of a worker: with the long checks, to keep the default run under 5 minutes
def test_cli_sweep_over_heads_writes_summary(subset_h5ad, tmp_path):
    sweep_dir = tmp_path / "sweep"
    overrides = [o for o in tiny_overrides(subset_h5ad) if not o.startswith("model.n_heads=")]
    result = run_cli(["train", "-m", "model.n_heads=1,2", *overrides, "trainer.max_epochs=2",
                      f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    for job in ("0", "1"):
        assert (sweep_dir / job / "model.ckpt").is_file()
    table = pd.read_csv(sweep_dir / "sweep_summary.csv")
    assert sorted(table["model.n_heads"]) == [1, 2]
    assert {"fit_seconds", "losses.val_elbo"} <= set(table.columns)
    assert table["losses.val_elbo"].notna().all()
    assert (sweep_dir / "sweep_summary.md").read_text().count("|") > 10
    assert list(sweep_dir.glob("sweep_*.png")), "no metric plot written"


def test_an_interrupted_fit_keeps_the_losses_logged_so_far(tmp_path):
    """Lightning's CSVLogger writes logs/metrics.csv at epoch ends (and rarely between): a signal in the middle
    of a long epoch (an atlas has thousands of steps per epoch) must not lose what was logged."""
    import signal
    from types import SimpleNamespace

    from pytorch_lightning.loggers import CSVLogger

    from batchfix.errors import Interrupted
    from batchfix.training.fitting import StopOnSignal

    logger = CSVLogger(str(tmp_path), name="logs", version="")
    logger.log_metrics({"train_loss": 1.5}, step=4)
    saved = []
    trainer = SimpleNamespace(global_step=5, save_checkpoint=saved.append, logger=logger)
    StopOnSignal(tmp_path / "last.ckpt").on_exception(trainer, None, Interrupted(signal.SIGTERM))
    assert saved == [tmp_path / "last.ckpt"]
    logged = pd.read_csv(tmp_path / "logs" / "metrics.csv")
    assert logged["step"].tolist() == [4] and logged["train_loss"].tolist() == [1.5]


def test_the_epoch_plan_follows_the_data():
    """About fit.target_steps gradient steps, but never less than one pass over the cells nor more than
    fit.max_auto_epochs; trainer.max_epochs overrides the plan."""
    from batchfix.config import FitConfig, TrainerConfig
    from batchfix.training.fitting import planned_epochs

    fit, trainer = FitConfig(), TrainerConfig()
    assert planned_epochs(trainer, fit, 8) == 63  # the bundled 1,021 cells: 504 steps
    assert planned_epochs(trainer, fit, 71) == 8  # 10,000 cells: 568 steps
    assert planned_epochs(trainer, fit, 704) == 1  # 100,000 cells: one pass, 704 steps
    assert planned_epochs(trainer, fit, 7032) == 1  # 1,000,000 cells: one pass
    assert planned_epochs(trainer, FitConfig(target_steps=10**6), 1) == fit.max_auto_epochs
    assert planned_epochs(TrainerConfig(max_epochs=3), fit, 8) == 3


def test_a_log_scale_runs_summary_speaks_of_log_values_not_counts(log_scale_subset, tmp_path):
    """A model of log values writes no counts: its summary says what it wrote (the modelled genes' log values; the
    others are left out of the layer), as the corrected file holds it."""
    from batchfix.cli.summary import run_summary

    log_scale_subset.write_h5ad(tmp_path / "log.h5ad")
    metrics = tasks.train(compose_train(tmp_path / "log.h5ad", "trainer.max_epochs=1", "data.scale=log",
                                        "model.likelihood=gaussian"), tmp_path / "run")
    summary = run_summary("train", metrics, tmp_path / "run", [])
    assert "corrected counts" not in summary
    assert (f"corrected log-scale values of the {N_TOP_GENES} modelled genes (a model of log values writes no "
            f"counts); the other {600 - N_TOP_GENES} genes are left out of the corrected layer (zero there; X keeps "
            "them)") in summary
    corrected = ad.read_h5ad(tmp_path / "run" / "corrected.h5ad")
    assert "batchfix_counts" not in corrected.layers
    others = ~corrected.var["batchfix_modelled"].to_numpy()
    assert others.sum() == 600 - N_TOP_GENES and abs(corrected.layers["batchfix"][:, others]).sum() == 0
