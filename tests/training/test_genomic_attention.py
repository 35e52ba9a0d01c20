"""Position variants, per-gene tokens, attention entropy, attention maps and INT8 inference, with small
real trainings on the 200-cell subset of the bundled data (tiny models, a few epochs)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_module

import batchfix
from batchfix import tasks
from batchfix.config import AttentionConfig, ResolvedCorrection, TrainConfig, validated
from batchfix.errors import InputError, OutputExistsError
from batchfix.tasks.attention_maps import attention_maps
from batchfix.training.module import ENTROPY_PREFIX, BatchfixModule
from batchfix.training.trained import load_trained

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(n_top_genes=200, genes_per_token=16, d_model=16, n_heads=2, n_layers=1, latent_dim=8, decoder_hidden=32,
            batch_size=64, threads=1, enable_progress_bar=False, seed=0)


def train_run(h5ad: Path, run_dir: Path, *overrides: str) -> Path:
    """tasks.train (as the CLI runs it) of a tiny model; returns the run folder."""
    tiny = ["data.n_top_genes=200", "model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.latent_dim=8",
            "model.decoder_hidden=32", "fit.batch_size=64", "threads=1", "evaluate=false",
            "trainer.enable_progress_bar=false"]
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        cfg = compose("train", overrides=[f"data.path={h5ad}", *tiny, *overrides])
    tasks.train(validated(cfg, TrainConfig), run_dir)
    return run_dir


def epoch_log(run_dir: Path) -> pd.DataFrame:
    log = pd.read_csv(run_dir / "logs" / "metrics.csv")
    return log.groupby("epoch").first()  # an epoch's train_* and val_* rows merged


@pytest.fixture(scope="module")
def per_gene_runs(subset_h5ad, tmp_path_factory) -> dict[str, Path]:
    """One epoch with one token per gene (200 tokens), attention whole and in recomputed blocks of 48 queries."""
    work = tmp_path_factory.mktemp("per_gene")
    common = ("model.genes_per_token=1", "trainer.max_epochs=2", "ablation.distance_bias=true")
    return {
        "whole": train_run(subset_h5ad, work / "whole", *common),
        "blocks": train_run(subset_h5ad, work / "blocks", *common, "model.attention_block_size=48",
                            "model.gradient_checkpointing=true"),
    }


# ---------------------------------------------------------------- position variants


@pytest.mark.slow  # three ablation models (3-4 s each): with the slow checks, which CI runs
@pytest.mark.parametrize("variant", [
    dict(token_identity="coordinates", distance_bias=True),
    dict(position_encoding="learned"),
    dict(token_identity="coordinates", position_encoding="shuffled", distance_bias=True),
], ids=["coordinates+distance-bias", "learned-table", "shuffled+distance-bias"])
def test_each_position_variant_trains_and_corrects(small_adata, variant):
    model = batchfix.train(small_adata, batch_key="batch", max_epochs=2, **TINY, **variant)
    encoder = model.net.encoder
    assert all(getattr(model.config, k) == v for k, v in variant.items())
    assert encoder.shared_values == (variant.get("token_identity") == "coordinates")
    if variant.get("distance_bias"):
        assert encoder.distance_bias.table.abs().sum() > 0, "the zero-initialised distance bias was not trained"
    corrected = batchfix.correct(small_adata, model, copy=True)
    assert np.isfinite(corrected.layers["batchfix"].data).all() and np.isfinite(corrected.obsm["X_batchfix"]).all()


# ---------------------------------------------------------------- per-gene tokens, blocks, checkpointing, entropy


def test_per_gene_tokens_in_recomputed_blocks_train_like_whole_attention(per_gene_runs):
    whole, blocks = (epoch_log(per_gene_runs[k]) for k in ("whole", "blocks"))
    for column in ("train_loss", "val_loss", "val_elbo"):
        np.testing.assert_allclose(blocks[column], whole[column], rtol=1e-4)
    trained = load_trained(per_gene_runs["blocks"] / "model.ckpt")
    assert trained.module.windows.n_tokens == 200 and trained.config.attention_block_size == 48
    assert trained.net.encoder.blocks[0].attn.checkpoint_blocks


def test_attention_entropy_is_logged_every_epoch(per_gene_runs):
    log = epoch_log(per_gene_runs["blocks"])
    columns = [f"{ENTROPY_PREFIX}_layer0_head{h}" for h in range(2)]
    entropy = log[columns]
    assert len(entropy) == 2 and entropy.notna().all().all()
    assert ((entropy > 0) & (entropy <= math.log(200) + 1e-6)).all().all()
    assert not any(k.startswith(ENTROPY_PREFIX) for k in json.loads(
        (per_gene_runs["blocks"] / "metrics.json").read_text())["losses"])


def test_heads_that_stay_uniform_or_collapse_are_warned_about(subset_h5ad, tmp_path, caplog):
    caplog.set_level("WARNING", logger="batchfix")
    train_run(subset_h5ad, tmp_path / "run", "model.genes_per_token=1", "trainer.max_epochs=1")
    assert "stayed near uniform" in caplog.text  # one epoch: attention over 200 tokens is still near uniform
    module = BatchfixModule(**dict(load_trained(tmp_path / "run" / "model.ckpt").module.hparams))  # the training plan
    caplog.clear()
    module.warn_heads(torch.tensor([[False, True]]), "collapsed onto single tokens")
    module.warn_heads(torch.tensor([[False, True]]), "collapsed onto single tokens")
    assert caplog.text.count("(layer, head) [(0, 1)] collapsed") == 1


# ---------------------------------------------------------------- attention maps


def test_attention_maps_are_the_mean_weights_per_group(per_gene_runs, subset_h5ad):
    trained = load_trained(per_gene_runs["whole"] / "model.ckpt")
    adata = ad.read_h5ad(subset_h5ad)
    # Chunks of 64 cells read from the file, forward passes of 48: the groups' sums cross both.
    settings = ResolvedCorrection(chunk_size=64, batch_size=48)
    full = attention_maps(trained, subset_h5ad, "cell_type", settings, resolution=256)
    pooled = attention_maps(trained, subset_h5ad, "cell_type", settings, resolution=50, max_cells=150)
    assert full.maps.shape == (5, 1, 2, 200, 200) and pooled.maps.shape == (5, 1, 2, 50, 50)
    np.testing.assert_allclose(full.maps.sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(pooled.maps.sum(-1), 1.0, atol=1e-4)

    # Reference: every cell's weights, averaged over the cells of one label.
    columns = adata.var_names.get_indexer(trained.genes)
    x = torch.from_numpy(adata.X[:, columns])
    seen = []
    with torch.no_grad(), trained.net.encoder.observing(lambda layer, w, first: seen.append(w.clone())):
        trained.net.encode(x)
    weights = torch.cat(seen).numpy()  # (cells, H, 200, 200)
    group = full.groups.index("H1975")
    cells = (adata.obs["cell_type"] == "H1975").to_numpy()
    expected = weights[cells].mean(0)
    np.testing.assert_allclose(full.maps[group, 0], expected, atol=1e-5)
    # Pooled: 4 neighbouring loci per bin; attention summed over key bins, averaged over query bins.
    sampled = np.zeros(len(cells), dtype=bool)
    sampled[np.random.default_rng(0).choice(len(cells), 150, replace=False)] = True
    expected = weights[cells & sampled].mean(0).reshape(2, 50, 4, 50, 4).sum(-1).mean(2)
    np.testing.assert_allclose(pooled.maps[group, 0], expected, atol=1e-5)
    assert list(full.bin_chromosome[:1]) == ["1"] and full.n_cells[group] == cells.sum()
    assert pooled.n_cells.sum() == 150 and pooled.n_cells[group] == (cells & sampled).sum()
    with pytest.raises(InputError, match="group_by 'tissue' is not an obs column. Columns present: "):
        attention_maps(trained, subset_h5ad, "tissue", settings)


def test_attention_verb_writes_only_what_is_asked(per_gene_runs, subset_h5ad, tmp_path):
    checkpoint = per_gene_runs["blocks"] / "model.ckpt"
    assert (per_gene_runs["blocks"] / "attention.png").is_file(), "train draws attention.png in the run folder"
    command = [sys.executable, "-m", "batchfix", "attention", f"input={subset_h5ad}", f"checkpoint={checkpoint}",
               f"output={tmp_path / 'maps'}", "group_by=batch", "max_cells=100", "resolution=40", "threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maps"]
    assert sorted(p.name for p in (tmp_path / "maps").iterdir()) == ["attention.npz", "attention.png"]
    saved = np.load(tmp_path / "maps" / "attention.npz")
    assert saved["maps"].shape == (5, 1, 2, 40, 40) and saved["n_cells"].sum() == 100
    assert set(saved["groups"]) == set(ad.read_h5ad(subset_h5ad).obs["batch"].astype(str))
    again = validated({"input": str(subset_h5ad), "checkpoint": str(checkpoint), "output": str(tmp_path / "maps")},
                      AttentionConfig)
    with pytest.raises(OutputExistsError, match="exists; pass overwrite=true"):
        tasks.attention(again)


# ---------------------------------------------------------------- the benchmark's ablation per variant


def test_the_benchmark_ablation_runs_every_encoding_of_every_variant():
    from scripts import benchmark

    args = benchmark.parse_args(["x.h5ad", "--methods", "batchfix", "--ablation", "--batchfix-override", "threads=1",
                                 "--variant", "cb", "ablation.token_identity=coordinates", "ablation.distance_bias=true",
                                 "--variant", "plain"])
    runs = benchmark.batchfix_runs(args)
    assert [(v, e) for _, v, e, _ in runs] == [(v, e) for v in ("cb", "plain") for e in ("real", "none", "shuffled",
                                                                                       "learned")]
    name, _, _, overrides = runs[3]
    assert name == "batchfix cb [position_encoding=learned]"
    assert overrides == ["threads=1", "ablation.token_identity=coordinates", "ablation.distance_bias=true",
                         "ablation.position_encoding=learned"]
    with pytest.raises(SystemExit):
        benchmark.parse_args(["x.h5ad", "--variant", "ablation.distance_bias=true"])
