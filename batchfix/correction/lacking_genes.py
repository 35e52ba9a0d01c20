"""Genes a whole batch lacks as biology: none of its cells has a count of them (`absent_from_batches`), or a
sex-linked set of them it holds at an ambient level (`lacking_sex_linked`). Their shifts are not applied, its depth
does not raise them and the batch is left out of their average reference (batchfix.correction.evidence).

A donor's sex is constitutional: a female donor has no chrY genes and a male donor's cells do not express XIST
(X inactivation). Their counts are not zero for it: ambient RNA, barcode swaps and doublets in a run shared with
cells of the other sex leave a few counts in a few cells, and a gene the batch has any count of is not
`absent_from_batches`. Its shift is then measured beside the other batches' full
level (a difference far beyond its noise) and applied whole, which gives the gene to most of the donor's cells.

The genome tells this apart from a chemistry's weak capture: a chromosome's genes (chrY's, or the X-inactivation
transcripts) are absent together. Per batch, the share of its counts on each such gene set is compared with the
batch expressing the set most; a batch below AMBIENT_SHARE of that lacks every gene of the set, as a batch with no
count of a gene lacks it (evidence: no shift, no depth, not a member of the gene's average reference). A batch of
donors of both sexes holds the set at about half the level and is corrected as before. The pseudoautosomal regions'
genes are on X and Y in both sexes: a gene placed on chrY there (an annotation may place it on both) is not chrY's.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from batchfix.data.genome import SYMBOL_COLUMNS, place_genes

X_INACTIVATION = ("XIST", "TSIX")  # expressed from the inactive X: female cells only
AMBIENT_SHARE = 0.1  # a batch holding a sex-linked set at under a tenth of the most expressing batch's share lacks it
PSEUDOAUTOSOMAL_Y = {  # chrY's pseudoautosomal regions (1-based, inclusive) of each bundled genome
    "GRCh38": ((10_001, 2_781_479), (56_887_903, 57_217_415)),
    "mm10": ((90_745_845, 91_644_698),),
}


def sex_linked_sets(var: pd.DataFrame, genome: str) -> list[np.ndarray]:
    """The input columns of each sex-linked gene set the input holds: the genes placed on chrY outside its
    pseudoautosomal regions, the X-inactivation transcripts (by name: var_names or a symbol column); empty sets left
    out."""
    placed = place_genes(var, genome, quiet=True)  # the output's var columns log the placement
    chromosome = placed.chromosome
    pseudoautosomal = np.zeros(len(var), dtype=bool)
    for first, last in PSEUDOAUTOSOMAL_Y.get(genome, ()):
        pseudoautosomal |= (chromosome == "Y") & (placed.start >= first) & (placed.start <= last)
    names = [pd.Series(var.index.astype(str))] + [pd.Series(var[c].astype(str).to_numpy()) for c in SYMBOL_COLUMNS
                                                  if c in var]
    x_inactivation = np.zeros(len(var), dtype=bool)
    for values in names:
        x_inactivation |= values.str.upper().isin(X_INACTIVATION).to_numpy()
    on_y = (chromosome == "Y") & ~pseudoautosomal
    sets = [np.flatnonzero(on_y), np.flatnonzero(x_inactivation & (chromosome != "Y"))]
    return [columns for columns in sets if len(columns)]


def lacking_sex_linked(counts: np.ndarray, n_cells: np.ndarray, sets: list[np.ndarray], min_cells: int) -> np.ndarray:
    """(codes, columns) bool: the sex-linked genes each batch lacks (module docstring), from each batch code's total
    `counts` of every input column (codes, columns) and its cells `n_cells` (codes,); a batch of fewer than
    `min_cells` cells is not judged."""
    lacking = np.zeros(counts.shape, dtype=bool)
    library = counts.sum(axis=1)
    judged = (n_cells >= min_cells) & (library > 0)
    for columns in sets:
        share = np.where(judged, counts[:, columns].sum(axis=1) / np.maximum(library, 1.0), 0.0)  # (codes,)
        below = judged & (share < AMBIENT_SHARE * share.max(initial=0.0))
        lacking[np.ix_(below, columns)] = True
    return lacking


def absent_from_batches(counts: np.ndarray, n_cells: np.ndarray, min_cells: int) -> np.ndarray:
    """(codes, genes) bool: the batch, of at least `min_cells` cells, has no count of the gene in any of them (it
    lacks the gene as biology), from each batch's total `counts` (codes, genes) and its cells `n_cells` (codes,)."""
    return (counts == 0) & (n_cells[:, None] >= min_cells)


def set_lacking(genes, lacking: np.ndarray) -> np.ndarray:
    """(codes, decoder genes) bool: `lacking` (codes, input columns) in a gene set's decoder order (False where the
    input lacks the gene)."""
    placed = np.zeros((len(lacking), len(genes.present)), dtype=bool)
    placed[:, genes.model_index] = lacking[:, genes.columns]
    return placed


def unless_lacking(weight: np.ndarray, lacking: np.ndarray | None) -> np.ndarray:
    """`weight` (codes, [groups,] genes) set to 0 for the genes each batch lacks (`lacking` (codes, genes) or None)."""
    if lacking is None:
        return weight
    return np.where(lacking[:, None, :] if weight.ndim == 3 else lacking, 0.0, weight)


def unshifted(lacking: np.ndarray | None, reference: int | None) -> np.ndarray | None:
    """(codes, genes) bool: the genes whose counts or values of a batch are not shifted: those it lacks and, with a
    named `reference` batch, those the reference lacks (no batch is shifted toward its absence)."""
    if lacking is None or reference is None:
        return lacking
    return lacking | lacking[reference][None, :]


def member_mean(values: np.ndarray, members: np.ndarray | None) -> np.ndarray:
    """(G,) the mean over the training batches of `values` (batches, G), each gene's over its `members` (batches, G)
    bool, the batches that do not lack it (None: every batch): an average reference's level."""
    return values.mean(axis=0) if members is None else (values * members).sum(axis=0) / members.sum(axis=0)
