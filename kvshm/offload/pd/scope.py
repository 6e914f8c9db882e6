"""Where one engine's P/D hand-offs live on the remote server, and what both ends share.

A :class:`HandoffScope` is handed to both sides of a hand-off (the prefill side's
:class:`~kvshm.offload.pd.publish.Publications` and the decode side's
:class:`~kvshm.offload.pd.consume.Consumers`): the server's index, the fingerprint,
world size and block size a manifest names (a consumer trusts only its own), how a CPU
key becomes a remote hash and a remote hash its readiness key. It holds no state: two
sides holding one scope can never disagree on a key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvshm.offload.pd.manifest import Manifest, check_manifest
from kvshm.remote.tier import KEY_PREFIX, ReadyIndex, block_key

__all__ = ["HandoffScope"]


@dataclass(frozen=True, slots=True)
class HandoffScope:
    """See the module docstring. ``remote_hash``: a CPU key's remote hash;
    ``ready_key``: a remote hash's readiness key."""

    index: ReadyIndex
    fingerprint: str
    world: int
    block_size: int
    remote_hash: Callable[[bytes], bytes]
    ready_key: Callable[[bytes], str]

    def read(self, raw: bytes, keys: Sequence[bytes]) -> tuple[Manifest | None, bool]:
        """Decode a manifest read for a request whose CPU keys from position 0 are
        ``keys``, and whether this engine may trust it
        (:func:`~kvshm.offload.pd.manifest.check_manifest`; the expiry is the caller's)."""
        return check_manifest(raw, keys, self.fingerprint, self.world, self.block_size,
                              self.remote_hash)

    def demote(self, hashes: Sequence[bytes]) -> None:
        """Give blocks (every rank's shard) and their readiness keys the ordinary TTL."""
        keys = [block_key(KEY_PREFIX, self.fingerprint, r, self.world, h)
                for h in hashes for r in range(self.world)]
        self.index.expire(keys + [self.ready_key(h) for h in hashes])
