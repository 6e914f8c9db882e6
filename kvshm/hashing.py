"""Chained prefix hashes of KV blocks, identical across processes, runs and machines.

A block's hash covers its parent's hash, its token ids and optional ``extra`` bytes
(model / adapter identity, multimodal keys), so equal hashes mean equal prefixes up to
and including that block. Python's ``hash()`` is never used: it is salted per process
(``PYTHONHASHSEED``), and kvshm's scheduler and workers must agree on every hash.

Encoding (version 1), fed to SHA-256, truncated to :data:`HASH_BYTES` bytes::

    b"kvshm.block.v1"
    u8 len(parent) || parent            (len 0 for the first block of a chain)
    u32 LE len(token_ids) || token_ids as u32 LE each
    extra                                (last, so no length prefix is needed)

Every variable-length field before ``extra`` is length-prefixed, so no two distinct
inputs share an encoding.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Sequence
from typing import TypeAlias

from kvshm.errors import ConfigError

BlockHash: TypeAlias = bytes
"""A block's chained hash: :data:`HASH_BYTES` bytes of SHA-256."""

HASH_BYTES = 16
_DOMAIN = b"kvshm.block.v1"
_MAX_TOKEN = 0xFFFF_FFFF


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids)
    except struct.error as exc:
        bad = next((t for t in token_ids if not _is_token(t)), None)
        raise ConfigError(f"token ids must be u32 ints (0 <= id < 2**32), got {bad!r} in "
                          f"{type(token_ids).__name__}") from exc


def _is_token(t: object) -> bool:
    """An int (or an integer type, e.g. numpy's) that fits in u32."""
    try:
        return 0 <= operator.index(t) <= _MAX_TOKEN  # type: ignore[arg-type]
    except TypeError:
        return False


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block whose prefix hashes to ``parent`` (None for the first block)."""
    if parent is not None and not 0 < len(parent) <= 255:
        raise ConfigError(f"parent hash must be 1..255 bytes, got {len(parent)}")
    h = hashlib.sha256(_DOMAIN)
    p = parent or b""
    h.update(bytes((len(p),)))
    h.update(p)
    h.update(_pack_tokens(token_ids))
    h.update(extra)
    return h.digest()[:HASH_BYTES]


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block is
    not hashed). ``parent`` continues an existing chain; ``extra`` goes into every block.
    """
    if type(block_size) is not int or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(token_ids, (str, bytes)):  # (a str's characters are no token ids)
        raise ConfigError(f"token_ids must be a sequence of ints, got "
                          f"{type(token_ids).__name__}")
    out: list[BlockHash] = []
    prev = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block(prev, token_ids[start : start + block_size], extra)
        out.append(prev)
    return out


_TAIL_PERSON = b"kvshm.tail.v1"


def tail_hash(parent: BlockHash, token_ids: Sequence[int], *, length: int | None = None,
              extra: bytes = b"") -> BlockHash:
    """Hash of a *partial* last block (``1 .. block_size - 1`` tokens) after the full
    block hashing to ``parent``: the key a P/D hand-off stores that block under.

    Domain-separated from :func:`hash_block` (BLAKE2b personalised ``kvshm.tail.v1``), so
    a tail never shares a key with a full block, whatever the engine's hash function.
    ``length``: output bytes, 1..64 (default ``len(parent)``: an engine whose block
    hashes are 32 bytes gets 32-byte tails, as the manager checks every hash's length).
    Encoding as :func:`hash_block`'s: ``u8 len(parent) || parent || u32 n || tokens ||
    extra``."""
    n = len(parent) if length is None else length
    if not 0 < len(parent) <= 255:
        raise ConfigError(f"parent hash must be 1..255 bytes, got {len(parent)}")
    if not 1 <= n <= 64:
        raise ConfigError(f"tail hash length must be 1..64 bytes, got {n}")
    h = hashlib.blake2b(digest_size=n, person=_TAIL_PERSON)
    h.update(bytes((len(parent),)))
    h.update(parent)
    h.update(_pack_tokens(token_ids))
    h.update(extra)
    return h.digest()


def chain_tail(token_ids: Sequence[int], block_size: int, hashes: Sequence[BlockHash], *,
               extra: bytes = b"") -> BlockHash | None:
    """The :func:`tail_hash` of ``token_ids``' partial last block, given its full blocks'
    chain ``hashes`` (:func:`chain_hashes`), or None when there is no partial block (or
    no full block before it). What ``RequestView.tail_hash`` and ``finished(...,
    tail_hash=)`` of a P/D request take."""
    n, rest = divmod(len(token_ids), block_size)
    if rest == 0 or n == 0 or len(hashes) < n:
        return None
    return tail_hash(hashes[n - 1], token_ids[n * block_size:], extra=extra)
