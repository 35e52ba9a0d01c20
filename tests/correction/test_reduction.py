"""Sums over forward batches reduced in a fixed order: the same bits however the batches are split between
processes (batchfix.correction.reduction)."""
from __future__ import annotations

import numpy as np

from batchfix.correction.calibration import ResidualSums
from batchfix.correction.counts import CountSums, name_keys
from batchfix.correction.reduction import OrderedSums
from batchfix.correction.state_groups import LatentSample


def reduced(batches: list[np.ndarray], cuts: list[int]) -> list:
    """Residual and count sums of `batches` (each (cells, genes)), every part [cuts[i], cuts[i+1]) summed on its own
    as a process would, then gathered in order."""
    templates = [ResidualSums(batches[0].shape[1]), CountSums(batches[0].shape[1])]
    parts = []
    for start, stop in zip(cuts, cuts[1:]):
        ordered = OrderedSums(templates)
        for index in range(start, stop):
            sums = ordered.fresh()
            sums[0].add(batches[index])
            sums[1].add(np.round(batches[index] ** 2), batches[index])
            ordered.push(index, sums)
        parts.append(ordered)
    everyone = [handed_to_gather(part) for part in parts]  # what each process's `totals` sends
    return parts[0].totals(lambda blocks: everyone)


def handed_to_gather(ordered: OrderedSums) -> list:
    """The blocks `ordered.totals` hands to `gather` (summed values only)."""
    handed = []
    ordered.totals(lambda blocks: handed.append(blocks) or [blocks])
    return handed[0]


def test_every_split_of_the_batches_gives_one_process_sums_bit_for_bit():
    rng = np.random.default_rng(0)
    batches = [rng.lognormal(0.0, 3.0, size=(int(rng.integers(1, 9)), 50)) for _ in range(37)]
    one_process = reduced(batches, [0, 37])
    assert one_process[0].n_cells == sum(len(b) for b in batches) and one_process[1].n_cells == one_process[0].n_cells
    np.testing.assert_allclose(one_process[0].sum, np.vstack(batches).sum(axis=0), rtol=1e-13)
    for cuts in ([0, 1, 37], [0, 5, 6, 37], [0, 13, 14, 15, 31, 37], [0, 36, 37], list(range(38))):
        split = reduced(batches, cuts)
        for name in ("sum", "sum_sq"):
            assert np.array_equal(getattr(split[0], name), getattr(one_process[0], name)), (cuts, name)
        for name in one_process[1].sums:
            assert np.array_equal(split[1].sums[name], one_process[1].sums[name]), (cuts, name)
    sequential = np.zeros(50)
    for batch in batches:
        sequential += batch.sum(axis=0)
    assert not np.array_equal(sequential, one_process[0].sum)  # the order matters: these data round differently


def test_no_batches_give_zero_sums():
    totals = OrderedSums([ResidualSums(3)]).totals()
    assert totals[0].n_cells == 0 and not totals[0].sum.any()


def sampled(latents: np.ndarray, keys: np.ndarray, cuts: list[int], forward_batch: int = 64) -> LatentSample:
    """The LatentSample of cells with `latents` and name `keys` over forward batches of `forward_batch` cells, every
    part [cuts[i], cuts[i+1]) of forward batches gathered on its own as a process would, then gathered in order."""
    parts = []
    for start, stop in zip(cuts, cuts[1:]):
        ordered = OrderedSums([LatentSample(len(latents), latents.shape[1])])
        for index in range(start, stop):
            cells = np.arange(index * forward_batch, min((index + 1) * forward_batch, len(latents)))
            sums = ordered.fresh()
            picked = sums[0].picked(keys[cells])
            sums[0].add(keys[cells][picked], latents[cells][picked])
            ordered.push(index, sums)
        parts.append(ordered)
    everyone = [handed_to_gather(part) for part in parts]
    return parts[0].totals(lambda blocks: everyone)[0]


def test_the_sampled_latents_are_the_same_however_the_cells_are_split_or_ordered():
    """About 5,000 of 12,000 cells sampled by their names' keys: one process, two, and the cells in another order
    give the same sample in the same (sorted) order."""
    rng = np.random.default_rng(0)
    latents = rng.normal(size=(12_000, 4))
    keys = name_keys([f"cell{i}" for i in range(len(latents))])
    whole = sampled(latents, keys, [0, 188])
    assert 4700 < len(whole.keys) < 5300
    np.testing.assert_array_equal(np.sort(whole.keys), np.sort(keys[whole.picked(keys)]))
    np.testing.assert_array_equal(sampled(latents, keys, [0, 77, 188]).sorted(), whole.sorted())
    order = rng.permutation(len(latents))
    np.testing.assert_array_equal(sampled(latents[order], keys[order], [0, 188]).sorted(), whole.sorted())
