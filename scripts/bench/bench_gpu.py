"""batchfix on a GPU: the fp16 guards on CUDA tensors, 16-mixed training against 32-true and bf16-mixed, and the
training speed against scVI on the same GPU.

Two halves, so that a GPU is held only while it trains:

    python -m scripts.bench.bench_gpu train OUT [--seeds 0 1 2] [--cells 100000] [--budget 420]   # needs CUDA
    python -m scripts.bench.bench_gpu train OUT --name per-gene --option genes_per_token=1 --cells 0   # another model
    python -m scripts.bench.bench_gpu score OUT [OUT ...] [--csv scores.csv] [--table summary.csv]  # any CPU

train:
- guards: attention on CUDA float16 tensors whose scores overflow fp16 without the guards (exp of an unshifted
  score; the product q k^T taken before the scale). Unguarded, each gives inf or NaN; batchfix's `guarded` and
  `sdpa` backends must stay finite and within 1e-2 of a float64 reference.
- bundled: the fit of `batchfix.train` on the bundled data's 2,000 batch-aware HVGs (as scripts/benchmark.py
  selects them), default options on the GPU, at each precision and seed: fit seconds, optimizer steps, training
  cells per second, peak GPU memory, the last validation ELBO, how many logged losses were not finite, and for
  16-mixed the loss scale at the end (it starts at 65,536 and halves at each step whose gradients overflowed,
  which is then skipped; it doubles only after 2,000 clean steps, more than a default fit takes). Each
  calibrated model is saved as OUT/bundled_NAME_PRECISION_SEED.ckpt (NAME: --name, for the batchfix.train options
  of --option).
- scale: --cells Poisson-resampled bundled cells (scripts/resampled.py, the 4,000 most detected genes, 2,000
  HVGs selected as above): batchfix's default fit (the epochs it plans at that size) at 16-mixed and at 32-true,
  and scVI (scvi-tools, default settings) for --scvi-epochs epochs, its later epochs' mean time projected to its
  default epoch count; ratio = batchfix's fit / scVI's projected default training, both on the GPU.
Everything measured goes to OUT/gpu.json after each fit; a part that would start after --budget seconds is
skipped, and the file says so.

score: each saved model corrects the bundled data (batchfix.correct: the default counterfactual output),
and its latent and the PCA of its corrected matrix are scored as scripts/benchmark.py scores them (scIB Total; the
four gene scores of batchfix.eval.fidelity): per model and precision, mean ± sd over seeds, beside the fit figures.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from scripts.benchmark import load, select_genes

BUNDLED_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
SCALE_PRECISIONS = ("16-mixed", "32-true")
INITIAL_LOSS_SCALE = 65536.0  # torch's GradScaler default, which Lightning's 16-mixed uses
GUARD_TOLERANCE = 1e-2
SCALE_GENES = 4000  # genes kept in the resampled file (the most detected), before the 2,000 HVGs


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64: the reference."""
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def guard_inputs(device: str, seed: int = 0) -> dict[str, tuple[torch.Tensor, ...]]:
    """(q, k, v) float16 on `device`, (B, H, L, Dh) = (4, 2, 64, 32), for each way fp16 overflows:

    exp: q all ones and k about 2.5 per entry, so the scaled scores are about 14 ± 1 (exp above fp16's 65,504
    unless the row maximum is subtracted first) and the softmax is far from one-hot; product: q and k of entries
    60 with every key alike, so the unscaled q k^T (115,200) overflows while the scaled one (20,365) does not, and
    the weights are uniform (scores that large have no finer resolution in fp16).
    """
    g = torch.Generator().manual_seed(seed)
    shape = (4, 2, 64, 32)
    v = torch.randn(shape, generator=g)
    q_exp = torch.ones(shape)
    k_exp = 14.0 / math.sqrt(shape[-1]) + torch.randn(shape, generator=g)
    q_product = torch.full(shape, 60.0)
    k_product = torch.full(shape, 60.0)
    return {name: tuple(t.half().to(device) for t in tensors)
            for name, tensors in (("exp", (q_exp, k_exp, v)), ("product", (q_product, k_product, v)))}


def unguarded(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention without the guard `kind` tests (in the inputs' dtype)."""
    if kind == "exp":  # scaled before the product, but exp of the raw scores
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        weights = scores.exp()
        return (weights / weights.sum(-1, keepdim=True)) @ v
    return torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), dim=-1) @ v  # product first


def guard_check(device: str) -> list[dict]:
    """Each overflow kind: whether the unguarded form breaks, and each backend's largest error against float64."""
    from batchfix.nn.attention import guarded_attention, sdpa_attention

    backends = {"guarded": guarded_attention, "sdpa": sdpa_attention}
    rows = []
    for kind, (q, k, v) in guard_inputs(device).items():
        expected = float64_attention(q, k, v)
        row = {"overflow": kind, "unguarded_finite": bool(torch.isfinite(unguarded(kind, q, k, v)).all())}
        for name, attend in backends.items():
            out = attend(q, k, v)
            row[f"{name}_dtype"] = str(out.dtype).replace("torch.", "")
            row[f"{name}_finite"] = bool(torch.isfinite(out).all())
            row[f"{name}_max_error"] = float((out.double() - expected).abs().max())
        row["passed"] = (not row["unguarded_finite"]) and all(
            row[f"{name}_finite"] and row[f"{name}_max_error"] <= GUARD_TOLERANCE for name in backends)
        rows.append(row)
    return rows


def model_path(folder: Path, name: str, precision: str, seed: int) -> Path:
    """Where `train` saves a bundled model and `score` reads it."""
    return folder / f"bundled_{name}_{precision}_{seed}.ckpt"


def logged_losses(run_dir: Path) -> tuple[float | None, int, int]:
    """(last validation ELBO, logged loss values, how many of them are not finite) from logs/metrics.csv."""
    path = run_dir / "logs" / "metrics.csv"
    if not path.is_file():
        return None, 0, 0
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    values, last_val = [], None
    for row in rows:
        for column, text in row.items():
            if text in ("", None) or not ("loss" in column or "elbo" in column):
                continue
            value = float(text)
            values.append(value)
            if column == "val_elbo":
                last_val = value
    return last_val, len(values), int(sum(not math.isfinite(v) for v in values))


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing to wait for without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_fit(adata, precision: str, seed: int, accelerator: str, **options):
    """batchfix's default fit at `precision`; (figures, fit result, prepared data, scratch folder of the run)."""
    from batchfix.api import train_config
    from batchfix.training import fitting

    cfg = train_config(batch_key="batch", label_key="cell_type", n_top_genes=None, seed=seed, precision=precision,
                       accelerator=accelerator, enable_progress_bar=False, **options)
    fitting.seed_and_threads(cfg.seed, cfg.threads)
    prepared = fitting.load_training_data(cfg.data, adata)
    scratch = tempfile.TemporaryDirectory(prefix="batchfix-gpu-")
    on_gpu = torch.cuda.is_available() and accelerator != "cpu"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    synchronize()
    result = fitting.fit(cfg, prepared, Path(scratch.name))
    synchronize()
    steps = int(result.trainer.global_step)
    scaler = getattr(result.trainer.precision_plugin, "scaler", None)
    last_val, n_logged, n_nonfinite = logged_losses(Path(scratch.name))
    figures = {"precision": precision, "seed": seed, "cells": prepared.n_cells, "fit_s": round(result.seconds, 2),
               "epochs": int(result.trainer.current_epoch), "steps": steps,
               "train_cells_per_s": round(steps * cfg.fit.batch_size / result.seconds),
               "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20) if on_gpu else None,
               "last_val_elbo": last_val, "logged_losses": n_logged, "nonfinite_losses": n_nonfinite}
    if scaler is not None:
        final = float(scaler.get_scale())
        figures.update(final_loss_scale=final, skipped_steps=round(math.log2(INITIAL_LOSS_SCALE / final)))
    return figures, result, prepared, scratch


def scvi_timing(adata, epochs: int, accelerator: str) -> dict:
    """scVI (default settings, the GPU) on `adata` for `epochs` epochs: mean time of the epochs after the first,
    projected to scvi-tools' default epoch count for this many cells."""
    import scvi
    from pytorch_lightning.callbacks import Callback

    class EpochTimer(Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_epoch_start(self, trainer, module):
            synchronize()
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            synchronize()
            self.times.append(time.perf_counter() - self.start)

    adata = adata.copy()
    scvi.settings.seed = 0
    scvi.model.SCVI.setup_anndata(adata, batch_key="batch")
    model = scvi.model.SCVI(adata)
    timer = EpochTimer()
    model.train(max_epochs=epochs, accelerator=accelerator, enable_progress_bar=False, callbacks=[timer])
    timed = timer.times[1:] if len(timer.times) > 1 else timer.times
    default_epochs = int(min(round(20000 / adata.n_obs * 400), 400))
    epoch = float(np.mean(timed))
    return {"scvi_version": scvi.__version__, "scvi_epoch_s": round(epoch, 3), "scvi_epochs_timed": len(timed),
            "scvi_default_epochs": default_epochs, "scvi_default_s": round(epoch * default_epochs, 1)}


def train(args: argparse.Namespace) -> None:
    """The GPU half: guards, fits on the bundled data, the speed at --cells cells; OUT/gpu.json after each."""
    import anndata as ad
    import pytorch_lightning as pl

    from batchfix.correction.calibration import calibrated_model
    from batchfix.data.io import bundled_dataset

    if args.accelerator != "cpu" and not torch.cuda.is_available():
        raise SystemExit("train needs a CUDA GPU (torch.cuda.is_available() is False): --accelerator cpu runs it on "
                         "the CPU (a dry run); score runs anywhere.")
    device = "cpu" if args.accelerator == "cpu" else "cuda"
    fit_options = dict(args.option)
    if args.max_epochs is not None:
        fit_options["max_epochs"] = args.max_epochs
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU dry run)",
              "torch": torch.__version__, "cuda": torch.version.cuda, "lightning": pl.__version__,
              "fit_options": fit_options, "guards": guard_check(device), "bundled": [], "scale": [], "skipped": []}

    def save() -> None:
        (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")

    def in_budget(part: str) -> bool:
        if time.perf_counter() - started < args.budget:
            return True
        report["skipped"].append(part)
        save()
        print(f"skipped (past --budget {args.budget:.0f} s): {part}", flush=True)
        return False

    save()
    print(json.dumps(report["guards"], indent=2), flush=True)
    bundled = select_genes(load(bundled_dataset(), "batch", "cell_type", None), "batch", 2000)
    for seed in args.seeds:
        for precision in args.precisions:
            if not in_budget(f"bundled {precision} seed {seed}"):
                continue
            figures, result, prepared, scratch = timed_fit(bundled, precision, seed, args.accelerator, **fit_options)
            figures["name"] = args.name
            calibrated_model(result.best_checkpoint, prepared).save(model_path(out, args.name, precision, seed))
            scratch.cleanup()
            report["bundled"].append(figures)
            save()
            print(json.dumps(figures), flush=True)
    if not args.cells:
        return
    from scripts.resampled import generate

    if not in_budget(f"scale {args.cells} cells"):
        return
    with tempfile.TemporaryDirectory(prefix="batchfix-gpu-") as folder:  # the file is read whole, then removed
        path = Path(folder) / f"resampled_{args.cells}.h5ad"
        generate(path, args.cells, n_genes=SCALE_GENES)
        cells = select_genes(ad.read_h5ad(path), "batch", 2000)
    cells.X = cells.X.astype(np.float32)
    for precision in SCALE_PRECISIONS:
        if not in_budget(f"scale {args.cells} cells, batchfix {precision}"):
            continue
        figures, _, _, scratch = timed_fit(cells, precision, 0, args.accelerator, **fit_options)
        scratch.cleanup()
        report["scale"].append({"method": "batchfix", **figures})
        save()
        print(json.dumps(report["scale"][-1]), flush=True)
    if args.scvi_epochs and in_budget(f"scale {args.cells} cells, scVI"):
        try:
            scvi = scvi_timing(cells, args.scvi_epochs, args.accelerator)
        except Exception as err:  # noqa: BLE001 - the baseline's own failure is reported, batchfix's figures kept
            report["scale"].append({"method": "scVI", "error": f"{type(err).__name__}: {err}"})
            save()
            raise
        for row in report["scale"]:
            row["ratio_to_scvi_default"] = round(row["fit_s"] / scvi["scvi_default_s"], 4)
        report["scale"].append({"method": "scVI", "cells": args.cells, **scvi})
        save()
        print(json.dumps(report["scale"][-1]), flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    save()


def model_scores(folder: Path, adata, uncorrected: np.ndarray) -> list[dict]:
    """One row per model of a `train` folder: its fit figures, the scIB Total of its latent and of its corrected
    matrix's PCA, and the four gene scores of that matrix, on the bundled data `adata` (HVG counts)."""
    import batchfix
    from batchfix.eval import fidelity, metrics

    report = json.loads((folder / "gpu.json").read_text())
    batch, labels = adata.obs["batch"].to_numpy(), adata.obs["cell_type"].to_numpy()
    rows = []
    for figures in report["bundled"]:
        model = batchfix.BatchfixModel.load(model_path(folder, figures["name"], figures["precision"], figures["seed"]))
        corrected = batchfix.correct(adata, model, copy=True)
        modelled = corrected.var["batchfix_modelled"].to_numpy()
        matrix = np.asarray(corrected.layers["batchfix"][:, modelled].toarray(), dtype=np.float32)
        embeddings = {"latent": np.asarray(corrected.obsm["X_batchfix"], dtype=np.float32),
                      "matrix": metrics.pca_embedding(matrix, seed=figures["seed"])}
        scib = metrics.score_embeddings(adata.obs, embeddings, uncorrected, "batch", "cell_type")
        genes = fidelity.gene_fidelity(adata.X[:, modelled], matrix, batch, labels)
        rows.append({"model": figures["name"], "precision": figures["precision"], "seed": figures["seed"],
                     "gpu": report["gpu"], "fit s": figures["fit_s"], "steps": figures["steps"],
                     "skipped steps": figures.get("skipped_steps", 0), "train cells/s": figures["train_cells_per_s"],
                     "peak GPU MB": figures["peak_gpu_mb"], "non-finite losses": figures["nonfinite_losses"],
                     "val ELBO": figures["last_val_elbo"],
                     "latent Total": float(scib.loc["latent", metrics.TOTAL_SCORE]),
                     "matrix Total": float(scib.loc["matrix", metrics.TOTAL_SCORE]),
                     **{metric: genes[metric] for metric in fidelity.GENE_METRICS}})
        print(rows[-1], flush=True)
    return rows


def summary_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per model and precision: the Totals as mean ± sd over seeds, every other figure as its mean."""
    from batchfix.eval import fidelity

    spread = ["latent Total", "matrix Total"]
    means = ["fit s", "steps", "skipped steps", "train cells/s", "peak GPU MB", "non-finite losses",
             *fidelity.GENE_METRICS]
    grouped = table.groupby(["model", "precision"], sort=False)
    mean, sd = grouped[spread + means].mean(), grouped[spread].std().fillna(0.0)
    out = pd.DataFrame(index=mean.index)
    out["seeds"] = grouped["seed"].apply(lambda seeds: ",".join(map(str, sorted(seeds))))
    for column in spread:
        out[column] = [f"{m:.3f} ± {s:.3f}" for m, s in zip(mean[column], sd[column])]
    decimals = {"fit s": 1, "steps": 0, "skipped steps": 1, "train cells/s": 0, "peak GPU MB": 0,
                "non-finite losses": 0}
    for column in means:
        out[column] = [f"{value:,.{decimals.get(column, 3)}f}" for value in mean[column]]
    return out.reset_index()


def speed_table(folders: list[Path]) -> pd.DataFrame:
    """The speed part of every folder that has one: batchfix's fits and scVI's projected default training."""
    rows = []
    for folder in folders:
        report = json.loads((folder / "gpu.json").read_text())
        scvi = next((row for row in report["scale"] if row["method"] == "scVI" and "scvi_default_s" in row), None)
        for row in report["scale"]:
            if row["method"] != "batchfix":
                continue
            rows.append({"cells": f"{row['cells']:,}", "batchfix precision": row["precision"],
                         "batchfix fit s (epochs, steps)": f"{row['fit_s']:.1f} ({row['epochs']}, {row['steps']})",
                         "train cells/s": f"{row['train_cells_per_s']:,}",
                         "peak GPU MB": "" if row["peak_gpu_mb"] is None else f"{row['peak_gpu_mb']:,}",
                         "scVI epoch x default epochs": "" if scvi is None else
                         f"{scvi['scvi_epoch_s']:.2f} s x {scvi['scvi_default_epochs']} = "
                         f"{scvi['scvi_default_s']:,.0f} s",
                         "fit / scVI": "" if scvi is None else f"{row['fit_s'] / scvi['scvi_default_s']:.3f}"})
    return pd.DataFrame(rows)


def score(args: argparse.Namespace) -> None:
    """The CPU half: correct the bundled data with every saved model of the folders and score latent and matrix."""
    from batchfix.data.io import bundled_dataset
    from batchfix.data.normalize import log_cp10k
    from batchfix.eval import metrics

    folders = [Path(folder) for folder in args.folders]
    adata = select_genes(load(bundled_dataset(), "batch", "cell_type", None), "batch", 2000)
    uncorrected = metrics.pca_embedding(np.asarray(log_cp10k(adata.X), dtype=np.float32))
    table = pd.DataFrame([row for folder in folders for row in model_scores(folder, adata, uncorrected)])
    summary = summary_table(table)
    speed = speed_table(folders)
    for path, frame in ((args.csv, table), (args.table, summary), (args.speed_table, speed)):
        if path:
            frame.to_csv(path, index=False)
    with pd.option_context("display.width", 250, "display.max_columns", None):
        print(f"\nmean (± sd) over seeds:\n{summary.to_string(index=False)}")
        if len(speed):
            print(f"\nspeed:\n{speed.to_string(index=False)}")


def keyword_option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as a Python literal where it is one (1, 0.5, True, None), else as text."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    trainer = verbs.add_parser("train", help="the GPU half: guards, fits, speed (needs CUDA)")
    trainer.add_argument("out", help="folder for gpu.json and the saved models")
    trainer.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    trainer.add_argument("--precisions", nargs="+", default=list(BUNDLED_PRECISIONS), choices=BUNDLED_PRECISIONS,
                         help="precisions of the bundled fits")
    trainer.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"),
                         help="cpu: a dry run of the whole script on the CPU (16-mixed then runs as bf16-mixed)")
    trainer.add_argument("--max-epochs", type=int, help="cap every fit's epochs (a quick dry run; default: none)")
    trainer.add_argument("--name", default="default", help="the bundled models' name in their files and the table")
    trainer.add_argument("--option", nargs="+", default=[], type=keyword_option, metavar="KEY=VALUE",
                         help="batchfix.train options of every fit (e.g. genes_per_token=1)")
    trainer.add_argument("--cells", type=int, default=100_000, help="resampled cells of the speed part (0: none)")
    trainer.add_argument("--scvi-epochs", type=int, default=3, help="scVI epochs timed there (0: no scVI)")
    trainer.add_argument("--budget", type=float, default=420.0,
                         help="seconds after which no further fit starts (what ran is saved)")
    scorer = verbs.add_parser("score", help="the CPU half: correct and score the saved models")
    scorer.add_argument("folders", nargs="+", help="folders `train` wrote")
    scorer.add_argument("--csv", help="also write every model's scores to this CSV")
    scorer.add_argument("--table", help="also write the mean over seeds per model and precision to this CSV")
    scorer.add_argument("--speed-table", help="also write the speed parts' figures to this CSV")
    args = parser.parse_args(argv)
    if args.verb == "train" and (args.cells < 0 or args.scvi_epochs < 0 or args.budget <= 0):
        parser.error("--cells and --scvi-epochs must be >= 0, --budget > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train(args) if args.verb == "train" else score(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
