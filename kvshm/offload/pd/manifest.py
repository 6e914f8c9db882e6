"""The P/D hand-off's manifest: its wire record, its key, and the lookup range it grants.

A manifest is msgspec JSON on the remote server, written by the prefill engine last,
once every block it names was put and acked (:mod:`kvshm.offload.pd.handoffs` keeps that
order and the consumer's checks). What lives here is what both ends must agree on
byte for byte: the record's fields (unknown ones refused, the tail written only when
not 0, so an older decoder still reads a tail-less manifest), the key a request's
manifest is written under (one per fingerprint, world size and request id, an
unambiguous encoding of the id: :func:`manifest_key`), the request a manifest belongs
to (:func:`handoff_owner`), the ``kv_transfer_params`` entry naming it, the size bound
under which a manifest is read at all, the consumer's hit range
(:func:`handoff_extent`), the checks a consumer makes before it trusts one
(:func:`check_manifest`) and the entries a collection may touch
(:func:`checked_hashes`). Also the hand-off's counters and a consumer's verdict.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Final

import msgspec

__all__ = ["DECODE_PARAM", "MANIFEST_BASE", "MANIFEST_PARAM", "MANIFEST_PER_BLOCK", "NAME_MAX",
           "PD_PREFIX", "PREFILL_PARAM", "Manifest", "PdCounters", "Verdict", "check_manifest",
           "checked_hashes", "handoff_extent", "handoff_owner", "is_handoff", "key_owner",
           "manifest_key", "remote_decode", "remote_prefill"]

#: A manifest larger than base + per-block x the request's blocks is refused unread.
MANIFEST_BASE: Final = 1024
MANIFEST_PER_BLOCK: Final = 80

#: The ``kv_transfer_params`` key naming a manifest.
MANIFEST_PARAM: Final = "kvshm_manifest"
#: vLLM's ``kv_transfer_params`` flag of a P/D decode request: its prefill ran elsewhere.
PREFILL_PARAM: Final = "do_remote_prefill"
#: vLLM's ``kv_transfer_params`` flag of a P/D prefill request: it decodes elsewhere.
DECODE_PARAM: Final = "do_remote_decode"
_SAFE = re.compile(r"^[A-Za-z0-9._=-]{1,120}$")
#: Marks a request id written as its SHA-256 in a manifest's name: outside ``_SAFE``'s
#: alphabet, so no id written as itself can ever equal a hashed one.
_HASHED = "#"
#: What :func:`handoff_owner` returns: 32 lowercase hex.
_OWNER = re.compile(r"^[0-9a-f]{32}$")
PD_PREFIX: Final = "kvshm:v1:pd"
#: The longest manifest name after its deployment's ``<prefix>:<fingerprint>:<world>:``
#: (an owner, ``:`` and a request id of 120 characters at most); a longer one is refused
#: unread.
NAME_MAX: Final = 32 + 1 + 120
#: vLLM's parallel sampling names its children ``<index>_<parent id>``.
_VLLM_CHILD = re.compile(r"^[0-9]+_")
#: vLLM makes each request's internal id ``<external id>-<8 hex>`` (random per engine).
_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a decode engine needs to trust a hand-off (msgspec JSON on the server).
    ``tail``: how many of the last ``hashes`` name the partial last block (one per KV
    group; 0: none) -- keys the consumer derives from its own tokens, so they are not
    compared (a consumer without that block's key simply does not find it). Written only
    when not 0, so a manifest without a tail reads as before the field existed (a
    decoder of the previous release, which refuses unknown fields, still trusts it;
    one with a tail it refuses: it would compare the tail key as a full block's). Whose
    it is, its name says (:func:`manifest_key`), so the record is the same for every
    release that reads it."""

    version: int
    fingerprint: str
    world: int
    block_size: int
    num_tokens: int
    hashes: list[str]  # remote hashes, hex, prefix order (position-major over groups)
    expires_at: float  # wall clock (time.time())
    tail: int = 0


def check_manifest(raw: bytes, keys: Sequence[bytes], fingerprint: str, world: int,
                   block_size: int, remote_hash: Callable[[bytes], bytes]
                   ) -> tuple[Manifest | None, bool]:
    """Decode a manifest read for a request whose CPU keys from position 0 are ``keys``
    (None: unreadable, or longer than the size bound for them) and whether the consumer
    may trust it: version 1, this engine's fingerprint, world size and block size, a
    tail count inside the list, and its full blocks' hashes exactly the request's own
    prefix. The expiry is not checked here (an expired manifest is demoted, not just
    refused)."""
    m = None
    if len(raw) <= MANIFEST_BASE + MANIFEST_PER_BLOCK * len(keys):
        try:
            m = msgspec.json.decode(raw, type=Manifest)
        except Exception:  # noqa: BLE001 - the server's bytes: a string that is not
            pass  # UTF-8 raised UnicodeDecodeError (no DecodeError) out of the lookup
    if m is None:
        return None, False
    full = len(m.hashes) - m.tail
    ok = (m.version == 1 and m.fingerprint == fingerprint and m.world == world
          and m.block_size == block_size and 0 <= m.tail < len(m.hashes)
          and full <= len(keys)
          and [remote_hash(k).hex() for k in keys[:full]] == m.hashes[:full])
    return m, ok


def checked_hashes(m: Manifest, keys: Sequence[bytes],
                   remote_hash: Callable[[bytes], bytes]) -> tuple[list[bytes], int]:
    """The remote hashes of the entries of a trusted ``m`` that are the request's own
    (``keys``: its CPU keys from position 0, its partial last block's included when it
    has one), and how many entries are not: the full blocks (checked by
    :func:`check_manifest`), then each tail entry equal to the request's own key at its
    place. A collection re-times only these: a tail entry naming anything else (another
    hand-off's blocks, in a forged manifest) is never touched."""
    full = len(m.hashes) - m.tail
    own = [remote_hash(k) for k in keys[:len(m.hashes)]]
    out = own[:full]
    out += [h for h, e in zip(own[full:], m.hashes[full:]) if h.hex() == e]
    return out, len(m.hashes) - len(out)


def remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Whether ``kv_transfer_params`` mark a P/D decode request (its prefill ran
    elsewhere: :data:`PREFILL_PARAM`)."""
    return bool(params) and bool(params.get(PREFILL_PARAM))  # type: ignore[union-attr]


def remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether ``kv_transfer_params`` mark a P/D prefill request (it decodes elsewhere,
    so its whole KV must reach the CPU tier: :data:`DECODE_PARAM`)."""
    return bool(params) and bool(params.get(DECODE_PARAM))  # type: ignore[union-attr]


def is_handoff(params: Mapping[str, Any]) -> bool:
    """Whether a lookup's ``kv_transfer_params`` are a P/D decode request's (kvshm's)."""
    return remote_prefill(params) and isinstance(params.get(MANIFEST_PARAM), str)


def handoff_extent(hashes: Sequence[bytes], tail: bytes | None, num_tokens: int,
                   block_size: int, start: int) -> tuple[Sequence[bytes], int]:
    """A hand-off consumer's lookup range: its hashes (with ``tail``, the partial last
    block's, appended when it has exactly the full blocks before it) and how many blocks
    from ``start`` the hit may cover: every block holding one of the first
    ``num_tokens - 1`` tokens (the last token is always computed; a 1-token tail holds
    only that one, so it is never loaded). No tail without a full block before it (its
    key has no parent)."""
    n_max = -(-(num_tokens - 1) // block_size) - start
    if tail is not None and hashes and len(hashes) == num_tokens // block_size:
        return [*hashes, tail], n_max
    return hashes, n_max


def manifest_key(fingerprint: str, world: int, req_id: str) -> str:
    """``kvshm:v1:pd:<fingerprint>:<world>:<owner>:<request>``: the request's
    :func:`handoff_owner`, then the request id -- one of ``[A-Za-z0-9._=-]{1,120}`` as
    itself, any other as ``#`` and its SHA-256 (hex). Unambiguous: ``#`` is outside the
    first alphabet, so two request ids never share a name (an id equal to another's
    SHA-256 hex is written as itself, without the ``#``)."""
    rid = req_id if _SAFE.match(req_id) else \
        _HASHED + hashlib.sha256(req_id.encode()).hexdigest()
    return f"{PD_PREFIX}:{fingerprint}:{world}:{handoff_owner(req_id)}:{rid}"


def key_owner(key: str, prefix: str) -> str | None:
    """The owner a manifest name under ``prefix`` (``kvshm:v1:pd:<fingerprint>:<world>:``)
    names (:func:`manifest_key`); None when it names none (another form: a name
    written before owners were, or not kvshm's)."""
    owner, sep, rid = key[len(prefix):].partition(":")
    if not key.startswith(prefix) or not sep or not rid or not _OWNER.match(owner):
        return None
    return owner


def handoff_owner(req_id: str) -> str:
    """Who a hand-off of request ``req_id`` belongs to: a digest (32 hex) of the id
    without vLLM's additions -- a parallel-sampling child's ``<index>_`` prefix (the
    children of one request share its hand-off: they are its owner too) and the
    ``-<8 hex>`` each vLLM engine appends to a request's external id (the prefill and the
    decode engine each append their own; vLLM's NIXL connector strips the same). Both
    sides apply it: the prefill writes it in the manifest's name (:func:`manifest_key`),
    a decoder compares its request's with the name's (:func:`key_owner`), so a request
    id without these forms is compared as itself. A proxy that sends one request to both
    engines under one request id (vLLM's example proxies: ``X-Request-Id``) has its
    decoder collect the hand-off; a request under any other id may read the blocks
    (ordinary cache) but never deletes or re-times anything."""
    base = _VLLM_SUFFIX.sub("", _VLLM_CHILD.sub("", req_id, count=1), count=1)
    return hashlib.blake2b(base.encode(), digest_size=16).hexdigest()


class Verdict(Enum):
    """A consumer's state: waiting for the manifest, cleared to query, or refused."""

    WAIT = "wait"
    GO = "go"
    REFUSED = "refused"


@dataclass(slots=True)
class PdCounters:
    """Monotonic counters of the hand-offs (in ``EngineStats.remote``, ``pd_*``)."""

    published: int = 0
    manifests_written: int = 0
    publish_failed: int = 0
    publish_timeouts: int = 0
    consumed: int = 0
    manifest_missing: int = 0
    manifest_refused: int = 0
    manifest_expired: int = 0
    collected: int = 0
    publish_empty: int = 0
    publish_superseded: int = 0  # a pending hand-off whose request id published again
    unhealthy: int = 0
    tails_dropped: int = 0
    tails_declined: int = 0  # a partial last block that could not be queued (pin_tail)
    tails_unkeyed: int = 0  # a partial last block with no key (multimodal, not hashed)
    manifest_reused: int = 0
    orphans_dropped: int = 0
    not_owner: int = 0
    entries_unchecked: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name, ``pd_`` first."""
        return {f"pd_{f.name}": getattr(self, f.name) for f in fields(self)}
