"""The README a user reads top to bottom, the LICENSE it names, a manual kept apart from the lab notebook
(docs/lab/), and docs/ tables that are written from their results files (scripts/make_docs_tables.py), never
edited by hand."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MANUAL = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LAB_PAGES = sorted((ROOT / "docs" / "lab").glob("*.md"))


def tables_script(monkeypatch, docs: Path):
    """scripts/make_docs_tables.py as a module, pointed at a copy of docs/ (and its README) in `docs`."""
    spec = importlib.util.spec_from_file_location("make_docs_tables", ROOT / "scripts" / "make_docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", docs.parent)
    monkeypatch.setattr(module, "DOCS", docs)
    monkeypatch.setattr(module, "RESULTS", docs / "results")
    monkeypatch.setattr(module, "LAB", docs / "lab")
    return module


def test_the_readme_is_short_and_says_how_to_install_and_test():
    assert len(README.splitlines()) <= 200
    for needed in ("git clone", "python3 -m venv", "pip install torch==2.13.0", 'pip install -e ".[test]"',
                   "python -m pytest -q", "CUDA", "--help"):
        assert needed in README, needed
    # fp16 on a GPU is claimed only beside the measurement that shows it (scripts/bench/bench_gpu.py's table)
    assert "16-mixed` training on a GPU" in README and "(docs/lab/scale.md#gpu)" in README
    assert "<!-- table: gpu-precision -->" in (ROOT / "docs" / "lab" / "scale.md").read_text()


def test_the_readme_api_example_trains_the_default_budget():
    example = README.split("```python\n", 1)[1].split("```", 1)[0]
    call = re.search(r"batchfix\.train\((.*?)\)", example).group(1)
    assert "max_epochs" not in call and "target_steps" not in call


def test_the_license_is_the_one_pyproject_names():
    assert "license = { text = \"MIT\" }" in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "batchfix developers" in text
    assert "[LICENSE](LICENSE)" in README


def test_every_docs_table_is_its_results_file():
    result = subprocess.run([sys.executable, "scripts/make_docs_tables.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    blocks = [name for page in [*MANUAL, *LAB_PAGES] for name in re.findall(r"<!-- table: ([\w-]+) -->",
                                                                          page.read_text())]
    results = [*(ROOT / "docs" / "results").glob("*.csv"), *(ROOT / "docs" / "lab" / "results").glob("*.csv")]
    assert len(blocks) >= 15 and set(blocks) == {p.stem for p in results}


def test_the_manual_is_short_and_holds_only_the_manual_tables():
    """README + docs/*.md stay within the budget; a manual table's file is in docs/results/, a lab one's not."""
    assert sum(len(page.read_text().splitlines()) for page in MANUAL) <= 900
    manual = {name for page in MANUAL for name in re.findall(r"<!-- table: ([\w-]+) -->", page.read_text())}
    assert manual == {p.stem for p in (ROOT / "docs" / "results").glob("*.csv")}


def test_every_lab_page_opens_with_its_verdict():
    assert LAB_PAGES
    for page in LAB_PAGES:
        head = page.read_text().splitlines()[:10]
        assert any(line.startswith("**Verdict:**") for line in head), page.name
        assert any(line.startswith("**Measured at:**") for line in head), page.name


def test_no_doc_prints_the_old_script_commands():
    """Scripts run as modules (python -m scripts.NAME, scripts.bench.NAME, scripts.lab.NAME)."""
    for page in [*MANUAL, *LAB_PAGES, ROOT / "docs" / "tutorial.ipynb", ROOT / "scripts" / "lab" / "README.md"]:
        assert not re.search(r"python3? (\.\./)*scripts/", page.read_text()), page.name


def test_a_number_changed_in_a_results_file_changes_its_table_when_written_again(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("*.ipynb"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    results = docs / "results" / "comparison-bundled.csv"
    results.write_text(results.read_text().replace("0.816 (0.001)", "0.901 (0.003)"))
    module = tables_script(monkeypatch, docs)
    monkeypatch.setattr(sys, "argv", ["make_docs_tables.py"])
    module.main()
    assert "| 0.901 (0.003) |" in (tmp_path / "README.md").read_text()
    assert "| 0.901 (0.003) |" in (docs / "results.md").read_text()
    assert "0.901" not in README
