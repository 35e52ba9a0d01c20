"""scripts/resampled.py: a file of Poisson-resampled bundled cells, as the benchmarks and larger stress sets use."""
from __future__ import annotations

import anndata as ad
import numpy as np
import pytest

from scripts import resampled


def test_the_command_writes_resampled_real_cells_and_refuses_an_existing_file(tmp_path):
    out = tmp_path / "res.h5ad"
    resampled.main([str(out), "--cells", "60", "--seed", "1"])
    cells, source = ad.read_h5ad(out), resampled.bundled_cells()
    assert cells.shape == (60, source.n_vars) and list(cells.var_names) == list(source.var_names)
    assert set(cells.obs["batch"]) <= set(source.obs["batch"])
    assert set(cells.obs["cell_type"]) <= set(source.obs["cell_type"])
    counts = cells.X.toarray()
    assert np.all(counts == np.round(counts)) and counts.sum(axis=1).min() > 0
    again = tmp_path / "again.h5ad"
    resampled.main([str(again), "--cells", "60", "--seed", "1"])
    np.testing.assert_array_equal(ad.read_h5ad(again).X.toarray(), counts)  # the seed decides every count
    with pytest.raises(SystemExit):
        resampled.main([str(out), "--cells", "60"])
