"""What a new user trips on in the first hour (issue 43): defaults that fit only the bundled file, options naming
what the input lacks, label-free runs, argparse habits, readable pictures and the abuse cases that got through."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from batchfix.config import EvaluateConfig, TrainConfig, validated


def composed(name: str, overrides: list[str]):
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        return compose(name, overrides=overrides)


def verb_probe(verb: str, args: list[str], cwd: Path) -> tuple[str, str]:
    """Run a verb's entry in a fresh process: (its stderr, whether torch was imported by the time it exited)."""
    probe = (f"import sys, runpy; sys.argv = ['x', *{args!r}]\n"
             f"try:\n    runpy.run_module('batchfix.cli.{verb}', run_name='__main__')\n"
             "except SystemExit:\n    print('torch' in sys.modules)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=env)
    return done.stderr, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


@pytest.mark.parametrize("name, path_key, schema", [("train", "data.path", TrainConfig),
                                                     ("evaluate", "input", EvaluateConfig)])
def test_the_bundled_label_column_is_no_default_for_a_users_file(name, path_key, schema):
    assert validated(composed(name, []), schema).data.label_key == "cell_type"
    assert validated(composed(name, [f"{path_key}=mine.h5ad"]), schema).data.label_key is None
    given = validated(composed(name, [f"{path_key}=mine.h5ad", "data.label_key=celltype"]), schema)
    assert given.data.label_key == "celltype"


@pytest.mark.parametrize("verb, args, message", [
    ("train", ["data.label_key=nope"], "Label key 'nope' is not an obs column"),
    ("train", ["data.batch_key=nope"], "Batch key 'nope' is not an obs column"),
    ("train", ["data.counts_layer=nope"], "Layer 'nope' not found"),
    ("evaluate", ["data.label_key=nope"], "Label key 'nope' is not an obs column"),
    ("correct", ["data.batch_key=nope", "checkpoint=CKPT"], "Batch key 'nope' is not an obs column"),
    ("correct", ["data.counts_layer=nope", "checkpoint=CKPT"], "Layer 'nope' not found"),
    ("attention", ["group_by=nope", "checkpoint=CKPT"], "Group key 'nope' is not an obs column"),
])
def test_an_option_naming_what_the_input_lacks_fails_before_any_work(verb, args, message, tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"not read")
    args = [arg.replace("CKPT", str(tmp_path / "model.ckpt")) for arg in args]
    folder = [f"hydra.run.dir={tmp_path / 'run'}"] if verb in ("train", "evaluate") else []
    stderr, torch_imported = verb_probe(verb, [*args, *folder], tmp_path)
    assert message in stderr, stderr[-2000:]
    assert torch_imported == "False"
    assert not (tmp_path / "run").exists()


def batchfix_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchfix", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args, spelling", [(["--max_epochs", "2"], "`trainer.max_epochs=2`"),
                                            (["--max-epochs=3"], "`trainer.max_epochs=3`"),
                                            (["--label_key", "cell_type"], "`data.label_key=cell_type`"),
                                            (["--n_head", "4"], "`model.n_heads=4`")])
def test_an_argparse_flag_gets_its_hydra_spelling_in_one_line(args, spelling, tmp_path):
    result = batchfix_cli(["train", *args], tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and spelling in lines[0], result.stderr
    assert "usage" not in result.stdout + result.stderr and not (tmp_path / "outputs").exists()


def test_a_mistyped_verb_suggests_the_verb_meant(tmp_path):
    result = batchfix_cli(["trian", "trainer.max_epochs=2"], tmp_path)
    assert result.returncode == 2 and "did you mean `train`?" in result.stderr


TINY = ["data.n_top_genes=200", "model.genes_per_token=16", "model.d_model=16", "model.n_layers=1",
        "model.latent_dim=8", "model.decoder_hidden=32", "fit.batch_size=64", "threads=1", "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def unlabelled_run(subset_h5ad, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A tiny `train` on a user's file (no data.label_key): its run folder and what it printed."""
    where = tmp_path_factory.mktemp("unlabelled")
    result = batchfix_cli(["train", f"data.path={subset_h5ad}", f"hydra.run.dir={where / 'run'}", *TINY], where)
    assert result.returncode == 0, result.stderr[-3000:]
    return where / "run", result


def test_a_run_without_labels_ends_with_mixing_scores_and_a_umap_by_batch(unlabelled_run):
    run, result = unlabelled_run
    evaluation = json.loads((run / "metrics.json").read_text())["evaluation"]
    assert evaluation["label_key"] is None
    scored = set().union(*(scores.keys() for scores in evaluation["scores"].values()))
    assert {"iLISI", "PCR comparison"} <= scored, scored
    assert (run / "umap.png").is_file()
    assert "Mixing alone rewards over-correction" in result.stdout


def test_the_umap_columns_are_titled_by_their_obs_column_and_never_share_a_colour():
    import pandas as pd

    from batchfix.eval import umap_plots

    batch = pd.Series(["a", "b", "c"] * 4, name="sample")
    labels = pd.Series(["x", "y", "z", "w"] * 3, name="cell_type")
    (batch_title, _, batch_colors), (label_title, _, label_colors) = umap_plots.umap_columns(batch, labels)
    assert (batch_title, label_title) == ("sample", "cell_type")
    for n in (3, 5, 12):
        assert len(set(batch_colors(n))) == n and not set(batch_colors(n)) & set(label_colors(n))


def test_the_attention_picture_has_a_large_panel_per_layer(tmp_path):
    import numpy as np
    from PIL import Image

    from batchfix.tasks.attention_maps import PANEL_INCHES, PICTURE_DPI, AttentionMaps, plot_attention_maps

    groups, layers, heads, bins = 3, 2, 4, 48
    maps = np.random.default_rng(0).dirichlet(np.ones(bins), size=(groups, layers, heads, bins)).astype(np.float32)
    chromosomes = np.repeat([f"chr{i}" for i in range(1, 25)], 2)
    attention = AttentionMaps(maps, ["a", "b", "c"], np.array([30, 20, 10]), np.ones(bins, int), chromosomes)
    assert attention.relative_to_uniform(heads_averaged=True).shape == (groups, layers, bins, bins)
    plot_attention_maps(attention, tmp_path / "attention.png")
    width, height = Image.open(tmp_path / "attention.png").size
    panel = PANEL_INCHES * PICTURE_DPI
    assert width < (layers + 1) * panel and height < (groups + 1) * panel  # a panel per layer, not per head
    assert width > layers * panel and height > groups * panel


def test_the_sweep_summary_drops_constant_columns_and_plots_head_counts_as_categories(tmp_path):
    import pandas as pd

    from batchfix.cli.sweep import SUMMARY_MD, category_positions, summarize_sweep

    for job, heads in enumerate((1, 2, 8)):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        (tmp_path / str(job) / ".hydra" / "overrides.yaml").write_text(f"- model.n_heads={heads}\n- seed=0\n")
        scores = {"batchfix corrected expression (PCA)": {"Batch correction": 0.5, "Total": 0.7 + job / 100},
                  "Unintegrated PCA": {"Batch correction": 0.4, "Total": 0.6}}
        (tmp_path / str(job) / "metrics.json").write_text(json.dumps({"evaluation": {"scores": scores}}))
    summarize_sweep(tmp_path)
    header = next(line for line in (tmp_path / SUMMARY_MD).read_text().splitlines() if line.startswith("| job"))
    assert header == "| job | model.n_heads | corrected Total |"
    positions, labels = category_positions(pd.Series([8, 1, 2, 1]))
    assert list(positions) == [2, 0, 1, 0] and labels == ["1", "2", "8"]


@pytest.mark.slow  # an evaluate in a fresh process (10-12 s): with the slow checks, which CI runs
def test_evaluate_says_what_it_is_scoring_and_keeps_it_in_its_log(unlabelled_run, tmp_path):
    run, _ = unlabelled_run
    result = batchfix_cli(["evaluate", f"input={run / 'corrected.h5ad'}", f"hydra.run.dir={tmp_path / 'scores'}"],
                          tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = (tmp_path / "scores" / "evaluate.log").read_text()
    for step in ("Reading", "Scoring 200 cells", "batch mixing only", "Gene-level fidelity", "UMAPs", "Scored in"):
        assert step in logged and step in result.stdout + result.stderr, step


def test_the_run_folders_corrected_file_is_compressed(unlabelled_run):
    import h5py

    run, _ = unlabelled_run
    with h5py.File(run / "corrected.h5ad") as f:
        assert f["layers/batchfix_counts/data"].compression == "gzip"


def test_corrects_streamed_layers_are_compressed(unlabelled_run, subset_h5ad, tmp_path):
    """`correct` writes its layers chunk by chunk: values and indices gzip-compressed after a byte shuffle."""
    import h5py

    from batchfix.config import ResolvedCorrection
    from batchfix.correction.writers import correct_file
    from batchfix.training.trained import load_trained

    run, _ = unlabelled_run
    out = correct_file(subset_h5ad, tmp_path / "out.h5ad", load_trained(run / "model.ckpt"), ResolvedCorrection(),
                       batch_key="batch", progress=False)
    with h5py.File(out) as f:
        for part in ("batchfix_counts/data", "batchfix/data", "batchfix/indices"):
            assert f[f"layers/{part}"].compression == "gzip" and f[f"layers/{part}"].shuffle, part


def test_correct_refuses_an_existing_output_before_reading_anything(tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"not read")
    (tmp_path / "out.h5ad").write_bytes(b"kept")
    stderr, torch_imported = verb_probe("correct", [f"output={tmp_path / 'out.h5ad'}",
                                                    f"checkpoint={tmp_path / 'model.ckpt'}"], tmp_path)
    assert f"Output {tmp_path / 'out.h5ad'} exists" in stderr and torch_imported == "False", stderr[-2000:]
    assert (tmp_path / "out.h5ad").read_bytes() == b"kept"


def test_the_quick_starts_outputs_are_ignored_by_git():
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = ["run/model.ckpt", "scores/umap.png", "cellbench5.corrected.h5ad", "outputs/train/x/train.log"]
    ignored = subprocess.run(["git", "check-ignore", *outputs], cwd=root, capture_output=True, text=True)
    assert ignored.stdout.split() == outputs


def test_a_sweep_value_is_checked_before_the_first_job(subset_h5ad, tmp_path):
    sweep = tmp_path / "sweep"
    result = batchfix_cli(["train", "-m", f"data.path={subset_h5ad}", "model.n_heads=2,3",
                           f"hydra.sweep.dir={sweep}", *TINY], tmp_path)
    assert result.returncode == 1 and "sweep job 1" in result.stderr and "model.n_heads" in result.stderr, \
        result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (sweep / "0").exists()


@pytest.mark.parametrize("swept, named", [("data.batch_key=batch,nosuchcol", "nosuchcol"),
                                           ("data.path={subset},{missing}", "no_such.h5ad")])
def test_a_sweeps_data_values_are_checked_before_the_first_job(subset_h5ad, tmp_path, swept, named):
    """Columns and files a job names are read from each job's input header before job 0 trains."""
    sweep = tmp_path / "sweep"
    swept = swept.format(subset=subset_h5ad, missing=tmp_path / "no_such.h5ad")
    path = [] if swept.startswith("data.path") else [f"data.path={subset_h5ad}"]
    result = batchfix_cli(["train", "-m", *path, swept, f"hydra.sweep.dir={sweep}", *TINY], tmp_path)
    assert result.returncode == 1 and "sweep job 1" in result.stderr and named in result.stderr, \
        result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (sweep / "0").exists()


def test_a_used_sweep_folder_is_refused_before_a_finished_runs_hydra_files_change(subset_h5ad, tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / "model.ckpt").write_bytes(b"a finished run")
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- model.n_heads=2\n")
    result = batchfix_cli(["train", "-m", f"data.path={subset_h5ad}", "model.n_heads=1,2",
                           f"hydra.sweep.dir={sweep}", *TINY], tmp_path)
    assert result.returncode == 1 and "already holds a run" in result.stderr, result.stderr[-2000:]
    assert "hydra.sweep.dir=..." in result.stderr and "hydra.run.dir" not in result.stderr
    assert (sweep / "1" / ".hydra" / "overrides.yaml").read_text() == "- model.n_heads=2\n"
    assert not (sweep / "0").exists()


def genome_table(genome: str, n: int = 200):
    from batchfix.data.genome import bundled_gene_table

    return bundled_gene_table(genome).dropna(subset=["symbol"]).iloc[1000:1000 + n]


@pytest.mark.parametrize("named_as, genome, column", [("mm10", "GRCh38", "symbol"), ("GRCh38", "mm10", "gene_id")])
def test_genes_named_as_another_genome_are_refused_naming_it(named_as, genome, column, caplog):
    """Mouse names with GRCh38 (or human ones with mm10) would be placed on the wrong coordinates: one line naming
    the genome they fit; with that genome they are placed and nothing is said."""
    import pandas as pd

    from batchfix.data.genome import place_genes
    from batchfix.errors import InputError

    var = pd.DataFrame(index=genome_table(named_as)[column].to_numpy())
    with pytest.raises(InputError, match=f"look like {named_as}'s, not {genome}'s .*set data.genome={named_as}"):
        place_genes(var, genome=genome)
    with caplog.at_level("WARNING", logger="batchfix"):
        coordinates = place_genes(var, genome=named_as)
    assert "data.genome" not in caplog.text and pd.notna(coordinates.chromosome).mean() > 0.9


def test_var_columns_that_place_genes_are_checked():
    import pandas as pd

    from batchfix.data.genome import place_genes
    from batchfix.errors import InputError

    var = pd.DataFrame({"chromosome": ["1", "2"], "start": [100, 200]}, index=["A", "B"])
    with pytest.raises(InputError, match=r"no \['end'\]"):
        place_genes(var)
    var["end"] = ["150", "two hundred"]
    with pytest.raises(InputError, match=r"var\['end'\] of 1 genes"):
        place_genes(var)


def test_a_gtf_is_checked_even_when_var_places_every_gene_and_a_truncated_one_is_one_line(tmp_path):
    import gzip

    import pandas as pd

    from batchfix.data.genome import place_genes
    from batchfix.errors import InputError

    var = pd.DataFrame({"chromosome": ["1"], "start": [100], "end": [150]}, index=["A"])
    (tmp_path / "bad.gtf").write_text("1\tx\tgene\tone\ttwo\t.\t+\t.\tgene_id \"A\";\n")
    with pytest.raises(InputError, match="not a number"):
        place_genes(var, gtf=str(tmp_path / "bad.gtf"))
    whole = gzip.compress(("1\tx\tgene\t1\t9\t.\t+\t.\tgene_id \"A\";\n" * 2000).encode())
    (tmp_path / "cut.gtf.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(InputError, match="Cannot read data.gtf"):
        place_genes(var, gtf=str(tmp_path / "cut.gtf.gz"))


def test_raw_counts_declared_log_are_refused_with_a_hint(small_adata, write_h5ad):
    from batchfix.config import DataKeys
    from batchfix.data.io import expression_input, read_h5ad
    from batchfix.errors import InputError

    path = write_h5ad(small_adata)
    with pytest.raises(InputError, match="looks like raw counts.*data.scale=counts"):
        expression_input(read_h5ad(path), DataKeys(), scale="log")


def corrupt_csr(adata, path: Path, part: str) -> Path:
    """`adata` written with a CSR X whose column indices (part='indices') or row pointers ('indptr') are broken."""
    import h5py
    import scipy.sparse as sp

    adata = adata.copy()
    adata.X = sp.csr_matrix(adata.X)
    adata.write_h5ad(path)
    with h5py.File(path, "r+") as f:
        values = f[f"X/{part}"][:]
        if part == "indices":
            values[5] = adata.n_vars + 1000
        else:
            values[3] = values[4] + 7
        f[f"X/{part}"][:] = values
    return path


# Each corrupt part in a fresh process (10-12 s) runs with the slow checks, which CI runs
@pytest.mark.slow
@pytest.mark.parametrize("part", ["indices", "indptr"])
def test_a_corrupt_csr_matrix_is_one_line_and_leaves_no_run_folder(part, small_adata, tmp_path):
    from batchfix.data import ondisk
    from batchfix.errors import InputError

    path = corrupt_csr(small_adata, tmp_path / "bad.h5ad", part)
    result = batchfix_cli(["train", f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}", *TINY], tmp_path)
    assert result.returncode == 1 and "corrupt" in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    with pytest.raises(InputError, match="corrupt"):  # what correct reads, chunk by chunk
        with ondisk.open_anndata(path) as f:
            ondisk.open_rows(f["X"]).rows(0, small_adata.n_obs)


@pytest.mark.parametrize("change, message", [
    (lambda obs: obs.assign(cell_type=obs["cell_type"].where(obs.index != obs.index[0])), "1 missing values"),
    (lambda obs: obs.iloc[:60], "at least 90 cells"),
    (lambda obs: obs.assign(cell_type=[f"cell{i}" for i in range(len(obs))]), "labels for 200 cells"),
    (lambda obs: obs.assign(batch="one"), "holds one batch"),
])
def test_what_evaluate_cannot_score_is_one_line_before_the_scoring(change, message, subset):
    from batchfix.errors import InputError
    from batchfix.eval.metrics import check_enough_cells, check_obs_keys

    obs = change(subset.obs.copy())
    with pytest.raises(InputError, match=message):
        check_obs_keys(obs, "batch", "cell_type")
        check_enough_cells(obs)  # evaluate's file route (a benchmark scores smaller balanced subsamples)


def test_cnv_scores_without_a_profiled_gene_are_a_note_not_a_traceback(subset):
    import numpy as np

    from batchfix.data.io import OutputKeys
    from batchfix.eval.metrics import cnv_level_scores

    adata = subset.copy()
    adata.layers["batchfix"] = np.log1p(adata.X)
    adata.var["batchfix_modelled"] = True
    adata.var["chromosome"], adata.var["start"] = "unplaced", 0
    result = cnv_level_scores(adata, OutputKeys("batchfix"), "batch", "cell_type")
    assert result["retention_r"] is None and "profiled chromosome" in result["note"]


@pytest.mark.slow  # a train in a fresh process (9-11 s): with the slow checks, which CI runs
def test_resuming_with_another_network_shape_is_one_line_and_leaves_no_run_folder(unlabelled_run, subset_h5ad,
                                                                                   tmp_path):
    run, _ = unlabelled_run
    tiny = [arg for arg in TINY if not arg.startswith("model.d_model")]
    result = batchfix_cli(["train", f"data.path={subset_h5ad}", f"resume={run}", "model.d_model=32",
                           f"hydra.run.dir={tmp_path / 'again'}", *tiny], tmp_path)
    assert result.returncode == 1 and "model.d_model=16 (not 32)" in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "again").exists()


def test_an_unquoted_unicode_value_gets_a_hint_to_quote_it(tmp_path):
    result = batchfix_cli(["train", "data.label_key=Zellé", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 1 and "data.label_key='Zellé'" in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1


def test_keeping_regional_shifts_warns_when_most_genes_are_unplaced(caplog):
    import numpy as np

    from batchfix.config import CorrectionOptions
    from batchfix.tasks import warn_if_mostly_unplaced

    mostly_unplaced = np.arange(2000) < 85
    with caplog.at_level("WARNING", logger="batchfix"):
        assert warn_if_mostly_unplaced(mostly_unplaced, CorrectionOptions(regional_shift="keep"))
    assert "only 85 of 2000" in caplog.text
    assert not warn_if_mostly_unplaced(mostly_unplaced, CorrectionOptions(regional_shift="apply"))
    assert not warn_if_mostly_unplaced(~mostly_unplaced, CorrectionOptions(regional_shift="keep"))


@pytest.mark.parametrize("verb", ["train", "correct", "evaluate"])
def test_the_api_refuses_a_backed_anndata_before_any_work(verb, subset_h5ad):
    import anndata as ad

    import batchfix
    from batchfix.errors import InputError

    backed = ad.read_h5ad(subset_h5ad, backed="r")
    call = {"train": lambda: batchfix.train(backed), "correct": lambda: batchfix.correct(backed, "no.ckpt"),
            "evaluate": lambda: batchfix.evaluate(backed)}[verb]
    with pytest.raises(InputError, match="adata.to_memory"):
        call()
    backed.file.close()


def test_a_full_disk_keeps_the_previous_checkpoint_whole_and_is_one_line(tmp_path, monkeypatch):
    import errno

    from pytorch_lightning.plugins.io import TorchCheckpointIO

    from batchfix.errors import OutputError
    from batchfix.training.checkpoint_io import AtomicCheckpointIO

    best = tmp_path / "checkpoints" / "best.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, best)
    whole = best.read_bytes()

    def disk_full(self, checkpoint, path, storage_options=None):
        Path(path).write_bytes(b"trunc")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", disk_full)
    with pytest.raises(OutputError, match="No space left on device"):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, best)
    assert best.read_bytes() == whole and sorted(p.name for p in best.parent.iterdir()) == ["best.ckpt"]


def test_a_one_layer_attention_pictures_title_is_wrapped_not_cut(tmp_path):
    """One layer makes a narrow picture: the title wraps inside it (no glyph touches the picture's left or right
    edge in the title band)."""
    import numpy as np
    from PIL import Image

    from batchfix.tasks.attention_maps import AttentionMaps, plot_attention_maps

    bins = 48
    maps = np.random.default_rng(0).dirichlet(np.ones(bins), size=(1, 1, 2, bins)).astype(np.float32)
    chromosomes = np.repeat([f"chr{i}" for i in range(1, 25)], 2)
    attention = AttentionMaps(maps, ["all cells"], np.array([30]), np.ones(bins, int), chromosomes)
    plot_attention_maps(attention, tmp_path / "attention.png")
    pixels = np.asarray(Image.open(tmp_path / "attention.png").convert("L"))
    band = pixels[: pixels.shape[0] // 10]  # the title's rows
    assert (band[:, :3] > 200).all() and (band[:, -3:] > 200).all()


def test_the_cnv_table_of_metrics_md_says_how_many_genes_and_windows_it_scored():
    from batchfix.eval.reports import cnv_markdown

    table = cnv_markdown({"retention_r": 0.9, "uncorrected_r": 0.95, "relative_r": 0.947, "amplitude_ratio": 0.8,
                          "n_genes": 174, "n_windows": 21})
    header, _, row = table.strip().splitlines()
    assert header.endswith("| genes | windows |") and row.endswith("| 174 | 21 |")
