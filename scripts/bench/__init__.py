"""Speed and scale benchmarks of batchfix."""
