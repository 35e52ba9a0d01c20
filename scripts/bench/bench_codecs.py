"""Benchmark the corrected layers' compression: seconds to write and read, and bytes on disk, with each codec HDF5
(h5py) and zarr offer, on the layers of a real `correct` output.

Each sparse layer's stored arrays (data and indices; indptr is small and stored as it is) are written to a fresh
file with each codec, in chunks of the size `correct` writes (batchfix.data.ondisk.CHUNK_BYTES), on one thread
(zarr's and Blosc's thread pools set to one), then read back and checked equal. Printed per layer and codec: write
and read seconds, MB on disk, the share of the uncompressed bytes, and whether every AnnData reader can open it:
gzip is part of every HDF5 library, while lzf is h5py's own filter and szip an optional one (readers built without
them, as R's and Julia's HDF5 libraries may be, cannot open such a file).

    python -m scripts.bench.bench_codecs OUTPUT.h5ad [--layers batchfix_counts batchfix] [--repeats 2] [--csv F]
"""
from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from batchfix.data.ondisk import CHUNK_BYTES, LAYER_COMPRESSION


@dataclass(frozen=True)
class Codec:
    """A codec: its name, the container ('hdf5' or 'zarr'), its keyword arguments (h5py's create_dataset) or
    compressor factory (zarr), and whether every HDF5 reader opens it."""

    name: str
    container: str
    options: dict | Callable | None
    portable: bool


def codecs() -> list[Codec]:
    """The codecs compared: HDF5's built-in ones and zarr's (Blosc's lz4 and zstd, zstd and gzip alone)."""
    from zarr import codecs as zc

    hdf5 = [("none", {}, True), ("gzip 1 + shuffle (batchfix)", LAYER_COMPRESSION, True),
            ("gzip 1", {"compression": "gzip", "compression_opts": 1}, True),
            ("gzip 4 + shuffle", {"compression": "gzip", "compression_opts": 4, "shuffle": True}, True),
            ("gzip 9 + shuffle", {"compression": "gzip", "compression_opts": 9, "shuffle": True}, True),
            ("lzf + shuffle", {"compression": "lzf", "shuffle": True}, False),
            ("lzf", {"compression": "lzf"}, False),
            ("szip + shuffle", {"compression": "szip", "compression_opts": ("nn", 16), "shuffle": True}, False)]
    zarr = [("zarr blosc lz4 + shuffle", lambda: zc.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")),
            ("zarr blosc zstd 3 + shuffle", lambda: zc.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")),
            ("zarr zstd 3", lambda: zc.ZstdCodec(level=3)), ("zarr gzip 1", lambda: zc.GzipCodec(level=1))]
    return ([Codec(name, "hdf5", options, portable) for name, options, portable in hdf5 if
             options.get("compression", "gzip") in h5py.filters.encode]
            + [Codec(name, "zarr", factory, False) for name, factory in zarr])


def layer_arrays(path: Path, layer: str) -> dict[str, np.ndarray]:
    """The stored arrays (data, indices) of a sparse layer of an .h5ad."""
    with h5py.File(path, "r") as f:
        if layer not in f.get("layers", {}):
            raise SystemExit(f"{path} has no layer {layer!r}; its layers: {sorted(f.get('layers', {}))}")
        group = f["layers"][layer]
        if not isinstance(group, h5py.Group):
            raise SystemExit(f"layer {layer!r} of {path} is dense; this benchmark reads sparse (CSR) layers")
        return {name: group[name][()] for name in ("data", "indices")}


def chunk_length(values: np.ndarray) -> int:
    return max(1, min(len(values), CHUNK_BYTES // values.itemsize))


def write_hdf5(path: Path, arrays: dict[str, np.ndarray], codec: Codec) -> None:
    with h5py.File(path, "w") as f:
        for name, values in arrays.items():
            f.create_dataset(name, data=values, chunks=(chunk_length(values),), **codec.options)


def read_hdf5(path: Path, names) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in names}


def write_zarr(path: Path, arrays: dict[str, np.ndarray], codec: Codec) -> None:
    import zarr

    group = zarr.open_group(path, mode="w")
    for name, values in arrays.items():
        group.create_array(name, data=values, chunks=(chunk_length(values),), compressors=[codec.options()])


def read_zarr(path: Path, names) -> dict[str, np.ndarray]:
    import zarr

    group = zarr.open_group(path, mode="r")
    return {name: group[name][:] for name in names}


def size_on_disk(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(arrays: dict[str, np.ndarray], codec: Codec, folder: Path, repeats: int) -> dict:
    """Median write and read seconds over `repeats`, and bytes on disk, of `arrays` with `codec`."""
    write, read = (write_hdf5, read_hdf5) if codec.container == "hdf5" else (write_zarr, read_zarr)
    writes, reads = [], []
    for _ in range(repeats):
        path = folder / ("layer.h5" if codec.container == "hdf5" else "layer.zarr")
        started = time.perf_counter()
        write(path, arrays, codec)
        writes.append(time.perf_counter() - started)
        started = time.perf_counter()
        back = read(path, arrays)
        reads.append(time.perf_counter() - started)
        if any(not np.array_equal(back[name], values) for name, values in arrays.items()):
            raise AssertionError(f"{codec.name}: the values read back differ from those written")
        size = size_on_disk(path)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return {"write_s": statistics.median(writes), "read_s": statistics.median(reads), "bytes": size}


def single_threaded() -> None:
    """zarr's and Blosc's thread pools to one thread, as h5py's filters run."""
    import numcodecs
    import zarr

    numcodecs.blosc.set_nthreads(1)
    zarr.config.set({"threading.max_workers": 1, "async.concurrency": 1})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="an .h5ad written by `batchfix correct`")
    parser.add_argument("--layers", nargs="+", default=["batchfix_counts", "batchfix"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--csv", type=Path, help="also write the figures here")
    args = parser.parse_args()
    single_threaded()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.output.parent) as folder:
        for layer in args.layers:
            arrays = layer_arrays(args.output, layer)
            raw = sum(values.nbytes for values in arrays.values())
            print(f"\nlayer {layer}: {len(arrays['data']):,} stored values, {raw / 2**20:,.1f} MB uncompressed")
            print(f"{'codec':<30} {'write s':>8} {'read s':>7} {'MB':>8} {'share':>6}  every reader")
            for codec in codecs():
                figures = measure(arrays, codec, Path(folder), args.repeats)
                rows.append({"layer": layer, "codec": codec.name, "container": codec.container,
                             "write_s": round(figures["write_s"], 3), "read_s": round(figures["read_s"], 3),
                             "mb": round(figures["bytes"] / 2**20, 2), "share": round(figures["bytes"] / raw, 4),
                             "every_reader": codec.portable})
                print(f"{codec.name:<30} {figures['write_s']:>8.2f} {figures['read_s']:>7.2f} "
                      f"{figures['bytes'] / 2**20:>8.1f} {figures['bytes'] / raw:>6.3f}  "
                      f"{'yes' if codec.portable else 'no'}", flush=True)
    if args.csv:
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
