"""Shared test fixtures: markers, the Hypothesis profiles, a /dev/shm leak check.

Layout: ``tests/unit/<part>/`` holds the fast tests of one part (seconds, one process,
no server); everything else is a process test (real processes, rendezvous, vLLM) and
carries the ``process`` marker, added here, so ``-m 'not process'`` runs the unit tests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

_UNIT = Path(__file__).parent / "unit"

# CI runs the state machines derandomized (the same examples on every run: a red CI is
# reproducible, a green one is not luck); elsewhere they explore new examples each run.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI") else "dev"))


def _kvshm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "kvshm" in n.lower()}
    except FileNotFoundError:  # pragma: no cover - Linux always has it
        return set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001  # pragma: no cover - a broken CUDA install: no GPU tests
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if not item.path.is_relative_to(_UNIT):
            item.add_marker(pytest.mark.process)


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Fail a test that leaves a named kvshm segment behind (none should ever exist). A
    segment has its name only between ``shm_open`` and the ``shm_unlink`` right after
    it (:mod:`kvshm.shm`): one that another xdist worker's test is creating at this
    instant is listed too, so a name is a leak only if it is still there a moment later
    (CI once failed a test for a host pool another worker's process was making)."""
    before = _kvshm_segments()
    yield
    leaked = _kvshm_segments() - before
    if leaked:
        time.sleep(0.05)
        leaked &= _kvshm_segments()
    assert not leaked, f"test left kvshm segments in /dev/shm: {sorted(leaked)}"


@pytest.fixture(autouse=True, scope="session")
def vllm_ipc_sockets_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """vLLM names its ZMQ ``ipc://`` sockets ``$VLLM_RPC_BASE_PATH/<uuid>`` (default: the
    system temp dir) and leaves the socket files behind: hundreds per CI run. Point it at
    a directory of this session (inherited by the engines and examples the tests start),
    removed with pytest's other temp dirs."""
    path = tmp_path_factory.mktemp("vllm-rpc")
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(path)
    yield
    if old is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = old
