"""The end of `train` and `evaluate` on the console: what was scored and the paths written.

The scoring modules are imported when a summary is made, not with the command line (they pull in scanpy).
"""
from __future__ import annotations

from pathlib import Path


def score_row(name: str, scores: dict) -> str:
    from batchfix.eval import metrics

    cells = ["n/a" if scores.get(col) is None else f"{scores[col]:.3f}" for col in metrics.AGGREGATE_COLUMNS]
    return f"  {name:<38} " + " ".join(f"{cell:>8}" for cell in cells)


def evaluation_summary(evaluation: dict) -> list[str]:
    """The scores table (batch, bio, Total of each embedding) and the gene-level scores, as lines."""
    from batchfix.eval import fidelity, matrix_scores, metrics

    lines = [f"  {'':<38} " + " ".join(f"{name.split()[0]:>8}" for name in metrics.AGGREGATE_COLUMNS)]
    lines += [score_row(name, scores) for name, scores in evaluation.get("scores", {}).items()]
    genes = evaluation.get("gene_fidelity") or {}
    lines.append("  gene level: " + ", ".join(
        f"{m} {'n/a' if genes.get(m) is None else f'{genes[m]:.3f}'}" for m in fidelity.GENE_METRICS))
    left = (evaluation.get("matrix_scores") or {}).get(matrix_scores.BATCH_EFFECT_LEFT["left_log"])
    if left is not None:
        lines.append(f"  batch effect left within cell types: {left:.3f} of the raw counts' (median over label x "
                     "gene; 0 = every gene's batch means equal within a label)")
    if evaluation.get("note"):
        lines.append(f"  note: {evaluation['note']}")
    misfit = misfit_line(evaluation.get("matrix_scores") or {})
    return lines + ([misfit] if misfit else [])


MISFIT_SHARE = 0.05  # bundled data: 0.5 % of gene x batch pairs; 0.1 % fail by chance (detection.PIT_ALPHA)
WORST_NAMED = 5


def misfit_line(scores: dict) -> str | None:
    """One line when the model misfits a high share of gene x batch pairs (their PIT is not uniform): the share, the
    genes failing in the most batches, and what to do; None otherwise."""
    share = scores.get("PIT fails")
    if share is None or share < MISFIT_SHARE:
        return None
    ranked: dict[str, tuple[int, int]] = {}  # gene: (batches where it fails, its best rank within a batch)
    for genes in scores.get("pit_failing_genes", {}).values():
        for rank, gene in enumerate(genes):
            batches, best = ranked.get(gene, (0, rank))
            ranked[gene] = (batches + 1, min(best, rank))
    worst = sorted(ranked, key=lambda gene: (-ranked[gene][0], ranked[gene][1]))[:WORST_NAMED]
    return (f"  model misfit: {share:.1%} of gene x batch pairs (their raw counts' PIT is not uniform; worst: "
            f"{', '.join(worst) or 'n/a'}): their corrected counts are less trustworthy; check the input holds raw "
            "counts, try a longer fit (fit.target_steps), and test these genes on X with batch in the DE design "
            "(metrics.md names them by batch)")


def run_summary(verb: str, result: dict, folder: str | Path, written: list[str]) -> str:
    """The end of `train` and `evaluate`: what was scored (or the fit's loss) and the paths written."""
    lines = [f"batchfix {verb}: done."]
    if "steps" in result:
        lines.append(f"  {result['n_cells']} cells, {result['n_genes']} genes, {result['epochs']} epochs "
                     f"({result['steps']} steps) in {result['fit_seconds']:.0f} s; precision {result['precision']}")
    genes = result.get("corrected_genes")
    if genes and result.get("scale") == "log":
        lines.append(f"  corrected log-scale values of the {genes['modelled']} modelled genes (a model of log values "
                     f"writes no counts); the other {genes['uncorrected']} genes are left out of the corrected layer "
                     "(zero there; X keeps them)")
    elif genes:
        lines.append(f"  corrected counts: {genes['modelled'] + genes['extra']} genes ({genes['modelled']} modelled, "
                     f"{genes['extra']} through the second decoder); {genes['uncorrected']} genes detected in fewer "
                     "than 3 cells keep their counts (var['batchfix_corrected'] is False)")
    evidence = result.get("shift_evidence")
    if evidence:
        lines.append("  shifts weighted by their evidence (correction.shrink): median weight "
                     + ", ".join(f"{batch} {entry['median_weight']:.2f}" for batch, entry in evidence.items())
                     + "; genes whose shift was more than halved "
                     + ", ".join(f"{entry['share_more_than_halved']:.1%}" for entry in evidence.values())
                     + ("" if "share_raised_in_state_groups" not in next(iter(evidence.values())) else
                        "; raised in the latent's state groups " + ", ".join(
                            f"{entry['share_raised_in_state_groups']:.1%}" for entry in evidence.values())))
    lacked = {batch: entry["genes_lacked"] for batch, entry in (evidence or {}).items() if entry.get("genes_lacked")}
    if lacked:
        lines.append("  genes a batch lacks as biology (no count in any cell, or chrY / XIST at an ambient level), "
                     "kept as they are: " + ", ".join(f"{batch} {n}" for batch, n in lacked.items()))
    depth = result.get("depth_shift")
    if depth:
        lines.append("  depth brought to the reference's (correction.depth): applied log shift "
                     + ", ".join(f"{batch} {entry['log_shift'] * entry['weight']:+.2f} (sd {entry['sd']:.2f})"
                                 for batch, entry in depth.items()))
    advice = result.get("recommendation")
    if advice:
        lines.append(f"  recommended correction: {advice['preset']}: {advice['reason']}"
                     + (f"\n    apply it to this model: {advice['command']}" if advice["command"] else ""))
    evaluation = result.get("evaluation", result if verb == "evaluate" else None)
    if evaluation:
        lines += evaluation_summary(evaluation)
    elif "losses" in result:
        loss = result["losses"].get("val_elbo", result["losses"].get("train_elbo"))
        lines.append("  not scored (evaluate=false)" +
                     ("" if loss is None else f"; final negative ELBO {loss:.1f}"))
    folder = Path(folder)
    lines.append(f"  wrote {folder}/: " + ", ".join(name for name in written if (folder / name).exists()))
    return "\n".join(lines)
