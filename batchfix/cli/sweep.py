"""Summary of a Hydra multirun: one table row per job, and plots of key metrics vs swept values.

Each job folder holds `.hydra/overrides.yaml` (the job's "key=value" overrides) and, when the
job finished, `metrics.json` (nested dicts are flattened with dots). `summarize_sweep` writes
`sweep_summary.csv` (every column), `sweep_summary.md` (overrides and key metrics) and one
`sweep_<metric>.png` per key metric into the sweep folder; `SweepSummary` calls it at the end of
a multirun when registered under `hydra.callbacks`.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from hydra.experimental.callback import Callback
from matplotlib.figure import Figure
from omegaconf import DictConfig

from batchfix.runfolder import METRICS_JSON

log = logging.getLogger(__name__)

SUMMARY_CSV = "sweep_summary.csv"
SUMMARY_MD = "sweep_summary.md"
JOB_COLUMN = "job"
FOUND_COLUMN = "metrics_found"
SECONDS = "seconds"
# scib-metrics aggregate score names (batchfix.eval.metrics), matched as the last dotted key part;
# any key whose last part contains "seconds" is plotted in the SECONDS group.
KEY_METRICS = ["Total", "Batch correction", "Bio conservation", SECONDS]


class SweepSummary(Callback):
    """Hydra callback: summarise the sweep folder once every job of a multirun has returned."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        table = summarize_sweep(sweep_dir)
        log.info("Sweep summary of %d jobs: %s", len(table), sweep_dir / SUMMARY_CSV)


def summarize_sweep(sweep_dir) -> pd.DataFrame:
    """Collect every job of `sweep_dir` into one table; write the CSV, markdown and plots."""
    sweep_dir = Path(sweep_dir)
    job_dirs = sorted(
        (p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")),
        key=lambda d: _natural_key(d.relative_to(sweep_dir).as_posix()),
    )
    if not job_dirs:
        raise ValueError(f"No job folders (with .hydra/overrides.yaml) under {sweep_dir}")

    rows = [_job_row(job_dir) for job_dir in job_dirs]
    override_keys = _ordered_union(row[0] for row in rows)
    metric_keys = _ordered_union(row[1] for row in rows)
    metric_keys = [k for k in metric_keys if not _is_seconds(k)] + [
        k for k in metric_keys if _is_seconds(k)
    ]
    table = pd.DataFrame(
        [
            {
                JOB_COLUMN: job_dir.relative_to(sweep_dir).as_posix(),
                **overrides,
                FOUND_COLUMN: bool(found),
                **found,
            }
            for job_dir, (overrides, found) in zip(job_dirs, rows)
        ],
        columns=[JOB_COLUMN, *override_keys, FOUND_COLUMN, *metric_keys],
    )

    table.to_csv(sweep_dir / SUMMARY_CSV, index=False)
    swept = [k for k in override_keys if table[k].astype(str).nunique() > 1]
    groups = _key_metric_groups(metric_keys)
    (sweep_dir / SUMMARY_MD).write_text(_markdown(table, override_keys, groups, sweep_dir))
    for group, columns in groups.items():
        _plot_metric(table, swept or override_keys, group, columns, sweep_dir)
    return table


def flatten(values: dict, prefix: str = "") -> dict[str, float]:
    """Numbers of a nested dict, keyed by dotted paths; strings, booleans and lists are left out."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """'model.n_heads=4' -> ('model.n_heads', 4); leading '+', '++' or '~' are dropped."""
    key, sep, value = text.partition("=")
    key = key.lstrip("+~")
    return key, (yaml.safe_load(value) if sep else None)


def _job_row(job_dir: Path) -> tuple[dict, dict]:
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    parsed = dict(parse_override(str(o)) for o in overrides)
    metrics_path = job_dir / METRICS_JSON
    if not metrics_path.is_file():
        log.warning("No metrics.json in %s (job failed or still running)", job_dir)
        return parsed, {}
    return parsed, flatten(json.loads(metrics_path.read_text()))


def _key_metric_groups(metric_keys: list[str]) -> dict[str, list[str]]:
    groups = {}
    for group in KEY_METRICS:
        columns = [
            k for k in metric_keys
            if (_is_seconds(k) if group == SECONDS else k.rsplit(".", 1)[-1] == group)
        ]
        if columns:
            groups[group] = columns
    return groups


def _plot_metric(
    table: pd.DataFrame, swept: list[str], group: str, columns: list[str], out_dir: Path
) -> None:
    """Metric vs the first swept key; one line per column (and per value of other swept keys)."""
    x_key = swept[0] if swept else JOB_COLUMN
    others = swept[1:]
    positions, categories = category_positions(table[x_key])

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    by_others = table.groupby(others, dropna=False, sort=False) if others else [((), table)]
    for other_values, part in by_others:
        for column in columns:
            label = short_header(column)
            if others:
                other_values = other_values if isinstance(other_values, tuple) else (other_values,)
                label += " | " + ", ".join(f"{k}={v}" for k, v in zip(others, other_values))
            x = positions.loc[part.index]
            y = part[column]
            means = y.groupby(x).mean().sort_index()
            line = ax.plot(means.index, means.to_numpy(), marker="o", label=label)[0]
            ax.scatter(x, y, color=line.get_color(), s=12, alpha=0.5)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_xlabel(x_key)
    ax.set_ylabel(group)
    ax.set_title(f"{group} vs {x_key}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(out_dir / f"sweep_{_slug(group)}.png", dpi=110)


# The scored embeddings (batchfix.eval.metrics) and aggregate scores by a short name in the summary's headers
SHORT_NAMES = {"batchfix corrected expression (PCA)": "corrected", "batchfix latent": "latent",
               "Unintegrated PCA": "unintegrated", "Batch correction": "batch", "Bio conservation": "bio"}


def short_header(column: str) -> str:
    """A metric column's header in the markdown summary: 'evaluation.scores.batchfix latent.Total' ->
    'latent Total', 'fit_seconds' -> 'fit_seconds'."""
    parts = column.split(".")
    if len(parts) >= 2 and "scores" in parts[:-2]:
        return " ".join(SHORT_NAMES.get(part, part) for part in parts[parts.index("scores") + 1:])
    return parts[-1]


def varying(table: pd.DataFrame, columns: list[str]) -> list[str]:
    """The columns whose values differ between jobs (a missing value counts as one)."""
    return [c for c in columns if table[c].astype(str).nunique(dropna=False) > 1]


def category_positions(values: pd.Series) -> tuple[pd.Series, list[str]]:
    """Swept values as evenly spaced categories (head counts 1, 2, 8 are choices, not a scale): each value's
    position and the tick labels, numbers in numeric order, other values in order of appearance."""
    distinct = list(dict.fromkeys(values.dropna()))
    if pd.api.types.is_numeric_dtype(values):
        distinct = sorted(distinct)
    labels = [str(v) for v in distinct]
    return values.astype(str).map({label: i for i, label in enumerate(labels)}), labels


def _markdown(
    table: pd.DataFrame, override_keys: list[str], groups: dict[str, list[str]], sweep_dir: Path
) -> str:
    metrics = [c for cols in groups.values() for c in cols]
    columns = [JOB_COLUMN, *varying(table, override_keys), *varying(table, metrics)]
    constant = sorted(set(override_keys) - set(columns))
    lines = [
        f"# Sweep summary: {sweep_dir.name}",
        "",
        f"{len(table)} jobs, {int(table[FOUND_COLUMN].sum())} with metrics.json. "
        f"Every metric is in {SUMMARY_CSV}; columns equal in every job are left out"
        + (f" (the same in every job: {', '.join(f'{k}={table[k].iloc[0]}' for k in constant)})." if constant
           else "."),
        "",
        "| " + " | ".join(short_header(c) if c in metrics else c for c in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for _, row in table.iterrows():
        lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, (float, np.floating)):
        return "n/a" if np.isnan(value) else f"{value:.4g}"
    return str(value)


def _is_seconds(key: str) -> bool:
    return SECONDS in key.rsplit(".", 1)[-1]


def _ordered_union(dicts) -> list[str]:
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    return list(keys)


def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
