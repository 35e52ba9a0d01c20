"""`python -m batchfix evaluate input=X.corrected.h5ad`: score batch mixing and biology conservation."""
from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from batchfix.cli.common import require_data_keys, require_inputs, run, user_errors_reported
from batchfix.cli.summary import run_summary
from batchfix.config import EvaluateConfig, validated
from batchfix.runfolder import METRICS_JSON, METRICS_MD, UMAP_PNG, remove_if_unused


@hydra.main(version_base=None, config_path="pkg://batchfix.conf", config_name="evaluate")
def main(cfg: DictConfig) -> float | None:
    """Evaluate (batchfix.eval.evaluate.evaluate) into the run folder; return the corrected-expression Total."""
    out_dir = HydraConfig.get().runtime.output_dir
    with user_errors_reported("evaluate", on_error=lambda: remove_if_unused(out_dir)):
        options = validated(cfg, EvaluateConfig)  # before the heavy imports: a bad option is reported at once
        require_inputs(("input", options.input))
        require_data_keys(options.input, options.data)
        from batchfix.eval import metrics  # scoring needs neither torch nor Lightning
        from batchfix.eval.evaluate import evaluate

        result = evaluate(options, out_dir)
        print(run_summary("evaluate", result, out_dir, [METRICS_JSON, METRICS_MD, UMAP_PNG]))
        return metrics.headline({"evaluation": result})


if __name__ == "__main__":
    run(main, "evaluate")
