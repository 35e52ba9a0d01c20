"""batchfix: batch-effect correction for gene-expression matrices, with self-attention over genes
in genomic order.

    import batchfix
    model = batchfix.train(adata, batch_key="sample")   # a BatchfixModel
    batchfix.correct(adata, model)                      # adds layers['batchfix'], obsm['X_batchfix']
    batchfix.settings.verbosity = "info"                # progress lines in a notebook

The command line (`python -m batchfix train|correct|evaluate`) runs the same code on files.
"""
from __future__ import annotations

__version__ = "0.1.0"

from batchfix.console import settings  # noqa: E402 - batchfix.settings.verbosity = "info": progress lines

# The API pulls in torch and Lightning: imported on first use, so `python -m batchfix --help` stays quick.
_LAZY = {"train": "batchfix.api", "correct": "batchfix.api", "evaluate": "batchfix.api",
         "BatchfixModel": "batchfix.training.trained", "bundled_dataset": "batchfix.data.io"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchfix' has no attribute '{name}'")


__all__ = ["train", "correct", "evaluate", "BatchfixModel", "bundled_dataset", "settings", "__version__"]


def __dir__() -> list[str]:
    """The public API, lazy names included: what `batchfix.<Tab>` offers in IPython."""
    return sorted(__all__)
