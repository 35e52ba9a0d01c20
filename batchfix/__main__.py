"""Command line: python -m batchfix {train,correct,evaluate} [Hydra overrides]."""
from __future__ import annotations

import logging
import os
import sys

VERBS = {
    "train": "fit a model on an .h5ad (default: the bundled dataset); writes a run folder",
    "correct": "add corrected expression to an .h5ad with a trained checkpoint",
    "evaluate": "score batch mixing and biology conservation of a corrected .h5ad",
}
# Lightning's DDP launcher re-runs `python -m batchfix <overrides>` for each extra process;
# the verb travels to those processes in the environment.
VERB_VARIABLE = "BATCHFIX_VERB"

USAGE = "usage: python -m batchfix {train,correct,evaluate} [key=value ...] [-m] [--cfg job]\n\n" + "\n".join(
    f"  {verb:<9} {text}" for verb, text in VERBS.items()
) + """

examples:
  python -m batchfix train
  python -m batchfix train data.path=my.h5ad data.batch_key=sample
  python -m batchfix correct input=new.h5ad output=new.corrected.h5ad checkpoint=RUN/model.ckpt
  python -m batchfix evaluate input=new.corrected.h5ad data.label_key=cell_type
  python -m batchfix train -m model.n_heads=1,2,4,8

Each verb's options: python -m batchfix VERB --cfg job (its composed config), or --help."""


def run_verb(verb: str):
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from batchfix import tasks
    from batchfix.io import InputError
    from batchfix.module import CheckpointError

    # Bad input or options (InputError, CheckpointError and the ValueErrors that name a bad option)
    # end with one clear line rather than a traceback.
    @hydra.main(version_base=None, config_path="pkg://batchfix.conf", config_name=verb)
    def entry(cfg: DictConfig):
        run_dir = HydraConfig.get().runtime.output_dir
        try:
            if verb == "train":
                return tasks.headline(tasks.train(cfg, run_dir))
            if verb == "correct":
                tasks.correct(cfg)
                return None
            return tasks.headline({"evaluation": tasks.evaluate(cfg, run_dir)})
        except (InputError, CheckpointError, FileExistsError, FileNotFoundError, ValueError) as err:
            # A user error: one clear line, no traceback (SystemExit passes through Hydra's handler).
            logging.getLogger("batchfix").error("%s", err)
            print(f"batchfix {verb}: error: {err}", file=sys.stderr)
            sys.exit(1)

    return entry()


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] in VERBS:
        verb = args.pop(0)
        os.environ[VERB_VARIABLE] = verb
    elif os.environ.get(VERB_VARIABLE) in VERBS and not (args and args[0] in ("-h", "--help")):
        verb = os.environ[VERB_VARIABLE]
    else:
        print(USAGE)
        sys.exit(0 if args and args[0] in ("-h", "--help") else 2)
    sys.argv = [sys.argv[0], *args]
    run_verb(verb)


if __name__ == "__main__":
    main()
