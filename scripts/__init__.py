"""Tools a user or maintainer runs: the benchmark, the baselines, the data makers and the docs tables."""
