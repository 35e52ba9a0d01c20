"""batchfix.data.memory: numpy's huge pages off within a verb, the user's setting back after it."""
from __future__ import annotations

import pytest

from batchfix.data import memory


def huge_pages() -> bool:
    return bool(memory._CORE.multiarray._get_madvise_hugepage())


@pytest.fixture(autouse=True)
def setting_restored():
    before = huge_pages()
    yield
    memory._CORE.multiarray._set_madvise_hugepage(before)


def test_huge_pages_are_off_within_and_restored_after(monkeypatch):
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    for setting in (True, False):
        memory._CORE.multiarray._set_madvise_hugepage(setting)
        with memory.numpy_huge_pages_off():
            assert huge_pages() is False
        assert huge_pages() is setting


def test_the_environment_variable_decides_when_set(monkeypatch):
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    memory._CORE.multiarray._set_madvise_hugepage(True)
    with memory.numpy_huge_pages_off():
        assert huge_pages() is True
