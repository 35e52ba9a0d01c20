"""batchfix.data.genome: placing genes, genomic order, and locus windows."""
from __future__ import annotations

import gzip
import logging

import numpy as np
import pandas as pd
import pytest

from batchfix.data import genome
from batchfix.data.genome import (
    CHROMOSOME_CODE,
    UNPLACED,
    GeneCoordinates,
    make_windows,
    place_genes,
)
from batchfix.errors import InputError

MIN_PLACED = 0.85
TP53 = ("17", 7661779, 7687550)  # GRCh38, as in the bundled table


def var_coordinates(var: pd.DataFrame):
    """The file's own coordinates (canonical chromosome or None, start, end)."""
    chrom = np.array([genome.canonical_chromosome(c) for c in var["chromosome"].astype(object)], dtype=object)
    start = var["start"].fillna(0).astype(np.int64).to_numpy()
    end = var["end"].fillna(0).astype(np.int64).to_numpy()
    return chrom, start, end


def assert_agrees_with_var(coords: GeneCoordinates, var: pd.DataFrame, min_fraction: float = 0.99):
    chrom, start, _ = var_coordinates(var)
    both = coords.placed & np.array([c is not None for c in chrom])
    assert both.sum() >= MIN_PLACED * len(var)
    same = (coords.chromosome[both] == chrom[both]) & (coords.start[both] == start[both])
    assert same.mean() >= min_fraction, same.mean()


@pytest.fixture(scope="module")
def real_var(bundled_adata) -> pd.DataFrame:
    return bundled_adata.var.copy()


@pytest.fixture(scope="module")
def real_coords(real_var) -> GeneCoordinates:
    return place_genes(real_var)


# --------------------------------------------------------------------------------------------
# Placing genes on the bundled dataset


def test_real_var_coordinates_used(real_var, real_coords, caplog):
    n = len(real_var)
    assert len(real_coords.chromosome) == n
    assert real_coords.placed.mean() >= MIN_PLACED
    chrom, start, end = var_coordinates(real_var)
    placed_in_var = np.array([c is not None for c in chrom])
    # every gene the file places is placed exactly where the file says
    assert real_coords.placed[placed_in_var].all()
    np.testing.assert_array_equal(real_coords.chromosome[placed_in_var], chrom[placed_in_var])
    np.testing.assert_array_equal(real_coords.start[placed_in_var], start[placed_in_var])
    np.testing.assert_array_equal(real_coords.end[placed_in_var], end[placed_in_var])
    unplaced = ~real_coords.placed
    assert (real_coords.start[unplaced] == 0).all() and (real_coords.end[unplaced] == 0).all()
    assert real_coords.start.dtype == np.int64 and real_coords.end.dtype == np.int64
    with caplog.at_level(logging.INFO, logger="batchfix.data.genome"):
        place_genes(real_var)
    assert f"Placed {int(real_coords.placed.sum())} of {n} genes" in caplog.text


def test_real_var_without_coordinates_uses_bundled_table_by_id(real_var):
    bare = real_var.drop(columns=["chromosome", "start", "end", "gene_symbol"])
    coords = place_genes(bare, genome="GRCh38")
    assert coords.placed.mean() >= MIN_PLACED
    assert_agrees_with_var(coords, real_var)


def test_real_var_with_versioned_ids(real_var):
    bare = pd.DataFrame(index=[f"{g}.{i % 20 + 1}" for i, g in enumerate(real_var.index)])
    coords = place_genes(bare)
    assert coords.placed.mean() >= MIN_PLACED
    assert_agrees_with_var(coords, real_var)


def test_real_var_symbols_as_names_case_insensitive(real_var):
    symbols = real_var["gene_symbol"].astype(object)
    has_symbol = symbols.notna().to_numpy()
    names = np.where(has_symbol, symbols.astype(str).str.lower(), real_var.index.to_numpy())
    by_symbol = pd.DataFrame(index=pd.Index(names, name="symbol"))
    assert by_symbol.index.is_unique
    coords = place_genes(by_symbol)
    assert coords.placed.mean() >= MIN_PLACED
    # the genes with a symbol are placed by it (the rest have no coordinates anywhere)
    assert coords.placed[has_symbol].mean() >= MIN_PLACED
    assert_agrees_with_var(coords, real_var, min_fraction=0.97)


def test_symbol_column_used_when_names_are_unknown(real_var):
    var = pd.DataFrame({"gene_symbol": real_var["gene_symbol"].to_numpy()},
                       index=[f"cell_ranger_{i}" for i in range(len(real_var))])
    coords = place_genes(var)
    assert coords.placed.mean() >= MIN_PLACED


def test_partial_var_coordinates_completed_from_table():
    var = pd.DataFrame(
        {"chromosome": ["chr2", None, np.nan], "start": [100.0, np.nan, np.nan], "end": [200.0, np.nan, np.nan]},
        index=["ENSG00000000001", "ENSG00000141510", "NOT_A_GENE"],
    )
    coords = place_genes(var)
    assert list(coords.chromosome) == ["2", "17", None]
    assert list(coords.start) == [100, TP53[1], 0]
    assert list(coords.end) == [200, TP53[2], 0]


def test_ensembl_version_suffix_matches():
    var = pd.DataFrame(index=["ENSG00000141510.17", "ENSG00000141510", "ENSG00000012048.23"])
    coords = place_genes(var)
    assert coords.placed.all()
    assert (coords.chromosome[0], coords.start[0], coords.end[0]) == TP53
    assert (coords.chromosome[1], coords.start[1], coords.end[1]) == TP53
    assert coords.chromosome[2] == "17"  # BRCA1
    assert genome.strip_version("ENSG00000141510.17") == "ENSG00000141510"
    assert genome.strip_version("AC092115.3") == "AC092115"  # only used on the ID pass


def test_duplicate_var_names_are_placed(real_var):
    """Symbols as var_names are often not unique (before var_names_make_unique)."""
    var = pd.DataFrame(index=["TP53", "TP53", "BRCA1", "no_such_gene", "no_such_gene"])
    coords = place_genes(var)
    assert list(coords.placed) == [True, True, True, False, False]
    assert (coords.chromosome[1], coords.start[1]) == TP53[:2]
    assert coords.chromosome[2] == "17"


def test_chromosome_stored_as_float_in_var():
    """A numeric chromosome column with gaps is read back as float (1.0): still chromosome 1."""
    var = pd.DataFrame({"chromosome": [1.0, 12.0, np.nan], "start": [10.0, 20.0, np.nan],
                        "end": [30.0, 40.0, np.nan]}, index=["a", "b", "c"])
    coords = place_genes(var)
    assert list(coords.chromosome) == ["1", "12", None]
    assert genome.chromosome_code(coords.chromosome[1]) == CHROMOSOME_CODE["12"]


def test_canonical_chromosome_names():
    assert genome.canonical_chromosome("chr1") == "1"
    assert genome.canonical_chromosome("CHRX") == "X"
    assert genome.canonical_chromosome("x") == "X"
    assert genome.canonical_chromosome("chrM") == "MT"
    assert genome.canonical_chromosome("MT") == "MT"
    assert genome.canonical_chromosome(7) == "7"
    assert genome.canonical_chromosome("GL000194.1") == "GL000194.1"
    for missing in (None, np.nan, "", "nan", "NA"):
        assert genome.canonical_chromosome(missing) is None


# --------------------------------------------------------------------------------------------
# GTF files

GTF_TEXT = "\n".join([
    "#!genome-build GRCh38.p14",
    "#!genome-version GRCh38",
    'chr17\tENSEMBL\tgene\t7661779\t7687550\t.\t-\t.\tgene_id "ENSG00000141510.17"; gene_version "17"; '
    'gene_name "TP53"; gene_biotype "protein_coding";',
    'chr17\tENSEMBL\ttranscript\t7661779\t7687538\t.\t-\t.\tgene_id "ENSG00000141510.17"; '
    'transcript_id "ENST00000269305"; gene_name "TP53";',
    'chr17\tENSEMBL\ttranscript\t1000\t2000\t.\t+\t.\tgene_id "ENSGTEST00000009"; '
    'transcript_id "ENSTTEST9"; gene_name "ONLYTX";',
    'chrX\tENSEMBL\tgene\t100\t900\t.\t+\t.\tgene_id "ENSGTEST00000001"; gene_name "MyGeneX";',
    '3\tENSEMBL\tgene\t5000\t6000\t.\t+\t.\tgene_id "ENSGTEST00000002"; gene_name "Other3";',
    'chrM\tENSEMBL\tgene\t10\t70\t.\t+\t.\tgene_id "ENSGTEST00000003"; gene_name "MT-TEST";',
    "",
])


@pytest.fixture(params=["plain", "gzip"])
def gtf_path(request, tmp_path):
    if request.param == "plain":
        path = tmp_path / "genes.gtf"
        path.write_text(GTF_TEXT)
    else:
        path = tmp_path / "genes.gtf.gz"
        with gzip.open(path, "wt") as fh:
            fh.write(GTF_TEXT)
    return path


def test_gtf_places_genes(gtf_path):
    before = gtf_path.read_bytes()
    var = pd.DataFrame(
        {"gene_symbol": ["ignored", "mygenex", None, None, "ONLYTX", "BRCA1"]},
        index=["ENSG00000141510", "X_by_symbol", "ENSGTEST00000002.4", "ENSGTEST00000003",
               "ENSGTEST00000009", "ENSG00000012048"],
    )
    coords = place_genes(var, gtf=str(gtf_path))
    # TP53 by unversioned ID, MyGeneX by symbol column (case-insensitive), Other3 by versioned ID
    assert list(coords.chromosome) == ["17", "X", "3", "MT", None, None]
    assert list(coords.start) == [7661779, 100, 5000, 10, 0, 0]
    assert list(coords.end) == [7687550, 900, 6000, 70, 0, 0]
    # transcript-only genes are not placed; BRCA1 is in the bundled table but not in this GTF
    assert gtf_path.read_bytes() == before


def test_read_gtf_keeps_gene_records_only(gtf_path):
    table = genome.read_gtf(gtf_path)
    assert list(table["symbol"]) == ["TP53", "MyGeneX", "Other3", "MT-TEST"]
    assert list(table["gene_id"]) == ["ENSG00000141510.17", "ENSGTEST00000001", "ENSGTEST00000002",
                                      "ENSGTEST00000003"]
    assert list(table["start"]) == [7661779, 100, 5000, 10]


def test_gtf_without_gene_records(tmp_path):
    path = tmp_path / "tx.gtf"
    path.write_text(GTF_TEXT.replace("\tgene\t", "\texon\t"))
    with pytest.raises(ValueError, match="no 'gene' records"):
        place_genes(pd.DataFrame(index=["TP53"]), gtf=str(path))


def test_missing_gtf(tmp_path):
    path = tmp_path / "nope.gtf"
    with pytest.raises(InputError, match="GTF file not found.*nope.gtf"):
        place_genes(pd.DataFrame(index=["TP53"]), gtf=str(path))


@pytest.mark.parametrize("content, message", [
    (None, "is a folder, not a GTF file"),
    (b"\x89HDF\r\n\x1a\n\x00\xff\xfe binary", "Cannot read data.gtf="),
    (b"chr1\tsrc\tgene\tten\t20\t.\t+\t.\tgene_id \"G1\";\n", "start or end .* not a number"),
])
def test_unreadable_gtf_is_an_input_error(tmp_path, content, message):
    path = tmp_path / "genes.gtf"
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        place_genes(pd.DataFrame(index=["TP53"]), gtf=str(path))


# --------------------------------------------------------------------------------------------
# Bundled genomes


def test_mm10_symbols():
    var = pd.DataFrame(index=["Trp53", "ACTB", "gapdh", "Xkr4", "NotAMouseGene"])
    coords = place_genes(var, genome="mm10")
    assert list(coords.chromosome) == ["11", "5", "6", "1", None]
    assert list(coords.start) == [69580359, 142903115, 125161715, 3205901, 0]
    human = place_genes(pd.DataFrame(index=["Trp53"]), genome="GRCh38")
    assert human.start[0] != coords.start[0]  # the genome choice matters


def test_mm10_ensembl_ids():
    coords = place_genes(pd.DataFrame(index=["ENSMUSG00000059552.13"]), genome="mm10")
    assert (coords.chromosome[0], coords.start[0]) == ("11", 69580359)


def test_unknown_genome():
    with pytest.raises(ValueError) as err:
        place_genes(pd.DataFrame(index=["TP53"]), genome="hg19")
    message = str(err.value)
    assert "'hg19'" in message and "GRCh38" in message and "mm10" in message and "gtf" in message


def test_bundled_tables_have_expected_columns():
    for name in genome.GENOMES:
        table = genome.bundled_gene_table(name)
        assert list(table.columns) == ["symbol", "gene_id", "chromosome", "start", "end"]
        assert len(table) > 30000
        assert {"1", "X", "Y"} <= set(table["chromosome"].astype(str))


# --------------------------------------------------------------------------------------------
# Genomic order


def test_genomic_order_synthetic():
    chrom = np.array(["10", None, "2", "X", "KI270728.1", "Y", "1", "2", None, "MT", "1", "22", "2"],
                     dtype=object)
    start = np.array([5, 0, 300, 7, 1, 2, 50, 100, 0, 3, 10, 4, 100], dtype=np.int64)
    coords = GeneCoordinates(chrom, start, start + 10)
    order = coords.genomic_order()
    # 1 (by start), 2 (by start, ties in file order), 10, 22, X, Y, then the rest, unplaced last
    assert list(order) == [10, 6, 7, 12, 2, 0, 11, 3, 5, 9, 4, 1, 8]
    assert order.dtype == np.int64


def test_genomic_order_all_unplaced_keeps_file_order():
    coords = GeneCoordinates(np.array([None] * 4, dtype=object), np.zeros(4, np.int64), np.zeros(4, np.int64))
    assert list(coords.genomic_order()) == [0, 1, 2, 3]


def test_genomic_order_real(real_coords):
    order = real_coords.genomic_order()
    n = len(real_coords.chromosome)
    assert sorted(order.tolist()) == list(range(n))
    ordered = real_coords.subset(order)
    n_placed = int(real_coords.placed.sum())
    assert ordered.placed[:n_placed].all() and not ordered.placed[n_placed:].any()
    # unplaced genes trail in file order
    np.testing.assert_array_equal(order[n_placed:], np.flatnonzero(~real_coords.placed))
    keys = [genome.chromosome_sort_key(c) + (int(s),) for c, s in
            zip(ordered.chromosome[:n_placed], ordered.start[:n_placed])]
    assert keys == sorted(keys)
    names = list(dict.fromkeys(ordered.chromosome[:n_placed]))
    assert names == [str(i) for i in range(1, 23)] + ["X"]


# --------------------------------------------------------------------------------------------
# Locus windows


def check_windows(coords: GeneCoordinates, windows, genes_per_token: int):
    n = len(coords.chromosome)
    gi, mask = windows.gene_index, windows.pad_mask
    assert gi.shape == mask.shape == (windows.n_tokens, genes_per_token)
    assert gi.dtype == np.int64
    np.testing.assert_array_equal(mask, gi == n)
    assert ((gi >= 0) & (gi <= n)).all()
    members = gi[~mask]
    np.testing.assert_array_equal(np.sort(members), np.arange(n))  # each gene exactly once
    np.testing.assert_array_equal(members, np.arange(n))  # in order, windows contiguous
    assert not mask[:, 0].any()  # no all-padding token
    for t in range(windows.n_tokens):
        genes = gi[t][~mask[t]]
        names = {coords.chromosome[g] for g in genes}
        assert len(names) == 1, f"window {t} crosses chromosomes: {names}"
        name = names.pop()
        assert windows.chromosome[t] == genome.chromosome_code(name)
        if name is None:
            assert windows.position[t] == 0
        else:
            assert coords.start[genes].min() <= windows.position[t] <= coords.end[genes].max()
        # padding only at a chromosome's last window
        if mask[t].any() and t + 1 < windows.n_tokens:
            nxt = gi[t + 1][0]
            assert coords.chromosome[nxt] != name


def test_windows_synthetic_exact():
    chrom = np.array(["1"] * 5 + ["2"] * 3 + [None] * 2, dtype=object)
    start = np.array([10, 20, 30, 40, 50, 5, 15, 25, 0, 0], dtype=np.int64)
    end = np.where(start > 0, start + 4, 0)
    coords = GeneCoordinates(chrom, start, end)
    w = make_windows(coords, genes_per_token=4)
    P = 10
    np.testing.assert_array_equal(w.gene_index, [[0, 1, 2, 3], [4, P, P, P], [5, 6, 7, P], [8, 9, P, P]])
    np.testing.assert_array_equal(w.pad_mask, w.gene_index == P)
    np.testing.assert_array_equal(w.chromosome, [CHROMOSOME_CODE["1"], CHROMOSOME_CODE["1"],
                                                 CHROMOSOME_CODE["2"], UNPLACED])
    np.testing.assert_allclose(w.position, [(10 + 44) / 2, (50 + 54) / 2, (5 + 29) / 2, 0.0])
    check_windows(coords, w, 4)


@pytest.mark.parametrize("genes_per_token", [1, 7, 32])
def test_windows_real(real_coords, genes_per_token):
    ordered = real_coords.subset(real_coords.genomic_order())
    w = make_windows(ordered, genes_per_token)
    check_windows(ordered, w, genes_per_token)
    n = len(ordered.chromosome)
    if genes_per_token == 1:
        assert w.n_tokens == n and not w.pad_mask.any()
        np.testing.assert_array_equal(w.gene_index[:, 0], np.arange(n))
    else:
        assert w.pad_mask.any()
        assert w.n_tokens < n
    assert w.chromosome[-1] == UNPLACED  # the bundled file has unplaced genes; they trail


@pytest.mark.parametrize("bad", [0, -1])
def test_windows_reject_genes_per_token_below_one(real_coords, bad):
    with pytest.raises(ValueError, match="genes_per_token must be >= 1"):
        make_windows(real_coords, bad)
