"""The Hydra callback that claims a verb's folder before Hydra writes `.hydra/` into it (batchfix.runfolder)."""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from batchfix.cli.common import user_errors_reported
from batchfix.runfolder import check_evaluation_folder, check_reuse, free_folder

log = logging.getLogger(__name__)


class RunFolderCheck(Callback):
    """Hydra callback: before Hydra writes into the run folder, make it (writable, or a one-line error), hold it
    (`hold`; another command holding the default folder moves this run to the next free one) and remember the
    folders made for it (`remove_if_unused`); for `train` and `evaluate`, refuse bad options and a folder that
    holds a run (or an evaluation), so that Hydra never replaces a previous run's .hydra/ files."""

    def __init__(self, verb: str = "train"):
        self.verb = verb

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        from batchfix.config import EvaluateConfig, TrainConfig, validated

        HydraConfig.instance().set_config(config)  # as Hydra does next, so ${hydra:...} resolves
        run_dir = Path(str(config.hydra.run.dir))
        named = overridden(config, "hydra.run.dir")
        task = copy.deepcopy(config)  # the verb's own options, without Hydra's
        with read_write(task), open_dict(task):
            del task["hydra"]
        with user_errors_reported(self.verb):
            if self.verb == "train":
                cfg = validated(task, TrainConfig)
                free = free_folder(run_dir, named, lambda folder: check_reuse(folder, cfg.overwrite, cfg.resume))
            elif self.verb == "evaluate":
                overwrite = validated(task, EvaluateConfig).overwrite
                free = free_folder(run_dir, named, lambda folder: check_evaluation_folder(folder, overwrite))
            else:
                free = free_folder(run_dir, named, lambda folder: None)
        if free != run_dir:
            moved(run_dir, free)
            with read_write(config.hydra.run):
                config.hydra.run.dir = str(free)  # where Hydra writes, and the job's output_dir

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep folder is held the same way (each job's folder is held by the job); for `train`, every job's
        options are checked and its folder refused if it holds a run, before the first job starts."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        named = overridden(config, "hydra.sweep.dir")
        with user_errors_reported(self.verb):
            if self.verb == "train":
                check_sweep_jobs(config, sweep_dir)
            free = free_folder(sweep_dir, named, lambda folder: None)
        if free != sweep_dir:
            moved(sweep_dir, free)
            with read_write(config.hydra):
                config.hydra.sweep.dir = str(free)
                # Hydra composes each job's configuration anew from these overrides.
                config.hydra.overrides.hydra.append(f"hydra.sweep.dir={free}")


def sweep_jobs(config: DictConfig) -> list[tuple[list[str], DictConfig]]:
    """Each job's options of a multirun (the overrides' sweeps expanded as Hydra's basic sweeper does), without
    Hydra's node; a value that cannot be composed is a ConfigError naming the job's overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    from batchfix.config import readable
    from batchfix.errors import ConfigError

    if not GlobalHydra.instance().is_initialized():  # called outside a Hydra application: nothing to expand
        return []
    loader = GlobalHydra.instance().config_loader()
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(list(config.hydra.overrides.task))
    jobs = []
    for job in BasicSweeper.split_arguments(overrides, None)[0]:
        try:
            composed = loader.load_configuration(config.hydra.job.config_name, job, RunMode.MULTIRUN)
        except (HydraException, OmegaConfBaseException) as err:
            cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
            raise ConfigError(f"sweep job {' '.join(job)}: {readable(cause)}") from None
        with read_write(composed), open_dict(composed):
            del composed["hydra"]
        jobs.append((job, composed))
    return jobs


def check_sweep_jobs(config: DictConfig, sweep_dir: Path) -> None:
    """Every job of a `train` sweep: its options valid, its input file there with the obs columns and layer it
    names (read from the header), and its folder (<sweep dir>/<job number>) holding no run."""
    from batchfix.cli.common import require_data_keys, require_inputs
    from batchfix.config import TrainConfig, validated
    from batchfix.errors import ConfigError, InputError

    numbered = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir") == "${hydra.job.num}"
    for number, (job, task) in enumerate(sweep_jobs(config)):
        try:
            cfg = validated(task, TrainConfig)
            require_inputs(("data.path", cfg.data.path))
            require_data_keys(cfg.data.path, cfg.data)
        except (ConfigError, InputError) as err:
            raise type(err)(f"sweep job {number} ({' '.join(job)}): {err}") from None
        if numbered:
            check_reuse(sweep_dir / str(number), cfg.overwrite, cfg.resume, "hydra.sweep.dir")


def overridden(config: DictConfig, key: str) -> bool:
    """Whether the user set Hydra's `key` on the command line (a folder they named, not the default)."""
    return any(str(item).startswith(f"{key}=") for item in config.hydra.overrides.hydra)


def moved(folder: Path, free: Path) -> None:
    log.warning("%s is in use by another batchfix command (started in the same second) or holds a run: this one "
                "writes into %s.", folder, free)
