"""batchfix against scVI as the data grow: fit, correct and evaluate times, peak memory, and the ratio
to scVI's default training time, all from one command.

For each size N a file of N cells is made from the bundled CellBench cells by Poisson resampling: a
new cell draws a real cell at random and takes Poisson(count) of each of its counts, so cells are not
copies, and it keeps that cell's batch and cell line (obs 'batch' and 'cell_type'; the batch
structure of the bundled data). The file is written chunk by chunk (CSR raw counts in X, every
bundled gene unless --genes), so even 1,000,000 cells need little memory to make. `--bundled` adds
the bundled 1,021 real cells as they are.

Per file:

- batchfix: `python -m batchfix train` with its defaults (labels: cell_type) in a child process, as a
  user runs it: fit, correct and evaluate seconds from its metrics.json, the planned epochs, whether
  it streamed the file, and the peak resident set size of the run (sampled with psutil, children
  included). With --fit-epochs E the fit stops after E epochs and the fit time of the planned
  epochs is projected from the measured time per epoch (said so in the output).
- scVI (scvi-tools, imported only in its own child process): SCVI on the same file's 2,000 highly
  variable genes (batch-aware seurat_v3, as batchfix selects them), trained --scvi-epochs epochs
  (by default enough to see about 20,000 cells after the first, and at least 2: 21 at 1,021 cells,
  2 from 20,000 cells) with its default settings; the time of each epoch is measured (the first one,
  which includes start-up, is left out when there are more) and its default training time projected:
  scvi-tools' default max_epochs = min(round(20000 / n_cells * 400), 400) times the mean epoch time.
- ratio = (batchfix fit + correct) / scVI's projected default training time; end to end = the whole
  train command's wall time (start-up, fit, correct, attention picture, evaluation) / the same, when
  the fit ran all its planned epochs.
- `--variant NAME KEY=VALUE ...` (repeatable) also trains a named variant of batchfix (its Hydra
  overrides) on every file, each compared with the same scVI measurement.

Everything runs on this machine's CPU with --threads threads (the GPU's figures: scripts/bench/bench_gpu.py).

    python -m scripts.bench.bench_scale                       # 10,000 and 100,000 cells
    python -m scripts.bench.bench_scale --sizes 10000 --bundled --threads 1
    python -m scripts.bench.bench_scale --million --fit-epochs 1
    python -m scripts.bench.bench_scale --bundled --sizes --threads 2 --variant tokens48 model.genes_per_token=48
    python -m scripts.bench.bench_scale --sizes 1000000 --genes 2000 --stop-after 900 --skip-scvi   # memory only
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from scripts.resampled import generate


def run_sampled(command: list[str], threads: int, cwd: Path, stop_after: float = 0) -> tuple[int, float, int, str]:
    """Run a child (sent SIGTERM after stop_after seconds when > 0); (exit status, wall seconds, peak RSS bytes of
    it and its children, stderr tail)."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict = {}
    readers = [threading.Thread(target=lambda k=k, s=s: out.__setitem__(k, s.read()), daemon=True)
               for k, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for reader in readers:
        reader.start()
    watched, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        if stop_after and time.perf_counter() - started > stop_after:
            proc.terminate()  # batchfix stops at the next step and saves checkpoints/last.ckpt
            stop_after = 0
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [watched, *watched.children(recursive=True)]))
        except psutil.Error:
            pass
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout=10)
    return proc.returncode, time.perf_counter() - started, peak, out.get("stdout", "") + out.get("stderr", "")[-4000:]


def default_planned_epochs(n_cells: int) -> int:
    """The epochs `train` plans by default for n_cells (no empty cells)."""
    from batchfix.config import FitConfig, TrainerConfig
    from batchfix.data.prepare import validation_size
    from batchfix.training.fitting import planned_epochs

    fit = FitConfig()
    n_validation = validation_size(n_cells, fit.validation_fraction, fit.max_validation_cells)
    return planned_epochs(TrainerConfig(), fit, math.ceil((n_cells - n_validation) / fit.batch_size))


def bench_batchfix(path: Path, n_cells: int, workdir: Path, args, variant: str = "", overrides=()) -> dict:
    run_dir = workdir / f"run_{path.stem}{f'_{variant}' if variant else ''}"
    command = [sys.executable, "-m", "batchfix", "train", f"data.path={path}", "data.label_key=cell_type",
               f"threads={args.threads}", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
               "overwrite=true", *overrides]
    if args.fit_epochs:
        command.append(f"trainer.max_epochs={args.fit_epochs}")
    status, wall, peak, output = run_sampled(command, args.threads, workdir, args.stop_after)
    if status != 0 and args.stop_after and wall >= args.stop_after:
        return stopped_run(run_dir, n_cells, wall, peak, output)
    if status != 0:
        raise SystemExit(f"batchfix train failed on {path} (exit status {status}):\n{output}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    planned = default_planned_epochs(n_cells)
    epochs = metrics["epochs"]
    fit_seconds = metrics["fit_seconds"]
    projected_fit = fit_seconds / max(epochs, 1) * planned if epochs < planned else fit_seconds
    evaluation = metrics.get("evaluation") or {}
    return {"fit_s": fit_seconds, "epochs_run": epochs, "planned_epochs": planned,
            "fit_s_planned": round(projected_fit, 1), "fit_projected": epochs < planned,
            "correct_s": metrics["correct_seconds"], "evaluate_s": evaluation.get("evaluation_seconds"),
            "evaluated_cells": evaluation.get("n_cells"), "streamed": metrics.get("streamed"),
            "train_cells_per_s": metrics.get("train_cells_per_second"), "total_s": metrics.get("total_seconds"),
            "wall_s": round(wall, 1), "peak_rss_mb": round(peak / 2**20)}


def stopped_run(run_dir: Path, n_cells: int, wall: float, peak: int, output: str) -> dict:
    """What a train stopped by --stop-after reached: its peak RSS, and the step its stop message names."""
    import re

    reached = re.search(r"interrupted by SIGTERM after (\d+) training steps", output)
    if "Traceback" in output or reached is None:
        raise SystemExit(f"batchfix train was stopped before it trained (in {run_dir}):\n{output}")
    steps = int(reached.group(1))
    print(f"  stopped by --stop-after after {wall:.0f} s, at step {steps}", flush=True)
    return {"stopped_after_s": round(wall, 1), "steps_reached": steps, "planned_epochs": default_planned_epochs(n_cells),
            "wall_s": round(wall, 1), "peak_rss_mb": round(peak / 2**20)}


SCVI_CHILD = r"""
import json, sys, time
import numpy as np, torch
path, epochs, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
import anndata as ad
import scvi
from pytorch_lightning.callbacks import Callback
from batchfix.data.select import highly_variable_genes
scvi.settings.num_threads = threads
adata = ad.read_h5ad(path)
import scipy.sparse as sp
adata.X = sp.csr_matrix(adata.X, dtype=np.float32)
genes = highly_variable_genes(adata.X, adata.obs["batch"].astype(str).to_numpy(), 2000, "counts")
adata = adata[:, np.asarray(genes)].copy()
try:
    from scvi.model._utils import get_max_epochs_heuristic
    default_epochs = int(get_max_epochs_heuristic(adata.n_obs))
except ImportError:
    default_epochs = int(min(round(20000 / adata.n_obs * 400), 400))
class Timer(Callback):
    def __init__(self):
        self.times = []
    def on_train_epoch_start(self, trainer, module):
        self.start = time.perf_counter()
    def on_train_epoch_end(self, trainer, module):
        self.times.append(time.perf_counter() - self.start)
timer = Timer()
scvi.settings.seed = 0
scvi.model.SCVI.setup_anndata(adata, batch_key="batch")
model = scvi.model.SCVI(adata)
started = time.perf_counter()
model.train(max_epochs=epochs, enable_progress_bar=False, callbacks=[timer])
print("SCVI " + json.dumps({"epoch_times": timer.times, "train_s": time.perf_counter() - started,
                            "default_epochs": default_epochs, "n_genes": int(adata.n_vars),
                            "version": scvi.__version__}))
"""


def scvi_epochs_to_time(n_cells: int, asked: int) -> int:
    """--scvi-epochs, or when 0 enough epochs to see about 20,000 cells after the first (start-up) one, at least 2:
    a single epoch of a small file lasts a fraction of a second, too short to time alone."""
    return asked or max(2, 1 + math.ceil(20_000 / n_cells))


def bench_scvi(path: Path, n_cells: int, workdir: Path, args) -> dict:
    epochs = scvi_epochs_to_time(n_cells, args.scvi_epochs)
    status, wall, peak, output = run_sampled([sys.executable, "-c", SCVI_CHILD, str(path), str(epochs),
                                              str(args.threads)], args.threads, workdir)
    lines = [line for line in output.splitlines() if line.startswith("SCVI ")]
    if status != 0 or not lines:
        raise SystemExit(f"scVI failed on {path} (exit status {status}):\n{output}")
    result = json.loads(lines[-1][5:])
    times = result["epoch_times"]
    epoch = float(np.mean(times[1:] if len(times) > 1 else times))
    return {"scvi_epoch_s": round(epoch, 2), "scvi_epochs_timed": len(times[1:] if len(times) > 1 else times),
            "scvi_default_epochs": result["default_epochs"],
            "scvi_default_s": round(epoch * result["default_epochs"], 1), "scvi_peak_rss_mb": round(peak / 2**20),
            "scvi_version": result["version"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000],
                        help="cells per resampled file (none: only --bundled)")
    parser.add_argument("--million", action="store_true", help="add a 1,000,000-cell file")
    parser.add_argument("--bundled", action="store_true", help="add the bundled 1,021 real cells as they are")
    parser.add_argument("--genes", type=int, default=0, help="keep the N most detected genes (0: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fit-epochs", type=int, default=0,
                        help="stop batchfix's fit after this many epochs and project the planned ones (0: all)")
    parser.add_argument("--scvi-epochs", type=int, default=0,
                        help="scVI epochs to train and time (0: enough to see about 20,000 cells after the first, "
                             "at least 2)")
    parser.add_argument("--skip-scvi", action="store_true")
    parser.add_argument("--stop-after", type=float, default=0,
                        help="send batchfix's train SIGTERM after this many seconds and report its peak RSS so far "
                             "and the step it reached (memory of a file too large to train on here; 0: never)")
    parser.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
                        help="also train this named variant of batchfix (its Hydra overrides) on every file, "
                             "against the same scVI measurement (repeatable)")
    parser.add_argument("--workdir", type=Path, default=Path("bench_scale_work"))
    args = parser.parse_args()
    if args.variant and any("=" in name or not name.strip() for name, *_ in args.variant):
        parser.error("--variant: give a NAME first, then its KEY=VALUE overrides")
    variants = [("", [])] + [(name, extra) for name, *extra in args.variant or []]
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if (args.fit_epochs < 0 or args.genes < 0 or args.stop_after < 0 or args.scvi_epochs < 0
            or min(args.sizes, default=100) < 100):
        parser.error("--fit-epochs, --genes, --stop-after and --scvi-epochs must be >= 0, --sizes >= 100")
    if not (args.sizes or args.million or args.bundled):
        parser.error("nothing to measure: give --sizes, --million or --bundled")
    args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir.resolve()
    sizes = sorted(set(args.sizes + ([1_000_000] if args.million else [])))
    files: list[tuple[int, Path]] = []
    if args.bundled:
        from batchfix.data.io import bundled_dataset

        files.append((1021, Path(bundled_dataset())))
    for n in sizes:
        path = workdir / f"resampled_{n}{f'_{args.genes}g' if args.genes else ''}.h5ad"
        if not path.is_file():
            started = time.perf_counter()
            generate(path, n, n_genes=args.genes or None)
            print(f"Made {path} ({path.stat().st_size / 2**20:,.0f} MB) in {time.perf_counter() - started:.0f} s",
                  flush=True)
        files.append((n, path))
    rows = []
    for n, path in files:
        print(f"\n== {n:,} cells: {path.name}", flush=True)
        scvi = None
        for variant, overrides in variants:
            name = f"batchfix {variant}" if variant else "batchfix"
            row = {"cells": n, "file": path.name, "variant": variant or "default", "overrides": overrides,
                   **bench_batchfix(path, n, workdir, args, variant, overrides)}
            rows.append(row)
            if "stopped_after_s" in row:
                print(f"  {name}  peak RSS {row['peak_rss_mb']:,} MB until stopped at step {row['steps_reached']} "
                      f"({row['planned_epochs']} epochs planned)", flush=True)
                continue
            projected = f"; {row['fit_s_planned']:.1f} s projected for all" if row["fit_projected"] else ""
            print(f"  {name}  fit {row['fit_s']:.1f} s ({row['epochs_run']} of {row['planned_epochs']} planned "
                  f"epochs{projected}), correct {row['correct_s']:.1f} s, evaluate {row['evaluate_s']} s on "
                  f"{row['evaluated_cells']} cells, streamed {row['streamed']}, peak RSS {row['peak_rss_mb']:,} MB",
                  flush=True)
            if args.skip_scvi:
                continue
            if scvi is None:  # once per file: every variant is compared with the same measurement
                scvi = bench_scvi(path, n, workdir, args)
                print(f"  scVI      {scvi['scvi_epoch_s']:.2f} s per epoch x {scvi['scvi_default_epochs']} default "
                      f"epochs = {scvi['scvi_default_s']:.0f} s projected (peak RSS {scvi['scvi_peak_rss_mb']:,} MB)",
                      flush=True)
            row.update(scvi)
            row["ratio"] = round((row["fit_s_planned"] + row["correct_s"]) / row["scvi_default_s"], 3)
            row["end_to_end_ratio"] = None if row["fit_projected"] else round(row["wall_s"] / row["scvi_default_s"], 3)
            print(f"  ratio     {name} fit + correct / scVI default training = {row['ratio']:.3f}", flush=True)
            if row["end_to_end_ratio"] is not None:
                print(f"  end to end  the whole train command ({row['wall_s']:.0f} s: start-up, fit, correct, attention "
                      f"picture, evaluation) / scVI default training = {row['end_to_end_ratio']:.3f}", flush=True)
    summary = {"threads": args.threads, "device": "cpu", "rows": rows}
    (workdir / "bench_scale.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n" + json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
