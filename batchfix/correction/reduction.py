"""Sums over cells that come out with the same bits however the cells are split between processes.

The estimate pass (batchfix.correction.estimates) reduces sums over all cells. Floating-point addition depends on
its order, so the pass adds each forward batch into fresh sums of its own and combines those pairwise over the
batches' global index, as a binary counter does: level k of the counter holds the sum of an aligned block of 2^k
forward batches. Whatever contiguous range of forward batches a process covers, the blocks it completes are the
blocks a single process completes; the processes' unfinished blocks, pushed in order into one counter, complete
the rest in the same order. So one process and N processes give the same sums (and pairwise sums are the more
accurate ones).

An accumulator is any object whose class names its summed attributes in `SUMMED` (arrays added in place, ints,
dicts of arrays, or None where unused); `zeroed` copies it with those attributes zero. An accumulator with a
`merge` method (a sample of cells, which grows instead of adding up) is merged in the same order instead, and its
`emptied` copy is its zero.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


def zeroed(accumulator):
    """A copy of `accumulator` with every attribute in its class's SUMMED set to zero (other attributes shared)."""
    if hasattr(accumulator, "merge"):
        return accumulator.emptied()
    fresh = copy.copy(accumulator)
    for name in type(accumulator).SUMMED:
        value = getattr(accumulator, name)
        if isinstance(value, np.ndarray):
            value = np.zeros_like(value)
        elif isinstance(value, dict):
            value = {key: np.zeros_like(item) for key, item in value.items()}
        elif value is not None:
            value = type(value)(0)
        setattr(fresh, name, value)
    return fresh


def add_into(total, part) -> None:
    """total's SUMMED attributes += part's (or part merged into total)."""
    if hasattr(total, "merge"):
        total.merge(part)
        return
    for name in type(total).SUMMED:
        value, added = getattr(total, name), getattr(part, name)
        if isinstance(value, np.ndarray):
            value += added
        elif isinstance(value, dict):
            for key in value:
                value[key] += added[key]
        elif value is not None:
            setattr(total, name, value + added)


def state_of(accumulator) -> dict:
    """The accumulator's SUMMED values: all of it that travels between processes (not the objects it refers to)."""
    return {name: getattr(accumulator, name) for name in type(accumulator).SUMMED}


def with_state(template, state: dict):
    """A copy of `template` holding copies of `state`'s values."""
    fresh = copy.copy(template)
    for name, value in state.items():
        if isinstance(value, np.ndarray):
            value = value.copy()
        elif isinstance(value, dict):
            value = {key: item.copy() for key, item in value.items()}
        setattr(fresh, name, value)
    return fresh


@dataclass
class Block:
    """The sums (one per accumulator) of the aligned forward batches [first, first + 2^level)."""

    first: int
    level: int
    sums: list


@dataclass
class OrderedSums:
    """The binary counter of a list of accumulators (`templates`, left at zero) over forward batches in order."""

    templates: list
    blocks: list[Block] = field(default_factory=list)

    def fresh(self) -> list:
        """Zero sums for one forward batch, to add its cells into and `push`."""
        return [zeroed(template) for template in self.templates]

    def push(self, index: int, sums: list) -> None:
        """Append forward batch `index`'s sums (indices pushed in order, none skipped)."""
        self.push_block(Block(index, 0, sums))

    def push_block(self, block: Block) -> None:
        """Append a block (the next in order), merging pairs of equal level that form an aligned block."""
        self.blocks.append(block)
        while len(self.blocks) >= 2:
            left, right = self.blocks[-2], self.blocks[-1]
            if left.level != right.level or left.first % (2 << left.level) \
                    or right.first != left.first + (1 << left.level):
                break
            for total, part in zip(left.sums, right.sums):
                add_into(total, part)
            self.blocks[-2:] = [Block(left.first, left.level + 1, left.sums)]

    def totals(self, gather: Callable[[list[Block]], Sequence[list[Block]]] | None = None) -> list:
        """The accumulators summed over every forward batch: this process's blocks with those `gather` returns for
        every process in order (None: this process covered every cell); zero sums where there was none. `gather`
        receives and returns blocks of summed values only (`state_of`); this process's blocks are left as they
        were."""
        counter = OrderedSums(self.templates)
        own = [Block(block.first, block.level, [state_of(sums) for sums in block.sums]) for block in self.blocks]
        for blocks in [own] if gather is None else gather(own):
            for block in blocks:
                counter.push_block(Block(block.first, block.level,
                                         [with_state(t, state) for t, state in zip(self.templates, block.sums)]))
        totals = [zeroed(template) for template in self.templates]
        for block in counter.blocks:
            for total, part in zip(totals, block.sums):
                add_into(total, part)
        return totals
