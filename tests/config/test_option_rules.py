"""The option surface's rules (docs/architecture.md, Rules the tree keeps): every correction option is read by an
output kind, one given to a kind that ignores it is warned about naming the kinds that read it, the switches that
measure a claim live in `ablation.*` (listed last by --help), and an earlier release's recorded options are read in
this release's terms."""
from __future__ import annotations

import logging
import re
from dataclasses import fields

import pytest

from batchfix.cli.help import verb_help
from batchfix.config import (
    CorrectionAblations,
    CorrectionOptions,
    ModelAblations,
    ResolvedCorrection,
    current_options,
    validated,
)
from batchfix.correction.provenance import KIND_NAMES, NOT_APPLIED, warn_not_applied

MAX_CORRECTION_OPTIONS = 12  # what `correct --help` may list outside the ablation group


def listed(help_text: str, group: str) -> list[str]:
    """The options of `group.*` a verb's --help lists, in order."""
    return re.findall(rf"^  {group}\.(\w+)=", help_text, flags=re.MULTILINE)


def test_every_correction_option_is_read_by_an_output_kind():
    for option in fields(CorrectionOptions):
        readers = [kind for kind in KIND_NAMES if option.name not in NOT_APPLIED[kind]]
        assert readers, f"correction.{option.name} is read by no output kind: remove it or move it to ablation.*"


@pytest.mark.parametrize("kind", sorted(NOT_APPLIED))
def test_an_option_given_to_a_kind_that_ignores_it_is_warned_about_naming_its_readers(kind, caplog):
    ignored = sorted(NOT_APPLIED[kind])
    assert ignored, kind
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        warn_not_applied({name: "x" for name in ignored} | {"key_added": "fixed"}, kind)
    assert len(caplog.records) == len(ignored)  # key_added is read by every kind: no warning
    for name, record in zip(ignored, caplog.records):
        message = record.getMessage()
        assert message.startswith(f"correction.{name}=x does nothing on {KIND_NAMES[kind]}: {NOT_APPLIED[kind][name]}")
        assert "It is read by " in message and KIND_NAMES[kind] not in message.split("It is read by ")[1]


@pytest.mark.parametrize("verb", ["train", "correct"])
def test_help_lists_the_ablations_last_and_at_most_12_correction_options(verb):
    text = verb_help(verb, "")
    options = text.split("\nExamples:")[0]
    assert len(listed(options, "correction")) <= MAX_CORRECTION_OPTIONS
    ablations = listed(options, "ablation")
    expected = {f.name for f in fields(CorrectionAblations)}
    if verb == "train":
        expected |= {f.name for f in fields(ModelAblations)}
    assert set(ablations) == expected
    every = re.findall(r"^  ([\w.]+)=", options, flags=re.MULTILINE)  # every option, in the order listed
    assert every[-len(ablations):] == [f"ablation.{name}" for name in ablations]  # the ablations come last


def test_no_ablation_is_a_correction_option_and_a_retired_value_names_its_successor():
    assert not {f.name for f in fields(CorrectionOptions)} & {f.name for f in fields(CorrectionAblations)}
    with pytest.raises(Exception, match="regional_shift=keep_all is retired: keep_input replaces it"):
        validated({"regional_shift": "keep_all"}, CorrectionOptions)


def test_an_earlier_releases_options_are_read_in_this_releases_terms(caplog):
    recorded = {"regional_shift": "keep_all", "regional_order": "genome", "regional_seed": 0, "spread": "batch"}
    with caplog.at_level(logging.WARNING, logger="batchfix"):
        remembered = current_options(recorded, ablations=False)
    assert remembered == {"regional_shift": "keep_input", "spread": "batch"}
    assert "regional_shift=keep_all, which this release names keep_input" in caplog.text
    validated(remembered, CorrectionOptions)
    with_normal = current_options({"regional_shift": "keep", "normal_key": "cell_type", "normal_values": ["T"],
                                   "regional_order": "shuffled"})
    assert with_normal["regional_shift"] == "reference_cells" and with_normal["regional_order"] == "shuffled"
    assert ResolvedCorrection(**with_normal).regional_order == "shuffled"


def test_the_ablation_group_reaches_the_network_and_the_correction():
    from hydra import compose, initialize_config_module

    from batchfix.config import CorrectConfig, TrainConfig, correction_ablations
    from batchfix.training.fitting import network_config

    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        train = validated(compose("train", ["ablation.position_encoding=none", "ablation.regional_order=shuffled"]),
                          TrainConfig)
        correct = validated(compose("correct", ["checkpoint=x", "ablation.regional_seed=7"]), CorrectConfig)
    assert network_config(train).position_encoding == "none" and network_config(train).n_heads == train.model.n_heads
    assert correction_ablations(train.ablation) == {"regional_order": "shuffled", "regional_seed": 0, "quantile_seed": 0}
    assert correction_ablations(correct.ablation) == {"regional_order": "genome", "regional_seed": 7, "quantile_seed": 0}


def test_a_retired_option_says_why_it_went():
    import anndata as ad
    import numpy as np

    import batchfix
    from batchfix.config import CorrectConfig, unknown_option_error

    assert "INT8 inference was removed" in str(unknown_option_error("inference.int8", CorrectConfig))
    with pytest.raises(Exception, match="'int8': INT8 inference was removed"):
        batchfix.correct(ad.AnnData(np.ones((3, 3), dtype=np.float32)), "model.ckpt", int8=True)
