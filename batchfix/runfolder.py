"""A training run folder: what it holds, never silently reused, and not left behind by a run that failed early.

- A folder that holds a run (any of RUN_OUTPUTS) is refused, unless `resume=` names that same folder
  (the run continues in place) or `overwrite=true` (its outputs and checkpoints are deleted first).
  The command line checks this before Hydra writes `.hydra/` into the folder
  (`batchfix.cli.folder_check.RunFolderCheck`).
- A run that stops on a user error or a signal before it saved anything leaves no folder behind:
  `remove_if_unused` deletes what Hydra and the logger wrote (RUN_FILES), then the folders left empty.
- A folder is held by one command at a time (`hold`): two commands started in the same second get the
  same time-stamped default folder; the second then takes `<folder>-2` (the next free one), while a
  folder named with hydra.run.dir that another command is using is refused.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: folders are not locked
    fcntl = None

from batchfix.data.atomic import missing_folders, remove_empty
from batchfix.errors import ConfigError, FolderInUseError, OutputError, OutputExistsError

log = logging.getLogger(__name__)

MODEL_CKPT = "model.ckpt"
CORRECTED_H5AD = "corrected.h5ad"
METRICS_JSON = "metrics.json"
METRICS_MD = "metrics.md"
UMAP_PNG = "umap.png"
CHECKPOINTS = "checkpoints"  # best.ckpt and last.ckpt
LAST_CKPT = "last"  # checkpoints/last.ckpt: what resume= continues
LOGS = "logs"  # logs/metrics.csv
RUN_OUTPUTS = (MODEL_CKPT, CORRECTED_H5AD, METRICS_JSON, METRICS_MD, UMAP_PNG, CHECKPOINTS, LOGS)
IN_USE = ".batchfix-in-use"  # locked by the command using the folder (its pid inside); removed when it ends
# The files a run writes before it has trained anything: Hydra's, the logger's, and the lock.
RUN_FILES = (IN_USE, ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log", "evaluate.log",
             f"{LOGS}/metrics.csv", f"{LOGS}/hparams.yaml")


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir).expanduser() / CHECKPOINTS / f"{LAST_CKPT}.ckpt"


def previous_outputs(run_dir: Path) -> list[str]:
    """The run outputs `run_dir` holds already."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def same_folder(a: str | Path, b: str | Path) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def check_reuse(run_dir: Path, overwrite: bool, resume: str | None, folder_option: str = "hydra.run.dir") -> list[str]:
    """The previous outputs `overwrite` will delete; raise when the folder holds a run and may not be reused
    (`folder_option`: the option that names another folder, hydra.sweep.dir for a sweep's job)."""
    found = previous_outputs(run_dir)
    resuming_here = resume is not None and same_folder(resume, run_dir)
    if resuming_here and overwrite:
        raise ConfigError(f"overwrite=true would delete the checkpoints resume={resume} continues from; "
                          "drop one of the two.")
    if not found or resuming_here:
        return []
    if not overwrite:
        raise OutputExistsError(
            f"Run folder {run_dir} already holds a run ({', '.join(found)}). Train into a new folder "
            f"({folder_option}=...), continue that run with resume={run_dir}, or replace it with overwrite=true."
        )
    return found


def check_evaluation_folder(out_dir: Path, overwrite: bool) -> None:
    """Refuse to evaluate into a folder that holds a run or an evaluation, unless `overwrite` (its metrics are then
    replaced)."""
    found = previous_outputs(Path(out_dir).expanduser())
    if found and not overwrite:
        raise OutputExistsError(
            f"Output folder {out_dir} already holds a run or an evaluation ({', '.join(found)}); evaluating into it "
            "would replace its metrics and its .hydra/ files. Evaluate into a new folder (hydra.run.dir=...), or "
            "replace them with overwrite=true.")


def claim(run_dir: Path, overwrite: bool, resume: str | None) -> None:
    """Make `run_dir` ready for a run (see `check_reuse`): with overwrite, delete the previous run's outputs."""
    found = check_reuse(run_dir, overwrite, resume)
    for name in found:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if found:
        log.warning("overwrite=true: deleted the previous run's %s from %s.", ", ".join(found), run_dir)


_held: dict[Path, int] = {}  # folder -> the open descriptor of its IN_USE file, locked by this process


def other_rank() -> bool:
    """Whether this process is a DDP rank other than the first (Lightning's, torchrun's and SLURM's variables):
    the first one holds the run folder for all of them."""
    return any(os.environ.get(name, "0") not in ("", "0") for name in ("LOCAL_RANK", "NODE_RANK", "RANK"))


def hold(folder: str | Path) -> bool:
    """Lock `folder` for this process until `release` or its exit; False if this process holds it already.

    FolderInUseError when another running command holds it. The lock is the kernel's (flock on folder/IN_USE),
    so it ends with the process however that ends: a killed run never leaves its folder locked. Not locked
    where the platform has no flock (Windows), nor in DDP ranks other than the first.
    """
    folder = Path(folder).expanduser().resolve()
    if folder in _held or fcntl is None or other_rank():
        return False
    path = folder / IN_USE
    while True:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            return not_locked(folder, err)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise FolderInUseError(
                f"Folder {folder} is in use by another batchfix command (process {holder}), still running. Give "
                "this one its own folder (hydra.run.dir=...).") from None
        except OSError as err:  # a file system without locks (some network mounts)
            os.close(descriptor)
            return not_locked(folder, err)
        try:
            if os.path.samestat(os.fstat(descriptor), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(descriptor)  # its holder removed the file as it ended: lock the one there now
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"{os.getpid()}\n".encode())
    if not _held:
        atexit.register(release_all)
    _held[folder] = descriptor
    return True


def not_locked(folder: Path, err: OSError) -> bool:
    log.warning("Cannot lock %s (%s): other commands are not kept out of it.", folder, err.strerror or err)
    return False


def release(folder: str | Path) -> None:
    """Unlock `folder` and remove its IN_USE file, if this process holds it."""
    folder = Path(folder).expanduser().resolve()
    descriptor = _held.pop(folder, None)
    if descriptor is None:
        return
    (folder / IN_USE).unlink(missing_ok=True)  # before the lock goes: a waiting command then locks a new file
    os.close(descriptor)


def release_all() -> None:
    for folder in list(_held):
        release(folder)


@contextmanager
def held(folder: str | Path) -> Iterator[None]:
    """`folder` held for the `with` (and kept held if this process held it before)."""
    taken = hold(folder)
    try:
        yield
    finally:
        if taken:
            release(folder)


def free_folder(folder: Path, named: bool, check: Callable[[Path], object]) -> Path:
    """`folder`, checked (`check` raises OutputExistsError for a folder this run may not use), made and held.

    When the user did not name it (`named` false: the time-stamped default) and it is in use or refused, the
    first `<folder>-N` that is neither.
    """
    candidate, number = folder, 1
    while True:
        try:
            check(candidate)
            make_run_folder(candidate)
            hold(candidate)
            return candidate
        except OutputExistsError:
            if named:
                raise
        number += 1
        candidate = folder.with_name(f"{folder.name}-{number}")


_made_for: dict[Path, list[Path]] = {}  # run folder -> the folders made for it (deepest first)


def make_run_folder(run_dir: str | Path) -> None:
    """Make the run folder, check it is writable, and remember which folders were made for it."""
    run_dir = Path(run_dir).expanduser().resolve()
    made = missing_folders(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        remove_empty(made)
        raise OutputError(f"Cannot write the run folder {run_dir}: {err.strerror or err}; set hydra.run.dir to a "
                          "writable folder.") from None
    _made_for[run_dir] = made


def remove_if_unused(run_dir: str | Path) -> None:
    """Delete a run folder that a failed run left without a checkpoint or output, and the parents made for it.

    Only the files runs write are deleted (RUN_FILES), and a folder only once it is empty: nothing else is touched.
    """
    run_dir = Path(run_dir).expanduser().resolve()
    release(run_dir)
    if not run_dir.is_dir() or any((run_dir / name).is_file() for name in (MODEL_CKPT, CORRECTED_H5AD, METRICS_JSON)):
        return
    if (run_dir / CHECKPOINTS).is_dir() and any((run_dir / CHECKPOINTS).iterdir()):
        return
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for folder in (run_dir / ".hydra", run_dir / LOGS, run_dir / CHECKPOINTS):
        try:
            folder.rmdir()
        except OSError:  # missing, or holds something else
            pass
    remove_empty(_made_for.get(run_dir, [run_dir]))  # not noted (a sweep job): the run folder alone
