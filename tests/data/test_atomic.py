"""Atomic whole-file writes (batchfix.data.atomic.atomic_output, as every whole-file output is written)."""
from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

from batchfix.data.atomic import atomic_output, refuse_existing
from batchfix.data.io import HDF5_SIGNATURE, read_h5ad
from batchfix.errors import InputError


def file_digest(path) -> str:
    """sha256 of a file's bytes (to check that inputs are left untouched)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def dense(matrix) -> np.ndarray:
    return matrix.toarray() if sp.issparse(matrix) else np.asarray(matrix)


def write_h5ad_atomic(adata: ad.AnnData, target: Path, overwrite: bool = False) -> Path:
    with atomic_output(target, overwrite) as tmp:
        adata.write_h5ad(tmp)
    return target


def test_write_atomic_roundtrip(small_adata, tmp_path):
    target = tmp_path / "out" / "corrected.h5ad"
    assert write_h5ad_atomic(small_adata, target) == target
    back = ad.read_h5ad(target)
    np.testing.assert_array_equal(dense(back.X), small_adata.X)
    assert list(back.obs_names) == list(small_adata.obs_names)
    assert sorted(p.name for p in target.parent.iterdir()) == ["corrected.h5ad"]


def test_write_atomic_refuses_existing_output(small_adata, tmp_path):
    target = tmp_path / "corrected.h5ad"
    target.write_bytes(b"precious results")
    with pytest.raises(FileExistsError) as err:
        write_h5ad_atomic(small_adata, target)
    assert str(target) in str(err.value) and "overwrite" in str(err.value)
    assert target.read_bytes() == b"precious results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrected.h5ad"]

    write_h5ad_atomic(small_adata, target, overwrite=True)
    assert ad.read_h5ad(target).shape == small_adata.shape
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrected.h5ad"]


def _failing_write(exc):
    """A stand-in for AnnData.write_h5ad that writes part of a file, then fails."""
    calls = []

    def write_h5ad(self, filename, *args, **kwargs):
        calls.append(str(filename))
        with open(filename, "wb") as fh:
            fh.write(HDF5_SIGNATURE + b"\0" * 4096)  # partial output
        raise exc

    return write_h5ad, calls


@pytest.mark.parametrize("exc", [OSError("No space left on device"), KeyboardInterrupt()])
def test_write_atomic_failure_leaves_no_temp_file(small_adata, tmp_path, monkeypatch, exc):
    fake, calls = _failing_write(exc)
    monkeypatch.setattr(ad.AnnData, "write_h5ad", fake)
    target = tmp_path / "corrected.h5ad"
    with pytest.raises(type(exc)):
        write_h5ad_atomic(small_adata, target)
    assert len(calls) == 1 and calls[0] != str(target)  # it wrote to a temporary name
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_failure_keeps_previous_output(small_adata, tmp_path, monkeypatch):
    target = tmp_path / "corrected.h5ad"
    write_h5ad_atomic(small_adata, target)
    before = file_digest(target)
    fake, _ = _failing_write(OSError("disk full"))
    monkeypatch.setattr(ad.AnnData, "write_h5ad", fake)
    with pytest.raises(OSError, match="disk full"):
        write_h5ad_atomic(small_adata, target, overwrite=True)
    assert file_digest(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrected.h5ad"]


def test_write_atomic_does_not_touch_input(small_h5ad, tmp_path):
    before = file_digest(small_h5ad)
    inp = read_h5ad(small_h5ad)
    write_h5ad_atomic(inp, tmp_path / "copy.h5ad")
    assert file_digest(small_h5ad) == before


def test_write_atomic_output_permissions_follow_umask(small_adata, tmp_path):
    """The output must be as readable as a plain write_h5ad (mkstemp makes 0600 files)."""
    old = os.umask(0o022)
    try:
        plain = tmp_path / "plain.h5ad"
        small_adata.write_h5ad(plain)
        atomic = write_h5ad_atomic(small_adata, tmp_path / "atomic.h5ad")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(atomic.stat().st_mode)
    assert mode == stat.S_IMODE(plain.stat().st_mode) == 0o644, oct(mode)


# What an output may replace: a regular file only ----------------------------------------------------------------------


def test_a_fifo_is_never_replaced(small_adata, tmp_path):
    fifo = tmp_path / "out.h5ad"
    os.mkfifo(fifo)
    for overwrite in (False, True):
        with pytest.raises(InputError, match=rf"^The output {re.escape(str(fifo))} is a named pipe \(FIFO\),"):
            write_h5ad_atomic(small_adata, fifo, overwrite=overwrite)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and list(tmp_path.iterdir()) == [fifo]


def test_a_character_device_is_never_replaced(small_adata, tmp_path):
    """/dev/null is only looked at (never written to); a node of the same device made in tmp_path is written to."""
    for overwrite in (False, True):
        with pytest.raises(InputError, match=r"^The output /dev/null is a character device,"):
            refuse_existing(Path("/dev/null"), overwrite)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
    except PermissionError:
        pytest.skip("making a device node needs root")
    with pytest.raises(InputError, match=rf"^The output {re.escape(str(node))} is a character device,"):
        write_h5ad_atomic(small_adata, node, overwrite=True)
    assert stat.S_ISCHR(os.lstat(node).st_mode) and list(tmp_path.iterdir()) == [node]


def test_a_symbolic_link_and_a_folder_are_never_replaced(small_adata, tmp_path):
    precious = tmp_path / "precious.h5ad"
    precious.write_bytes(b"precious results")
    link = tmp_path / "out.h5ad"
    link.symlink_to(precious)
    with pytest.raises(InputError, match=rf"is a symbolic link \(to {re.escape(str(precious))}\)"):
        write_h5ad_atomic(small_adata, link, overwrite=True)
    assert link.is_symlink() and precious.read_bytes() == b"precious results"
    folder = tmp_path / "folder.h5ad"
    folder.mkdir()
    with pytest.raises(InputError, match="is a folder,"):
        write_h5ad_atomic(small_adata, folder, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.h5ad", "out.h5ad", "precious.h5ad"]


def test_a_file_the_command_reads_is_never_replaced(small_h5ad, tmp_path):
    before = file_digest(small_h5ad)
    hard_link = tmp_path / "same.h5ad"
    os.link(small_h5ad, hard_link)
    for target in (small_h5ad, hard_link):
        with pytest.raises(InputError, match=rf"^The output {re.escape(str(target))} is the input file this command"):
            refuse_existing(target, overwrite=True, reads={"input": small_h5ad, "checkpoint": None})
    refuse_existing(tmp_path / "new.h5ad", overwrite=False, reads={"input": small_h5ad})
    assert file_digest(small_h5ad) == before


def test_train_refuses_before_it_reads_what_overwrite_would_replace(small_adata, tmp_path, monkeypatch):
    """A run's corrected.h5ad trained on again in that run folder (overwrite=true deletes and rewrites it), and a
    correction.key_added naming the training file's own layer, are refused before the data is read."""
    from batchfix import tasks
    from batchfix.config import TrainConfig, validated
    from batchfix.training import fitting

    def no_fit(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(fitting, "fit", no_fit)
    run = tmp_path / "run"
    run.mkdir()
    small_adata.layers["counts"] = small_adata.X.copy()
    small_adata.write_h5ad(run / "corrected.h5ad")
    before = file_digest(run / "corrected.h5ad")
    options = dict(data=dict(path=str(run / "corrected.h5ad"), batch_key="batch"), overwrite=True, threads=1)
    with pytest.raises(InputError, match=r"^The output \S+corrected.h5ad is the input file this command reads"):
        tasks.train(validated(options, TrainConfig), run)
    with pytest.raises(InputError, match=r"^correction.key_added=counts would replace the input's layers\['counts'\]"):
        tasks.train(validated({**options, "correction": dict(key_added="counts")}, TrainConfig), tmp_path / "other")
    assert file_digest(run / "corrected.h5ad") == before and sorted(tmp_path.iterdir()) == [run]
