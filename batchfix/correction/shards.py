"""Correction beyond one process: each part of the cells corrected into a shard file, then the shards merged.

A part (`inference.shard=i/N`, or rank i of N under torchrun) is a contiguous range of rows cut where a one-process
run starts a forward batch (a chunk's start plus a multiple of inference.batch_size), and it is read in the same
chunks, so its cells go through the network in the same batches and come out with the same bits; parts differ in
size by less than a forward batch. Each part reads the estimates of all cells: an independent job runs the estimate
pass itself (deterministic: the same bits in every job, and no job waits for another); under torchrun each rank
runs it over its own rows and the ranks' sums are gathered in a fixed order (batchfix.correction.reduction), so
every rank holds the estimates of one process reading every row, bit for bit, after reading only its part. A part
applies the output kind to its rows (batchfix.correction.outputs) and writes OUT.shard-i-of-N beside the output,
atomically (a rerun rewrites it): each layer's CSR rows, the latents, the tallies, the estimates' summary and a
fingerprint of the input, checkpoint and options.

The merge (`inference.shard=merge/N`, or rank 0 after a barrier) refuses a missing shard, or one written for
another input, checkpoint or options, naming it; writes the output as `correct_file` does (the input's content,
the shards' rows in order, the provenance with the summed tallies and `n_shards`), then removes the shards.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

from batchfix import signals
from batchfix.config import ResolvedCorrection
from batchfix.correction.count_output import ModelChecks
from batchfix.correction.estimates import Part, estimate
from batchfix.correction.outputs import ChunkOutput, OutputKind, Tallies, output_kind
from batchfix.correction.provenance import batch_names
from batchfix.correction.writers import (
    CsrAppender,
    bind_file,
    log_written,
    open_input,
    output_layers,
    write_correction,
    write_provenance,
)
from batchfix.data import ondisk
from batchfix.data.atomic import atomic_output
from batchfix.data.io import file_sha256
from batchfix.errors import InputError
from batchfix.training.trained import BatchfixModel

log = logging.getLogger(__name__)

SHARD_FORMAT = "batchfix-shard-1"
# A shard lives until the merge, which reads it at once: stored uncompressed (about 16 bytes a stored entry of the
# counts' two layers, twice lzf's size), 50,000 cells x 2,000 genes written in 2.9 s and read in 0.5 s where lzf took
# 5.3 and 3.6 s (docs/lab/scale.md, Correction over processes)
SHARD_COMPRESSION: dict = {}
RANK_WAIT = datetime.timedelta(days=1)  # the longest a rank waits at the barrier for the slowest one


@dataclass(frozen=True)
class FileJob:
    """One file's correction besides the model and the options: what `correct_file` takes."""

    source: Path
    target: Path
    counts_layer: str | None = None
    batch_key: str | None = None
    all_batches_new: bool = False
    overwrite: bool = False
    progress: bool = True


@dataclass(frozen=True)
class RecordedEstimates:
    """The estimates as the shards recorded them: their summary, all the provenance reads of them."""

    recorded: dict

    def summary(self, batch_names: list[str]) -> dict:
        return self.recorded


def shard_path(target: Path, index: int, count: int) -> Path:
    return target.with_name(f"{target.name}.shard-{index}-of-{count}")


def part_rows(n_obs: int, settings: ResolvedCorrection, index: int, count: int) -> tuple[int, int]:
    """Rows [start, stop) of part `index` of `count`: nearly equal numbers of cells, cut where a one-process run
    starts a forward batch."""
    in_chunk = np.arange(0, min(settings.chunk_size, max(n_obs, 1)), settings.batch_size)
    starts = (np.arange(0, n_obs, settings.chunk_size)[:, None] + in_chunk[None, :]).ravel()  # (chunks * batches,)
    starts = np.append(starts[starts < n_obs], n_obs)
    cuts = starts[np.searchsorted(starts, np.arange(count + 1) * n_obs // count)]
    return int(cuts[index]), int(cuts[index + 1])


def part_chunks(output: OutputKind, rows, start: int, stop: int,
                progress: bool) -> Iterator[tuple[int, int, ChunkOutput]]:
    """(start, stop, outputs) of the part's rows, cut into chunks where a one-process run cuts them."""
    started = time.perf_counter()
    with tqdm(total=stop - start, unit="cell", unit_scale=True, desc="batchfix correct", disable=not progress,
              mininterval=1.0, smoothing=0.1) as bar:
        for first, last in output.bound.chunks(start, stop):
            signals.raise_pending()
            with output.bound.clock.stage("read"):
                chunk = rows.rows(first, last)
            yield first, last, output.apply(chunk, first)
            bar.update(last - first)
    seconds = time.perf_counter() - started
    log.info("Corrected cells %d-%d in %.1f s (%.0f cells/s).", start, stop, seconds,
             (stop - start) / max(seconds, 1e-9))


def fingerprint(job: FileJob, trained: BatchfixModel, settings: ResolvedCorrection, n_obs: int) -> str:
    """What a shard was corrected from (the input, the checkpoint, the options): the merge takes only its own."""
    source = Path(job.source)
    stat = source.stat()
    return json.dumps({"input": source.name, "input_bytes": stat.st_size, "input_mtime_ns": stat.st_mtime_ns,
                       "n_obs": n_obs, "checkpoint_sha256": file_sha256(trained.path) if trained.path else "",
                       "settings": dataclasses.asdict(settings), "counts_layer": job.counts_layer,
                       "batch_key": job.batch_key, "all_batches_new": job.all_batches_new}, sort_keys=True)


def correct_shard(job: FileJob, trained: BatchfixModel, settings: ResolvedCorrection, index: int, count: int,
                  estimated: Callable = estimate) -> Path:
    """Correct part `index` of `count` of the input into its shard file beside the output (rewritten if there), with
    the (estimates, latents) of `estimated(bound, rows, n_obs)`: the estimate pass over all cells."""
    settings = dataclasses.replace(settings, shard=None)
    path = shard_path(Path(job.target), index, count)
    source, path = open_input(job.source, path, overwrite=True)
    with ondisk.open_anndata(source) as src:
        bound, rows, n_obs = bind_file(src, source, trained, settings, job.counts_layer, job.batch_key,
                                       job.all_batches_new)
        output = output_kind(bound, *estimated(bound, rows, n_obs))
        start, stop = part_rows(n_obs, settings, index, count)
        header = {"format": SHARD_FORMAT, "index": index, "count": count, "start": start, "stop": stop,
                  "fingerprint": fingerprint(job, trained, settings, n_obs),
                  "estimates": json.dumps(output.estimates.summary(batch_names(bound)))}
        with atomic_output(path, overwrite=True) as tmp, h5py.File(tmp, "w") as dst:
            write_shard(dst, output, rows, start, stop, job.progress)
            dst.attrs.update(header)
    log.info("Wrote %s (cells %d-%d of %d).", path, start, stop, n_obs)
    bound.clock.log(f"cells {start}-{stop} of {n_obs}, shard {index + 1} of {count}")
    return path


def write_shard(dst: h5py.File, output: OutputKind, rows, start: int, stop: int, progress: bool) -> None:
    """The part's layers (CSR rows), latents and tallies into the open shard file."""
    bound = output.bound
    layers = {kind: CsrAppender(dst, kind, (stop - start, bound.n_vars), SHARD_COMPRESSION)
              for kind in output_layers(bound)}
    latent = dst.create_dataset("latent", (stop - start, bound.latent_dim), dtype=np.float32)
    tallies = Tallies()
    for first, last, chunk in part_chunks(output, rows, start, stop, progress):
        tallies += chunk.tallies
        with bound.clock.stage("write"):
            latent[first - start:last - start] = chunk.latent
            for kind, matrix_rows in chunk.layers.items():
                layers[kind].append(matrix_rows)
    dst.attrs.update(tallies.counts())
    if tallies.checks is not None:
        checks = dst.create_group("model_checks")
        for field in dataclasses.fields(tallies.checks):
            checks.create_dataset(field.name, data=getattr(tallies.checks, field.name))


def merge_shards(job: FileJob, trained: BatchfixModel, settings: ResolvedCorrection, count: int,
                 workers: int | None = None) -> Path:
    """Write the output from the `count` shard files beside it (refusing a missing or foreign one, naming it), as
    `correct_file` would have written it (its layers compressed on `workers` threads; default torch's thread
    count), then remove them."""
    settings = dataclasses.replace(settings, shard=None)
    source, target = open_input(job.source, job.target, job.overwrite)
    paths = [shard_path(target, index, count) for index in range(count)]
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise InputError(f"Cannot merge {count} shards into {target.name}: {', '.join(missing)} missing; write "
                         f"each with inference.shard=i/{count} first.")
    with ondisk.open_anndata(source) as src:
        bound, _, n_obs = bind_file(src, source, trained, settings, job.counts_layer, job.batch_key,
                                    job.all_batches_new)
        recorded = checked_shards(paths, fingerprint(job, trained, settings, n_obs), n_obs, settings)
        with atomic_output(target, job.overwrite) as tmp, h5py.File(tmp, "w") as dst:
            tallies = write_correction(src, dst, bound, n_obs, shard_chunks(paths, bound), workers)
            write_provenance(dst, bound, RecordedEstimates(recorded), tallies, n_obs, n_shards=count)
    for path in paths:
        path.unlink(missing_ok=True)
    log_written(target, bound, n_obs)
    bound.clock.log(f"the merge of {count} shards: read = reading them")
    return target


def checked_shards(paths: list[Path], expected: str, n_obs: int, settings: ResolvedCorrection) -> dict:
    """The estimates' summary the shards recorded; a shard of another input, checkpoint, options or split, or
    whose estimates differ from the first shard's, is refused by name."""
    foreign, summaries = [], []
    for index, path in enumerate(paths):
        try:
            with h5py.File(path, "r") as shard:
                attrs = dict(shard.attrs)
        except OSError:  # not an HDF5 file
            attrs = {}
        rows = (attrs.get("start"), attrs.get("stop"))
        if attrs.get("format") != SHARD_FORMAT or attrs.get("fingerprint") != expected \
                or rows != part_rows(n_obs, settings, index, len(paths)):
            foreign.append(path.name)
        summaries.append(attrs.get("estimates"))
    foreign += [path.name for path, summary in zip(paths, summaries) if summary != summaries[0]
                and path.name not in foreign]
    if foreign:
        raise InputError(f"Cannot merge: {', '.join(foreign)} {'was' if len(foreign) == 1 else 'were'} written from "
                         "another input, checkpoint or options (or estimated other numbers); write "
                         f"{'it' if len(foreign) == 1 else 'them'} again with these.")
    return json.loads(summaries[0])


def shard_chunks(paths: list[Path], bound) -> Iterator[tuple[int, int, ChunkOutput]]:
    """(start, stop, outputs) of every shard's rows in order, chunk_size rows at a time; a shard's tallies come
    with its first chunk."""
    block = bound.settings.chunk_size
    for path in paths:
        with h5py.File(path, "r") as shard:
            start, stop = int(shard.attrs["start"]), int(shard.attrs["stop"])
            tallies = shard_tallies(shard)
            for first in range(start, stop, block):
                signals.raise_pending()
                last = min(first + block, stop)
                rows = slice(first - start, last - start)
                with bound.clock.stage("read"):
                    layers = {kind: csr_rows(shard[kind], rows, bound.n_vars) for kind in output_layers(bound)}
                    latent = shard["latent"][rows]
                yield first, last, ChunkOutput(latent, layers, tallies if first == start else Tallies())


def shard_tallies(shard: h5py.File) -> Tallies:
    """The tallies a shard file recorded (its counts' model checks too)."""
    checks = None if "model_checks" not in shard else ModelChecks(
        **{field.name: shard["model_checks"][field.name][()] for field in dataclasses.fields(ModelChecks)})
    return Tallies(**{name: int(shard.attrs[name]) for name in Tallies.COUNTS}, checks=checks)


def csr_rows(csr: h5py.Group, rows: slice, n_vars: int) -> sp.csr_matrix:
    """Rows of a CSR matrix stored in a shard file."""
    indptr = csr["indptr"][rows.start:rows.stop + 1].astype(np.int64)
    stored = slice(int(indptr[0]), int(indptr[-1]))
    return sp.csr_matrix((csr["data"][stored], csr["indices"][stored], indptr - indptr[0]),
                         shape=(rows.stop - rows.start, n_vars))


def correct_distributed(job: FileJob, trained: BatchfixModel, settings: ResolvedCorrection) -> Path:
    """Under torchrun: every rank runs the estimate pass over its part's rows (the sums gathered from all ranks), and
    corrects its part into a shard file; after a barrier rank 0 merges them. Returns the output (rank 0) or the
    rank's shard file."""
    import torch.distributed as dist

    # gloo on every machine: the ranks exchange Python objects and a barrier, never a tensor on a GPU
    dist.init_process_group("gloo", timeout=RANK_WAIT)
    try:
        rank, count = dist.get_rank(), dist.get_world_size()
        written = correct_shard(dataclasses.replace(job, progress=job.progress and rank == 0), trained, settings,
                                rank, count, estimated=estimate_on_ranks)
        dist.barrier()
        # the other ranks are done: the merge compresses on the threads of them all
        return merge_shards(job, trained, settings, count, count * torch.get_num_threads()) if rank == 0 \
            else written
    finally:
        dist.destroy_process_group()


def estimate_on_ranks(bound, rows, n_obs: int) -> tuple:
    """`estimate` with this rank reading only its part's rows; the sums' blocks of every rank are gathered, so each
    rank holds the estimates of all cells (the latents of its own rows)."""
    import torch.distributed as dist

    start, stop = part_rows(n_obs, bound.settings, dist.get_rank(), dist.get_world_size())
    return estimate(bound, rows, n_obs, Part(start, stop, gather_blocks))


def gather_blocks(blocks: list) -> list[list]:
    """Every rank's blocks of sums (batchfix.correction.reduction), in rank order."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, blocks)
    return everyone
