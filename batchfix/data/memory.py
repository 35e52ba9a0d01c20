"""How the process asks the kernel for memory: numpy's transparent huge pages off while a verb runs.

numpy marks every large array it allocates for transparent huge pages (madvise). Where the kernel then compacts
memory to back them on the first touch (/sys/kernel/mm/transparent_hugepage/defrag = madvise, a common default),
the many short-lived cells x genes arrays of a correction spend their time in the kernel: `correct` of 20,000
resampled cells x every bundled gene took 136-152 s with them and 106-107 s without (docs/lab/scale.md). The values
computed are the same either way; NUMPY_MADVISE_HUGEPAGE, when set, decides instead.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

_CORE = getattr(np, "_core", None) or np.core  # numpy >= 2, else 1.x


@contextmanager
def numpy_huge_pages_off() -> Iterator[None]:
    """Within the `with`, numpy asks for no huge pages (unless NUMPY_MADVISE_HUGEPAGE is set); restored after."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        yield
        return
    before = _CORE.multiarray._set_madvise_hugepage(False)  # returns the previous setting
    try:
        yield
    finally:
        _CORE.multiarray._set_madvise_hugepage(before)
