"""Write the tables of README.md, docs/*.md and docs/lab/*.md from their results files (NAME.csv).

Each table in a page sits between `<!-- table: NAME -->` and `<!-- /table -->`; this script replaces what is
between them with NAME.csv as a markdown table (the CSV's first row is the header, cells as written). The
manual's files are in docs/results/, the lab notebook's in docs/lab/results/ (a lab page may also show a
manual's table). A number is changed in its results file, then the pages are written again:

    python -m scripts.make_docs_tables           # rewrite the tables of every page
    python -m scripts.make_docs_tables --check   # exit 1, naming the pages, when a table is not its file's
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
LAB = DOCS / "lab"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<table>.*?)(<!-- /table -->)", re.S)


def markdown_table(path: Path) -> str:
    """A results CSV as a markdown table: header, separator, one line per row."""
    with open(path, newline="") as fh:
        header, *rows = list(csv.reader(fh))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def rendered(page: Path) -> str:
    """The page with every table block written from its results file (a missing file is an error)."""
    def table(match: re.Match) -> str:
        name = f"{match['name']}.csv"
        folders = [LAB / "results", RESULTS] if page.parent == LAB else [RESULTS]
        source = next((folder / name for folder in folders if (folder / name).is_file()), RESULTS / name)
        if not source.is_file():
            sys.exit(f"{page.relative_to(ROOT)}: no results file {source.relative_to(ROOT)} for table '{match['name']}'")
        return match.group(1) + markdown_table(source) + match.group(4)

    return BLOCK.sub(table, page.read_text())


def pages() -> list[Path]:
    """Every page that may hold a table: docs/*.md, docs/lab/*.md and README.md."""
    return [*sorted(DOCS.glob("*.md")), *sorted(LAB.glob("*.md")), ROOT / "README.md"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    args = parser.parse_args()
    stale = []
    for page in pages():
        text = rendered(page)
        if text != page.read_text():
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(text)
    if args.check and stale:
        sys.exit(f"out of date with their results files: {stale} (run python -m scripts.make_docs_tables)")
    print(("written: " if stale else "up to date: ") + (", ".join(stale) or "docs/*.md, docs/lab/*.md, README.md"))


if __name__ == "__main__":
    main()
