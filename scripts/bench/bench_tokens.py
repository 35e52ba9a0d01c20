"""Peak memory and speed of per-gene tokens (model.genes_per_token=1) against the windowed default.

Each configuration and phase runs in its own process. The process prepares the bundled data's top
HVGs as training does, builds the model, resets the kernel's resident-memory high-water mark
(Linux: /proc/self/clear_refs), then runs either `--steps` training steps (forward, backward, AdamW
on minibatches of fit.batch_size cells; the first step is a warm-up and is not timed) or inference
(the encoder and decoder as `correct` runs them, on `--infer-cells` cells in forward passes of
fit.batch_size cells: 128, as correct's batch_size, unless the configuration sets a smaller one). Printed per configuration: tokens, the speed of each phase, and the peak
resident memory of the phase (VmHWM) and its growth over the memory held when the phase began.

Speed is given per CPU-second of the process (CPU time, all its threads): on a machine other jobs
share, wall-clock cells/s says more about them than about the model; with --threads 1 it is the
speed of one dedicated core. Wall-clock cells/s is printed beside it. Configurations: CONFIGS below.

    python -m scripts.bench.bench_tokens --threads 1
    python -m scripts.bench.bench_tokens --only default gene2k_blocks_ckpt
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

# name: (HVGs, model and fit options as the Python API names them)
CONFIGS = {
    "default": (2000, {}),
    "gene2k_b16": (2000, {"genes_per_token": 1, "batch_size": 16}),
    "gene2k_blocks_b16": (2000, {"genes_per_token": 1, "attention_block_size": 64, "batch_size": 16}),
    "gene2k_blocks_ckpt_b16": (2000, {"genes_per_token": 1, "attention_block_size": 64,
                                      "gradient_checkpointing": True, "batch_size": 16}),
    "gene2k_blocks_ckpt": (2000, {"genes_per_token": 1, "attention_block_size": 64, "gradient_checkpointing": True}),
    "gene2k_sdpa": (2000, {"genes_per_token": 1, "attention": "sdpa"}),
    "default_5k": (5000, {}),
    "gene5k_blocks_ckpt_b32": (5000, {"genes_per_token": 1, "attention_block_size": 32, "gradient_checkpointing": True,
                                      "batch_size": 32}),
}


def high_water_kb() -> int:
    """The kernel's peak resident set size of this process since the last reset (VmHWM)."""
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def resident_kb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def train_phase(module, x, batch_index, batch_size: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of `steps` timed optimisation steps (after one warm-up step)."""
    import torch

    optimizer = torch.optim.AdamW(module.parameter_groups(), lr=module.hparams.learning_rate)
    module.train()
    wall = cpu = 0.0
    for step in range(steps + 1):
        rows = torch.randint(0, x.shape[0], (batch_size,), generator=torch.Generator().manual_seed(step))
        wall0, cpu0 = clocks()
        optimizer.zero_grad()
        module.net.loss(x[rows], batch_index[rows])["loss"].backward()
        optimizer.step()
        if step:
            wall, cpu = wall + time.perf_counter() - wall0, cpu + time.process_time() - cpu0
    return wall, cpu


def infer_phase(module, x, cells: int, batch_size: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the correction's forward passes (batch_size cells each) over `cells` cells."""
    import torch

    module.eval()
    wall0, cpu0 = clocks()
    with torch.inference_mode():
        for start in range(0, cells, batch_size):
            module.net.corrected(x[start:min(start + batch_size, cells)])
    return time.perf_counter() - wall0, time.process_time() - cpu0


def child(name: str, phase: str, args: argparse.Namespace) -> dict:
    """One configuration and phase, in this process: the json line the parent reads."""
    import torch

    from batchfix.api import train_config
    from batchfix.training import fitting

    genes, options = CONFIGS[name]
    cfg = train_config(n_top_genes=genes, threads=args.threads, seed=0, **options)
    fitting.seed_and_threads(cfg.seed, cfg.threads)
    prepared = fitting.load_training_data(cfg.data)
    module = fitting.build_module(cfg, prepared, planned_steps=100)
    x = torch.from_numpy(prepared.counts.toarray())
    batch_index = torch.from_numpy(prepared.batch_index)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the phase's own peak from here
    before = resident_kb()
    if phase == "train":
        cells = args.steps * cfg.fit.batch_size
        wall, cpu = train_phase(module, x, batch_index, cfg.fit.batch_size, args.steps)
    else:
        cells = min(args.infer_cells, x.shape[0])
        wall, cpu = infer_phase(module, x, cells, cfg.fit.batch_size)
    peak = high_water_kb()
    return {"tokens": module.windows.n_tokens, "per_cpu_s": cells / cpu, "per_s": cells / wall,
            "peak_mb": peak / 1024, "growth_mb": (peak - before) / 1024, "batch_size": cfg.fit.batch_size}


def measure(name: str, phase: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "scripts.bench.bench_tokens", "--child", name, phase,
               "--threads", str(args.threads), "--steps", str(args.steps), "--infer-cells", str(args.infer_cells)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        return {"error": (run.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="timed training steps (after one warm-up)")
    parser.add_argument("--infer-cells", type=int, default=256)
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "PHASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return
    print("| config | genes | tokens | batch | train cells per CPU-s (wall cells/s) | train peak MB (growth) "
          "| infer cells per CPU-s (wall cells/s) | infer peak MB (growth) |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for name in args.only:
        train, infer = measure(name, "train", args), measure(name, "infer", args)
        cells = [f"{name}", str(CONFIGS[name][0])]
        if "error" in train or "error" in infer:
            print("| " + " | ".join(cells + [train.get("error", ""), infer.get("error", "")]) + " |", flush=True)
            continue
        cells += [str(train["tokens"]), str(train["batch_size"]), f"{train['per_cpu_s']:.1f} ({train['per_s']:.1f})",
                  f"{train['peak_mb']:.0f} (+{train['growth_mb']:.0f})",
                  f"{infer['per_cpu_s']:.1f} ({infer['per_s']:.1f})", f"{infer['peak_mb']:.0f} (+{infer['growth_mb']:.0f})"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
