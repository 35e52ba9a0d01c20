"""CNV fidelity of batch corrections (docs/cnv.md): profile retention, injected clones, the confounded design
and the oligodendroglioma tumours, for uncorrected data, ComBat and batchfix's counterfactual output with
each correction.regional_shift (apply, keep = the default, keep_input; genomic and shuffled gene orders, the
latter by ablation.regional_order).

Every method is scored on the genes batchfix modelled (its 2,000 batch-aware HVGs), on log1p(counts per
10k) of those genes for the uncorrected data and ComBat. batchfix is trained once per (data, seed); its
regional variants are corrections of that one model. One JSON of records per command (--out).

    python -m scripts.cnv_benchmark profile data/cellbench5.h5ad --seeds 0 1 2 --out docs/results/cnv_profile.json
    python -m scripts.cnv_benchmark inject data/cellbench5.h5ad --design confounded --seeds 0 --out ...
    python -m scripts.cnv_benchmark confounded data/cellbench5.h5ad --seeds 0 1 2 --out ...
    python -m scripts.cnv_benchmark oligodendroglioma --seeds 0 1 2 --out ...
    python -m scripts.cnv_benchmark reference data/cellbench5.h5ad --seeds 0 1 2 --out ...   # reference cells
    python -m scripts.cnv_benchmark floor data/cellbench5.h5ad --seeds 0 1 2 --out ...   # regional noise and floor
    python -m scripts.cnv_benchmark report --reports docs/results/cnv_*.json   # the tables of docs/cnv.md
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

import batchfix
from batchfix.data.normalize import log_cp10k
from batchfix.eval import cnv, metrics
from scripts import inject_clones
from scripts.baselines import cellanova, combat, missing_module, scvi_fit

SHUFFLE_SEEDS = (1, 2, 3)  # gene orders of ablation.regional_order=shuffled
TRAIN_OPTIONS = dict(threads=1, enable_progress_bar=False)


OUTPUT = {}  # "path" and "command" of the JSON being written: every record is saved as soon as it is made


def emit(records: list[dict]) -> None:
    """Print the newest record and rewrite the output file with every record so far (a long run that is
    stopped keeps what it measured)."""
    print(json.dumps(records[-1]), flush=True)
    Path(OUTPUT["path"]).write_text(json.dumps({"command": OUTPUT["command"], "records": records}, indent=1))


def regional_variants(shuffles=SHUFFLE_SEEDS) -> dict[str, dict]:
    """batchfix correction options by row name: regional_shift apply, keep and keep_input over the genome, and the
    last two over shuffled gene orders (ablation.regional_order; keep_all, measured in the runs recorded before it
    was retired, is keep_input's predecessor)."""
    variants = {"batchfix regional=apply": {"regional_shift": "apply"}}
    for mode in ("keep", "keep_input"):
        variants[f"batchfix regional={mode}"] = {"regional_shift": mode}
        for seed in shuffles:
            variants[f"batchfix regional={mode}_shuffled/{seed}"] = {"regional_shift": mode,
                                                                     "regional_order": "shuffled",
                                                                     "regional_seed": seed}
    return variants


def dense(matrix) -> np.ndarray:
    return np.asarray(matrix.toarray() if hasattr(matrix, "toarray") else matrix, dtype=np.float32)


def batchfix_matrices(adata: ad.AnnData, batch_key: str, seed: int, options: dict, variants: dict) -> tuple:
    """(modelled-gene mask, {row name: corrected values on those genes}, train seconds)."""
    start = time.perf_counter()
    model = batchfix.train(adata, batch_key=batch_key, seed=seed, **TRAIN_OPTIONS, **options)
    seconds = time.perf_counter() - start
    out, genes = {}, None
    for name, correction in variants.items():
        corrected = batchfix.correct(adata, model, batch_key=batch_key, copy=True, **correction)
        genes = corrected.var["batchfix_modelled"].to_numpy()
        out[name] = dense(corrected.layers["batchfix"][:, genes])
    return genes, out, seconds


def method_matrices(adata, batch_key, seed, options, variants, extra=()) -> tuple[np.ndarray, dict, float]:
    """(genes, {method: log-scale matrix}, batchfix train seconds): uncorrected, ComBat, batchfix rows and the
    `extra` baselines (cellanova, scvi)."""
    genes, corrected, seconds = batchfix_matrices(adata, batch_key, seed, options, variants)
    counts = dense(adata.X[:, genes])
    log_values = counts if options.get("scale") == "log" else dense(log_cp10k(counts))
    matrices = {"uncorrected": log_values, "ComBat": combat(log_values, adata.obs, batch_key).astype(np.float32),
                **corrected}
    if "cellanova" in extra:
        matrices["CellANOVA"] = cellanova(log_values, adata.obs, batch_key, seed)
    if "scvi" in extra:  # trained on the same genes' raw counts
        matrices["scVI decoded"] = scvi_fit(ad.AnnData(counts, obs=adata.obs[[batch_key]].copy()), batch_key, seed)[1]
    return genes, matrices, seconds


def scib_totals(obs, matrices: dict, batch_key: str, label_key: str, seed: int) -> dict:
    """{method: {Total, Batch correction, Bio conservation}} of the PCA of each matrix (scib-metrics)."""
    embeddings = {name: metrics.pca_embedding(values, seed=seed) for name, values in matrices.items()}
    table = metrics.score_embeddings(obs, embeddings, embeddings["uncorrected"], batch_key, label_key)
    return {name: {column: float(table.loc[name, column]) for column in metrics.AGGREGATE_COLUMNS}
            for name in matrices}


def profile_run(args) -> list[dict]:
    """Profile retention and scIB Total on the whole file, per seed."""
    adata = ad.read_h5ad(args.input)
    records = []
    for seed in args.seeds:
        genes, matrices, seconds = method_matrices(adata, args.batch_key, seed, {}, regional_variants())
        windows = cnv.windows_of(adata.var[genes])
        labels, batch = adata.obs[args.label_key].to_numpy(), adata.obs[args.batch_key].to_numpy()
        totals = scib_totals(adata.obs, matrices, args.batch_key, args.label_key, seed) if args.scib else {}
        for name, values in matrices.items():
            retention = cnv.profile_retention(matrices["uncorrected"], values, batch, labels, windows)
            records.append({"experiment": "profile", "seed": seed, "method": name, "train_seconds": seconds,
                            **{k: v for k, v in retention.items() if k != "groups"}, **totals.get(name, {})})
            emit(records)
    return records


def inject_run(args) -> list[dict]:
    """Injected clones: for each seed and label in turn, inject, train, correct, score two segments (design
    none: one training per seed on the data as they are, scored for every label)."""
    adata = ad.read_h5ad(args.input)
    labels = adata.obs[args.label_key].astype(str).to_numpy()
    batch = adata.obs[args.batch_key].astype(str).to_numpy()
    records = []
    for seed in args.seeds:
        as_is = None
        for label in args.labels or sorted(set(labels)):
            own = max(sorted(set(batch[labels == label])), key=lambda b: ((labels == label) & (batch == b)).sum())
            clone = inject_clones.Clone(label, [own] if args.design != "shared" else None, args.gain, args.loss)
            if args.design == "none":
                injected = adata.copy()
                injected.obs["clone"] = False
                as_is = as_is or method_matrices(injected, args.batch_key, seed, {}, regional_variants(), args.extra)
                genes, matrices, seconds = as_is
            else:
                injected = inject_clones.inject(adata, clone, args.label_key, args.batch_key, seed)
                genes, matrices, seconds = method_matrices(injected, args.batch_key, seed, {}, regional_variants(),
                                                           args.extra)
            original = dense(log_cp10k(dense(adata.X[:, genes])))
            scores = inject_clones.clone_scores(matrices, original, matrices["uncorrected"], injected.obs,
                                                adata.var[genes], clone, args.design, args.label_key, args.batch_key)
            for name, by_segment in scores.items():
                records.append({"experiment": f"inject/{args.design}", "label": label, "batch": own, "seed": seed,
                                "method": name, **by_segment, "mean": float(np.mean(list(by_segment.values())))})
                emit(records)
    return records


def confounded_run(args) -> list[dict]:
    """Each label kept in one batch only (its largest); its profile scored against its removed cells."""
    adata = ad.read_h5ad(args.input)
    labels = adata.obs[args.label_key].astype(str).to_numpy()
    batch = adata.obs[args.batch_key].astype(str).to_numpy()
    records = []
    for label in args.labels or sorted(set(labels)):
        own = max(sorted(set(batch[labels == label])), key=lambda b: ((labels == label) & (batch == b)).sum())
        removed = (labels == label) & (batch != own)
        kept = adata[~removed].copy()
        for seed in args.seeds:
            genes, matrices, seconds = method_matrices(kept, args.batch_key, seed, {}, regional_variants(), args.extra)
            windows = cnv.windows_of(adata.var[genes])
            truth = dense(log_cp10k(dense(adata.X[:, genes])))  # every cell of the original, uncorrected
            for name, values in matrices.items():
                retention = cnv.profile_retention(
                    matrices["uncorrected"], values, batch[~removed], labels[~removed], windows, truth_log=truth,
                    truth_batch=batch, truth_labels=labels, scored_labels=[label])
                records.append({"experiment": "confounded", "label": label, "batch": own, "seed": seed, "method": name,
                                "r": retention["retention_r"], "uncorrected_r": retention["uncorrected_r"],
                                "amplitude_ratio": retention["amplitude_ratio"]})
                emit(records)
    return records


OLIGO_SEGMENTS = {"1p": ("1", 0.0, 120e6), "19q": ("19", 28e6, np.inf)}  # clear of both builds' centromeres


def oligodendroglioma_run(args) -> list[dict]:
    """Tirosh 2016 oligodendrogliomas (infercnvpy's example), patients as batches: depth of the 1p and 19q losses
    per malignant group (reference = the normal cells' mean), normal cells' depth per type and per (type, patient).

    The file holds TPM (Smart-seq2; not counts, so not the negative binomial's input): they enter as
    log1p(TPM per 10k) with data.scale=log (Gaussian likelihood on standardised values), the scale every
    score here reads."""
    import infercnvpy

    adata = infercnvpy.datasets.oligodendroglioma()
    adata.X = dense(log_cp10k(dense(adata.X)))
    adata.obs["patient"] = adata.obs_names.str.split("_").str[0]
    adata.var["chromosome"] = adata.var["chromosome"].astype(str).str.replace("^chr", "", regex=True)
    cell_type = np.asarray(adata.obs["cell_type"], dtype=str)
    normal = ~np.char.startswith(cell_type, "malignant")
    # Normal cells per type and per (type, patient): a correction that moves a patient's tumour CNVs into its
    # normal cells shows in the latter, as a change from the uncorrected depth.
    per_patient = np.char.add(np.char.add(cell_type, " @"), adata.obs["patient"].to_numpy().astype(str))
    adata.obs["reference"] = np.where(normal, "normal", "malignant")
    experiment, variants = "oligodendroglioma", regional_variants()
    if args.reference_cells:  # normal cells named (regional_shift=reference_cells), beside the rows weighed with them
        experiment = "oligodendroglioma/reference"
        variants = {name: variants[name] for name in ("batchfix regional=keep", "batchfix regional=keep_input")}
        variants["batchfix keep + reference cells"] = {"regional_shift": "reference_cells",
                                                       "normal_key": "reference", "normal_values": ["normal"]}
    records = []
    for seed in args.seeds:
        options = dict(scale="log", n_top_genes=None)
        genes, matrices, seconds = method_matrices(adata, "patient", seed, options, variants)
        windows = cnv.windows_of(adata.var[genes])
        totals = scib_totals(adata.obs, matrices, "patient", "cell_type", seed) if args.scib else {}
        for name, values in matrices.items():
            reference = values[normal].mean(axis=0)
            profiles = pd.concat([cnv.group_profiles(values, cell_type, windows, reference=reference, min_cells=5),
                                  cnv.group_profiles(values[normal], per_patient[normal], windows,
                                                     reference=reference, min_cells=5)])
            depths = cnv.segment_depths(profiles, windows, OLIGO_SEGMENTS)
            records.append({"experiment": experiment, "seed": seed, "method": name,
                            "depths": {g: row.to_dict() for g, row in depths.iterrows()}, **totals.get(name, {})})
            emit(records)
    return records


def reference_rows(records: list[dict]) -> list[list[str]]:
    """The reference and floor experiments' table: per method, the mean over seeds of each score (4 decimals for
    the regional statistics, whose line is a ratio of small numbers)."""
    frame = pd.DataFrame(records)
    columns = [c for c in frame.columns if c not in ("experiment", "method", "seed")]
    mean = frame.groupby("method", sort=False)[columns].mean()
    rows = [["method", "seeds", *columns]]
    for name in mean.index:
        rows.append([name, str(int((frame["method"] == name).sum())), *(
            f"{mean.loc[name, c]:.4f}" if c in ("artefact above floor", "floor", "artefact", "above_floor")
            else f"{mean.loc[name, c]:.2f}"
            for c in columns)])
    return rows


def summary_rows(records: list[dict], columns: list[str], by: str = "method") -> list[list[str]]:
    """Table rows (header first): per `by` value, mean, sd and standard error (over every record) of each column."""
    frame = pd.DataFrame(records)
    grouped = frame.groupby(by, sort=False)[columns]
    mean, sd, n = grouped.mean(), grouped.std(), grouped.count()
    rows = [[by, "n", *(f"{c} mean (sd, se)" for c in columns)]]
    for name in mean.index:
        rows.append([name, str(int(n.loc[name].max())), *(
            f"{mean.loc[name, c]:.3f} ({sd.loc[name, c]:.3f}, {sd.loc[name, c] / np.sqrt(n.loc[name, c]):.3f})"
            for c in columns)])
    return rows


def paired_rows(records: list[dict], columns: list[str]) -> list[list[str]]:
    """Table rows (header first): regional=keep and keep_input (and keep_all, in runs recorded before it was
    retired) minus each other method on each column, paired by (label, seed) (shuffled orders averaged first):
    mean, standard error and number of pairs."""
    frame = pd.DataFrame(records)
    frame["method"] = frame["method"].str.replace(r"_shuffled/\d+$", "_shuffled (mean of orders)", regex=True)
    keys = [k for k in ("label", "seed") if k in frame]
    rows = [["score", "method", "minus", "mean", "se", "pairs (" + " x ".join(keys) + ")"]]
    for column in columns:
        wide = frame.groupby([*keys, "method"])[column].mean().unstack("method")
        for mine in ("batchfix regional=keep", "batchfix regional=keep_all", "batchfix regional=keep_input"):
            for other in wide.columns.drop(mine) if mine in wide else []:
                d = (wide[mine] - wide[other]).dropna()
                rows.append([column, mine.split(" ")[1], other, f"{d.mean():+.3f}", f"{d.std() / np.sqrt(len(d)):.3f}",
                             str(len(d))])
    return rows


def markdown(rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
                      *("| " + " | ".join(row) + " |" for row in rows[1:])])


LEGACY_NAMES = {"batchfix": "batchfix regional=apply"}  # row names of records made before the name said the mode


def record_key(record: dict) -> tuple:
    """What one record measures: its experiment, line, seed and method."""
    return record["experiment"], record.get("label"), record["seed"], record["method"]


def report(paths: list[str], csv_dir: Path | None = None) -> str:
    """Markdown tables of the JSON files this script wrote; the records of files of one experiment are pooled into
    one table. With `csv_dir`, each table is also written there as cnv-KIND.csv and cnv-KIND-paired.csv, the
    results files of docs/cnv.md's tables (scripts/make_docs_tables.py)."""
    by_kind: dict[str, tuple[list[str], list[dict]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        records = [{**r, "method": LEGACY_NAMES.get(r["method"], r["method"])} for r in data["records"]]
        commands, pooled = by_kind.setdefault(records[0]["experiment"], ([], []))
        commands.append(data["command"])
        seen = {record_key(r) for r in pooled}  # a file run for one more baseline repeats the others' records
        pooled.extend(r for r in records if record_key(r) not in seen)
    sections = []
    for kind, (commands, records) in by_kind.items():
        if kind == "profile":
            columns = [c for c in ["retention_r", "relative_r", "amplitude_ratio", *metrics.AGGREGATE_COLUMNS]
                       if c in records[0]]
        elif kind == "confounded":
            # the amplitude's distance from 1: a profile amplified past the truth is not kept either
            records = [{**r, "amplitude_error": abs(r["amplitude_ratio"] - 1.0)} for r in records]
            columns = ["r", "uncorrected_r", "amplitude_ratio", "amplitude_error"]
        elif kind.startswith("oligodendroglioma"):
            records = oligodendroglioma_rows(records)
            columns = [c for c in records[0] if c not in ("method", "seed")]
        elif kind in ("reference", "floor"):
            columns = []
        else:
            columns = [c for c in records[0] if c.startswith(("gain", "loss")) or c == "mean"]
        paired = {"profile": ["retention_r", "Total"], "confounded": ["r", "amplitude_ratio", "amplitude_error"],
                  "oligodendroglioma": ["malignant kept (mean)"], "inject/confounded": ["mean"]}.get(kind, [])
        tables = {"": reference_rows(records) if kind in ("reference", "floor") else summary_rows(records, columns)}
        if paired:  # the designs where keeping a regional shift is at stake (shared and none: every row alike)
            tables["-paired"] = paired_rows(records, [c for c in paired if c in records[0]])
        if csv_dir is not None:
            for suffix, rows in tables.items():
                with open(Path(csv_dir) / f"cnv-{kind.replace('/', '-')}{suffix}.csv", "w", newline="") as fh:
                    csv.writer(fh).writerows(rows)
        runs = "\n".join(f"    {command}" for command in commands)
        sections.append(f"#### {kind}\n\n{runs}\n\n" + "\n\n".join(markdown(t) for t in tables.values()) + "\n")
    return "\n".join(sections)


def oligodendroglioma_rows(records: list[dict]) -> list[dict]:
    """Per (method, seed): each malignant group's 1p and 19q depth over the uncorrected depth, each normal type's
    depth and the largest absolute one, the largest change of a (type, patient) group's depth from the
    uncorrected one, and the scIB Total."""
    uncorrected = {r["seed"]: r["depths"] for r in records if r["method"] == "uncorrected"}
    rows = []
    for r in records:
        row, pooled, moved = {"method": r["method"], "seed": r["seed"]}, [], []
        for group, depth in r["depths"].items():
            for segment, value in depth.items():
                before = uncorrected[r["seed"]][group][segment]
                if group.startswith("malignant"):
                    row[f"{group.removeprefix('malignant_')} {segment} kept"] = value / before
                    continue
                cell_type, _, patient = group.partition(" @")
                if patient:  # summarised by the largest change (a column each would fill the table)
                    moved.append(abs(value - before))
                else:
                    row[f"{cell_type.split(' ')[0].split('/')[0]} {segment}"] = value
                    pooled.append(abs(value))
        row["malignant kept (mean)"] = float(np.mean([v for k, v in row.items() if str(k).endswith(" kept")]))
        row["normal type max abs depth"] = float(max(pooled))
        if moved:
            row["normal per patient max abs change"] = float(max(moved))
        row["Total"] = r.get("Total", np.nan)
        rows.append(row)
    return rows


REFERENCE_VARIANTS = {
    "batchfix regional=keep": {"regional_shift": "keep"},
    "batchfix regional=keep_input": {"regional_shift": "keep_input"},
    "batchfix keep + reference cells": {"regional_shift": "reference_cells"},  # normal_key / values added per run
    "batchfix keep + reference cells, spread=gene": {"regional_shift": "reference_cells", "spread": "gene"},
}


def label_contrast(values, genes, labels, batch, own, label) -> float:
    """seg(label, own batch) - seg(label, other batches)."""
    return cnv.segment_shift(values, genes, (labels == label) & (batch == own), (labels == label) & (batch != own))


def reference_run(args) -> list[dict]:
    """Reference cells (correction.normal_key) on one dataset holding both errors: a clone in every cell but the
    normal line's of one batch (--clone-batch; gain --gain, loss --loss) and a regional technical effect in every
    cell of another (--artefact-batch; gain chr3, loss chr12, the normal line's cells included). --mislabelled S:
    tumour cells of the clone batch are named normal too, S of the cells named normal there.

    Per segment, on the segment's modelled genes: `clone kept` = mean over the clone's labels of seg(L, batch) -
    seg(L, other batches), over the injected shift (1 = the clone kept whole, 0 = taken for batch effect);
    `normal moved` = the same contrast of the normal line's cells there, over the injected shift (0 = the normal
    cells at the other batches' level); `artefact left` = mean over the artefact batch's labels of the contrast,
    over the injected shift (0 = removed; the uncorrected data's includes the batch's own regional difference).
    `artefact above floor`: cnv.regional_artefact on the cells outside the clone batch, sqrt(A^2 - F^2), beside
    `floor` F (the uncorrected data's floor is the line to meet, times 1.2). Every matrix on log1p(counts per 10k
    over all genes), on the modelled genes."""
    adata = ad.read_h5ad(args.input)
    labels = adata.obs[args.label_key].astype(str).to_numpy()
    batch = adata.obs[args.batch_key].astype(str).to_numpy()
    clone_labels = sorted(set(labels[batch == args.clone_batch]) - {args.normal})
    artefact_labels = sorted(set(labels[batch == args.artefact_batch]))
    injected, clone_cells = adata, np.zeros(adata.n_obs, dtype=bool)
    for i, label in enumerate(clone_labels):
        injected = inject_clones.inject(injected, inject_clones.Clone(label, [args.clone_batch], args.gain, args.loss),
                                        args.label_key, args.batch_key, seed=i)
        clone_cells |= injected.obs["clone"].to_numpy(dtype=bool)
    for i, label in enumerate(artefact_labels):
        injected = inject_clones.inject(injected, inject_clones.Clone(label, [args.artefact_batch], "3", "12"),
                                        args.label_key, args.batch_key, seed=100 + i)
    original, after = dense(log_cp10k(dense(adata.X))), dense(log_cp10k(dense(injected.X)))
    records = []
    reference = labels == args.normal  # the cells named normal; --mislabelled adds tumour cells of the clone batch
    own_normal = int((reference & (batch == args.clone_batch)).sum())
    extra = int(round(args.mislabelled * own_normal / (1.0 - args.mislabelled)))
    tumour = np.flatnonzero(clone_cells)
    reference[np.random.default_rng(0).choice(tumour, min(extra, len(tumour)), replace=False)] = True
    injected.obs["reference"] = np.where(reference, "normal", "other")
    for seed in args.seeds:
        variants = {name: dict(options) for name, options in REFERENCE_VARIANTS.items()}
        for name in variants:
            if "reference cells" in name:
                variants[name].update(normal_key="reference", normal_values=["normal"])
        model = batchfix.train(injected, batch_key=args.batch_key, seed=seed, **TRAIN_OPTIONS)
        matrices = {"uncorrected": after, "ComBat": combat(after, injected.obs, args.batch_key).astype(np.float32)}
        for name, options in variants.items():
            matrices[name] = dense(batchfix.correct(injected, model, copy=True, **options).layers["batchfix"])
        modelled = np.isin(injected.var_names, model.genes)
        for name, values in matrices.items():
            record = {"experiment": "reference", "seed": seed, "method": name}
            for kind, chromosome in (("gain", args.gain), ("loss", args.loss)):
                genes = modelled & inject_clones.segment_genes(adata.var, chromosome)
                truth = inject_clones.injected_shift(original, after, clone_cells, genes)
                record[f"clone {kind} kept"] = float(np.mean([
                    label_contrast(values, genes, labels, batch, args.clone_batch, label) for label in clone_labels])
                    / truth)
                record[f"normal {kind} moved"] = label_contrast(values, genes, labels, batch, args.clone_batch,
                                                                args.normal) / truth
            for kind, chromosome in (("gain", "3"), ("loss", "12")):
                genes = modelled & inject_clones.segment_genes(adata.var, chromosome)
                truth = inject_clones.injected_shift(original, after, batch == args.artefact_batch, genes)
                record[f"artefact {kind} left"] = float(np.mean([
                    label_contrast(values, genes, labels, batch, args.artefact_batch, label)
                    for label in artefact_labels]) / truth)
            outside = batch != args.clone_batch
            regional = cnv.regional_artefact(values[outside][:, modelled], batch[outside], labels[outside],
                                             cnv.windows_of(adata.var[modelled]), seed=seed)
            record.update({"artefact above floor": regional["above_floor"], "floor": regional["floor"]})
            records.append(record)
            emit(records)
    return records


def floor_run(args) -> list[dict]:
    """The regional artefact between batches and its floor within groups (cnv.regional_artefact) of the whole
    file's layer, all genes: uncorrected log1p(counts per 10k over all genes), ComBat on them, batchfix's layer with
    regional_shift keep (the default) and keep_input."""
    adata = ad.read_h5ad(args.input)
    labels, batch = adata.obs[args.label_key].to_numpy(), adata.obs[args.batch_key].to_numpy()
    windows = cnv.windows_of(adata.var)
    uncorrected = dense(log_cp10k(dense(adata.X)))
    records = []
    for seed in args.seeds:
        model = batchfix.train(adata, batch_key=args.batch_key, seed=seed, **TRAIN_OPTIONS)
        matrices = {"uncorrected": uncorrected,
                    "ComBat": combat(uncorrected, adata.obs, args.batch_key).astype(np.float32)}
        for mode in ("keep", "keep_input"):
            corrected = batchfix.correct(adata, model, copy=True, regional_shift=mode)
            matrices[f"batchfix regional={mode}"] = dense(corrected.layers["batchfix"])
        for name, values in matrices.items():
            scores = cnv.regional_artefact(values, batch, labels, windows, seed=seed)
            records.append({"experiment": "floor", "seed": seed, "method": name, **scores,
                            "floor / uncorrected floor": None})
        base = next(r["floor"] for r in records if r["seed"] == seed and r["method"] == "uncorrected")
        for record in records:
            if record["seed"] == seed:
                record["floor / uncorrected floor"] = record["floor"] / base
        emit(records)
    return records


RUNS = {"profile": profile_run, "reference": reference_run, "floor": floor_run, "inject": inject_run, "confounded": confounded_run,
        "oligodendroglioma": oligodendroglioma_run}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=[*RUNS, "report"])
    parser.add_argument("input", nargs="?", default=str(batchfix.bundled_dataset()))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--labels", nargs="*", default=None, help="labels to run (default: every label)")
    parser.add_argument("--design", choices=inject_clones.DESIGNS, default="confounded")
    parser.add_argument("--gain", default="7")
    parser.add_argument("--loss", default="17")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--label-key", default="cell_type")
    parser.add_argument("--normal", default="H1975", help="reference: the label of the normal (reference) cells")
    parser.add_argument("--clone-batch", default="sc_celseq2_5cl_p3", help="reference: the batch of the clone")
    parser.add_argument("--artefact-batch", default="sc_dropseq", help="reference: the batch of the artefact")
    parser.add_argument("--mislabelled", type=float, default=0.0,
                        help="reference: share of the clone batch's cells named normal that are tumour cells")
    parser.add_argument("--extra", nargs="*", default=[], choices=["cellanova", "scvi"],
                        help="baselines beside ComBat (scvi: its decoded expression; counts in X only)")
    parser.add_argument("--reference-cells", action="store_true",
                        help="oligodendroglioma: the normal cells named reference cells (keep, keep_input beside)")
    parser.add_argument("--no-scib", dest="scib", action="store_false", help="skip the scIB Totals")
    parser.add_argument("--out", help="JSON file of the records")
    parser.add_argument("--reports", nargs="*", default=[], help="report: the JSON files to tabulate")
    parser.add_argument("--csv-dir", type=Path, help="report: also write each table as a CSV here (docs/results)")
    args = parser.parse_args(argv)
    for module in args.extra:
        if missing_module(module):
            parser.error(f"--extra {module}: {missing_module(module)}")
    if args.experiment == "report":
        print(report(args.reports, args.csv_dir))
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.update(path=args.out, command=" ".join(["python", "-m", "scripts.cnv_benchmark", *sys.argv[1:]]))
    RUNS[args.experiment](args)


if __name__ == "__main__":
    main()
