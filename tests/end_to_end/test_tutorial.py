"""docs/tutorial.ipynb runs from top to bottom in a fresh kernel (nbclient), as written but for its
training budget: the `max_epochs = None` line (the default, minutes on a 2-core CPU) becomes 2 epochs."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorial.ipynb"
BUDGET = "max_epochs = None"


@pytest.mark.slow  # the whole notebook executed in a kernel: CI's slow step
def test_the_tutorial_runs_and_shows_what_it_says(tmp_path):
    notebook = nbformat.read(TUTORIAL, as_version=4)
    setup = next(cell for cell in notebook.cells if BUDGET in cell.source)
    setup.source = setup.source.replace(BUDGET, "max_epochs = 2")
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    pictures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pictures) >= 4  # the UMAPs before and after, the marker dot plot, the CNV heatmaps before and after
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "batchfix corrected expression (PCA)" in printed and "Total" in printed
    assert "batchfix: Modelling 2000 genes" in printed  # the progress lines show (settings.verbosity)
    differences = dict(re.findall(r"(\w+): a line's CNV profile differs between batches by ([0-9.]+)", printed))
    assert float(differences["batchfix"]) < float(differences["uncorrected"])
