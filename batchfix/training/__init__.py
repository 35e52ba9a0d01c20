"""Training: the Lightning module around the network and the checkpoint it writes (module), the epoch
plan, trainer and fit (fitting)."""
