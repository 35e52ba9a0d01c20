"""Where a correction's time goes: wall seconds by stage, summed over chunks and logged once at the end.

Stages (each timed on the calling thread; the layers' compression runs on worker threads meanwhile and shows as
time in `write` only where the caller waits for it):

- estimate: the estimate pass over every row (its own reads, encoding and decoding included);
- read: reading the input's rows for the correction;
- decode: the network's passes of the correction (a cell's latent where the estimate pass kept none, the decoder's
  means of every batch, the options' shift);
- map: the corrected counts' quantile map (the draws included);
- checks: the model checks of the sampled cells (corrected counts);
- layers: the output rows (the log layer from the counts, CSR assembly);
- write: copying the input's content into the output, the latents and the layers' rows, the last compressed chunks.

`batchfix correct` logs one line, `Stage seconds: estimate=... read=... ...; total=...`, that
scripts/bench/bench_correct.py reads.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

STAGES = ("estimate", "read", "decode", "map", "checks", "layers", "write")


class StageClock:
    """Wall seconds spent in each of STAGES, summed over every `stage` block."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def line(self) -> str:
        """`Stage seconds: estimate=1.2 read=0.3 ...; total=4.5` (total: since the clock was made)."""
        stages = " ".join(f"{name}={seconds:.1f}" for name, seconds in self.seconds.items())
        return f"Stage seconds: {stages}; total={time.perf_counter() - self.started:.1f}"

    def log(self, what: str) -> None:
        log.info("%s (%s).", self.line(), what)
