"""Compilation caches: where they go, and that JAX and numba really write into them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchfix.eval import caches


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(caches.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert caches.cache_root() == tmp_path / "xdg" / "batchfix"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert caches.cache_root() == Path.home() / ".cache" / "batchfix"
    monkeypatch.setenv(caches.ENV_VAR, str(tmp_path / "mine"))
    assert caches.cache_root() == tmp_path / "mine"
    monkeypatch.setenv(caches.ENV_VAR, "off")
    assert caches.cache_root() is None


SCRIPT = """
import numpy as np
from batchfix.eval import caches
root = caches.enable()
import jax, jax.numpy as jnp
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
from umap import layouts
layouts.rdist(np.ones(2, np.float32), np.zeros(2, np.float32))
print(root)
"""


@pytest.mark.slow  # two processes compiling scib-metrics' kernels: CI's slow step
def test_jax_and_numba_compile_into_the_cache_directory(tmp_path):
    env = {**os.environ, caches.ENV_VAR: str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(tmp_path / "cache")
    assert any((tmp_path / "cache" / "jax").iterdir()), "JAX wrote no compiled kernel"
    assert list((tmp_path / "cache" / "numba").rglob("*.nbi")), "numba wrote no cache index"


def test_unwritable_cache_directory_is_skipped(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {**os.environ, caches.ENV_VAR: str(blocker / "cache")}
    done = subprocess.run([sys.executable, "-c", "from batchfix.eval import caches; print(caches.enable())"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "None"
