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

ROOT = Path(__file__).resolve().parents[1]
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
    results.write_text(results.read_text().replace("0.836 (0.002)", "0.901 (0.003)"))
    module = tables_script(monkeypatch, docs)
    monkeypatch.setattr(sys, "argv", ["make_docs_tables.py"])
    module.main()
    assert "| 0.901 (0.003) |" in (tmp_path / "README.md").read_text()
    assert "| 0.901 (0.003) |" in (docs / "results.md").read_text()
    assert "0.901" not in README


def test_a_seed_table_is_the_mean_and_sd_over_seeds_of_each_row(tmp_path):
    """scripts/seed_table.py: per (data, output), "mean ± sd" over the seeds of each score, rows in their first
    order, dropped rows left out, and a score one data set lacks left blank (as the decoding-scale table has)."""
    runs = tmp_path / "runs.csv"
    runs.write_text(",Total,Marker recall,seed\n"
                    "uncorrected,0.5,1.0,0\ndefault,0.80,0.90,0\nComBat,0.70,0.95,0\n"
                    "uncorrected,0.5,1.0,1\ndefault,0.84,0.96,1\nComBat,0.70,0.95,1\n")
    stress = tmp_path / "stress.csv"
    stress.write_text(",Total,Marker recall,\"Truth error (group contrasts, relative)\",seed\n"
                      "default,0.6,0.8,0.25,0\ndefault,0.6,0.8,0.35,1\n")
    one_seed = tmp_path / "one_seed.csv"  # one seed: the mean alone; a latent has no gene scores: blank
    one_seed.write_text(",Total,Marker recall,seed\ndefault,0.9,0.97,0\nlatent,0.85,,0\n")
    out = tmp_path / "table.csv"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "seed_table.py"), str(out), f"bundled={runs}",
                    f"stress sd 1.0={stress}", f"stress sd 0.5={one_seed}", "--drop", "uncorrected"], check=True,
                   capture_output=True)
    assert out.read_text().splitlines() == [
        "data,output,Total,markers,truth error (contrasts)",
        "bundled,default,0.820 ± 0.028,0.930 ± 0.042,",
        "bundled,ComBat,0.700 ± 0.000,0.950 ± 0.000,",
        "stress sd 1.0,default,0.600 ± 0.000,0.800 ± 0.000,0.300 ± 0.071",
        "stress sd 0.5,default,0.900,0.970,",
        "stress sd 0.5,latent,0.850,,",
    ]
