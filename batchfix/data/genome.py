"""Genome coordinates for genes, genomic ordering, and locus windows (the model's tokens).

Coordinates come from `var` (`chromosome`, `start`, `end`), then from a user GTF when given,
else from the bundled GRCh38/mm10 tables (Ensembl ID first, version suffix stripped, then
symbol, case-insensitive). Genes that stay unplaced go to a trailing group.
"""
from __future__ import annotations

import functools
import gzip
import logging
import re
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from batchfix.config import GENOMES, DataConfig
from batchfix.errors import InputError

log = logging.getLogger(__name__)

# Fixed vocabulary so a checkpoint's chromosome codes mean the same thing on any file.
CHROMOSOMES = [str(i) for i in range(1, 23)] + ["X", "Y", "MT", "other", "unplaced"]
CHROMOSOME_CODE = {name: code for code, name in enumerate(CHROMOSOMES)}
UNPLACED = CHROMOSOME_CODE["unplaced"]
SYMBOL_COLUMNS = ("gene_symbol", "gene_symbols", "gene_name", "feature_name", "symbol")
ID_COLUMNS = ("gene_id", "gene_ids", "ensembl_id", "gene_ensembl")


def canonical_chromosome(name) -> str | None:
    """'chr1' -> '1', 'chrM'/'M' -> 'MT'; None for missing values."""
    if name is None or (isinstance(name, float) and np.isnan(name)):
        return None
    text = str(name).strip()
    if isinstance(name, (float, np.floating)) and float(name).is_integer():
        text = str(int(name))  # a numeric column with gaps is stored as float: 1.0 -> '1'
    if text in ("", "nan", "None", "NA"):
        return None
    if text.lower().startswith("chr"):
        text = text[3:]
    text = text.upper() if text.upper() in ("X", "Y", "M", "MT") else text
    return "MT" if text in ("M", "MT") else text


def chromosome_sort_key(name: str) -> tuple:
    """Order 1..22 (or 1..19), X, Y, MT, then the rest by name."""
    if name.isdigit():
        return (0, int(name), "")
    return {"X": (1, 0, ""), "Y": (2, 0, ""), "MT": (3, 0, "")}.get(name, (4, 0, name))


def chromosome_code(name: str | None) -> int:
    if name is None:
        return UNPLACED
    return CHROMOSOME_CODE.get(name, CHROMOSOME_CODE["other"])


VERSION_SUFFIX = r"\.\d+$"  # an Ensembl ID's version: ENSG00000141510.17


def strip_version(gene_id: str) -> str:
    """ENSG00000141510.17 -> ENSG00000141510."""
    return re.sub(VERSION_SUFFIX, "", str(gene_id))


def unversioned(gene_ids: pd.Series) -> pd.Series:
    """`strip_version` of every value, as strings."""
    return gene_ids.astype(str).str.replace(VERSION_SUFFIX, "", regex=True)


def bundled_gene_table(genome: str) -> pd.DataFrame:
    """The bundled coordinate table: columns symbol, gene_id, chromosome, start, end (a copy of the one read)."""
    if genome not in GENOMES:
        raise ValueError(f"Unknown data.genome '{genome}'. Bundled genomes: {list(GENOMES)}; or pass data.gtf=<file>.")
    return read_bundled_table(genome).copy()


@functools.lru_cache(maxsize=None)
def read_bundled_table(genome: str) -> pd.DataFrame:
    """The bundled table as read once per process (train, correct and their checks place genes several times)."""
    with resources.files("batchfix.data.genes").joinpath(f"{genome}.genes.tsv.gz").open("rb") as fh:
        table = pd.read_csv(fh, sep="\t", compression="gzip", dtype={"chr": str})
    return table.rename(columns={"GeneName": "symbol", "GeneID": "gene_id", "chr": "chromosome", "stop": "end"})


def read_gtf(path: str | Path) -> pd.DataFrame:
    """Gene records of a GTF file (plain or .gz): columns symbol, gene_id, chromosome, start, end."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"data.gtf={path} is a folder, not a GTF file." if path.is_dir()
                         else f"GTF file not found (data.gtf): {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as fh:
            gtf = pd.read_csv(
                fh, sep="\t", comment="#", header=None, usecols=[0, 2, 3, 4, 8],
                names=["chromosome", "feature", "start", "end", "attributes"], dtype={0: str},
            )
    # unreadable, not gzip, cut short (a truncated .gz), not tab-separated text
    except (OSError, EOFError, zlib.error, ValueError, UnicodeDecodeError) as err:
        raise InputError(f"Cannot read data.gtf={path} as a GTF file: {type(err).__name__}: {err}") from None
    genes = gtf[gtf["feature"] == "gene"]
    if genes.empty:
        raise InputError(f"GTF {path} has no 'gene' records (column 3).")
    start, end = (pd.to_numeric(genes[column], errors="coerce") for column in ("start", "end"))
    if start.isna().any() or end.isna().any():
        raise InputError(f"GTF {path}: {int((start.isna() | end.isna()).sum())} gene records have a start or end "
                         "(columns 4 and 5) that is not a number.")
    return pd.DataFrame({
        "symbol": genes["attributes"].astype(str).str.extract(r'gene_name "([^"]+)"', expand=False),
        "gene_id": genes["attributes"].astype(str).str.extract(r'gene_id "([^"]+)"', expand=False),
        "chromosome": genes["chromosome"].astype(str),
        "start": start.astype(np.int64),
        "end": end.astype(np.int64),
    })


def lookup_in_table(var: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Match genes to a coordinate table by Ensembl ID (unversioned), then by symbol (case-insensitive)."""
    by_id = table.dropna(subset=["gene_id"]).assign(key=lambda t: unversioned(t["gene_id"]))
    by_id = by_id.drop_duplicates("key").set_index("key")
    by_symbol = table.dropna(subset=["symbol"]).assign(key=lambda t: t["symbol"].str.upper())
    by_symbol = by_symbol.drop_duplicates("key").set_index("key")

    # Positional (RangeIndex) throughout: var_names need not be unique.
    found = pd.DataFrame(index=pd.RangeIndex(len(var)), columns=["chromosome", "start", "end"], dtype=object)
    id_candidates = [pd.Series(var.index.to_numpy())] + [pd.Series(var[c].to_numpy()) for c in ID_COLUMNS if c in var]
    symbol_candidates = [pd.Series(var.index.to_numpy())] + [
        pd.Series(var[c].to_numpy()) for c in SYMBOL_COLUMNS if c in var
    ]
    for candidates, lookup, transform in (
        (id_candidates, by_id, unversioned),
        (symbol_candidates, by_symbol, lambda names: names.astype(str).str.upper()),
    ):
        for names in candidates:
            missing = found["chromosome"].isna()
            if not missing.any():
                break
            keys = transform(names[missing])
            hit = keys.isin(lookup.index)
            rows = lookup.loc[keys[hit].to_numpy(), ["chromosome", "start", "end"]]
            found.loc[keys[hit].index, ["chromosome", "start", "end"]] = rows.to_numpy()
    found.index = var.index
    return found


@dataclass
class GeneCoordinates:
    """Per-gene coordinates aligned with the var index it was built from."""

    chromosome: np.ndarray  # (genes,) canonical name, or None when unplaced
    start: np.ndarray  # (genes,) int64, 0 when unplaced
    end: np.ndarray  # (genes,) int64, 0 when unplaced

    @property
    def placed(self) -> np.ndarray:
        return np.array([c is not None for c in self.chromosome])

    def genomic_order(self) -> np.ndarray:
        """Permutation putting genes in genomic order; unplaced genes trail in their file order."""
        placed = np.flatnonzero(self.placed)
        unplaced = np.flatnonzero(~self.placed)
        keys = [chromosome_sort_key(self.chromosome[i]) + (int(self.start[i]), i) for i in placed]
        order = [placed[j] for j in sorted(range(len(placed)), key=keys.__getitem__)]
        return np.concatenate([np.asarray(order, dtype=np.int64), unplaced.astype(np.int64)])

    def subset(self, index: np.ndarray) -> "GeneCoordinates":
        return GeneCoordinates(self.chromosome[index], self.start[index], self.end[index])


VAR_PLACE = ("chromosome", "start", "end")  # the var columns that place a gene (base pairs)


def coordinates_from_var(var: pd.DataFrame) -> pd.DataFrame | None:
    """var's chromosome, start and end (positional index; chromosome None where var places no gene), None when var
    has none of them; some of the three without the others, or a placed gene without a numeric start and end, is
    refused."""
    present = [c for c in VAR_PLACE if c in var.columns]
    if not present:
        return None
    if len(present) < len(VAR_PLACE):
        absent = [c for c in VAR_PLACE if c not in present]
        raise InputError(f"var has {present} but no {absent}: genes are placed from var with all of chromosome, "
                         "start and end (base pairs). Add the missing column(s), or remove these to place genes by "
                         "name (data.genome, data.gtf).")
    from_var = var[list(VAR_PLACE)].reset_index(drop=True)
    from_var["chromosome"] = from_var["chromosome"].astype(object).map(canonical_chromosome)
    placed = from_var["chromosome"].notna()
    for column in ("start", "end"):
        values = pd.to_numeric(from_var[column], errors="coerce")
        bad = placed & values.isna()
        if bad.any():
            raise InputError(f"var['{column}'] of {int(bad.sum())} genes with a chromosome is not a number "
                             f"(e.g. gene {var.index[int(np.flatnonzero(bad)[0])]!r}).")
    return from_var


def exact_share(var: pd.DataFrame, table: pd.DataFrame) -> float:
    """The share of var's genes whose name, symbol or (unversioned) Ensembl ID is in `table` as written: case
    tells mouse symbols (Actb) from human ones (ACTB), which the case-insensitive lookup does not."""
    keys = set(table["symbol"].dropna()) | set(unversioned(table["gene_id"].dropna()))
    names = [var.index.to_series()] + [var[c] for c in (*ID_COLUMNS, *SYMBOL_COLUMNS) if c in var]
    hit = np.zeros(len(var), dtype=bool)
    for column in names:
        hit |= unversioned(column).isin(keys).to_numpy()
    return float(hit.mean()) if len(var) else 0.0


def refuse_if_another_genome_fits(var: pd.DataFrame, genome: str, table: pd.DataFrame) -> None:
    """Refuse genes named as another bundled genome's (mouse symbols or IDs with GRCh38, human ones with mm10):
    placed by the lookup anyway, they would sit on the wrong coordinates (or on none) and train a model of a
    genomic order that is not theirs."""
    if len(var) < 20:
        return
    own = exact_share(var, table)
    for other in (g for g in GENOMES if g != genome):
        theirs = exact_share(var, bundled_gene_table(other))
        if theirs >= 0.5 and theirs > 2 * own:
            raise InputError(f"The gene names look like {other}'s, not {genome}'s ({100 * theirs:.0f}% match the "
                             f"{other} table as written, {100 * own:.0f}% the {genome} one): set data.genome={other} "
                             "(or data.gtf=<annotation>, or coordinates in var).")


def place_genes(var: pd.DataFrame, genome: str = DataConfig.genome, gtf: str | None = None,
                quiet: bool = False) -> GeneCoordinates:
    """Coordinates for every gene of `var`: from var itself, then a GTF or the bundled table (how many were placed
    logged unless `quiet`)."""
    # Positional (RangeIndex) throughout: var_names need not be unique.
    found = pd.DataFrame(index=pd.RangeIndex(len(var)), columns=["chromosome", "start", "end"], dtype=object)
    sources = []
    from_var = coordinates_from_var(var)
    if from_var is not None:
        ok = from_var["chromosome"].notna().to_numpy()
        found.loc[ok] = from_var.loc[ok].to_numpy()
        sources.append(f"{int(ok.sum())} from var")
    table = read_gtf(gtf) if gtf else None  # a GTF is read (and checked) even when var places every gene
    missing = np.flatnonzero(found["chromosome"].isna().to_numpy())
    if len(missing):
        if table is None:
            table = bundled_gene_table(genome)
            refuse_if_another_genome_fits(var, genome, table)
        table = table.assign(chromosome=table["chromosome"].map(canonical_chromosome))
        looked_up = lookup_in_table(var.iloc[missing], table)
        ok = looked_up["chromosome"].notna().to_numpy()
        found.iloc[missing[ok]] = looked_up.to_numpy()[ok]
        sources.append(f"{int(ok.sum())} from {'GTF ' + str(gtf) if gtf else genome + ' table'}")
    placed = found["chromosome"].notna().to_numpy()
    n = len(var)
    (log.debug if quiet else log.info)(
        "Placed %d of %d genes on the genome (%.1f%%; %s); %d unplaced.",
        placed.sum(), n, 100.0 * placed.sum() / max(n, 1), ", ".join(sources) or "none", n - placed.sum(),
    )
    return GeneCoordinates(
        chromosome=np.array([c if p else None for c, p in zip(found["chromosome"], placed)], dtype=object),
        start=np.where(placed, pd.to_numeric(found["start"], errors="coerce").fillna(0), 0).astype(np.int64),
        end=np.where(placed, pd.to_numeric(found["end"], errors="coerce").fillna(0), 0).astype(np.int64),
    )


@dataclass
class LocusWindows:
    """Tokens over genes in genomic order: windows of neighbouring genes on one chromosome.

    gene_index: (tokens, genes_per_token) index into the ordered genes; padding slots hold
                n_genes (a zero column appended by the model).
    pad_mask:   (tokens, genes_per_token) True where the slot is padding.
    position:   (tokens,) window centre in base pairs (0 for unplaced windows).
    chromosome: (tokens,) code into CHROMOSOMES (UNPLACED for the trailing group).
    """

    gene_index: np.ndarray
    pad_mask: np.ndarray
    position: np.ndarray
    chromosome: np.ndarray

    @property
    def n_tokens(self) -> int:
        return self.gene_index.shape[0]


def chromosome_runs(coords: GeneCoordinates) -> list[np.ndarray]:
    """Positions of the genes (in genomic order) of each chromosome; unplaced genes form one trailing run."""
    names = np.array(["\0unplaced" if c is None else c for c in coords.chromosome], dtype=object)
    boundaries = np.flatnonzero(names[1:] != names[:-1]) + 1
    return np.split(np.arange(len(names)), boundaries)


def make_windows(coords: GeneCoordinates, genes_per_token: int) -> LocusWindows:
    """Group genes (already in genomic order) into windows that never cross a chromosome."""
    if genes_per_token < 1:
        raise ValueError(f"model.genes_per_token must be >= 1, got {genes_per_token}.")
    n_genes = len(coords.chromosome)
    codes = np.array([chromosome_code(c) for c in coords.chromosome])
    runs = chromosome_runs(coords)
    gene_index, pad_mask, position, chromosome = [], [], [], []
    for run in runs:
        for first in range(0, len(run), genes_per_token):
            members = run[first:first + genes_per_token]
            slots = np.full(genes_per_token, n_genes, dtype=np.int64)
            slots[: len(members)] = members
            gene_index.append(slots)
            pad_mask.append(slots == n_genes)
            placed = codes[members[0]] != UNPLACED
            centre = (coords.start[members].min() + coords.end[members].max()) / 2.0 if placed else 0.0
            position.append(centre)
            chromosome.append(codes[members[0]])
    return LocusWindows(
        gene_index=np.stack(gene_index),
        pad_mask=np.stack(pad_mask),
        position=np.asarray(position, dtype=np.float64),
        chromosome=np.asarray(chromosome, dtype=np.int64),
    )


def infercnv_columns(var: pd.DataFrame, genome: str = DataConfig.genome) -> dict[str, pd.Series] | None:
    """var's coordinate columns as infercnvpy reads them ('chromosome' as 'chr1' ... 'chrX', 'chrM'; 'start',
    'end'), from var itself or the bundled table of `genome`; None when var already has them in that form."""
    present = {"chromosome", "start", "end"} <= set(var.columns)
    if present and var["chromosome"].dropna().astype(str).str.startswith("chr").all():
        return None
    coordinates = place_genes(var, genome)
    placed = coordinates.placed
    names = [f"chr{'M' if c == 'MT' else c}" if p else None for c, p in zip(coordinates.chromosome, placed)]
    return {"chromosome": pd.Categorical(names),
            "start": np.where(placed, coordinates.start, np.nan),
            "end": np.where(placed, coordinates.end, np.nan)}

