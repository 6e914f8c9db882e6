"""Shared test fixtures: GPU skipping and a /dev/shm leak check around every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def _kvshm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "kvshm" in n.lower()}
    except FileNotFoundError:  # pragma: no cover - Linux always has it
        return set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Fail a test that leaves a named kvshm segment behind (none should ever exist)."""
    before = _kvshm_segments()
    yield
    leaked = _kvshm_segments() - before
    assert not leaked, f"test left kvshm segments in /dev/shm: {sorted(leaked)}"
