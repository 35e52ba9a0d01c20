"""Benchmark `batchfix correct` on large synthetic files: throughput (cells/s) and peak memory.

For each --cells N, an .h5ad of N cells x the model's genes (2,000 by default; with --all-genes every gene of
the bundled data, 11,533: the modelled genes and those the extra genes' decoder corrects) is generated chunk
by chunk (scripts/resampled.py): its cells are resampled (with replacement) from the bundled CellBench
data and their counts Poisson-resampled, stored as CSR in X, obs batch and cell_type from the sampled cells. The generator holds one chunk
at a time, so even the 1,000,000-cell file needs little memory.

The correction then runs in a child process exactly as the CLI does (`correct_file`, streaming),
while this process samples the child's resident set size (psutil); the child also reports the
kernel's high-water mark (ru_maxrss). Printed per file: cells/s of the correction loop (steady
state, from per-chunk progress), wall time including start-up and the copy of the input's other
groups, peak RSS, and for comparison the size of the dense float32 matrix.

With --max-seconds, a run still going after that many seconds of correction is interrupted
(SIGINT: the temporary output is removed, as a Ctrl-C would) and its total time extrapolated from
the measured rate; the peak RSS is then the peak over the part that ran (after the copy of the
input's other groups, memory is flat: every chunk needs the same).

    python -m scripts.bench.bench_correct --cells 100000 1000000 --max-seconds 300 --threads 1
    python -m scripts.bench.bench_correct --cells 100000 --checkpoint RUN/model.ckpt --workdir bench_work
    python -m scripts.bench.bench_correct --cells 20000 --regional-shift apply keep   # the regional option's cost
    python -m scripts.bench.bench_correct --cells 1000 100000 --all-genes --max-seconds 300

With --processes N ..., the whole `python -m batchfix correct` verb is timed instead (start to exit: imports, the
estimate pass, the correction, the merge) with each number of processes (torchrun above 1; --threads each), and its
cells/s compared with one process's; after each run the I/O floor is measured on the same files (anndata reading the
input and writing its content with the corrected layers and latent, the layers gzip 1 after a byte shuffle, as
`correct` writes them), and each median run is given as a multiple of the floor's median. Under each run, the
seconds and cells/s of each stage the verb logged (batchfix.correction.stages: the estimate pass, reading, decoding,
the map, the model checks, the layers, writing; per shard and for the merge under torchrun):

    python -m scripts.bench.bench_correct --cells 40000 --processes 1 2 1 2 1 2 --threads 1 --keep
    python -m scripts.bench.bench_correct --cells 20000 --all-genes --processes 1 2 1 2 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import h5py

from batchfix.config import REGIONAL_SHIFTS, ResolvedCorrection
from scripts.resampled import bundled_cells, generate

STAGE_LINE = re.compile(r"Stage seconds: (.*) \((.*)\)\.$")  # batchfix.correction.stages' line, and what it timed


def train_checkpoint(workdir: Path, threads: int) -> Path:
    """A quickly trained model on the bundled data (default options: 2,000 genes)."""
    run_dir = workdir / "model"
    checkpoint = run_dir / "model.ckpt"
    if checkpoint.is_file():
        return checkpoint
    print(f"Training a model for the benchmark (1 epoch) into {run_dir} ...", flush=True)
    subprocess.run([sys.executable, "-m", "batchfix", "train", "trainer.max_epochs=1", "evaluate=false",
                    f"threads={threads}", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"],
                   check=True, cwd=workdir, stdout=subprocess.DEVNULL)
    return checkpoint


def child(args) -> None:
    """Run the correction as the CLI does, printing progress lines for the parent."""
    import torch

    from batchfix.correction import writers
    from batchfix.training.trained import load_trained

    torch.set_num_threads(args.threads)
    print(f"IMPORTS {time.time() - args.launched:.3f}", flush=True)
    started = time.perf_counter()
    real_chunks = writers.corrected_chunks

    def reporting_chunks(*a, **k):
        print(f"LOOP {time.perf_counter() - started:.3f}", flush=True)
        for item in real_chunks(*a, **k):
            yield item
            print(f"PROGRESS {item[1]} {time.perf_counter() - started:.3f}", flush=True)

    writers.corrected_chunks = reporting_chunks
    try:
        settings = ResolvedCorrection(chunk_size=args.chunk_size, batch_size=args.batch_size,
                                      regional_shift=args.regional_shift[0])
        writers.correct_file(args.child[0], args.child[1], load_trained(args.child[2]), settings, overwrite=True,
                                progress=False)
        print(f"DONE {time.perf_counter() - started:.3f}", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    finally:
        print(f"MAXRSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", flush=True)


def measure(input_path: Path, output_path: Path, checkpoint: Path, args) -> dict:
    """Correct in a child process; sample its RSS; interrupt it after --max-seconds of correction."""
    import psutil

    command = [sys.executable, "-m", "scripts.bench.bench_correct", "--child", str(input_path), str(output_path),
               str(checkpoint), "--threads", str(args.threads), "--chunk-size", str(args.chunk_size),
               "--batch-size", str(args.batch_size), "--regional-shift", args.regional_shift[0],
               "--launched", repr(time.time())]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    launched = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    records: dict = {"progress": []}

    def read() -> None:
        for line in proc.stdout:
            word, *rest = line.split()
            if word == "PROGRESS":
                records["progress"].append((int(rest[0]), float(rest[1])))
            elif word in ("LOOP", "DONE", "MAXRSS"):
                records[word] = float(rest[0])
                if word == "LOOP":
                    records["loop_seen_at"] = time.perf_counter()
            elif word == "IMPORTS":
                records["imports"] = float(rest[0])
            elif word == "INTERRUPTED":
                records["interrupted"] = True

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    watched = psutil.Process(proc.pid)
    peak, interrupted_at = 0, None
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        loop_seen_at = records.get("loop_seen_at")
        if (args.max_seconds and interrupted_at is None and loop_seen_at is not None
                and time.perf_counter() - loop_seen_at > args.max_seconds):
            interrupted_at = time.perf_counter()
            proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    reader.join(timeout=10)
    if proc.returncode not in (0, None) and not records.get("interrupted"):
        raise SystemExit(f"The correction failed (exit status {proc.returncode}).")
    records["sampled_peak_rss"] = peak
    records["wall"] = time.perf_counter() - launched
    records["leftover_temp_files"] = sorted(p.name for p in output_path.parent.glob(f".{output_path.name}.*.tmp"))
    return records


def report(n_cells: int, n_genes: int, input_path: Path, output_path: Path, records: dict, shift: str) -> dict:
    progress = records["progress"]
    done = progress[-1][0] if progress else 0
    first_cells, first_time = progress[0] if progress else (0, 0.0)
    last_cells, last_time = progress[-1] if progress else (0, 0.0)
    # Steady state: from the end of the first chunk (start-up costs of the first forward pass excluded).
    steady = (last_cells - first_cells) / (last_time - first_time) if len(progress) > 1 else float("nan")
    loop_started = records.get("LOOP", float("nan"))
    overall = done / (last_time - loop_started) if progress else float("nan")
    finished = "DONE" in records
    total = records["DONE"] if finished else first_time + (n_cells - first_cells) / steady
    peak = max(records.get("MAXRSS", 0), records["sampled_peak_rss"])
    row = {
        "cells": n_cells,
        "genes": n_genes,
        "cells_corrected": done,
        "finished": finished,
        "cells_per_s_steady": round(steady, 1),
        "cells_per_s_loop": round(overall, 1),
        "startup_and_copy_s": round(loop_started, 1),
        "imports_s": round(records.get("imports", float("nan")), 1),
        "total_s": round(total, 1),
        "total_is_extrapolated": not finished,
        "peak_rss_mb": round(peak / 2**20),
        "sampled_peak_rss_mb": round(records["sampled_peak_rss"] / 2**20),
        "dense_float32_mb": round(n_cells * n_genes * 4 / 2**20),
        "input_file_mb": round(input_path.stat().st_size / 2**20),
        "output_file_mb": round(output_path.stat().st_size / 2**20) if output_path.exists() else None,
        "leftover_temp_files": records["leftover_temp_files"],
    }
    print(f"\n{n_cells:,} cells x {n_genes:,} genes, regional_shift={shift}: "
          f"{'finished' if finished else f'interrupted after {done:,} cells'}\n"
          f"  throughput        {steady:,.0f} cells/s steady state ({overall:,.0f} cells/s over the correction loop)\n"
          f"  wall time         {row['total_s']:,.0f} s{' (extrapolated)' if not finished else ''}, "
          f"of which {loop_started:.1f} s before the loop (loading the model, copying the input's other groups; "
          f"for regional_shift keep|keep_input, the pass that encodes every cell and estimates the batch means) "
          f"(+ {row['imports_s']:.0f} s of Python imports before)\n"
          f"  peak RSS          {row['peak_rss_mb']:,} MB (kernel high-water mark; sampled: "
          f"{row['sampled_peak_rss_mb']:,} MB)\n"
          f"  dense matrix      {row['dense_float32_mb']:,} MB (float32, cells x genes)\n"
          f"  input file        {row['input_file_mb']:,} MB; output file "
          f"{row['output_file_mb'] if row['output_file_mb'] is not None else '-'} MB"
          f"{'' if finished else ' (interrupted: temporary output removed)'}\n"
          f"  leftover temp     {row['leftover_temp_files'] or 'none'}", flush=True)
    return row


def stage_seconds(log_text: str) -> list[dict]:
    """The `Stage seconds: ...` lines the verb logged (batchfix.correction.stages), one dict of seconds by stage each
    (and 'what': one process, a shard, the merge)."""
    found = []
    for line in log_text.splitlines():
        match = STAGE_LINE.search(line)
        if match:
            seconds = {name: float(value) for name, value in re.findall(r"(\w+)=([\d.]+)", match.group(1))}
            found.append({"what": match.group(2), **seconds})
    return found


def verb_seconds(input_path: Path, output_path: Path, checkpoint: Path, processes: int,
                 args) -> tuple[float, float, list[dict]]:
    """(wall, CPU) seconds of `python -m batchfix correct` on the file with `processes` processes (torchrun above 1),
    and the stage seconds it logged; the CPU time is every process's, user and system."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    command = [sys.executable, *launcher, "-m", "batchfix", "correct", f"input={input_path}", f"output={output_path}",
               f"checkpoint={checkpoint}", f"threads={args.threads}", "progress=false", "overwrite=true",
               f"inference.chunk_size={args.chunk_size}", f"inference.batch_size={args.batch_size}"]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    run = subprocess.run(command, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    wall = time.perf_counter() - started
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime, stage_seconds(run.stdout)


def print_stages(stages: list[dict], n_cells: int) -> None:
    """One line per logged stage line: seconds and cells/s of each stage (the cells that process corrected)."""
    for line in stages:
        rows = re.search(r"cells (\d+)-(\d+)", line["what"])
        cells = int(rows.group(2)) - int(rows.group(1)) if rows else n_cells
        parts = ", ".join(f"{name} {seconds:,.1f} s" + (f" ({cells / seconds:,.0f} cells/s)" if seconds >= 0.05 else "")
                          for name, seconds in line.items() if name not in ("what", "total"))
        print(f"    {line['what']}: {parts}; {line['total']:,.1f} s from binding the model", flush=True)


def io_floor_seconds(input_path: Path, output_path: Path, floor_path: Path) -> float:
    """Seconds to read the input with anndata and write what `correct` writes (the input's content, its corrected
    layers and latent) with anndata, the layers with the same compression (gzip 1 after a byte shuffle): the I/O
    no correction avoids. The corrected layers are read before the clock starts."""
    import anndata as ad

    from batchfix.data.ondisk import LAYER_COMPRESSION

    corrected = ad.read_h5ad(output_path)
    added = {key: corrected.layers[key] for key in corrected.layers if key.startswith("batchfix")}
    latent = {key: corrected.obsm[key] for key in corrected.obsm if key.startswith("X_batchfix")}
    del corrected
    started = time.perf_counter()
    adata = ad.read_h5ad(input_path)
    with h5py.File(floor_path, "w") as dst:
        for key in ("X", "obs", "var"):
            ad.io.write_elem(dst, key, getattr(adata, key), dataset_kwargs=LAYER_COMPRESSION if key == "X" else {})
        ad.io.write_elem(dst, "layers", added, dataset_kwargs=LAYER_COMPRESSION)
        ad.io.write_elem(dst, "obsm", latent)
    seconds = time.perf_counter() - started
    floor_path.unlink()
    return seconds


def process_rows(n_cells: int, input_path: Path, output_path: Path, checkpoint: Path, args) -> list[dict]:
    """The verb's cells/s with each of --processes (in turn, so a repeated list interleaves them), the I/O floor
    measured after each run, and the ratio of each number of processes' median wall time to the first's and to the
    floor's median."""
    rows = []
    for processes in args.processes:
        output_path.unlink(missing_ok=True)
        load = os.getloadavg()[0]
        wall, cpu, stages = verb_seconds(input_path, output_path, checkpoint, processes, args)
        floor = io_floor_seconds(input_path, output_path, output_path.with_name("io_floor.h5ad"))
        rows.append({"cells": n_cells, "processes": processes, "threads_each": args.threads, "seconds": round(wall, 1),
                     "cpu_seconds": round(cpu, 1), "cells_per_s": round(n_cells / wall, 1),
                     "io_floor_seconds": round(floor, 2), "load_average_before": round(load, 1), "stages": stages})
        print(f"{n_cells:,} cells, {processes} process(es) x {args.threads} thread(s): {wall:,.1f} s "
              f"({cpu:,.1f} s of CPU), {n_cells / wall:,.0f} cells/s; I/O floor {floor:,.1f} s "
              f"(load average before: {load:.1f})", flush=True)
        print_stages(stages, n_cells)
    median = {n: statistics.median(r["seconds"] for r in rows if r["processes"] == n) for n in args.processes}
    floor = statistics.median(r["io_floor_seconds"] for r in rows)
    first = args.processes[0]
    for n, seconds in median.items():
        print(f"median of {n} process(es): {seconds:,.1f} s, {n_cells / seconds:,.0f} cells/s, "
              f"x{median[first] / seconds:.2f} against {first}, {seconds / floor:.1f}x the I/O floor "
              f"({floor:,.1f} s, median)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--checkpoint", type=Path, help="a model trained on the bundled data (default: train one)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "batchfix_bench")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="interrupt a correction after this many seconds of its loop and extrapolate")
    parser.add_argument("--regional-shift", nargs="+", default=[ResolvedCorrection.regional_shift],
                        choices=REGIONAL_SHIFTS, help="correction.regional_shift: each one given is timed on each file")
    parser.add_argument("--all-genes", action="store_true",
                        help="every gene of the bundled data in the input, not only the model's")
    parser.add_argument("--processes", type=int, nargs="+",
                        help="time the whole verb with each number of processes (torchrun above 1) instead")
    parser.add_argument("--keep", action="store_true", help="keep the generated inputs and outputs")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--child", nargs=3, metavar=("INPUT", "OUTPUT", "CHECKPOINT"), help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or train_checkpoint(args.workdir, args.threads)
    from batchfix.training.trained import load_trained

    genes = None if args.all_genes else load_trained(checkpoint).genes
    n_genes = bundled_cells().n_vars if genes is None else len(genes)
    rows = []
    for n_cells in args.cells:
        input_path = args.workdir / f"synthetic_{n_cells}x{n_genes}.h5ad"
        output_path = args.workdir / f"synthetic_{n_cells}x{n_genes}.corrected.h5ad"
        if not input_path.is_file():
            began = time.perf_counter()
            generate(input_path, n_cells, genes)
            print(f"Generated {input_path} ({input_path.stat().st_size / 2**20:,.0f} MB) in "
                  f"{time.perf_counter() - began:.0f} s.", flush=True)
        if args.processes:
            rows += process_rows(n_cells, input_path, output_path, checkpoint, args)
        for shift in [] if args.processes else args.regional_shift:
            output_path.unlink(missing_ok=True)
            records = measure(input_path, output_path, checkpoint, argparse.Namespace(**{**vars(args),
                                                                                       "regional_shift": [shift]}))
            rows.append({"regional_shift": shift,
                         **report(n_cells, n_genes, input_path, output_path, records, shift)})
        if not args.keep:
            output_path.unlink(missing_ok=True)
            input_path.unlink(missing_ok=True)
    print(f"\nCPU: {os.cpu_count()} cores visible, torch threads {args.threads}; "
          f"load average at the end {os.getloadavg()[0]:.1f}.")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if not args.keep and args.checkpoint is None:
        shutil.rmtree(args.workdir / "model", ignore_errors=True)


if __name__ == "__main__":
    main()
