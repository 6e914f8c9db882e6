"""The engine's link to its remote tier: the readiness index it opens and closes.

:func:`open_remote` runs at ``Runtime.open`` (so a missing client library or a bad URL
is a ConfigError before any worker connects): it parses ``EngineConfig.remote_url`` and
starts the backend's :class:`~kvshm.remote.tier.ReadyIndex` (its thread connects lazily:
a server that is down makes lookups miss, never blocks the open). At READY,
:meth:`RemoteLink.book_factory` hands the manager what builds its
:class:`~kvshm.offload.remote.RemoteBook`, with readiness keys under the layout
fingerprint every rank got in ``Ready.remote``. :meth:`RemoteLink.close` stops the
index (idempotent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvshm.config import EngineConfig
from kvshm.ipc.protocol import RemoteSetup
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import JobTable
from kvshm.offload.pd.handoffs import Handoffs
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote import RemoteBook
from kvshm.offload.remote_puts import max_job_blocks, remote_hash
from kvshm.remote.tier import ReadyIndex, RemoteSpec, ready_key
from kvshm.remote.valkey_index import ValkeyReadyIndex

__all__ = ["RemoteLink", "open_remote"]

BookFactory = Callable[[BlockPool, GroupSet, JobTable], RemoteBook]


@dataclass
class RemoteLink:
    """The index (None: no remote tier) and the config it serves."""

    config: EngineConfig | None
    index: ReadyIndex | None

    @classmethod
    def none(cls) -> RemoteLink:
        """No remote tier."""
        return cls(None, None)

    def book_factory(self, setup: RemoteSetup | None, max_record: int) -> BookFactory | None:
        """What builds the manager's remote book (None without a remote tier);
        ``max_record``: the largest command every rank's ring takes (bounds a job)."""
        cfg, index = self.config, self.index
        if cfg is None or index is None or setup is None:
            return None
        fingerprint, world = setup.fingerprint, cfg.world_size
        spec = RemoteSpec.parse(setup.url)

        def key(h: bytes) -> str:
            return ready_key(fingerprint, world, h)

        def make(cpu: BlockPool, gs: GroupSet, jobs: JobTable) -> RemoteBook:
            pd = Handoffs(index, fingerprint, world, cfg.block_size, remote_hash, key)
            return RemoteBook(cpu, gs, jobs, index, key, mode=cfg.remote_mode, handoffs=pd,
                              max_job_blocks=max_job_blocks(max_record), ttl_s=spec.ttl_s,
                              hold_ttl_s=spec.hold_ttl_s)
        return make

    def close(self) -> None:
        """Stop the index (idempotent)."""
        if self.index is not None:
            self.index.close()


def open_remote(config: EngineConfig) -> RemoteLink:
    """The engine's remote link (no tier where ``config.remote_url`` is None).
    ConfigError: a bad URL, or the client library missing (``pip install
    'kvshm[remote]'``)."""
    if config.remote_url is None:
        return RemoteLink.none()
    spec = RemoteSpec.parse(config.remote_url)
    return RemoteLink(config, ValkeyReadyIndex(spec))  # MissingExtra: a ConfigError
