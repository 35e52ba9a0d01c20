"""The verbs that read a trained model, as plain functions of validated options: correct and attention. Neither
imports Lightning (batchfix.training.trained loads the checkpoint): a correction's imports take about 2 s."""
from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from batchfix import signals
from batchfix.config import (
    AttentionConfig,
    CorrectConfig,
    CorrectionChoice,
    ResolvedCorrection,
    correction_ablations,
)
from batchfix.correction.provenance import output_kind_name, refuse_key_collisions_in_file, warn_not_applied
from batchfix.correction.writers import correct_file
from batchfix.data.atomic import CORRECTED_SUFFIX, default_output, refuse_existing
from batchfix.data.io import input_path
from batchfix.errors import ConfigError
from batchfix.training.trained import load_trained

log = logging.getLogger(__name__)


def correct(cfg: CorrectConfig, told: CorrectionChoice | None = None) -> Path:
    """Correct cfg.input with cfg.checkpoint into cfg.output (streamed, inference.chunk_size cells at a time),
    with the correction `told` names, else the one the checkpoint remembers (CorrectionChoice.resolve)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = input_path(cfg.input)
    output = default_output(source, cfg.output, CORRECTED_SUFFIX)
    refuse_existing(output, cfg.overwrite, reads={"input": source, "checkpoint": cfg.checkpoint})
    earlier = file_identity(output)
    trained = load_trained(cfg.checkpoint)
    told = told or CorrectionChoice()
    preset, options = told.resolve(trained.correction)
    settings = ResolvedCorrection(**asdict(options), **asdict(cfg.inference), **correction_ablations(cfg.ablation),
                                  preset=preset)
    warn_not_applied(told.options, output_kind_name(settings.output_mode, trained.config.likelihood))
    refuse_key_collisions_in_file(source, settings.key_added)
    def output_state() -> str:
        now = file_identity(output)
        return f"; {output} " + ("was not written" if now is None else "is unchanged" if now == earlier
                                 else "was complete before the signal came")

    with signals.interrupt_noted(output_state):
        return correct_parts(cfg, source, output, trained, settings)


def correct_parts(cfg: CorrectConfig, source: Path, output: Path, trained, settings: ResolvedCorrection) -> Path:
    """One process corrects every cell (`correct_file`); inference.shard=i/N part i into its shard file, merge/N
    the shards into the output; under torchrun each rank its part, merged by rank 0 (batchfix.correction.shards)."""
    part = settings.shard_part()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if part is None and world_size == 1:
        return correct_file(source, output, trained, settings, counts_layer=cfg.data.counts_layer,
                            batch_key=cfg.data.batch_key, overwrite=cfg.overwrite, progress=cfg.progress,
                            all_batches_new=cfg.all_batches_new)
    if part is not None and world_size > 1:
        raise ConfigError(f"inference.shard={settings.shard} names a part for independent jobs; under torchrun "
                          f"(WORLD_SIZE={world_size}) each rank is its part: leave it out.")
    from batchfix.correction import shards

    job = shards.FileJob(source, output, cfg.data.counts_layer, cfg.data.batch_key, cfg.all_batches_new,
                         cfg.overwrite, cfg.progress)
    if part is None:
        return shards.correct_distributed(job, trained, settings)
    index, count = part
    if index is None:
        return shards.merge_shards(job, trained, settings, count)
    return shards.correct_shard(job, trained, settings, index, count)


def attention(cfg: AttentionConfig) -> list[Path]:
    """Mean attention between loci per group of cfg.input's cells: attention.png and attention.npz in cfg.output."""
    from batchfix.tasks.attention_maps import attention_maps, write_attention

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = input_path(cfg.input)
    output = Path(cfg.output).expanduser() if cfg.output else Path.cwd() / (Path(source).stem + ".attention")
    settings = ResolvedCorrection(**asdict(cfg.inference))
    trained = load_trained(cfg.checkpoint)
    maps = attention_maps(trained, source, cfg.group_by, settings, cfg.data.counts_layer, cfg.max_cells,
                          cfg.resolution)
    written = write_attention(maps, output, overwrite=cfg.overwrite, title=f"{Path(source).name}: ")
    log.info("Wrote %s", ", ".join(map(str, written)))
    return written


def file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a file, None when there is none: an atomic replacement changes it."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino
