"""What every verb's entry shares: a user's mistake or a signal ends as one line on stderr, no traceback.

A UserError (bad option, input, checkpoint or output) exits with status 1; a signal (SIGTERM, SIGINT)
with 128 + its number (143, 130). Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from batchfix import signals
from batchfix.errors import Interrupted, UserError


def one_line(text: str) -> str:
    """A message of several lines (Hydra's) as one."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def report(verb: str, message: str, status: int) -> None:
    """Print the one line (and write it to the log file Hydra set up for a run: not again on the console)
    and exit with `status`."""
    logger = logging.getLogger("batchfix")
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in {*logging.getLogger().handlers, *logger.handlers}:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(f"batchfix {verb}: error: {one_line(message)}", file=sys.stderr)
    sys.exit(status)


@contextmanager
def user_errors_reported(verb: str, on_error: Callable[[], None] | None = None) -> Iterator[None]:
    """Turn a UserError (exit 1) or Interrupted (exit 128 + signal) into one line; `on_error` runs first.

    Any other exception raised after a signal came is that signal, turned into another error by the C code it
    landed in (h5py's); SystemExit passes through Hydra's handler; any other exception is a bug and keeps its
    traceback."""
    try:
        yield
    except (Interrupted, Exception) as err:
        if not isinstance(err, UserError):
            err = signals.as_interrupt(err)
            if err is None:
                raise
        if on_error is not None:
            on_error()
        report(verb, str(err), err.exit_status if isinstance(err, Interrupted) else 1)


H5AD_OPTIONS = ("input", "data.path")  # the options naming an .h5ad file


def require_inputs(*named_paths: tuple[str, str | None]) -> None:
    """Refuse a named input file that does not exist, before seconds of imports (torch, scanpy) are spent on
    it; null (or 'bundled' for data) is the bundled dataset and always there."""
    from batchfix.errors import CheckpointError, InputError

    for option, path in named_paths:
        if path in (None, "", "bundled"):
            continue
        error = CheckpointError if option == "checkpoint" else InputError
        what = "Checkpoint" if option == "checkpoint" else "Input file"
        if not Path(path).expanduser().exists():
            raise error(f"{what} not found: {Path(path).expanduser()} ({option}=)")
        if Path(path).expanduser().is_dir():
            inside = sorted(entry.name for entry in Path(path).expanduser().iterdir() if entry.is_file())
            raise error(f"{what} {Path(path).expanduser()} is a folder ({option}= names a file); files in it: "
                        f"{inside[:10]}{' ...' if len(inside) > 10 else ''}.")
        if option in H5AD_OPTIONS:
            from batchfix.data.io import check_h5ad_path

            check_h5ad_path(path)  # an HDF5 signature: a text or empty file is named as such, before the imports


def require_keys(path: str | None, obs: dict[str, tuple[str, str | None]],
                 layers: dict[str, str | None]) -> None:
    """Refuse an option naming an obs column or a layer that the input lacks, reading only its header (h5py):
    before the imports and the read (batchfix.data.header)."""
    from batchfix.data.header import check_named_keys, input_path

    check_named_keys(input_path(path), obs, layers)


def require_data_keys(path: str | None, data) -> None:
    """require_keys for the `data.*` options of train and evaluate (batchfix.config.DataKeys)."""
    require_keys(path, {"data.batch_key": ("Batch", data.batch_key), "data.label_key": ("Label", data.label_key)},
                 {"data.counts_layer": data.counts_layer})


def require_normal_cells(path: str | None, correction) -> None:
    """Refuse correction.normal_key / normal_values that name no obs column, or values no cell has, before training
    (the correction at its end would refuse them): reads that one column of the input."""
    if correction.normal_key is None:
        return
    import anndata as ad
    import h5py
    import pandas as pd

    from batchfix.correction.writers import normal_cells
    from batchfix.data.header import header, input_path

    path = input_path(path)
    found = header(path)
    if found is None:
        return
    columns = found[0]
    values = None
    if correction.normal_key in columns:
        with h5py.File(path, "r") as file:
            values = pd.Series(ad.io.read_elem(file["obs"][correction.normal_key]))
    normal_cells(values, correction, columns)


def config_groups() -> set[str]:
    """The preset groups of conf/ (`data`, `model`, ...): `model=default` chooses a preset, not an option."""
    from importlib import resources

    return {entry.name for entry in resources.files("batchfix.conf").iterdir() if entry.is_dir()}


def check_overrides(args: list[str], verb: str) -> None:
    """Refuse a `key=value` (or `+key=value`) whose key is no option of the verb, before Hydra composes
    (whose hint for an unknown key is to add it with `+`), naming the closest option names."""
    from batchfix.config import SCHEMAS, dashed_option_error, dotted_options, unknown_option_error

    dashed = dashed_option_error(args, SCHEMAS[verb])
    if dashed is not None:
        raise dashed
    known, groups = set(dotted_options(SCHEMAS[verb])), config_groups()
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~").strip()
        if arg.startswith("-") or "=" not in arg or key.split(".")[0] in ("hydra", "") or "/" in key:
            continue
        if key not in known and key not in groups:
            raise unknown_option_error(key, SCHEMAS[verb])
        if key in groups and not arg.startswith("~") and arg.split("=", 1)[1].strip().lower() in ("null", "none", ""):
            raise group_without_entry(key, verb)


def group_without_entry(group: str, verb: str):
    """The error for `correction=null` (or `model=null`, ...): a group option names one of its entries."""
    from importlib import resources

    from batchfix.errors import ConfigError

    entries = sorted(entry.name.removesuffix(".yaml") for entry in resources.files("batchfix.conf").joinpath(group)
                     .iterdir() if entry.name.endswith(".yaml"))
    default = "the checkpoint's" if verb == "correct" and group == "correction" else "the default"
    return ConfigError(f"{group}= names one of conf/{group}/ ({', '.join(entries)}), not null: leave {group} out "
                       f"for {default}.")


def quoting_hint(args: list[str]) -> str:
    """A hint to quote the first value Hydra's override grammar cannot read unquoted (non-ASCII letters, spaces),
    as `key='value'`; '' when every value is plain."""
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and not arg.startswith("-") and not value.startswith(("'", '"')) and \
                (not value.isascii() or " " in value):
            return (f". Quote a value with other than ASCII letters: {key}='{value}' (in the shell: "
                    f"\"{key}='{value}'\")")
    return ""


def run(main: Callable[[], object], verb: str) -> None:
    """Run a verb's @hydra.main with signals raising Interrupted and Hydra's own errors as one line.

    Hydra prints a composition error (an override of the wrong type, an unknown key or group option)
    over several lines and exits; with HYDRA_FULL_ERROR it raises it instead, to be reported here.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from batchfix.config import readable
    from batchfix.console import quiet_third_parties
    from batchfix.data.memory import numpy_huge_pages_off
    from batchfix.signals import interrupts_raised

    if {"--help", "-h"} & set(sys.argv[1:]):
        from batchfix.__main__ import VERBS
        from batchfix.cli.help import verb_help

        print(verb_help(verb, VERBS[verb]))
        sys.exit(0)
    os.environ["HYDRA_FULL_ERROR"] = "1"
    quiet_third_parties()
    with interrupts_raised(), user_errors_reported(verb), numpy_huge_pages_off():
        check_overrides(sys.argv[1:], verb)
        try:
            main()
        except HydraException as err:
            cause = err.__cause__
            detail = f": {readable(cause)}" if isinstance(cause, OmegaConfBaseException) else ""
            message = str(err).split("Config search path")[0]  # Hydra's list of where it looked: noise here
            report(verb, f"{one_line(message)}{detail}{quoting_hint(sys.argv[1:])}", 1)
