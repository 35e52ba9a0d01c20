"""One entry module per verb (`python -m batchfix.cli.<verb>`, which `python -m batchfix <verb>` runs)."""
