"""Compilation caches for evaluation, so that a second run does not compile again.

Scoring (scib-metrics) runs on JAX and the UMAP picture on numba: both compile their kernels on
first use, which on a small file costs more than the scoring itself. `enable()` points JAX's
persistent compilation cache and numba's cache at one user cache directory:

    $BATCHFIX_CACHE_DIR, else $XDG_CACHE_HOME/batchfix, else ~/.cache/batchfix

(`BATCHFIX_CACHE_DIR=off` turns both caches off). numba only caches functions compiled with
`cache=True`; umap-learn's layout optimiser and much of pynndescent (the nearest neighbours of
scib-metrics) are not, so `enable()` also turns caching on for those modules' module-level functions
(caching changes where compiled code comes from, never what it computes; numba keys it on the
source file and the argument types).
A cache that cannot be written is skipped with a log line: evaluation does not depend on it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV_VAR = "BATCHFIX_CACHE_DIR"
OFF = ("off", "none", "0", "false")
# Modules whose module-level numba functions are compiled on every run unless their caching is turned on:
# umap-learn's layout optimiser and pynndescent's nearest-neighbour descent (scib-metrics' neighbours).
NUMBA_MODULES = ("umap.layouts", "umap.umap_", "pynndescent.pynndescent_", "pynndescent.utils",
                 "pynndescent.rp_trees", "pynndescent.graph_utils", "pynndescent.distances")

_enabled: Path | None = None


def cache_root() -> Path | None:
    """The cache directory from the environment (None when turned off)."""
    configured = os.environ.get(ENV_VAR)
    if configured is not None and configured.strip().lower() in OFF + ("",):
        return None
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "batchfix"


def enable() -> Path | None:
    """Turn the JAX and numba compilation caches on (once per process); returns the directory used."""
    global _enabled
    if _enabled is not None:
        return _enabled
    root = cache_root()
    if root is None:
        return None
    try:
        (root / "jax").mkdir(parents=True, exist_ok=True)
        (root / "numba").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.info("Compilation caches off: %s cannot be created (%s); set %s to another directory.", root, err,
                 ENV_VAR)
        return None
    enable_jax(root / "jax")
    enable_numba(root / "numba")
    _enabled = root
    return root


def enable_jax(directory: Path) -> None:
    try:
        import jax
    except ImportError:  # pragma: no cover - scib-metrics brings JAX
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the many small kernels add up
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def enable_numba(directory: Path) -> None:
    import importlib
    import warnings

    from numba.core import config
    from numba.core.dispatcher import Dispatcher
    from numba.core.errors import NumbaWarning

    os.environ.setdefault("NUMBA_CACHE_DIR", str(directory))
    config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]  # numba read its environment when it was imported
    for module_name in NUMBA_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - scanpy's UMAP and scib-metrics bring them
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher) and type(value._cache).__name__ == "NullCache":
                value.enable_caching()
    # A function numba cannot cache (one that takes functions as arguments) is compiled as before; say nothing.
    warnings.filterwarnings("ignore", message=r"Cannot cache compiled function", category=NumbaWarning)
