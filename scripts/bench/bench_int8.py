"""INT8 inference (`correct` with int8=true) against float32: speed and the change in corrected values.

Corrects the same cells with the same checkpoint both ways (the Python API's `batchfix.correct`,
alternating, `--repeats` times each) and prints cells per CPU-second and wall-clock cells/s (median
over repeats; the correction loop only, torch threads as --threads), and how far the int8 corrected
values and latent are from the float32 ones: largest absolute difference, its 99.9th percentile
and mean, on the log1p(counts per 10k) scale of layers['batchfix'].

    python -m scripts.bench.bench_int8 RUN/model.ckpt                 # on the bundled data
    python -m scripts.bench.bench_int8 RUN/model.ckpt other.h5ad --repeats 5
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def timed_correction(adata, model, int8: bool) -> tuple[float, float, np.ndarray, np.ndarray]:
    """(wall s, CPU s, corrected values of the modelled genes, latent) of one correction."""
    import batchfix

    wall, cpu = time.perf_counter(), time.process_time()
    out = batchfix.correct(adata, model, copy=True, int8=int8)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    values = out.layers["batchfix"][:, out.var["batchfix_modelled"].to_numpy()].toarray()
    return wall, cpu, values, out.obsm["X_batchfix"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data", nargs="?", default=None, help=".h5ad with raw counts in X (default: bundled)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import anndata as ad
    import torch

    import batchfix

    torch.set_num_threads(args.threads)
    adata = ad.read_h5ad(args.data or batchfix.bundled_dataset())
    model = batchfix.BatchfixModel.load(args.checkpoint)
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for int8 in (False, True):
            runs[int8].append(timed_correction(adata, model, int8))
    print(f"{adata.n_obs} cells x {runs[False][0][2].shape[1]} modelled genes, {args.threads} thread(s), "
          f"median of {args.repeats}")
    print("| inference | cells per CPU-s | wall cells/s |\n|---|---|---|")
    for int8, name in ((False, "float32"), (True, "int8 (dynamic, linear layers)")):
        wall, cpu = np.median([r[0] for r in runs[int8]]), np.median([r[1] for r in runs[int8]])
        print(f"| {name} | {adata.n_obs / cpu:.0f} | {adata.n_obs / wall:.0f} |")
    print("\n| int8 - float32 | max abs | 99.9th percentile | mean abs |\n|---|---|---|---|")
    for index, name in ((2, "corrected log1p(CP10k)"), (3, "latent")):
        diff = np.abs(runs[True][0][index] - runs[False][0][index])
        print(f"| {name} | {diff.max():.4f} | {np.quantile(diff, 0.999):.4f} | {diff.mean():.5f} |")
    scale = np.abs(runs[False][0][2]).max()
    print(f"\nlargest float32 corrected value: {scale:.2f}")


if __name__ == "__main__":
    main()
