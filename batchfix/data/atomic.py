"""Atomic whole-file writes: a temporary file in the destination folder, then a rename (or a hard link, which
never replaces a file), so a crash never leaves a partial output; what killed writers left is cleaned up."""
from __future__ import annotations

import errno
import glob
import logging
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from batchfix import signals
from batchfix.errors import InputError, OutputError, OutputExistsError, UserError

log = logging.getLogger(__name__)

CORRECTED_SUFFIX = ".corrected.h5ad"  # `correct`'s output beside nothing: <input name>.corrected.h5ad


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(target: Path) -> None:
    """Delete the temporary files that killed writers of `target` left beside it.

    A temporary file is named `.<target name>.batchfix-<host>-<pid>-<random>.tmp`: it is deleted only when
    written on this host by a process that no longer runs. Others (a writer still running, another host,
    an unknown owner) are left in place and named in a warning.
    """
    ours = re.compile(rf"\.{re.escape(target.name)}\.batchfix-(?P<host>\w*)-(?P<pid>\d+)-\w+\.tmp")
    for path in sorted(target.parent.glob(f".{glob.escape(target.name)}.*.tmp")):
        match = ours.fullmatch(path.name)
        if match and match["host"] == _host() and not _alive(int(match["pid"])):
            path.unlink(missing_ok=True)
            log.warning("Removed %s, a temporary file left by a writer that was stopped (process %s).",
                        path, match["pid"])
        else:
            owner = f"process {match['pid']} on {match['host']}" if match else "an unknown writer"
            log.warning("Left %s in place: a temporary file of %s, which may still be writing it; delete it "
                        "if it is not.", path, owner)


def cannot_write(target: Path, err: OSError) -> OutputError:
    return OutputError(f"Cannot write the output {target}: {err.strerror or err} "
                       f"({type(err).__name__}); choose a writable folder with free space.")


WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                errno.ENOTDIR, errno.EEXIST, errno.EISDIR}


def _temporary(target: Path) -> Path:
    """A new empty temporary file beside `target` (its folder made if needed), named after this host and process."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.batchfix-{_host()}-{os.getpid()}-", suffix=".tmp",
                                    dir=target.parent)
    except OSError as err:
        raise cannot_write(target, err) from None
    os.close(fd)
    return Path(name)


@contextmanager
def atomic_output(target: Path, overwrite: bool, finish_on_signal: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success move it to `target`, on any failure delete it.

    Without `overwrite` the final step is a hard link, which fails if `target` appeared meanwhile, so an
    existing file is never replaced; with it, an atomic rename replaces the old file in one step. Temporary
    files left by killed writers of the same target are removed first; a write that fails for lack of
    space or permission raises OutputError. A signal pending after the write abandons the output, unless
    `finish_on_signal` (a checkpoint saved because a stop was asked for). What is not a regular file is never
    replaced (`refuse_existing`).
    """
    refuse_existing(target, overwrite)
    made = missing_folders(target.parent)
    tmp = None
    try:
        if finish_on_signal:
            tmp = _temporary(target)
        else:
            with signals.deferred():  # a signal while the file is made is raised once `tmp` names it
                tmp = _temporary(target)
        yield tmp
        if not finish_on_signal:
            signals.raise_pending()  # a signal whose exception was lost on the way: never finish this output
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())  # the data is on disk before the name points at it
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600 files; match a plain write
        _move_into_place(tmp, target, overwrite)
    except BaseException as err:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        remove_empty(made)
        if not isinstance(err, OSError) or isinstance(err, UserError) or err.errno not in WRITE_ERRNOS:
            raise
        raise cannot_write(target, err) from err


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first."""
    missing = []
    folder = folder.expanduser().resolve()
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders (deepest first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _move_into_place(tmp: Path, target: Path, overwrite: bool) -> None:
    if overwrite:
        refuse_unreplaceable(target)  # again: the path may have changed while the output was written
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise output_exists(target) from None
    except OSError:  # a file system without hard links
        if target.exists():
            raise output_exists(target) from None
        os.replace(tmp, target)
    tmp.unlink(missing_ok=True)


def default_output(source: str | Path, output: str | None, suffix: str) -> Path:
    """An output path: `output`, else <source's name><suffix> in the working folder."""
    return Path(output).expanduser() if output else Path.cwd() / (Path(source).stem + suffix)


def refuse_existing(target: Path, overwrite: bool, reads: Mapping[str, str | Path | None] | None = None) -> None:
    """Refuse an output path that holds what may not be replaced (`refuse_unreplaceable`), or, unless overwrite,
    any file (OutputExistsError)."""
    refuse_unreplaceable(target, reads)
    if target.exists() and not overwrite:
        raise output_exists(target)


def refuse_unreplaceable(target: Path, reads: Mapping[str, str | Path | None] | None = None) -> None:
    """Refuse (InputError, one line naming the path and what it is) an output path that holds anything but a regular
    file: a folder, a device, a FIFO, a socket, a symbolic link (whose target the user did not name), or that is one
    of the files the command reads (`reads`: {what it is, e.g. 'input' or 'checkpoint': its path})."""
    try:
        mode = os.lstat(target).st_mode
    except OSError:  # nothing there (or no way to look): the write itself reports what is wrong
        return
    if not stat.S_ISREG(mode):
        raise InputError(f"The output {target} is {file_kind(target, mode)}, which batchfix never replaces; name a "
                         "new file or a regular one.")
    for what, path in (reads or {}).items():
        if path is not None and _same_file(target, path):
            raise InputError(f"The output {target} is the {what} file this command reads; write the output "
                             "elsewhere.")


def file_kind(path: Path, mode: int) -> str:
    """What a path that is no regular file is, in words."""
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)})"
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISSOCK: "a socket"}
    return next((kind for test, kind in kinds.items() if test(mode)), "not a regular file")


def _same_file(a: Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, Path(b).expanduser())
    except OSError:
        return False


def output_exists(target: Path) -> OutputExistsError:
    return OutputExistsError(f"Output {target} exists; pass overwrite=true to replace it.")
