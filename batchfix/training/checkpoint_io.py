"""Lightning's checkpoints (checkpoints/best.ckpt, last.ckpt) written atomically (batchfix.data.atomic): a full disk
keeps the previous checkpoint whole, never a truncated one, and ends as one line (OutputError)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pytorch_lightning.plugins.io import TorchCheckpointIO

from batchfix.data.atomic import atomic_output


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO into a temporary file beside the checkpoint, moved into place once complete."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        with atomic_output(Path(path), overwrite=True, finish_on_signal=True) as tmp:  # the stop's own checkpoint
            super().save_checkpoint(checkpoint, tmp, storage_options)
