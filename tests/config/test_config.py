"""Every config and every preset of conf/ composes onto its schema and builds what it describes;
every out-of-range option is refused with a message naming it."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from batchfix import config
from batchfix.config import AttentionConfig, CorrectConfig, EvaluateConfig, ModelConfig, TrainConfig, validated
from batchfix.data.genome import GeneCoordinates, make_windows
from batchfix.errors import ConfigError
from batchfix.nn.network import BatchfixNet
from batchfix.training import fitting

CONF = Path(__file__).resolve().parents[2] / "conf"
PRESETS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml"))


def composed(name: str, overrides=(), schema=None, hydra_node: bool = False):
    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=hydra_node)
    return cfg if schema is None else validated(cfg, schema)


def tiny_net(model: ModelConfig) -> BatchfixNet:
    """A network for 40 genes on chromosome 1 and 3 batches, built from a model config."""
    coords = GeneCoordinates(np.array(["1"] * 40, dtype=object), np.arange(40) * 1000, np.arange(40) * 1000 + 500)
    return BatchfixNet(model, make_windows(coords, model.genes_per_token), 40, 3, np.zeros(40), np.ones(40))


@pytest.mark.parametrize("verb, schema", [("train", TrainConfig), ("correct", CorrectConfig),
                                          ("evaluate", EvaluateConfig), ("attention", AttentionConfig)])
def test_each_verb_config_composes_onto_its_schema(verb, schema):
    overrides = ["checkpoint=run/model.ckpt"] if verb in ("correct", "attention") else []
    assert isinstance(composed(verb, overrides, schema), schema)


def test_the_schemas_are_the_one_home_of_the_defaults():
    """The presets set only what differs from the schema (the bundled data's label column, DDP)."""
    train = composed("train", schema=TrainConfig)
    assert train == TrainConfig(data=config.DataConfig(label_key="cell_type"))
    assert composed("correct", ["checkpoint=x"], CorrectConfig) == CorrectConfig(checkpoint="x")


def test_every_preset_was_found():
    assert {("data", "cellbench5"), ("model", "default"), ("trainer", "default"), ("trainer", "ddp"),
            ("sweep", "heads")} <= set(PRESETS)


@pytest.mark.parametrize("group, preset", PRESETS)
def test_every_preset_composes_and_builds_what_it_describes(group, preset, tmp_path):
    if group == "sweep":
        cfg = composed("train", [f"+sweep={preset}"], hydra_node=True)
        swept = OmegaConf.to_container(cfg.hydra.sweeper.params)
        assert cfg.hydra.mode.name == "MULTIRUN" and swept
        for key in swept:  # every swept key is an option of the schema
            OmegaConf.select(OmegaConf.structured(TrainConfig), key, throw_on_missing=True)
        return
    cfg = composed("train", [f"{group}={preset}"], TrainConfig)
    if group == "model":
        assert tiny_net(fitting.network_config(cfg)).n_genes == 40
    elif group == "trainer":
        assert isinstance(fitting.build_trainer(cfg, tmp_path, has_validation=True), pl.Trainer)
    elif group == "data":
        assert cfg.data.batch_key and cfg.data.genome in config.GENOMES


BAD_OPTIONS = [
    ("trainer.max_epochs=-1", "trainer.max_epochs must be >= 1"),
    ("trainer.max_epochs=0", "trainer.max_epochs must be >= 1"),
    ("model.latent_dim=0", "model.latent_dim must be >= 1"),
    ("model.n_heads=3", "model.d_model (64) must be divisible by model.n_heads (3)"),
    ("model.dropout=1.0", "model.dropout must be in [0.0, 1.0)"),
    ("ablation.attention=flash", "ablation.attention must be one of ['guarded', 'sdpa']"),
    ("model.min_wavelength=1e9", "model.min_wavelength and model.max_wavelength"),
    ("ablation.position_encoding=sorted",
     "ablation.position_encoding must be one of ['real', 'shuffled', 'none', 'learned']"),
    ("ablation.token_identity=genes", "ablation.token_identity must be one of ['learned', 'coordinates']"),
    ("ablation.distance_buckets=1", "ablation.distance_buckets must be >= 2"),
    ("model.attention_block_size=0", "model.attention_block_size must be >= 1"),
    ("model.gradient_checkpointing=maybe", "Value 'maybe' is not a valid bool"),
    ("fit.batch_size=0", "fit.batch_size must be >= 1"),
    ("fit.learning_rate=0", "fit.learning_rate must be a finite number > 0"),
    ("fit.validation_fraction=1", "fit.validation_fraction must be in [0.0, 1.0)"),
    ("fit.max_auto_epochs=0", "fit.max_auto_epochs must be >= 1"),
    ("data.n_top_genes=0", "data.n_top_genes must be >= 1"),
    ("data.genome=hg19", "data.genome must be one of ['GRCh38', 'mm10']"),
    ("data.label_key=batch", "data.label_key and data.batch_key both name obs column 'batch'"),
    ("data.counts_layer=''", "data.counts_layer must name something"),
    ("model.likelihood=gaussian", "model.likelihood=gaussian is for log-scale input"),
    ("trainer.precision=8-true", "trainer.precision must be one of"),
    ("trainer.devices=0", "trainer.devices must be a positive count"),
    ("threads=-1", "threads must be >= 1"),
    ("correction.key_added=''", "correction.key_added must be a non-empty name"),
    ("fit.batch_size=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
    ("model.nope=1", "Could not override 'model.nope'"),
    ("data.stream=sometimes", "data.stream must be one of ['auto', 'true', 'false']"),
    ("data.stream_above_gb=-1", "data.stream_above_gb must be >= 0"),
    ("data.chunk_cells=8", "data.chunk_cells must be >= 16"),
    ("data.hvg_max_cells=50", "data.hvg_max_cells must be >= 100"),
    ("fit.max_validation_cells=0", "fit.max_validation_cells must be >= 1"),
    ("evaluation.max_cells=10", "evaluation.max_cells must be >= 100"),
    ("evaluation.neighbors=fast", "evaluation.neighbors must be one of ['auto', 'exact', 'approximate']"),
]


@pytest.mark.parametrize("override, message", BAD_OPTIONS)
def test_bad_train_options_are_refused_naming_the_option(override, message):
    """Ranges: ConfigError from the schema; types and unknown keys: Hydra's composition error (its cause)."""
    with pytest.raises(Exception) as err:
        composed("train", [override], TrainConfig)
    assert isinstance(err.value, ConfigError) or type(err.value).__module__.startswith("hydra")
    assert message in f"{err.value} {err.value.__cause__}"


@pytest.mark.parametrize("override, message", [
    ("inference.chunk_size=0", "inference.chunk_size must be >= 1"),
    ("inference.batch_size=-5", "inference.batch_size must be >= 1"),
    ("inference.max_missing_fraction=1.5", "inference.max_missing_fraction must be in [0.0, 1.0]"),
    ("correction.key_added=null", "field 'correction.key_added' is not Optional"),
    ("correction.key_added=''", "correction.key_added must be a non-empty name"),
    ("correction.key_added=a/b", "correction.key_added must not contain '/'"),
    ("threads=0", "threads must be >= 1"),
    ("ablation.regional_order=random", "ablation.regional_order must be one of ['genome', 'shuffled']"),
    ("correction.regional_shift=keep_all", "correction.regional_shift=keep_all is retired: keep_input replaces it"),
    ("correction.normal_key=cell_type correction.normal_values=[T]", "regional_shift=reference_cells and "
     "correction.normal_key go together"),
    ("correction.regional_order=shuffled", "Could not override 'correction.regional_order'"),
])
def test_bad_correct_options_are_refused_naming_the_option(override, message):
    with pytest.raises(Exception) as err:
        composed("correct", ["checkpoint=x", *override.split()], CorrectConfig)
    assert isinstance(err.value, ConfigError) or type(err.value).__module__.startswith("hydra")
    assert message in f"{err.value} {err.value.__cause__}"


def test_evaluate_refuses_a_too_small_subsample():
    with pytest.raises(ConfigError, match=re.escape("evaluation.max_cells must be >= 100")):
        composed("evaluate", ["evaluation.max_cells=99"], EvaluateConfig)


def test_correct_needs_a_checkpoint():
    with pytest.raises(ConfigError, match="correct needs checkpoint="):
        composed("correct", [], CorrectConfig)


@pytest.mark.parametrize("override, message", [
    ("resolution=1", "resolution must be >= 2"),
    ("max_cells=0", "max_cells must be >= 1"),
    ("group_by=''", "group_by must name something"),
    ("inference.batch_size=0", "inference.batch_size must be >= 1"),
    ("inference.max_missing_fraction=2", "inference.max_missing_fraction must be in [0.0, 1.0]"),
])
def test_bad_attention_options_are_refused_naming_the_option(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        composed("attention", ["checkpoint=x", override], AttentionConfig)
    with pytest.raises(ConfigError, match="attention needs checkpoint="):
        composed("attention", [], AttentionConfig)


def test_option_names_are_unique_across_groups():
    names = config.flat_option_names(TrainConfig)
    assert names["n_heads"] == "model.n_heads" and names["max_epochs"] == "trainer.max_epochs"
    assert names["min_auto_epochs"] == "fit.min_auto_epochs" and names["seed"] == "seed"
