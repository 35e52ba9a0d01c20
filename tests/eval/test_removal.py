"""The gene-level removal score (batchfix.eval.removal) on the real subset: 1 for the raw data, 0 where every label's
batch means are made equal, one half where each batch's deviation from its label's mean is halved."""
from __future__ import annotations

import numpy as np
import pytest

from batchfix.data.normalize import log_cp10k
from batchfix.eval.removal import label_batch_rows, noise_floor, removal_scores


@pytest.fixture(scope="module")
def raw_log(subset):
    return np.asarray(log_cp10k(subset.X), dtype=np.float64)


def moved_toward_label_means(raw_log, batch, labels, keep: float) -> np.ndarray:
    """Each (label, batch) group's cells shifted so its mean deviation from the label's mean is `keep` times its own."""
    out = raw_log.copy()
    for rows in label_batch_rows(batch, labels).values():
        means = np.vstack([raw_log[r].mean(axis=0) for r in rows])
        for r, mean in zip(rows, means):
            out[r] += (keep - 1.0) * (mean - means.mean(axis=0))
    return out


def test_the_raw_data_leave_all_of_it_and_equal_batch_means_none(subset, raw_log):
    batch, labels = subset.obs["batch"].to_numpy(), subset.obs["cell_type"].to_numpy()
    assert removal_scores(raw_log, raw_log, batch, labels) == {"left_log": 1.0, "left_mean": 1.0,
                                                                "left_balanced": 1.0}
    halved = removal_scores(raw_log, moved_toward_label_means(raw_log, batch, labels, 0.5), batch, labels)
    assert halved["left_log"] == pytest.approx(0.5) and halved["left_balanced"] == pytest.approx(0.5)
    assert 0.3 < halved["left_mean"] < 0.8  # the mean scale: not the log shift's share exactly
    removed = removal_scores(raw_log, moved_toward_label_means(raw_log, batch, labels, 0.0), batch, labels)
    assert removed["left_log"] == pytest.approx(0.0, abs=1e-9)


def test_labels_in_one_batch_only_are_not_scored(subset, raw_log):
    batch = subset.obs["batch"].to_numpy()
    assert removal_scores(raw_log, raw_log, batch, batch)["left_log"] is None  # each label is one batch


def test_the_noise_floor_is_all_of_a_random_split_and_little_of_a_planted_effect(subset, raw_log):
    """Batches drawn at random within each label: all of their spread is noise (floor about 1); a shift of 2 (log)
    planted on every gene of one batch: noise is a small share of the spread."""
    labels = subset.obs["cell_type"].to_numpy()
    random_batches = np.random.default_rng(0).choice(["a", "b", "c"], size=len(labels))
    floor = noise_floor(raw_log, random_batches, labels, seed=1)
    assert 0.8 < floor["floor_log"] < 1.25 and 0.8 < floor["floor_mean"] < 1.25, floor
    planted = raw_log + (random_batches == "a")[:, None] * 2.0
    assert noise_floor(planted, random_batches, labels, seed=1)["floor_log"] < 0.3
