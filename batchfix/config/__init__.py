"""Every option of batchfix: its type, its one default, and the values it accepts.

These dataclasses are the schemas Hydra composes the YAML presets of `conf/` onto (registered in
Hydra's ConfigStore by `register_schemas`), so a value of the wrong type is refused while the
command line is parsed (`fit.batch_size=abc`). Ranges and combinations are checked in each
schema's `__post_init__`, which runs when a composed config becomes these objects (`validated`),
and when the Python API builds them from keyword options (`train_config`): no option reaches
torch or scanpy unchecked, and every error names the option and what it accepts.

The modules: `choices` (accepted values and the checks), `groups` (train's data, model, fit and trainer
groups), `verbs` (each verb's schema and the options they share), `parsing` (a composed config made into
them), `presets` (the `correction` group's named entries, and which correction a command applies) and
`help_text` (the options' descriptions and the did-you-mean of an unknown one). Everything is imported from
here: `from batchfix.config import TrainConfig`.
"""
from batchfix.config.choices import (
    ATTENTION_BACKENDS,
    GENOMES,
    HYDRA_FLAGS,
    LIKELIHOODS,
    NEIGHBOR_METHODS,
    OUTPUT_MODES,
    POSITION_ENCODINGS,
    PRECISIONS,
    REGIONAL_ORDERS,
    REGIONAL_SHIFTS,
    RETIRED_OPTIONS,
    RETIRED_REGIONAL_SHIFTS,
    SCALES,
    SHRINKS,
    SPREADS,
    STREAM_CHOICES,
    TOKEN_IDENTITIES,
    UNPLACED_CHOICES,
    at_least,
    non_empty,
    one_of,
    within,
)
from batchfix.config.groups import (
    DataConfig,
    DataKeys,
    FitConfig,
    ModelAblations,
    ModelConfig,
    ModelOptions,
    TrainerConfig,
)
from batchfix.config.help_text import (
    dashed_option_error,
    dotted_options,
    field_comments,
    flat_option_names,
    option_descriptions,
    unknown_option_error,
)
from batchfix.config.parsing import readable, unknown_options, validated
from batchfix.config.presets import (
    DEFAULT_PRESET,
    CorrectionChoice,
    current_options,
    preset_names,
    preset_options,
    remembered_correction,
)
from batchfix.config.verbs import (
    GROUP_SCHEMAS,
    SCHEMAS,
    AttentionConfig,
    AttentionDataOptions,
    AttentionInferenceOptions,
    CorrectConfig,
    CorrectDataOptions,
    CorrectInferenceOptions,
    CorrectionAblations,
    CorrectionOptions,
    EvaluateConfig,
    EvaluateCorrectionOptions,
    EvaluationOptions,
    ResolvedCorrection,
    TrainAblations,
    TrainConfig,
    correction_ablations,
    register_schemas,
    schema_values,
)

__all__ = [
    "ATTENTION_BACKENDS", "GENOMES", "HYDRA_FLAGS", "LIKELIHOODS", "NEIGHBOR_METHODS", "OUTPUT_MODES", "POSITION_ENCODINGS",
    "PRECISIONS", "REGIONAL_ORDERS", "REGIONAL_SHIFTS",
    "RETIRED_OPTIONS", "RETIRED_REGIONAL_SHIFTS", "SCALES", "SHRINKS", "SPREADS", "STREAM_CHOICES", "TOKEN_IDENTITIES",
    "UNPLACED_CHOICES", "at_least", "non_empty", "one_of", "within",
    "DataConfig", "DataKeys", "FitConfig", "ModelAblations", "ModelConfig", "ModelOptions", "TrainerConfig",
    "dashed_option_error", "dotted_options", "field_comments", "flat_option_names", "option_descriptions", "unknown_option_error",
    "readable", "unknown_options", "validated",
    "DEFAULT_PRESET", "CorrectionChoice", "current_options", "preset_names", "preset_options", "remembered_correction",
    "GROUP_SCHEMAS", "SCHEMAS", "AttentionConfig", "AttentionDataOptions", "AttentionInferenceOptions",
    "CorrectConfig", "CorrectDataOptions", "CorrectInferenceOptions", "CorrectionAblations", "CorrectionOptions",
    "EvaluateConfig", "EvaluateCorrectionOptions", "EvaluationOptions", "ResolvedCorrection", "TrainAblations",
    "TrainConfig", "correction_ablations", "register_schemas",
    "schema_values",
]
