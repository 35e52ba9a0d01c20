"""Paired comparison of two batchfix outputs from the same trained models, from scripts/benchmark.py's CSVs.

benchmark.py corrects each trained model in every output mode and with every regional shift, so two of its rows
differ only in the correction: their per-seed differences carry no training noise. For each CSV (one dataset),
this prints and writes a row per score: each output's mean over seeds, and the paired difference (mean and
standard error over seeds), with ComBat's mean beside them. An output is named by its embedding row, or by
several separated by "|", the first one the CSV holds (the default output's row is "batchfix counterfactual
(PCA)" whatever the default was when the CSV was made; the other regional shifts are named by their mode).
CSVs of one dataset's runs with other seeds are pooled by joining their paths with "+".

    python -m scripts.lab.variant_table docs/results/runs/bundled-3seeds.csv=bundled \\
        docs/results/runs/plate-trio-3seeds.csv=plate-trio docs/results/runs/platform-pair-3seeds.csv=platform-pair \\
        --rows "batchfix counterfactual_regional_keep (PCA)|batchfix counterfactual (PCA)=keep" \\
               "batchfix counterfactual_regional_apply (PCA)|batchfix counterfactual (PCA)=apply" \\
        --out docs/results/regional-default.csv
"""
from __future__ import annotations

import argparse
import csv

import numpy as np
import pandas as pd

SCORES = {"Total": "Total", "within-type NN": "Within-type 10-NN kept", "markers": "Marker recall",
          "DE-rank": "DE-rank agreement", "HVG": "HVG conservation", "CNV profile r": "CNV profile r",
          "truth error (group means)": "Truth error (group means)"}  # rows for the scores a CSV has


def named(pairs: list[str]) -> list[tuple[str, str]]:
    """'VALUE=NAME' arguments as (value, name)."""
    return [tuple(pair.rsplit("=", 1)) for pair in pairs]


def rows_of(path: str, dataset: str, first: tuple[str, str], second: tuple[str, str]) -> list[list[str]]:
    """One table row per score: both outputs' means, their paired difference (se) and ComBat's mean."""
    frame = pd.concat([pd.read_csv(part) for part in path.split("+")])  # runs of other seeds pooled
    rows = []
    for label, column in SCORES.items():
        if column not in frame:  # the truth errors: a stress set's runs only
            continue
        wide = frame.pivot_table(index="seed", columns="embedding", values=column)
        a, b = (wide[next(name for name in output.split("|") if name in wide)] for output, _ in (first, second))
        difference = (a - b).dropna()
        rows.append([dataset, label, f"{a.mean():.3f}", f"{b.mean():.3f}",
                     f"{difference.mean():+.4f} ({difference.std() / np.sqrt(len(difference)):.4f})",
                     str(len(difference)), f"{wide['ComBat'].mean():.3f}" if "ComBat" in wide else "n/a"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csvs", nargs="+", metavar="CSV=DATASET", help="benchmark.py CSVs and their datasets' names")
    parser.add_argument("--rows", nargs=2, required=True, metavar="EMBEDDING=NAME", help="the two outputs compared")
    parser.add_argument("--out", help="write the table here (a results CSV of docs/)")
    args = parser.parse_args()
    first, second = named(args.rows)
    table = [["data", "score", first[1], second[1], f"{first[1]} - {second[1]} (se)", "seeds", "ComBat"]]
    for path, dataset in named(args.csvs):
        table += rows_of(path, dataset, first, second)
    if args.out:
        with open(args.out, "w", newline="") as fh:
            csv.writer(fh).writerows(table)
    print("\n".join(" | ".join(row) for row in table))


if __name__ == "__main__":
    main()
