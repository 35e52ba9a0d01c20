"""The counts' quantile map in torch (batchfix.correction.device_map) against numpy/scipy's
(batchfix.correction.counts): entries per second on a chunk drawn like real sparse single-cell counts.

The chunk: cells x 2,000 genes, gene fractions log-normal, cell libraries log-normal around 300 counts (about
90% zeros, positive counts mostly 1-10), dispersions log-uniform in 0.1-50 and kept by the reference (the
default correction.spread=batch), and a per-gene log-mean shift N(0, 0.3); uniforms as the counts output takes
them (the counter draws for zeros, 0.5 for positive counts). Prints, for each size, entries/s (median wall time
over --repeats) and entries per CPU-second of this process (steadier on a shared machine) of
numpy's counts.quantile_map (the map before device_map) on 1 worker and on --threads workers, quantile_map_torch on the CPU (1 and --threads
torch threads) and on CUDA when there is one, the wall-time ratio to numpy on 1 worker, and how many counts differ
from numpy's; the same for the uniforms (counts.counter_uniform against counter_uniform_torch). --profile adds
where the CPU time goes in each map (cProfile, own time per function).

    python -m scripts.bench.bench_device_map                        # 2e6 and 1e7 entries
    python -m scripts.bench.bench_device_map --sizes 2e6 --threads 1 --profile
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from batchfix.correction import counts, device_map

GENES = 2000
MEDIAN_LIBRARY = 300.0
SHIFT_SD = 0.3


def sparse_chunk(n_entries: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Flat float64 arrays of a (cells, GENES) chunk: y, own_mean, ref_mean, own_theta, ref_theta, u; and the
    cells' and genes' uint64 keys."""
    rng = np.random.default_rng(seed)
    cells = max(1, int(n_entries) // GENES)
    fraction = rng.lognormal(0.0, 1.6, GENES)
    fraction /= fraction.sum()
    library = rng.lognormal(np.log(MEDIAN_LIBRARY), 0.5, cells)
    own_mean = library[:, None] * fraction[None, :]  # (cells, GENES)
    theta = np.broadcast_to(np.exp(rng.uniform(np.log(0.1), np.log(50.0), GENES)), own_mean.shape)
    ref_mean = own_mean * np.exp(rng.normal(0.0, SHIFT_SD, GENES))[None, :]
    y = rng.negative_binomial(theta, theta / (theta + own_mean)).astype(np.float64)
    cell_keys = rng.integers(0, 2**63, cells, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    gene_keys = rng.integers(0, 2**63, GENES, dtype=np.uint64)
    u = np.where(y == 0, counts.counter_uniform(0, cell_keys, gene_keys), 0.5)
    arrays = dict(y=y, own_mean=own_mean, ref_mean=ref_mean, own_theta=theta, ref_theta=theta, u=u)
    return {**{name: np.ascontiguousarray(values).ravel() for name, values in arrays.items()},
            "cell_keys": cell_keys, "gene_keys": gene_keys}


def timed(function, repeats: int, device: str = "cpu") -> tuple[float, float, object]:
    """(median wall seconds, median CPU seconds of this process, the last result) over `repeats` calls after one
    warm-up call."""
    result, wall, cpu = function(), [], []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        result = function()
        if device == "cuda":
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return float(np.median(wall)), float(np.median(cpu)), result


MAP_ARGUMENTS = ("y", "own_mean", "ref_mean", "own_theta", "ref_theta", "u")
MIN_ENTRIES_PER_THREAD = 100_000  # a smaller part is not worth a thread of its own


def numpy_threads_map(y: np.ndarray, own_mean: np.ndarray, ref_mean: np.ndarray, own_theta: np.ndarray,
                         ref_theta: np.ndarray, u: np.ndarray, workers: int) -> np.ndarray:
    """counts.quantile_map on `workers` threads, each mapping one contiguous part of the flat arrays (scipy's special
    functions release the GIL): the same counts as one call; the corrected counts' map before device_map."""
    if workers <= 1 or len(y) < 2 * MIN_ENTRIES_PER_THREAD:
        return counts.quantile_map(y, own_mean, ref_mean, own_theta, ref_theta, u)
    bounds = np.linspace(0, len(y), min(workers, len(y) // MIN_ENTRIES_PER_THREAD) + 1).astype(np.int64)
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(len(parts)) as pool:
        mapped = pool.map(lambda part: counts.quantile_map(y[part], own_mean[part], ref_mean[part], own_theta[part],
                                                    ref_theta[part], u[part]), parts)
        return np.concatenate(list(mapped))


def map_rows(chunk: dict[str, np.ndarray], threads: int, repeats: int, devices: list[str]) -> list[tuple]:
    """(method, wall s, CPU s, counts differing from numpy's on 1 worker) of the quantile maps."""
    arrays = [chunk[name] for name in MAP_ARGUMENTS]
    wall, cpu, expected = timed(lambda: numpy_threads_map(*arrays, 1), repeats)
    rows = [("numpy, 1 worker", wall, cpu, 0)]
    if threads > 1:
        wall, cpu, mapped = timed(lambda: numpy_threads_map(*arrays, threads), repeats)
        rows.append((f"numpy, {threads} workers", wall, cpu, int((mapped != expected).sum())))
    for device in devices:
        tensors = [torch.from_numpy(values).to(device) for values in arrays]
        for device_threads in sorted({1, threads}) if device == "cpu" else [threads]:
            torch.set_num_threads(device_threads)
            wall, cpu, mapped = timed(lambda: device_map.quantile_map_torch(*tensors), repeats, device)
            name = f"torch, cpu, {device_threads} thread{'s' if device_threads > 1 else ''}" if device == "cpu" \
                else f"torch, {device}"
            rows.append((name, wall, cpu, int((mapped.cpu().numpy() != expected).sum())))
        torch.set_num_threads(threads)
    return rows


def uniform_rows(chunk: dict[str, np.ndarray], repeats: int, devices: list[str]) -> list[tuple]:
    """(method, wall s, CPU s, uniforms differing from numpy's bits) of the counter draws."""
    cells, genes = chunk["cell_keys"], chunk["gene_keys"]
    wall, cpu, expected = timed(lambda: counts.counter_uniform(0, cells, genes), repeats)
    rows = [("numpy", wall, cpu, 0)]
    for device in devices:
        wall, cpu, drawn = timed(lambda: device_map.counter_uniform_torch(0, cells, genes, device), repeats, device)
        rows.append((f"torch, {device}", wall, cpu, int((drawn.cpu().numpy() != expected).sum())))
    return rows


def print_table(title: str, n: int, rows: list[tuple]) -> None:
    """Entries/s of each row, and its wall-time ratio to the first row's."""
    baseline = rows[0][1]
    print(f"\n{title}\n| method | entries/s | entries per CPU-s | x {rows[0][0]} (wall) | differing |\n"
          "|---|---|---|---|---|")
    for name, wall, cpu, differing in rows:
        print(f"| {name} | {n / wall:,.0f} | {n / max(cpu, 1e-9):,.0f} | {baseline / wall:.1f} | {differing} |")


def pow_closed_form(y: torch.Tensor, own_mean: torch.Tensor, ref_mean: torch.Tensor, own_theta: torch.Tensor,
                    ref_theta: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """counts.quantile_map's test of which entries move, in torch on every entry (pow, in the inputs' dtype)."""
    return (y > 0) | (u * torch.pow(own_theta / (own_theta + own_mean), own_theta)
                      > torch.pow(ref_theta / (ref_theta + ref_mean), ref_theta))


def closed_form_rows(chunk: dict[str, np.ndarray], repeats: int) -> list[tuple]:
    """(method, wall s, CPU s, differing) of the pass over every entry: the closed form with pow in float64 (as
    numpy's) and in float32 (differing: entries whose decision is not float64's), against device_map's bound, which
    uses no exp, log or pow and keeps more entries, for the closed form on the gathered ones (differing: entries the
    float64 closed form moves that the bound settles at 0; must be none)."""
    tensors = [torch.from_numpy(chunk[name]) for name in MAP_ARGUMENTS]
    singles = [values.float() for values in tensors]
    wall, cpu, expected = timed(lambda: pow_closed_form(*tensors), repeats)
    rows = [("closed form, float64 pow", wall, cpu, 0)]
    wall, cpu, kept = timed(lambda: pow_closed_form(*singles), repeats)
    rows.append(("closed form, float32 pow", wall, cpu, int((kept != expected).sum())))
    screen = [tensors[index] for index in (0, 1, 2, 3, 5)]
    wall, cpu, kept = timed(lambda: device_map.may_move_blocks(*screen), repeats)
    share = f"{kept.double().mean().item():.1%} kept, the closed form moves {expected.double().mean().item():.1%}"
    rows.append((f"device_map bound, float64 ({share})", wall, cpu, int((expected & ~kept).sum())))
    return rows


def print_profile(chunk: dict[str, np.ndarray]) -> None:
    """The functions that take the most CPU time (own time, cProfile) in one call of each map."""
    arrays = [chunk[name] for name in MAP_ARGUMENTS]
    tensors = [torch.from_numpy(values) for values in arrays]
    for name, function in (("counts.quantile_map", lambda: counts.quantile_map(*arrays)),
                           ("device_map.quantile_map_torch", lambda: device_map.quantile_map_torch(*tensors))):
        function()
        profile = cProfile.Profile(time.process_time)
        profile.runcall(function)
        print(f"\nprofile of {name} (CPU seconds)")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2e6, 1e7], help="entries per chunk")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print where the CPU time goes in each map")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for size in args.sizes:
        chunk = sparse_chunk(int(size))
        y = chunk["y"]
        positive = y[y > 0]
        print(f"\n## {len(y):,} entries ({len(y) // GENES} cells x {GENES} genes): {np.mean(y == 0):.1%} zeros, "
              f"{np.mean(positive <= 10):.1%} of positive counts 1-10, largest {y.max():.0f}; "
              f"{args.threads} threads, median of {args.repeats}")
        print_table("quantile map", len(y), map_rows(chunk, args.threads, args.repeats, devices))
        print_table("uniforms", len(y), uniform_rows(chunk, args.repeats, devices))
        if args.profile:
            print_table("the pass over every entry", len(y), closed_form_rows(chunk, args.repeats))
            print_profile(chunk)


if __name__ == "__main__":
    main()
