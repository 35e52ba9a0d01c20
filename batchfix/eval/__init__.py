"""Scoring: scIB batch-mixing and biology scores (metrics), gene-level fidelity (fidelity), a corrected
file's evaluation folder (evaluate), attention maps, sweep summaries, and compilation caches."""
