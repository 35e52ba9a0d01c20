"""`python -m batchfix attention input=IN checkpoint=RUN/model.ckpt output=FOLDER`: attention maps along the genome."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from batchfix.cli.common import require_inputs, require_keys, run, user_errors_reported
from batchfix.config import AttentionConfig, validated


@hydra.main(version_base=None, config_path="pkg://batchfix.conf", config_name="attention")
def main(cfg: DictConfig) -> None:
    """Attention maps (batchfix.tasks.attention): attention.png and attention.npz are all it writes."""
    with user_errors_reported("attention"):
        options = validated(cfg, AttentionConfig)  # before the heavy imports: a bad option is reported at once
        require_inputs(("input", options.input), ("checkpoint", options.checkpoint))
        require_keys(options.input, {"group_by": ("Group", options.group_by)},
                     {"data.counts_layer": options.data.counts_layer})
        from batchfix import tasks

        tasks.attention(options)


if __name__ == "__main__":
    run(main, "attention")
