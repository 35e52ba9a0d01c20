"""batchfix's Hydra configs: YAML entry configs and presets. Their schemas (every option, its type,
its default and its range) are the dataclasses of batchfix.config, registered here so that any
composition of this package (the command line, tests, the benchmark) validates against them."""
from batchfix.config import register_schemas

register_schemas()
