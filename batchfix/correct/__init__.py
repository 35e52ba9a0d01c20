"""Correction with a trained model: streamed inference over any cells (correction) and the
counterfactual output with its calibration (counterfactual)."""
