"""The presets' table: every preset of conf/correction/ applied to the same trained models, on each dataset, and
the preset that meets the most lines there beside the one each model recommended after training.

For each dataset and seed, batchfix is trained once (the benchmark's 2,000 batch-aware HVGs, the default options,
one thread; checkpoints kept in --models and reused) and corrected with each preset; ComBat is fitted once on the
same genes. Each matrix's Total (scIB, exact neighbours, PCA of the log layer) and gene lines (DE-rank, markers,
within-type neighbours, HVG; against the raw counts, or against the truth layer of a stress set) are scored.
A preset meets a line where it is level with ComBat or above over the seeds: the paired mean difference is
>= -LEVEL_MARGIN and not more than 2 standard errors below zero (issue rules of the presets' work).

    python -m scripts.preset_table data/cellbench5.h5ad stress_sd1.h5ad --seeds 0 1 2 --models models/ \
        --out docs/lab/runs/presets.csv
"""
from __future__ import annotations

import argparse
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

import batchfix
from batchfix.config import preset_names
from batchfix.correction import recommendation
from batchfix.data.normalize import log_cp10k
from batchfix.eval import fidelity, metrics
from scripts import baselines
from scripts.benchmark import dense_float32, load, select_genes

LEVEL_MARGIN = 0.005
LINES = ["Total", *fidelity.GENE_METRICS]
MEASURED = ["gene_effect", "regional_shift", "regional_batch", "confined_cells", "states"]  # recommendation.rule's


def trained(counts: ad.AnnData, name: str, seed: int, models: Path, label_key: str) -> batchfix.BatchfixModel:
    """The dataset's model of `seed`, trained once and kept in `models`."""
    path = models / f"{name}-seed{seed}.ckpt"
    if path.exists():
        return batchfix.BatchfixModel.load(path)
    model = batchfix.train(counts, batch_key="batch", label_key=label_key, n_top_genes=None, seed=seed, threads=1,
                           enable_progress_bar=False)
    model.save(path)
    return model


def scores(counts: ad.AnnData, matrix: np.ndarray, unintegrated: np.ndarray, reference: np.ndarray,
           label_key: str, seed: int) -> dict:
    """Total and the gene lines of one matrix (gene lines against `reference` counts)."""
    table = metrics.score_embeddings(counts.obs, {"m": metrics.pca_embedding(matrix, seed=seed)}, unintegrated,
                                     "batch", label_key, neighbors="exact")
    genes = fidelity.gene_fidelity(reference, matrix, counts.obs["batch"].to_numpy(), counts.obs[label_key].to_numpy())
    return {"Total": float(table.loc["m", "Total"]), **{m: genes[m] for m in fidelity.GENE_METRICS}}


def dataset_rows(path: Path, seeds: list[int], models: Path, label_key: str) -> list[dict]:
    adata = load(path, "batch", label_key, None)
    truth = adata.layers.pop("truth") if "truth" in adata.layers else None
    counts = select_genes(adata, "batch", 2000)
    reference = dense_float32(truth[:, adata.var_names.get_indexer(counts.var_names)]) if truth is not None \
        else counts.X
    log_values = np.asarray(log_cp10k(counts.X), dtype=np.float32)
    combat = baselines.combat(log_values, counts.obs, "batch")
    rows = []
    for seed in seeds:
        unintegrated = metrics.pca_embedding(log_values, seed=seed)
        rows.append({"dataset": path.stem, "seed": seed, "matrix": "ComBat",
                     **scores(counts, combat, unintegrated, reference, label_key, seed)})
        model = trained(counts, path.stem, seed, models, label_key)
        for preset in preset_names():
            layer = batchfix.correct(counts, model, correction=preset, copy=True).layers["batchfix"]
            matrix = np.asarray(layer.toarray() if hasattr(layer, "toarray") else layer, dtype=np.float32)
            advice = model.recommendation
            rows.append({"dataset": path.stem, "seed": seed, "matrix": preset,
                         **{key: advice[key] for key in MEASURED},
                         **scores(counts, matrix, unintegrated, reference, label_key, seed)})
            print(rows[-1], flush=True)
    return rows


def lines_met(rows: pd.DataFrame) -> pd.DataFrame:
    """Per dataset and preset: the lines met against ComBat, their count, and the seeds' recommendations."""
    out = []
    for (dataset, preset), group in rows[rows.matrix != "ComBat"].groupby(["dataset", "matrix"]):
        combat = rows[(rows.dataset == dataset) & (rows.matrix == "ComBat")].set_index("seed")
        mine = group.set_index("seed")
        met = {}
        for line in LINES:
            diff = (mine[line] - combat.loc[mine.index, line]).to_numpy()
            se = diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else 0.0
            met[line] = bool(diff.mean() >= -LEVEL_MARGIN and diff.mean() >= -2 * se)
        out.append({"dataset": dataset, "preset": preset, **{f"{k} mean": group[k].mean() for k in LINES},
                    **{f"{k} met": v for k, v in met.items()}, "lines met": sum(met.values()),
                    "recommended": ",".join(sorted({recommendation.rule(*values)[0]
                                                    for values in group[MEASURED].itertuples(index=False)}))})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--label-key", default="cell_type")
    parser.add_argument("--models", type=Path, required=True, help="folder of the trained checkpoints (reused)")
    parser.add_argument("--out", type=Path, required=True, help="CSV of every row; the summary beside it")
    args = parser.parse_args(argv)
    args.models.mkdir(parents=True, exist_ok=True)
    rows = pd.DataFrame([row for path in args.data for row in dataset_rows(path, args.seeds, args.models,
                                                                           args.label_key)])
    rows.to_csv(args.out, index=False)
    summary = lines_met(rows)
    summary.to_csv(args.out.with_name(args.out.stem + "-summary.csv"), index=False)
    for dataset, group in summary.groupby("dataset"):
        best = group["lines met"].max()
        print(f"{dataset}: most lines met by {sorted(group.loc[group['lines met'] == best, 'preset'])} ({best}); "
              f"recommended: {group['recommended'].iloc[0]}")


if __name__ == "__main__":
    main()
