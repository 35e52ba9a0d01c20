"""The codec benchmark (scripts/bench/bench_codecs.py) on a small corrected file: every codec's layer read back
equal, batchfix's own gzip among them, and a missing layer named with those the file has."""
from __future__ import annotations

import csv
import sys

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

from scripts.bench import bench_codecs

pytestmark = pytest.mark.bench


def test_every_codec_round_trips_the_layers_and_gzip_shrinks_them(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(0)
    counts = sp.random(400, 300, density=0.1, format="csr", random_state=0, dtype=np.float32)
    counts.data = rng.poisson(3.0, counts.nnz).astype(np.float32) + 1
    adata = ad.AnnData(sp.csr_matrix(counts.shape, dtype=np.float32),
                       layers={"batchfix_counts": counts, "batchfix": counts.log1p()})
    path = tmp_path / "corrected.h5ad"
    adata.write_h5ad(path)
    table = tmp_path / "codecs.csv"
    monkeypatch.setattr(sys, "argv", ["bench_codecs", str(path), "--repeats", "1", "--csv", str(table)])
    bench_codecs.main()
    rows = list(csv.DictReader(table.open()))
    names = [codec.name for codec in bench_codecs.codecs()]
    assert [row["codec"] for row in rows] == names * 2 and "gzip 1 + shuffle (batchfix)" in names
    share = {(row["layer"], row["codec"]): float(row["share"]) for row in rows}
    for layer in ("batchfix_counts", "batchfix"):
        assert share[layer, "gzip 1 + shuffle (batchfix)"] < 0.7 * share[layer, "none"]
    assert {row["codec"] for row in rows if row["every_reader"] == "True"} >= {"none", "gzip 1 + shuffle (batchfix)"}
    assert "lzf" not in {row["codec"] for row in rows if row["every_reader"] == "True"}
    assert "stored values" in capsys.readouterr().out

    monkeypatch.setattr(sys, "argv", ["bench_codecs", str(path), "--layers", "nope"])
    with pytest.raises(SystemExit, match="no layer 'nope'; its layers: \\['batchfix', 'batchfix_counts'\\]"):
        bench_codecs.main()
