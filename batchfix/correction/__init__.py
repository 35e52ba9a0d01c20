"""Correction with a trained model: streamed inference over any cells (corrector) and the
counterfactual output with its calibration (counterfactual)."""
