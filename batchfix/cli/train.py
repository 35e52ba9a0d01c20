"""`python -m batchfix train [overrides]`: fit a model on an .h5ad and write a Hydra run folder."""
from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from batchfix.cli.common import user_errors_reported
from batchfix.config import TrainConfig, validated


@hydra.main(version_base=None, config_path="pkg://batchfix.conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Train (batchfix.tasks.train); return the number a sweep optimises."""
    with user_errors_reported("train"):
        from batchfix import tasks

        metrics = tasks.train(validated(cfg, TrainConfig), HydraConfig.get().runtime.output_dir)
        return tasks.headline(metrics)


if __name__ == "__main__":
    main()
