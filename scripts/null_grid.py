"""Null splits of every batch of a file, at several fractions and seeds: what the default correction changes where
nothing is technical, beside ComBat in the same run.

For each (batch, fractions, seed): `scripts/null_split.py` splits the batch's cells at random into pseudo-batches
(the split file holds only them), `python -m batchfix train` fits a default model on it (that seed, threads=1,
evaluate=false), `python -m batchfix correct` corrects it, and `scripts/null_scores.py --combat` scores the
corrected counts and ComBat. A run whose scores are in the work folder is not run again, so an interrupted grid
resumes. The table: per (batch, fractions), the mean over seeds of the nonzero counts changed, zeros raised and
kNN kept (batchfix and ComBat), and the most DE genes any seed called between the pseudo-batches.
`--baselines-only` trains nothing: on the same splits it scores ComBat and ComBat-seq (inmoose) alone.

    python -m scripts.null_grid data/cellbench5.h5ad --workdir null_grid --seeds 0 1 2 --out null-grid.csv
    python -m scripts.null_grid data/cellbench5.h5ad --workdir null_grid --baselines-only --out baselines.csv
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import anndata as ad
import pandas as pd

FRACTIONS = {"50/50": (0.5, 0.5), "2:1": (0.6667, 0.3333)}
COLUMNS = ["counts_changed", "zeros_raised", "knn_kept", "de_genes"]


def run_tag(batch: str, fractions: tuple[float, ...], seed: int) -> str:
    return f"{batch}_{''.join(f'{f:g}'.replace('.', '') for f in fractions)}_s{seed}"


def run_one(data: Path, workdir: Path, batch: str, fractions: tuple[float, ...], seed: int,
            baselines_only: bool = False) -> Path:
    """Split, train, correct and score one null split (with `baselines_only`: split and score the baselines);
    returns its scores' JSON (kept if there already)."""
    stem = workdir / run_tag(batch, fractions, seed)
    scores = stem.with_suffix(".baselines.json" if baselines_only else ".null_scores.json")
    if scores.is_file():
        return scores
    python = [sys.executable, "-m"]
    split = ["scripts.null_split", str(data), f"{stem}.h5ad", "--batch", batch, "--fractions", *map(str, fractions),
             "--seed", str(seed)]
    if baselines_only:
        steps = [split, ["scripts.null_scores", f"{stem}.h5ad", "--combat", "--combat-seq", "--out", str(scores)]]
        with open(f"{stem}.baselines.log", "w") as log:
            for step in steps:
                subprocess.run([*python, *step], check=True, stdout=log, stderr=subprocess.STDOUT)
        return scores
    steps = [
        split,
        ["batchfix", "train", f"data.path={stem}.h5ad", "data.label_key=cell_type", "threads=1", f"seed={seed}",
         "evaluate=false", "trainer.enable_progress_bar=false", f"hydra.run.dir={stem}.run"],
        ["batchfix", "correct", f"input={stem}.h5ad", f"checkpoint={stem}.run/model.ckpt",
         f"output={stem}.corrected.h5ad", "threads=1", "overwrite=true"],
        ["scripts.null_scores", f"{stem}.h5ad", f"{stem}.corrected.h5ad", "--layer", "batchfix_counts",
         "--log-layer", "batchfix", "--combat", "--out", str(scores)],
    ]
    with open(f"{stem}.log", "w") as log:
        for step in steps:
            subprocess.run([*python, *step], check=True, stdout=log, stderr=subprocess.STDOUT)
    Path(f"{stem}.corrected.h5ad").unlink()
    return scores


def table(rows: list[dict]) -> pd.DataFrame:
    """Per (batch, fractions): mean over seeds of each score (batchfix, ComBat), the most DE genes of any seed."""
    frame = pd.DataFrame(rows)
    means = frame.groupby(["batch", "fractions", "method"])[COLUMNS[:-1]].mean()
    means["de_genes_max"] = frame.groupby(["batch", "fractions", "method"])["de_genes"].max()
    means["seeds"] = frame.groupby(["batch", "fractions", "method"])["seed"].nunique()
    return means.reset_index()


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help=".h5ad with raw counts in X, obs 'batch' and 'cell_type'")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--batches", nargs="+", help="default: every batch of the file")
    parser.add_argument("--fractions", nargs="+", choices=list(FRACTIONS), default=list(FRACTIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--baselines-only", action="store_true", help="train nothing: ComBat and ComBat-seq alone")
    parser.add_argument("--out", type=Path, help="CSV of the table")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    batches = args.batches or sorted(ad.read_h5ad(args.data, backed="r").obs["batch"].astype(str).unique())
    rows = []
    for batch in batches:
        for name in args.fractions:
            for seed in args.seeds:
                scores = json.loads(run_one(args.data, args.workdir, batch, FRACTIONS[name], seed,
                                            args.baselines_only).read_text())
                methods = (("ComBat", "ComBat"), ("ComBat-seq", "ComBat-seq")) if args.baselines_only else (
                    ("batchfix", "batchfix_counts"), ("ComBat", "ComBat"))
                for method, key in methods:
                    rows.append({"batch": batch, "fractions": name, "seed": seed, "method": method,
                                 **{column: scores["methods"][key][column] for column in COLUMNS}})
    result = table(rows)
    print(result.to_string(index=False, float_format="%.4f"))
    if args.out:
        result.to_csv(args.out, index=False, float_format="%.4f")
    return result


if __name__ == "__main__":
    main()
