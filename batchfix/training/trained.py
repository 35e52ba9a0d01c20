"""A trained batchfix model for inference, and the safe checkpoint loader: no Lightning here.

Everything correction needs (modelled genes in genomic order, their coordinates, batch
categories, input scale, model hyperparameters) is saved as plain hyperparameters, and the
normalization statistics as buffers, so a checkpoint loads with `torch.load(weights_only=True)`:
no Hydra, no unpickling of arbitrary objects. The training plan (batchfix.training.module) builds its
network with the same `network_parts`, so its checkpoints load here; `correct` thus never imports
Lightning (about 1.3 s of a correction's start-up).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from torch import nn

from batchfix.config import ModelConfig, current_options
from batchfix.data.atomic import atomic_output
from batchfix.data.genome import GeneCoordinates, LocusWindows, make_windows
from batchfix.errors import CheckpointError, CheckpointFormatError
from batchfix.nn.network import BatchfixNet
from batchfix.training.tables import CalibrationTables, tables_from_network_keys

# What a checkpoint records of the data it was trained on (hyperparameter `data`), and what checkpoints written
# before it was recorded are taken to have used: the defaults of that time.
TRAINED_DATA_OPTIONS = ("batch_key", "label_key", "counts_layer", "genome")
LEGACY_DATA_OPTIONS = {"batch_key": "batch", "label_key": None, "counts_layer": None, "genome": "GRCh38"}


class Hyperparameters(dict):
    """A checkpoint's hyperparameters, read as keys or attributes (as Lightning's `hparams` are)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def network_parts(model: dict, genes: list[str], chromosome: list[str | None], start: list[int], end: list[int],
                  batch_categories: list[str], extra_genes: list[str] | None
                  ) -> tuple[ModelConfig, LocusWindows, BatchfixNet, CalibrationTables]:
    """(model config, loci windows, untrained network, empty calibration tables) of a checkpoint's
    hyperparameters."""
    config = ModelConfig(**model)
    coordinates = GeneCoordinates(np.array(chromosome, dtype=object), np.array(start), np.array(end))
    windows = make_windows(coordinates, config.genes_per_token)
    n_genes = len(genes)
    net = BatchfixNet(config, windows, n_genes, len(batch_categories), gene_mean=np.zeros(n_genes),
                      gene_std=np.ones(n_genes))
    tables = CalibrationTables(len(batch_categories), n_genes)
    if extra_genes:  # the genes the encoder does not read, corrected through a second decoder
        net.add_extra_genes(len(extra_genes))
        tables.add_extra_genes(len(extra_genes))
    return config, windows, net, tables


class TrainedNetwork(nn.Module):
    """The network of a checkpoint, its calibration tables and its hyperparameters (`hparams`), as the training plan
    holds them: the same state_dict keys (`net.*`, `tables.*`)."""

    def __init__(self, hyper_parameters: dict):
        super().__init__()
        self.hparams = Hyperparameters(hyper_parameters)
        h = self.hparams
        self.model_config, self.windows, self.net, self.tables = network_parts(
            h["model"], h["genes"], h["chromosome"], h["start"], h["end"], h["batch_categories"], h.get("extra_genes"))
        self._register_load_state_dict_pre_hook(tables_from_network_keys, with_module=True)


@dataclass
class BatchfixModel:
    """A trained batchfix model: the network plus what inference must check (genes, their order, batches).

    `BatchfixModel.load(path)` reads a checkpoint (a run folder's model.ckpt, or one `save` wrote);
    `save(path)` writes the same format; `batchfix.correct(adata, model)` adds corrected expression to an AnnData.
    """

    module: nn.Module  # TrainedNetwork, or the training plan (batchfix.training.module) after a fit
    path: Path | None = None  # the checkpoint file it was loaded from or last saved to

    @classmethod
    def load(cls, path: str | Path) -> "BatchfixModel":
        return load_trained(path)

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write a checkpoint that `load` and `python -m batchfix correct checkpoint=...` read (atomically)."""
        target = Path(path).expanduser()
        state = {"hyper_parameters": dict(self.module.hparams), "state_dict": self.module.state_dict(),
                 "pytorch-lightning_version": version("pytorch-lightning")}
        with atomic_output(target, overwrite) as tmp:
            torch.save(state, tmp)
        self.path = target
        return target

    @property
    def config(self) -> ModelConfig:
        return self.module.model_config

    @property
    def net(self) -> BatchfixNet:
        return self.module.net

    @property
    def tables(self) -> CalibrationTables:
        """What calibration measured after the fit (batchfix.training.tables)."""
        return self.module.tables

    @property
    def genes(self) -> list[str]:
        return list(self.module.hparams.genes)

    @property
    def extra_genes(self) -> list[str]:
        """The genes corrected through the second decoder (batchfix.correction.extra_genes), in its order."""
        return list(self.module.hparams.get("extra_genes") or [])

    @property
    def batch_categories(self) -> list[str]:
        return list(self.module.hparams.batch_categories)

    @property
    def scale(self) -> str:
        return self.module.hparams.scale

    @property
    def data_options(self) -> dict:
        """The data options it was trained with (TRAINED_DATA_OPTIONS), which `correct` takes as its defaults;
        a checkpoint written before they were saved gives the defaults of that time."""
        saved = self.module.hparams.get("data") or {}
        return {**LEGACY_DATA_OPTIONS, **saved, "scale": self.scale}

    @property
    def correction(self) -> dict | None:
        """The correction it was trained with ({'preset': name, 'options': every correction option}), which
        `correct` applies unless told otherwise; None for a checkpoint that does not record it. An earlier
        release's record is read in this release's terms (batchfix.config.current_options)."""
        remembered = self.module.hparams.get("correction")
        if remembered is None:
            return None
        return {**remembered, "options": current_options(remembered["options"], ablations=False)}

    @property
    def recommendation(self) -> dict | None:
        """The preset recommended after training and why (batchfix.correction.recommendation); None if not made."""
        return self.module.hparams.get("recommendation")

    def remember_recommendation(self, record: dict) -> None:
        self.module.hparams["recommendation"] = record

    def remember_correction(self, record: dict) -> None:
        """Keep `record` (batchfix.config.remembered_correction) as the correction `correct` applies by default."""
        self.module.hparams["correction"] = record


def load_trained(path: str | Path) -> BatchfixModel:
    """Load a batchfix checkpoint without executing code from the file (weights_only)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise CheckpointError(f"Checkpoint {path} is a folder: name the checkpoint file in it "
                              f"(e.g. {path}/model.ckpt).")
    if not path.is_file():
        raise CheckpointError(f"Checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (MemoryError, PermissionError, IsADirectoryError):  # the machine or the path, not the file's content
        raise
    except Exception as err:
        raise CheckpointError(
            f"Cannot load checkpoint {path}: it is truncated, corrupt, or holds objects other than tensors "
            f"and plain values (refused for safety). {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
        ) from err
    if not isinstance(checkpoint, dict) or "hyper_parameters" not in checkpoint or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path} is not a batchfix checkpoint (no hyper_parameters/state_dict).")
    try:
        module = TrainedNetwork(checkpoint["hyper_parameters"])
        module.load_state_dict(checkpoint["state_dict"])
    except CheckpointFormatError:
        raise
    except (TypeError, RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path} does not match the batchfix model: {err}") from err
    module.eval()
    return BatchfixModel(module, path)
