"""Sweep summaries: a hand-made sweep folder, and a real Hydra multirun with the callback."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from batchfix.cli.sweep import SUMMARY_CSV, SUMMARY_MD, flatten, parse_override, summarize_sweep


def make_job(sweep_dir, name, overrides, metrics=None):
    job = sweep_dir / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))


def job_metrics(total, seconds):
    return {
        "train_seconds": seconds,
        "n_cells": 1021,
        "data": "cellbench5.h5ad",
        "scores": {
            "batchfix latent": {"Batch correction": total - 0.05, "Bio conservation": total + 0.03,
                                "Total": total},
            "Unintegrated PCA": {"Batch correction": 0.41, "Bio conservation": 0.87,
                                 "Total": 0.685},
        },
    }


def test_flatten_and_parse_override():
    assert flatten({"a": 1, "b": {"c": 2.5, "d": "text", "e": True}}) == {"a": 1.0, "b.c": 2.5}
    assert parse_override("model.n_heads=4") == ("model.n_heads", 4)
    assert parse_override("+trainer.precision=16-mixed") == ("trainer.precision", "16-mixed")


def test_summarize_sweep_on_hand_made_folder(tmp_path):
    make_job(tmp_path, "0", ["model.n_heads=1", "trainer.max_epochs=3"], job_metrics(0.80, 40.0))
    make_job(tmp_path, "1", ["model.n_heads=4", "trainer.max_epochs=3"], job_metrics(0.83, 55.5))
    make_job(tmp_path, "2", ["model.n_heads=8", "trainer.max_epochs=3"])  # failed: no metrics

    table = summarize_sweep(tmp_path)

    assert list(table["job"]) == ["0", "1", "2"]
    assert list(table["model.n_heads"]) == [1, 4, 8]
    assert list(table["metrics_found"]) == [True, True, False]
    assert table.loc[1, "scores.batchfix latent.Total"] == pytest.approx(0.83)
    assert pd.isna(table.loc[2, "train_seconds"])
    assert table.columns[-1] == "train_seconds"

    csv = pd.read_csv(tmp_path / SUMMARY_CSV)
    assert "model.n_heads" in csv.columns and len(csv) == 3
    markdown = (tmp_path / SUMMARY_MD).read_text()
    assert "| job | model.n_heads | latent Total |" in markdown  # trainer.max_epochs=3 in every job
    assert "the same in every job: trainer.max_epochs=3" in markdown
    assert "n/a" in markdown  # the failed job
    for plot in ("sweep_total.png", "sweep_batch_correction.png",
                 "sweep_bio_conservation.png", "sweep_seconds.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG"), plot


def test_summarize_sweep_needs_job_folders(tmp_path):
    with pytest.raises(ValueError, match="No job folders"):
        summarize_sweep(tmp_path)


def test_callback_runs_at_the_end_of_a_real_multirun(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent("""
        import json
        import hydra
        from hydra.core.hydra_config import HydraConfig

        @hydra.main(version_base="1.3", config_path=".", config_name="config")
        def main(cfg):
            out = HydraConfig.get().runtime.output_dir
            total = 0.7 + 0.01 * cfg.model.n_heads
            with open(f"{out}/metrics.json", "w") as fh:
                json.dump({"Total": total, "train_seconds": 1.0 * cfg.model.n_heads}, fh)

        main()
    """))
    (tmp_path / "config.yaml").write_text(textwrap.dedent(f"""
        model:
          n_heads: 1
        hydra:
          sweep:
            dir: {tmp_path / "sweep"}
          callbacks:
            summary:
              _target_: batchfix.cli.sweep.SweepSummary
    """))
    run = subprocess.run(
        [sys.executable, str(app), "-m", "model.n_heads=1,2,4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    table = pd.read_csv(tmp_path / "sweep" / SUMMARY_CSV)
    assert list(table["model.n_heads"]) == [1, 2, 4]
    assert list(table["Total"]) == pytest.approx([0.71, 0.72, 0.74])
    assert (tmp_path / "sweep" / "sweep_total.png").exists()
