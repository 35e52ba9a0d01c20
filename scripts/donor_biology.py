"""A donor-biology known-answer set: genes made biologically absent from one whole batch (every count of the batch
set to zero, as a gene a donor does not carry or a sex-chromosome gene of the other sex), and its score on a
corrected file: a corrector should not give the emptied batch counts of them, nor take them from the others.

`build` picks, among genes placed on an autosome and detected in the emptied batch before, two at random (seeded)
of each expression level: detected in about 90 %, 50 % and 20 % of the other batches' cells (within 0.05); and a
sex-chromosome gene: the chrY gene detected in most cells, else XIST, else the chrX gene detected nearest half the
cells (the bundled data has no chrY gene: XIST, which its female lines express). `uns['donor_biology']` records the
batch, the genes, their level and their detection in the batch before it was emptied.

`score`: for each gene, `emptied_share`, the share of the emptied batch's cells with corrected counts > 0 (target <=
0.05), and `kept_ratio`, the share of the other batches' cells with corrected counts > 0 over their raw share (target
>= 0.8); `control_kept_ratio`, the median kept ratio of the genes not emptied whose raw share in the other batches is
within 0.05 of the gene's, tells a loss the emptying caused from what the correction does to any gene of that level.

    python -m scripts.donor_biology build data/cellbench5.h5ad donor.h5ad --batch sc_celseq2_5cl_p1 --seed 0
    python -m scripts.donor_biology build ... --ambient 0.02   # 2 % of the batch's cells keep one count of each
    python -m scripts.donor_biology score donor.h5ad run/corrected.h5ad --layer batchfix_counts
    python -m scripts.donor_biology combat-seq donor.h5ad donor.combat_seq.h5ad   # then score --layer combat_seq

`combat-seq` writes the set with ComBat-seq's adjusted counts of it (inmoose, no covariate; scripts/baselines.py)
in layers['combat_seq'], the baseline scored beside the corrector.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from batchfix.data.atomic import atomic_output, refuse_existing
from batchfix.errors import OutputExistsError

LEVELS = {"high": 0.9, "mid": 0.5, "low": 0.2}  # detection share in the other batches' cells
LEVEL_WINDOW = 0.05
GENES_PER_LEVEL = 2
MIN_EMPTIED_SHARE = 0.05  # a chosen gene was detected in at least this share of the emptied batch before
EMPTIED_TARGET = 0.05
KEPT_TARGET = 0.8
SEX_GENE = "XIST"


def detection(counts, rows: np.ndarray) -> np.ndarray:
    """Per gene, the share of the given cells with a positive count."""
    return np.asarray((counts[rows] > 0).mean(axis=0)).ravel()


def sex_gene(var: pd.DataFrame, others: np.ndarray, emptied: np.ndarray) -> int | None:
    """Column of the sex-chromosome gene (see the module's docstring), or None when no such gene is expressed."""
    chromosome = var["chromosome"].astype(str).str.removeprefix("chr").to_numpy()
    usable = emptied >= MIN_EMPTIED_SHARE
    on_y = np.flatnonzero((chromosome == "Y") & usable)
    if len(on_y):
        return int(on_y[np.argmax(others[on_y])])
    symbol = var["gene_symbol"].astype(str).to_numpy() if "gene_symbol" in var else var.index.to_numpy()
    xist = np.flatnonzero((symbol == SEX_GENE) & (chromosome == "X") & usable)
    if len(xist):
        return int(xist[0])
    on_x = np.flatnonzero((chromosome == "X") & usable)
    return int(on_x[np.argmin(np.abs(others[on_x] - 0.5))]) if len(on_x) else None


def choose_genes(adata: ad.AnnData, rows: np.ndarray, seed: int) -> dict[int, str]:
    """Column -> level of the genes to empty in the cells `rows` (see the module's docstring)."""
    counts = sp.csr_matrix(adata.X)
    other_rows = np.setdiff1d(np.arange(adata.n_obs), rows)
    others, emptied = detection(counts, other_rows), detection(counts, rows)
    chromosome = adata.var["chromosome"].astype(str).str.removeprefix("chr")
    autosomal = chromosome.isin([str(n) for n in range(1, 23)]).to_numpy() & (emptied >= MIN_EMPTIED_SHARE)
    rng = np.random.default_rng(seed)
    chosen = {}
    for level, share in LEVELS.items():
        near = np.flatnonzero(autosomal & (np.abs(others - share) <= LEVEL_WINDOW))
        if len(near) < GENES_PER_LEVEL:
            raise ValueError(f"fewer than {GENES_PER_LEVEL} autosomal genes are detected in {share:.0%} of the cells")
        chosen.update({int(g): level for g in rng.choice(near, GENES_PER_LEVEL, replace=False)})
    sex = sex_gene(adata.var, others, emptied)
    if sex is not None:
        chosen[sex] = "sex chromosome"
    return chosen


def build(adata: ad.AnnData, batch: str, seed: int = 0, batch_key: str = "batch", ambient: float = 0.0) -> ad.AnnData:
    """A copy of `adata` (raw counts in X) with the chosen genes set to zero in every cell of `batch`; with
    `ambient`, that share of the batch's cells (drawn with `seed`) keeps one count of each, as ambient RNA or
    doublets from other donors leave a few counts of a gene a donor does not carry."""
    batches = adata.obs[batch_key].astype(str).to_numpy()
    if batch not in set(batches):
        raise ValueError(f"{batch} is not in obs['{batch_key}']; present: {sorted(set(batches))}")
    rows = np.flatnonzero(batches == batch)
    chosen = choose_genes(adata, rows, seed)
    columns = np.array(sorted(chosen))
    out = adata.copy()
    counts = sp.lil_matrix(sp.csr_matrix(out.X)) if sp.issparse(out.X) else np.array(out.X)
    before = detection(sp.csr_matrix(out.X), rows)[columns]
    counts[np.ix_(rows, columns)] = 0
    if ambient > 0:
        rng = np.random.default_rng(seed + 1)
        for column in columns:
            counts[rng.choice(rows, max(1, round(ambient * len(rows))), replace=False), column] = 1
    out.X = sp.csr_matrix(counts) if sp.issparse(out.X) else counts
    out.uns["donor_biology"] = {"batch": batch, "batch_key": batch_key, "seed": seed, "ambient": ambient,
                                "genes": out.var_names[columns].to_numpy().astype(str),
                                "levels": np.array([chosen[c] for c in columns]),
                                "emptied_share_before": before}
    return out


def control_kept_ratios(donor: ad.AnnData, corrected: ad.AnnData, layer: str, rows: np.ndarray,
                        raw_shares: pd.Series) -> np.ndarray:
    """For each emptied gene, the median kept ratio in the cells `rows` of the genes not emptied whose raw share
    there is within LEVEL_WINDOW of its own: what the correction does to any gene of that level."""
    genes = donor.var_names.difference(raw_shares.index)
    raw = detection(sp.csr_matrix(donor[:, genes].X), rows)
    fixed = detection(sp.csr_matrix(corrected[donor.obs_names, genes].layers[layer]), rows)
    ratios = np.divide(fixed, raw, out=np.full(len(raw), np.nan), where=raw > 0)
    return np.array([np.nanmedian(ratios[np.abs(raw - share) <= LEVEL_WINDOW]) for share in raw_shares])


def score(donor: ad.AnnData, corrected: ad.AnnData, layer: str) -> pd.DataFrame:
    """Per emptied gene: the emptied batch's cells given counts, and the other batches' detection kept."""
    manifest = donor.uns["donor_biology"]
    genes = pd.Index(np.asarray(manifest["genes"]).astype(str))
    missing = donor.obs_names.difference(corrected.obs_names).union(genes.difference(corrected.var_names))
    if len(missing) or layer not in corrected.layers:
        raise SystemExit(f"the corrected file lacks {len(missing)} cells or genes of the set, or layers['{layer}']")
    in_batch = (donor.obs[manifest["batch_key"]].astype(str) == manifest["batch"]).to_numpy()
    raw = sp.csr_matrix(donor[:, genes].X)
    fixed = sp.csr_matrix(corrected[donor.obs_names, genes].layers[layer])
    rows_in, rows_out = np.flatnonzero(in_batch), np.flatnonzero(~in_batch)
    table = pd.DataFrame({"level": np.asarray(manifest["levels"]).astype(str),
                          "emptied_share_before": np.asarray(manifest["emptied_share_before"]),
                          "emptied_share": detection(fixed, rows_in),
                          "others_raw_share": detection(raw, rows_out),
                          "others_corrected_share": detection(fixed, rows_out)}, index=genes)
    table["kept_ratio"] = table["others_corrected_share"] / table["others_raw_share"]
    table["control_kept_ratio"] = control_kept_ratios(donor, corrected, layer, rows_out, table["others_raw_share"])
    table["passes"] = (table["emptied_share"] <= EMPTIED_TARGET) & (table["kept_ratio"] >= KEPT_TARGET)
    if "gene_symbol" in donor.var:
        table.insert(0, "symbol", donor.var.loc[genes, "gene_symbol"].astype(str).to_numpy())
    return table


def write_combat_seq(donor_path: Path, output: Path) -> None:
    """The set with ComBat-seq's adjusted counts of it in layers['combat_seq'] (never over an existing file)."""
    from scripts.baselines import combat_seq

    refuse_existing(output, overwrite=False)
    donor = ad.read_h5ad(donor_path)
    batches = donor.obs[donor.uns["donor_biology"]["batch_key"]].astype(str).to_numpy()
    donor.layers["combat_seq"] = combat_seq(sp.csr_matrix(donor.X, dtype=np.float32), batches)
    with atomic_output(output, overwrite=False) as tmp:
        donor.write_h5ad(tmp)
    print(f"Wrote {output}: layers['combat_seq']")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    make = verbs.add_parser("build", help="write the known-answer set")
    make.add_argument("input", help=".h5ad with raw counts in X and var['chromosome']")
    make.add_argument("output", help=".h5ad written (never over an existing file)")
    make.add_argument("--batch", required=True, help="the batch the genes are emptied in")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--batch-key", default="batch")
    make.add_argument("--ambient", type=float, default=0.0,
                      help="share of the batch's cells that keep one count of each emptied gene (ambient RNA)")
    seq = verbs.add_parser("combat-seq", help="write the set with ComBat-seq's counts in layers['combat_seq']")
    seq.add_argument("donor", help="the set (.h5ad)")
    seq.add_argument("output", help=".h5ad written (never over an existing file)")
    rate = verbs.add_parser("score", help="score a corrected file of the set")
    rate.add_argument("donor", help="the set (.h5ad) the corrector was given")
    rate.add_argument("corrected", help="the corrected file (.h5ad)")
    rate.add_argument("--layer", default="batchfix_counts", help="its corrected counts layer")
    rate.add_argument("--out", type=Path, help="JSON written (default: <corrected name>.donor_scores.json here)")
    args = parser.parse_args(argv)
    if args.verb == "build":
        try:
            refuse_existing(Path(args.output), overwrite=False)
            out = build(ad.read_h5ad(args.input), args.batch, args.seed, args.batch_key, args.ambient)
        except (ValueError, OutputExistsError) as error:
            parser.error(str(error))
        with atomic_output(Path(args.output), overwrite=False) as tmp:
            out.write_h5ad(tmp)
        genes = [str(gene) for gene in out.uns["donor_biology"]["genes"]]
        print(f"Wrote {args.output}: genes {genes} emptied in {args.batch}")
        return
    if args.verb == "combat-seq":
        write_combat_seq(Path(args.donor), Path(args.output))
        return
    table = score(ad.read_h5ad(args.donor), ad.read_h5ad(args.corrected), args.layer)
    print(table.to_string(float_format="%.3f"))
    out = args.out or Path.cwd() / (Path(args.corrected).stem + ".donor_scores.json")
    with atomic_output(out, overwrite=True) as tmp:
        tmp.write_text(json.dumps({"targets": {"emptied_share_at_most": EMPTIED_TARGET,
                                               "kept_ratio_at_least": KEPT_TARGET},
                                   "genes": table.reset_index(names="gene").to_dict(orient="records")}, indent=2))
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
