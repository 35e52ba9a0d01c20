"""The values each choice option accepts (the one home of every choice list), and the checks that refuse
the others with a message naming the option and what it accepts."""
from __future__ import annotations

import math
import os

from batchfix.errors import ConfigError

GENOMES = ("GRCh38", "mm10")
SCALES = ("counts", "log")
UNPLACED_CHOICES = ("keep", "drop")
ATTENTION_BACKENDS = ("guarded", "sdpa")
POSITION_ENCODINGS = ("real", "shuffled", "none", "learned")
TOKEN_IDENTITIES = ("learned", "coordinates")
LIKELIHOODS = ("nb", "gaussian")
PRECISIONS = ("32-true", "32", "16-mixed", "16", "bf16-mixed", "bf16", "64-true", "64")
STREAM_CHOICES = ("auto", "true", "false")
OUTPUT_MODES = ("counterfactual", "denoised")
REGIONAL_SHIFTS = ("keep", "keep_input", "reference_cells", "apply")  # batchfix.correction.regional.RegionalShift
# Options a release accepted and this one refuses, with why (by dotted name; the API's keyword is the last part)
RETIRED_OPTIONS = {"inference.int8": "INT8 inference was removed: on CPU it was not faster than float32, and it "
                                     "moved corrected values (docs/lab/benchmarks.md, INT8 inference)"}
# Values a release accepted and this one refuses, with what replaces them (a checkpoint's are translated on load)
RETIRED_REGIONAL_SHIFTS = {"keep_all": "keep_input replaces it (it keeps a batch-wide regional shift whole, where "
                                       "keep_all still scaled it by the batch's spread: docs/cnv.md)"}
REGIONAL_ORDERS = ("genome", "shuffled")
DEPTHS = ("keep", "reference")  # the corrected counts' depth: each cell's library kept | brought to the reference's
SHRINKS = ("evidence", "none")  # the corrected counts' shifts: weighted by their evidence | applied in full
SPREADS = ("batch", "gene")  # the counterfactual output's residual scale: one per batch | per gene and batch, shrunk
NEIGHBOR_METHODS = ("auto", "exact", "approximate")  # how batchfix.eval.metrics finds the scores' neighbour graphs
# Hydra's own command-line flags: every other `--name` is an argparse habit (batchfix.config.help_text)
HYDRA_FLAGS = ("--cfg", "-c", "--multirun", "-m", "--help", "-h", "--hydra-help", "--version", "--resolve",
               "--package", "-p", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
               "-cd", "--run", "-r", "--shell-completion", "-sc", "--experimental-rerun")


def one_of(option: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{option} must be one of {list(choices)}, got {value!r}.")


def at_least(option: str, value, minimum, what: str = "") -> None:
    if not (value >= minimum and math.isfinite(value)):  # NaN and inf are refused too
        raise ConfigError(f"{option} must be >= {minimum}{what}, got {value!r}.")


def thread_count(value: int | None) -> None:
    """threads: null, or 1 .. 4 x this machine's cores (beyond, threads only wait on each other; 100,000 of them
    exhaust memory while torch starts them)."""
    if value is not None:
        at_least("threads", value, 1, " (or null: all cores)")
        within("threads", value, 1, 4 * (os.cpu_count() or 1))


def within(option: str, value, low, high, high_open: bool = False) -> None:
    if not (low <= value < high if high_open else low <= value <= high):  # False for NaN
        raise ConfigError(f"{option} must be in [{low}, {high}{')' if high_open else ']'}, got {value!r}.")


def non_empty(option: str, value) -> None:
    if value is not None and not str(value).strip():
        raise ConfigError(f"{option} must name something (got an empty string); use null to leave it unset.")
