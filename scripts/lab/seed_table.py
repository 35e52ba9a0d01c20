"""One docs table (docs/results/NAME.csv) from per-seed score files: mean ± sd over seeds per (data, row).

The inputs are the --out CSVs of scripts/lab/decoding_scale.py, scripts/lab/residual_weight.py,
scripts/lab/count_draws.py, scripts/lab/evidence_forms.py or scripts/lab/marker_loss.py (one row per (output,
seed), the output's name first, a "seed" column), each named by the data it scored:

    python -m scripts.lab.seed_table docs/results/residual-weight.csv \\
        bundled=docs/results/runs/residual-weight-bundled.csv "stress sd 1.0"=docs/results/runs/residual-weight-sd1.csv

Columns are the scores of COLUMNS that the inputs hold, under their short names, rounded to 3 decimals; rows keep
the order of their first appearance. scripts/make_docs_tables.py then writes the table into the pages.
"""
from __future__ import annotations

import argparse
import sys

import pandas as pd

# Score column of the per-seed files -> its name in the docs tables.
COLUMNS = {
    "left_log": "effect left (log)",
    "left_mean": "effect left (mean)",
    "Total": "Total",
    "Batch correction": "batch",
    "Bio conservation": "bio",
    "DE-rank agreement": "DE-rank",
    "Marker recall": "markers",
    "Within-type 10-NN kept": "within-type NN",
    "HVG conservation": "HVG",
    "Truth error (group contrasts, relative)": "truth error (contrasts)",
    "DE-rank agreement (truth)": "DE-rank vs truth",
    "Marker recall (truth)": "markers vs truth",
    "Within-type 10-NN kept (truth)": "within-type NN vs truth",
    "HVG conservation (truth)": "HVG vs truth",
}


def seed_summary(scores: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """"mean ± sd" over seeds of `columns` per output (the index), in the outputs' first order; the mean alone
    where an output has one seed's value, blank where a column is missing or has no value for the output (a
    latent's gene scores)."""
    grouped = scores.groupby(level=0, sort=False)
    table = pd.DataFrame(index=pd.Index(grouped.size().index, name="output"))
    for column in columns:
        if column in scores.columns:
            mean, sd, n = grouped[column].mean(), grouped[column].std(), grouped[column].count()
            table[COLUMNS[column]] = ["" if k == 0 else f"{m:.3f}" if k == 1 else f"{m:.3f} ± {s:.3f}"
                                      for m, s, k in zip(mean, sd, n)]
        else:
            table[COLUMNS[column]] = ""
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the docs table to write (CSV)")
    parser.add_argument("runs", nargs="+", metavar="DATA=CSV", help="a data name and its per-seed scores")
    parser.add_argument("--columns", nargs="+", choices=list(COLUMNS.values()),
                        help="the docs columns to keep (default: every one some input holds)")
    parser.add_argument("--drop", nargs="*", default=[], metavar="OUTPUT", help="rows (outputs) to leave out")
    args = parser.parse_args(argv)
    named = []
    for run in args.runs:
        name, sep, path = run.partition("=")
        if not sep or not name or not path:
            parser.error(f"{run!r}: give DATA=CSV")
        named.append((name, pd.read_csv(path, index_col=0)))
    present = [c for c in COLUMNS if any(c in scores.columns for _, scores in named)]
    columns = [c for c in present if args.columns is None or COLUMNS[c] in args.columns]
    parts = []
    for name, scores in named:
        scores = scores[~scores.index.isin(args.drop)]
        parts.append(seed_summary(scores, columns).reset_index().assign(data=name))
    table = pd.concat(parts)[["data", "output", *[COLUMNS[c] for c in columns]]]
    table.to_csv(args.out, index=False, lineterminator="\r\n")  # as the csv module writes the other tables
    print(f"Wrote {args.out}: {len(table)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
