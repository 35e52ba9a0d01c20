"""Where a correction's time goes (batchfix.correction.stages): the clock's sums and the line the benchmark reads."""
from __future__ import annotations

import logging
import time

import pytest

from batchfix.correction.stages import STAGES, StageClock
from scripts.bench.bench_correct import stage_seconds


def test_each_stage_sums_its_blocks_and_the_logged_line_reads_back(caplog):
    clock = StageClock()
    for _ in range(2):
        with clock.stage("map"):
            time.sleep(0.03)
    with pytest.raises(ValueError), clock.stage("write"):  # a block left by an error is still counted
        time.sleep(0.02)
        raise ValueError
    assert clock.seconds["map"] >= 0.06 and 0.02 <= clock.seconds["write"] < clock.seconds["map"]
    assert all(clock.seconds[name] == 0 for name in STAGES if name not in ("map", "write"))
    with caplog.at_level(logging.INFO, logger="batchfix.correction.stages"):
        clock.log("12 cells, one process")
    [line] = stage_seconds(caplog.text)
    assert line["what"] == "12 cells, one process"
    assert list(line)[1:] == [*STAGES, "total"]
    assert line["map"] == round(clock.seconds["map"], 1) and line["total"] >= line["map"] + line["write"] - 0.1


def test_lines_of_other_logs_are_not_read_as_stages():
    assert stage_seconds("Corrected 200 cells x 300 genes in 1.0 s (200 cells/s).\nStage seconds in a sentence") == []
