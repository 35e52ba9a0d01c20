"""`python -m batchfix train [overrides]`: fit a model on an .h5ad and write a Hydra run folder."""
from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from batchfix.cli.common import require_data_keys, require_inputs, require_normal_cells, run, user_errors_reported
from batchfix.cli.summary import run_summary
from batchfix.config import TrainConfig, validated
from batchfix.runfolder import RUN_OUTPUTS, remove_if_unused


@hydra.main(version_base=None, config_path="pkg://batchfix.conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Train (batchfix.tasks.train); return the number a sweep optimises. A run stopped by a user error or a
    signal before it saved anything leaves no run folder behind."""
    run_dir = HydraConfig.get().runtime.output_dir
    with user_errors_reported("train", on_error=lambda: remove_if_unused(run_dir)):
        options = validated(cfg, TrainConfig)  # before the heavy imports: a bad option is reported at once
        require_inputs(("data.path", options.data.path), ("data.gtf", options.data.gtf))
        require_data_keys(options.data.path, options.data)
        require_normal_cells(options.data.path, options.correction)
        from batchfix import tasks
        from batchfix.eval.metrics import headline

        metrics = tasks.train(options, run_dir, HydraConfig.get().runtime.choices.get("correction"))
        if metrics:  # rank 0
            print(run_summary("train", metrics, run_dir, [*RUN_OUTPUTS, "attention.png"]))
        return headline(metrics)


if __name__ == "__main__":
    run(main, "train")
