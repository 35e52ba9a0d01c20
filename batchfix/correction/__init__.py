"""Correction with a trained model, in three steps: bind the model to an input (corrector), estimate from all its
cells (estimates), apply to any row range (outputs); the counterfactual output's formulas (counterfactual,
count_output, counts) and the writers of AnnData and .h5ad outputs (writers)."""
