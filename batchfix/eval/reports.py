"""Markdown reports of the scores: the scIB scores table, and the gene-level and CNV scores as one-row tables."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from batchfix.eval import fidelity


def cnv_markdown(scores: Mapping) -> str:
    """CNV profile retention as a one-row markdown table, or its note."""
    if scores.get("retention_r") is None:
        return f"{scores.get('note', 'not computed')}\n"
    values = ["n/a" if scores.get(name) is None else f"{scores[name]:.3f}"  # relative r: none where uncorrected r <= 0
              for name in ("retention_r", "uncorrected_r", "relative_r", "amplitude_ratio")]
    return ("| CNV profile r | uncorrected r | relative r | amplitude ratio | genes | windows |\n"
            "|---|---|---|---|---|---|\n"
            f"| {' | '.join(values)} | {scores.get('n_genes', 'n/a')} | {scores.get('n_windows', 'n/a')} |\n")


def gene_markdown(scores: Mapping) -> str:
    """The four gene-level scores as a one-row markdown table, with the note on what was not computed."""
    header = "| " + " | ".join(fidelity.GENE_METRICS) + " |"
    row = "| " + " | ".join("n/a" if scores.get(m) is None else f"{scores[m]:.3f}" for m in fidelity.GENE_METRICS)
    lines = [header, "|" + "---|" * len(fidelity.GENE_METRICS), row + " |", ""]
    if scores.get("note"):
        lines += [f"{scores['note']}", ""]
    return "\n".join(lines)


def markdown_table(table: pd.DataFrame, digits: int = 3) -> str:
    """A GitHub-markdown table of a scores table ('n/a' for NaN), index as first column."""
    header = [table.index.name or ""] + [str(c) for c in table.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, *values in table.itertuples(name=None):
        cells = [_format_cell(v, digits) for v in values]
        lines.append("| " + " | ".join([str(name)] + cells) + " |")
    return "\n".join(lines) + "\n"


def _format_cell(value, digits: int) -> str:
    if isinstance(value, (float, np.floating)):
        return "n/a" if np.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def matrix_markdown(scores: Mapping) -> str:
    """The matrix scores (batchfix.eval.matrix_scores) as a one-row markdown table, with the reference used."""
    if scores.get("note"):
        return f"{scores['note']}\n"
    columns = [k for k in scores if k not in ("layer", "n_genes", "reference", "pit_failing_genes",
                                              "model_checks_missing", "model_checks_cells")]
    cells = ["n/a" if scores[c] is None else _format_cell(scores[c], 3) for c in columns]
    failing = "".join(f"- {batch}: {', '.join(genes)}\n"
                      for batch, genes in scores.get("pit_failing_genes", {}).items())
    return ("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n| " + " | ".join(cells) + " |\n\n"
            f"On {scores['n_genes']} genes; expected nonzero shares from the {scores['reference']}"
            + (f"; the model's checks over {scores['model_checks_cells']} cells sampled by name at correct time"
               if scores.get("model_checks_cells") else "") + ".\n"
            + (f"\nGenes the model misfits (PIT not uniform, worst first), by batch:\n{failing}" if failing else "")
            + (f"\n{scores['model_checks_missing']}.\n" if scores.get("model_checks_missing") else ""))
