"""State groups (batchfix.correction.state_groups): k-means groups of the latent that the evidence weights and the
state shrink are also taken in (the state shrink's for the corrected counts and the log-scale output), so a batch
effect that differs between cell states, even in sign, is measured and removed where its cells are."""
from __future__ import annotations

import numpy as np
import torch

from batchfix.correction import counterfactual
from batchfix.correction.count_output import CountTables
from batchfix.correction.counts import name_keys
from batchfix.correction.evidence import ShiftEvidenceSums
from batchfix.correction.state_groups import LatentSample, StateGroups, fit_groups, group_codes


def three_states(n_cells: int, seed: int = 0) -> np.ndarray:
    """(n_cells, 4) latents around three well-separated centres, the state of cell i is i % 3."""
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0, 0, 0], [6, 0, 0, 0], [0, 6, 0, 0]])
    return centres[np.arange(n_cells) % 3] + rng.normal(0.0, 0.3, (n_cells, 4))


def test_groups_find_the_states_and_are_the_same_bits_again():
    latents = three_states(12_000)
    sample = LatentSample(len(latents), latents.shape[1])
    keys = name_keys([f"cell{i}" for i in range(len(latents))])
    sample.add(keys[sample.picked(keys)], latents[sample.picked(keys)])
    groups = fit_groups(sample)
    assert groups.centroids.shape == (10, 4)
    assigned = groups.assign(latents)
    for state in range(3):  # no group holds cells of two states
        held = set(assigned[np.arange(len(latents)) % 3 == state])
        others = set(assigned[np.arange(len(latents)) % 3 != state])
        assert held and not held & others
    np.testing.assert_array_equal(fit_groups(sample).centroids, groups.centroids)
    few = LatentSample(30, 4)
    few.add(np.arange(30, dtype=np.uint64), three_states(30))
    assert fit_groups(few) is None  # under two groups of GROUP_CELLS sampled cells


def test_a_shift_that_changes_sign_between_states_is_applied_where_its_state_measures_it():
    """Batch 0 (the reference batch 1 measured on 10^6 counts a gene) is shifted +1 in state group 0 and -1 in
    group 1 on every gene of thousands of counts: its mean over the batch is 0, so its batch weight is ~0, and each
    group's weight ~1. Batch 2's shifts are noise, in both groups: (almost) nothing applied. A gene without a count
    in batch 2 stays at weight 0."""
    rng = np.random.default_rng(0)
    n_genes, n_cells, n_groups = 200, 100, 2
    by_batch, by_group = ShiftEvidenceSums(3, n_genes), ShiftEvidenceSums(3 * n_groups, n_genes)
    sign = rng.choice([-1.0, 1.0], n_genes)
    for group in range(n_groups):
        rows = np.arange(3) * n_groups + group  # (batch codes) in group code order
        by_group.shift[rows[0]] = sign * (1.0 if group == 0 else -1.0) * n_cells
        by_group.counts[rows], by_group.n_cells[rows] = [[5000.0], [1e6], [20.0]], n_cells
        by_group.shift[rows[2]] = rng.normal(0.0, np.sqrt(1 / 20.5), n_genes) * n_cells
    by_group.means[:], by_group.mean_squares[:] = by_group.counts, by_group.counts**2 / n_cells
    by_group.counts[2 * n_groups:, -1] = 0.0
    for name in ShiftEvidenceSums.SUMMED:
        summed = np.add.reduceat(getattr(by_group, name), np.arange(0, 3 * n_groups, n_groups), axis=0)
        setattr(by_batch, name, summed)
    tables = CountTables(theta=np.full((3, n_genes), 10.0), ratio=np.ones((3, n_genes)),
                         reference_ratio=np.ones(n_genes), reference_theta=None)
    present = np.ones(n_genes, dtype=bool)
    batch_weight, _ = by_batch.weights(tables, present, min_cells=10, reference=1, n_training=3)
    state_weight = by_group.state_weights(tables, present, 1, 3, batch_weight)
    assert state_weight.shape == (3, n_groups, n_genes)
    assert np.median(batch_weight[0]) < 0.1 and state_weight[0].min() > 0.99
    assert np.median(state_weight[2]) == 0.0 and (state_weight[2] > 0.5).mean() <= 0.01
    assert (batch_weight[2, -1] == 0.0) and (state_weight[2, :, -1] == 0.0).all()


def test_the_state_shrink_draws_each_cell_toward_its_batch_and_groups_mean():
    """With weight 0 every cell's term is the mean of its (batch, group); cells of the same batch in other groups
    get their own group's."""
    groups = StateGroups(np.array([[0.0, 0.0], [5.0, 0.0]]))
    mu = torch.tensor([[0.1, 0.0], [4.9, 0.2], [0.0, -0.1]])
    codes = torch.tensor([0, 0, 1])
    mean = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)  # (codes * groups, G)
    state = counterfactual.StateShrink(0.0, mean, torch.ones(2), groups)
    np.testing.assert_array_equal(group_codes(codes.numpy(), groups, mu), [0, 1, 2])
    shift = counterfactual.applied_shift(torch.zeros(3, 3), codes, mu, state, None)
    np.testing.assert_array_equal(shift.numpy(), mean[[0, 1, 2]].numpy())
