"""`python -m batchfix correct input=IN output=OUT checkpoint=RUN/model.ckpt`: write a corrected copy of an .h5ad."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from batchfix.cli.common import require_inputs, run, user_errors_reported
from batchfix.config import CorrectConfig, validated


@hydra.main(version_base=None, config_path="pkg://batchfix.conf", config_name="correct")
def main(cfg: DictConfig) -> None:
    """Correct (batchfix.tasks.correct): the output file is all it writes."""
    with user_errors_reported("correct"):
        options = validated(cfg, CorrectConfig)  # before the heavy imports: a bad option is reported at once
        require_inputs(("input", options.input), ("checkpoint", options.checkpoint))
        from batchfix import tasks

        tasks.correct(options)


if __name__ == "__main__":
    run(main, "correct")
