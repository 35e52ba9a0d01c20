"""Pseudobulk DE of a planted condition on raw, ComBat-seq and corrected counts, and the detection / false-DE
scores of batchfix.eval.detection on each matrix.

Methods (each a cells x genes counts matrix; pydeseq2 on counts summed per sample within each cell type):
raw counts with batch as a covariate (~ batch + condition), raw counts (~ condition), ComBat-seq counts
(inmoose's pycombat_seq) without and with `group=condition` (~ condition), and every `--layer` of the input
(e.g. batchfix_counts) twice: ~ condition, and ~ batch + condition (row LAYER+covariate: the batch shifts a
correction estimated from the same cells spend degrees of freedom a design without batch does not count, which
makes its p-values over-confident, Nygaard et al. 2016). A gene is called at padj < 0.05; against the truth of a
DE stress set (scripts/de_stress.py: var['de'], var['null_gene']), pooled over the cell types: precision and recall
of the planted genes, the false-DE rate on the null genes (no batch effect, not planted), and the share of null
genes with an unadjusted p < 0.05 (a calibrated test's is 0.05). On each matrix: false DE
between batches within each cell type (normalize_total(1e4) + log1p; calls on genes with zero raw counts in both
groups; the rate on the null genes), and detection calibration against the stress set's pre-batch counts
(layers['truth'], its nonzero cells the expected shares) and the share of observed zeros raised. A file without
a stress truth (the bundled data) gets the matrix scores only, the expected shares from a batch-free NB reference
(per cell type rate, the cell's library, one theta per gene by moments).

Stated in advance, before any batchfix counts were scored here: on the multiplicative design (where the covariate
GLM and ComBat-seq with group= are correctly specified) batchfix ties them when its precision and its recall are
each within 0.05 of ComBat-seq with group= (pooled over the cell types, same seed); on the state design batchfix
should beat ComBat-seq with and without group= (fitted across the cell types): recall above both, precision no
more than 0.05 below either. Against raw counts with batch as a covariate it can at best tie there (within 0.05,
as above): DE is run within each cell type, where a batch effect that differs by cell type is again one factor
per gene and batch, so the covariate GLM stays correctly specified. And on every matrix: no call between batches
on a gene with zero raw counts in both groups, and a false-DE rate on the null genes no higher than raw counts
with batch as a covariate.

    python -m scripts.de_benchmark de_mult.h5ad --out de_mult.csv
    python -m scripts.de_benchmark corrected.h5ad --layer batchfix_counts --out de.csv
    python -m scripts.de_benchmark data/cellbench5.h5ad --methods combat-seq --out bundled_detection.csv
"""
from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp

from batchfix.eval.detection import detection_calibration, false_de, reference_nonzero
from scripts import baselines

PADJ = 0.05
BASELINES = ("raw+covariate", "raw", "combat-seq", "combat-seq+group")
EXTRA_HINT = "pip install -e '.[bench]'"


def require(module: str):
    """Import an optional baseline's module, or fail naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise SystemExit(f"{module} is needed here; it is in the bench extra: {EXTRA_HINT}") from error


def method_counts(adata: ad.AnnData, methods: list[str], layers: list[str]) -> dict[str, tuple]:
    """Method name -> (cells x genes counts, whether the DE design has batch as a covariate)."""
    raw = sp.csr_matrix(adata.X, dtype=np.float32)
    batches = adata.obs["batch"].astype(str).to_numpy()
    out = {}
    for method in methods:
        if method.startswith("raw"):
            out[method] = (raw, method == "raw+covariate")
        else:
            group = adata.obs["condition"].astype(str).to_numpy() if method.endswith("+group") else None
            require("inmoose.pycombat")
            out[method] = (baselines.combat_seq(raw, batches, group), False)
    for layer in layers:
        counts = sp.csr_matrix(adata.layers[layer], dtype=np.float32)
        out[layer], out[f"{layer}+covariate"] = (counts, False), (counts, True)
    return out


def pseudobulk(counts: sp.csr_matrix, obs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(samples x genes summed counts, samples' batch and condition) of the given cells."""
    samples = obs["sample"].astype(str).to_numpy()
    names, codes = np.unique(samples, return_inverse=True)
    onehot = sp.csr_matrix((np.ones(len(codes)), (codes, np.arange(len(codes)))), shape=(len(names), len(codes)))
    summed = np.asarray((onehot @ counts).toarray(), dtype=np.int64)
    meta = obs.assign(sample=samples).drop_duplicates("sample").set_index("sample").loc[names]
    meta = meta[["batch", "condition"]].astype(str)
    return pd.DataFrame(summed, index=names, columns=[f"g{i}" for i in range(counts.shape[1])]), meta


def deseq_p(summed: pd.DataFrame, meta: pd.DataFrame, covariate: bool) -> tuple[np.ndarray, np.ndarray]:
    """pydeseq2's p and adjusted p of condition B against A (NaN -> 1), with batch as a covariate or not."""
    dds_module = require("pydeseq2.dds")
    from pydeseq2.default_inference import DefaultInference
    from pydeseq2.ds import DeseqStats

    factors = ["batch", "condition"] if covariate else ["condition"]
    kwargs = {"inference": DefaultInference(n_cpus=1), "quiet": True}
    if "design" in inspect.signature(dds_module.DeseqDataSet).parameters:
        kwargs["design"] = "~" + " + ".join(factors)
    else:
        kwargs["design_factors"] = factors
    dds = dds_module.DeseqDataSet(counts=summed, metadata=meta, **kwargs)
    dds.deseq2()
    stats = DeseqStats(dds, contrast=["condition", "B", "A"], inference=DefaultInference(n_cpus=1), quiet=True)
    stats.summary()
    results = stats.results_df.reindex(summed.columns)
    return results["pvalue"].fillna(1.0).to_numpy(), results["padj"].fillna(1.0).to_numpy()


def de_scores(counts: sp.csr_matrix, covariate: bool, adata: ad.AnnData) -> dict:
    """Precision and recall of the planted genes, the false-DE rate on the null genes and their share at p < PADJ
    unadjusted, pooled over cell types."""
    planted, null = adata.var["de"].to_numpy(), (adata.var["null_gene"] & ~adata.var["de"]).to_numpy()
    hits = called = missed = null_called = null_nominal = null_total = 0
    for label in sorted(adata.obs["cell_type"].astype(str).unique()):
        cells = (adata.obs["cell_type"].astype(str) == label).to_numpy()
        p, padj = deseq_p(*pseudobulk(counts[cells], adata.obs[cells]), covariate)
        calls = padj < PADJ
        hits, called, missed = hits + (calls & planted).sum(), called + calls.sum(), missed + (~calls & planted).sum()
        null_called, null_total = null_called + (calls & null).sum(), null_total + null.sum()
        null_nominal += (null & (p < PADJ)).sum()
    return {"precision": hits / called if called else float("nan"), "recall": hits / (hits + missed),
            "null_false_de": null_called / null_total if null_total else float("nan"),
            "null_p_below_0.05": null_nominal / null_total if null_total else float("nan")}


def matrix_scores(counts: sp.csr_matrix, adata: ad.AnnData) -> dict:
    """False DE between batches within each cell type and detection calibration of one method's counts."""
    raw = sp.csr_matrix(adata.X, dtype=np.float32)
    labels = adata.obs["cell_type"].astype(str).to_numpy()
    batches = adata.obs["batch"].astype(str).to_numpy()
    log = ad.AnnData(X=counts.copy())
    sc.pp.normalize_total(log, target_sum=1e4)
    sc.pp.log1p(log)
    null = adata.var["null_gene"].to_numpy() if "null_gene" in adata.var else None
    calls = false_de(sp.csr_matrix(log.X), raw, labels, batches, null_genes=null)
    if "truth" in adata.layers:
        expected = (sp.csr_matrix(adata.layers["truth"]) > 0).toarray()
    else:
        expected = reference_nonzero(raw, labels)
    detection, _ = detection_calibration(counts, raw, expected, labels, batches)
    scores = {"between_batch_calls": int(calls["called"].sum()),
              "calls_zero_raw": int(calls["called_zero_raw"].sum())}
    if null is not None:
        scores["null_between_batch_rate"] = float(calls["null_called"].sum() / (null.sum() * len(calls)))
    return {**scores, **{f"detection_{key}": value for key, value in detection.items()}}


def top_detected(adata: ad.AnnData, n_genes: int) -> ad.AnnData:
    """The `n_genes` genes detected in the most cells (all when 0), raw counts as CSR."""
    if n_genes and adata.n_vars > n_genes:
        detected = np.asarray((sp.csr_matrix(adata.X) > 0).sum(axis=0)).ravel()
        adata = adata[:, np.sort(np.argsort(-detected, kind="stable")[:n_genes])]
    adata = adata.copy()
    adata.X = sp.csr_matrix(adata.X, dtype=np.float32)
    return adata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help=".h5ad: a DE stress set (scripts/de_stress.py) or any file with raw counts")
    parser.add_argument("--layer", action="append", default=[], help="a corrected-counts layer to score (repeat)")
    parser.add_argument("--methods", nargs="+", default=list(BASELINES), choices=BASELINES)
    parser.add_argument("--n-genes", type=int, default=2000, help="most-detected genes kept (0: all)")
    parser.add_argument("--out", type=Path, help="CSV of the table")
    args = parser.parse_args()
    adata = top_detected(ad.read_h5ad(args.input), args.n_genes)
    has_truth = "de" in adata.var and "sample" in adata.obs
    rows = []
    for name, (counts, covariate) in method_counts(adata, args.methods, args.layer).items():
        row = {"method": name, **(de_scores(counts, covariate, adata) if has_truth else {})}
        rows.append({**row, **matrix_scores(counts, adata)})
        print(pd.DataFrame([rows[-1]]).to_string(index=False, float_format="%.4f"), flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format="%.4f"))
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
