"""Command line: python -m batchfix {train,correct,evaluate,attention} [Hydra overrides].

Each verb is its own entry module, `batchfix.cli.<verb>` (a @hydra.main). This router runs that
module as the main module, so when Lightning's DDP launcher starts the other processes again as
`python -m <main module> <same arguments>`, they run the same verb: nothing travels outside the
command line.
"""
from __future__ import annotations

import runpy
import sys

VERBS = {
    "train": "fit a model on an .h5ad (default: the bundled dataset); writes a run folder",
    "correct": "add corrected expression to an .h5ad with a trained checkpoint",
    "evaluate": "score batch mixing and biology conservation of a corrected .h5ad",
    "attention": "draw a checkpoint's mean attention between loci along the genome, per label or batch",
}

USAGE = "usage: python -m batchfix {train,correct,evaluate,attention} [key=value ...] [-m] [--cfg job]\n\n" + "\n".join(
    f"  {verb:<9} {text}" for verb, text in VERBS.items()
) + """

examples:
  python -m batchfix train
  python -m batchfix train data.path=my.h5ad data.batch_key=sample
  python -m batchfix correct input=new.h5ad output=new.corrected.h5ad checkpoint=RUN/model.ckpt
  python -m batchfix evaluate input=new.corrected.h5ad data.label_key=cell_type
  python -m batchfix attention input=new.h5ad checkpoint=RUN/model.ckpt output=maps group_by=cell_type
  python -m batchfix train -m model.n_heads=1,2,4,8

Each verb's options, their defaults and descriptions: python -m batchfix VERB --help
(the composed configuration: --cfg job)."""


def verb_meant(word: str) -> str:
    """'; did you mean train?' for a mistyped verb (`trian`), else ''."""
    import difflib

    close = difflib.get_close_matches(word.lower(), VERBS, n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] not in VERBS:
        asked_for_help = bool(args) and args[0] in ("-h", "--help")
        if args and not asked_for_help:
            print(f"batchfix: error: '{args[0]}' is not a verb{verb_meant(args[0])}: the first argument is one of "
                  f"{list(VERBS)}.", file=sys.stderr)
        print(USAGE)
        sys.exit(0 if asked_for_help else 2)
    sys.argv = [sys.argv[0], *args[1:]]
    runpy.run_module(f"batchfix.cli.{args[0]}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
