"""`python -m batchfix correct input=IN output=OUT checkpoint=RUN/model.ckpt`: write a corrected copy of an .h5ad."""
from __future__ import annotations

import re

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from batchfix.cli.common import require_inputs, require_keys, run, user_errors_reported
from batchfix.config import CorrectConfig, CorrectionChoice, validated
from batchfix.data.atomic import CORRECTED_SUFFIX, default_output, refuse_existing
from batchfix.data.header import input_path
from batchfix.errors import InputError

# The layer errors' hint for train, where null means X; for correct null means the checkpoint's layer.
NULL_READS_X = re.compile(r"Use (data\.)?counts_layer=null to read X\.$")
X_READS_X = ("data.counts_layer=X reads X (null: the layer the model was trained on, data.counts_layer=NAME: another "
             "layer).")


def hint_for_correct(err: InputError) -> InputError:
    """A missing layer's error with the hint that holds for correct: data.counts_layer=X, not null."""
    return InputError(NULL_READS_X.sub(X_READS_X, str(err))) if NULL_READS_X.search(str(err)) else err


def correction_told(cfg: DictConfig) -> CorrectionChoice:
    """The preset (`correction=NAME`) and options (`correction.KEY=VALUE`) given on the command line: the rest of
    the correction is the checkpoint's."""
    keys = [str(arg).lstrip("+~").split("=", 1)[0] for arg in HydraConfig.get().overrides.task]
    preset = HydraConfig.get().runtime.choices.get("correction") if "correction" in keys else None
    options = {key.split(".", 1)[1]: cfg.correction[key.split(".", 1)[1]] for key in keys
               if key.startswith("correction.")}
    return CorrectionChoice(preset, options)


@hydra.main(version_base=None, config_path="pkg://batchfix.conf", config_name="correct")
def main(cfg: DictConfig) -> None:
    """Correct (batchfix.tasks.correct): the output file is all it writes."""
    with user_errors_reported("correct"):
        options = validated(cfg, CorrectConfig)  # before the heavy imports: a bad option is reported at once
        require_inputs(("input", options.input), ("checkpoint", options.checkpoint))
        refuse_existing(default_output(input_path(options.input), options.output, CORRECTED_SUFFIX),
                        options.overwrite)  # before anything is read
        layer = options.data.counts_layer  # X names the X matrix, not a layer: the correction reads it so
        try:
            require_keys(options.input, {"data.batch_key": ("Batch", options.data.batch_key)},
                         {"data.counts_layer": None if layer == "X" else layer})
            from batchfix import tasks

            tasks.correct(options, correction_told(cfg))
        except InputError as err:
            raise hint_for_correct(err) from None


if __name__ == "__main__":
    run(main, "correct")
