"""scripts/bench/bench_gpu.py: its guard check on float16 tensors, and its two halves end to end on the CPU (a dry run)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from scripts.bench import bench_gpu

pytestmark = pytest.mark.bench
ROOT = Path(__file__).resolve().parents[2]


def test_the_guard_inputs_overflow_fp16_only_without_the_guards():
    rows = {row["overflow"]: row for row in bench_gpu.guard_check("cpu")}
    assert set(rows) == {"exp", "product"}
    for row in rows.values():
        assert not row["unguarded_finite"], "the inputs must break the attention without its guards"
        assert row["guarded_finite"] and row["sdpa_finite"]
        assert row["guarded_dtype"] == row["sdpa_dtype"] == "float16"
        assert row["guarded_max_error"] <= bench_gpu.GUARD_TOLERANCE and row["passed"]
    q, k, v = bench_gpu.guard_inputs("cpu")["exp"]
    scores = (q.double() @ k.double().transpose(-2, -1)) / q.shape[-1] ** 0.5
    overflowing = scores > 11.1  # exp(11.1) > 65,504
    assert overflowing.any(-1).all() and overflowing.float().mean() > 0.9  # every row of weights breaks
    assert torch.softmax(scores, -1).amax(-1).median() < 0.5  # far from one-hot: the weights are tested


def test_options_are_read_as_python_literals():
    assert bench_gpu.keyword_option("genes_per_token=1") == ("genes_per_token", 1)
    assert bench_gpu.keyword_option("attention=sdpa") == ("attention", "sdpa")
    assert bench_gpu.keyword_option("distance_bias=True") == ("distance_bias", True)
    with pytest.raises(Exception, match="KEY=VALUE"):
        bench_gpu.keyword_option("genes_per_token")


@pytest.mark.slow
def test_both_halves_run_on_the_cpu_and_score_every_saved_model(tmp_path):
    out = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_gpu", "train", str(out), "--accelerator", "cpu",
         "--seeds", "0", "1", "--precisions", "32-true", "--max-epochs", "1", "--cells", "0",
         "--name", "narrow", "--option", "genes_per_token=64"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert train.returncode == 0, train.stderr[-3000:]
    report = json.loads((out / "gpu.json").read_text())
    assert report["fit_options"] == {"genes_per_token": 64, "max_epochs": 1}
    fits = [(row["name"], row["seed"], row["epochs"]) for row in report["bundled"]]
    assert fits == [("narrow", 0, 1), ("narrow", 1, 1)]
    assert all(row["nonfinite_losses"] == 0 and row["steps"] == 8 for row in report["bundled"])
    saved = sorted(path.name for path in out.glob("*.ckpt"))
    assert saved == ["bundled_narrow_32-true_0.ckpt", "bundled_narrow_32-true_1.ckpt"]

    table, scores = tmp_path / "summary.csv", tmp_path / "scores.csv"
    score = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_gpu", "score", str(out), "--table", str(table),
         "--csv", str(scores)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert score.returncode == 0, score.stderr[-3000:]
    rows = pd.read_csv(scores)
    assert list(rows["seed"]) == [0, 1]
    assert rows[["latent Total", "matrix Total"]].apply(lambda c: c.between(0, 1)).all().all()
    assert (rows["matrix Total"] > 0.7).all()  # one epoch already mixes the bundled data (uncorrected: 0.69)
    summary = pd.read_csv(table)
    assert summary.loc[0, "seeds"] == "0,1" and "±" in summary.loc[0, "matrix Total"]
