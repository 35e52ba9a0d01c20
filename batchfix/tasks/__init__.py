"""The verbs as plain functions of validated options (the CLI and tests call these): train (tasks.training),
correct and attention (tasks.inference); evaluate's is batchfix.eval.evaluate.evaluate, which needs neither torch
nor Lightning. Each is imported on first use, so `correct` never imports the training stack (Lightning)."""
from __future__ import annotations

from importlib import import_module

_LAZY = {"train": "training", "warn_if_mostly_unplaced": "training", "correct": "inference",
         "attention": "inference"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"batchfix.tasks.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'batchfix.tasks' has no attribute '{name}'")
