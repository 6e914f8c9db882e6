"""Whose a P/D hand-off is (:func:`~kvshm.offload.pd.manifest.handoff_owner`), the
manifest names it is written under (:func:`~kvshm.offload.pd.manifest.manifest_key`)
and the entries a collection may re-time
(:func:`~kvshm.offload.pd.manifest.checked_hashes`); then the owner rule on real
managers: a prefill manager P and a decode manager D share one :class:`HeldIndex`
(BS = 4, two ranks), with vLLM's request ids -- each engine appends its own
``-<8 hex>`` to a request's external id, and the children of an ``n > 1`` request are
``<index>_<parent id>``. (The attacks on a real server: tests/remote/test_pd_ownership.py.)
"""

from __future__ import annotations

import hashlib
import time

import msgspec
from manager_rig import REMOTE, Req
from test_handoff_local_prefix import wait_for_hit
from test_handoff_tail import publish, tail_of
from test_remote_book import WORLD, HeldIndex, remote_rig

from kvshm.offload.pd.manifest import (
    PD_PREFIX,
    Manifest,
    check_manifest,
    checked_hashes,
    handoff_owner,
    key_owner,
    manifest_key,
)
from kvshm.offload.remote_puts import remote_hash
from kvshm.types import RequestView


def test_vllm_siblings_and_both_engines_copies_of_a_request_share_one_owner() -> None:
    """The prefill engine's ``cmpl-7-1a2b3c4d`` and the decode engine's children
    ``0_cmpl-7-9f8e7d6c``, ``1_cmpl-7-9f8e7d6c`` are one owner; another external id, or
    an id that only looks alike, is another owner."""
    owner = handoff_owner("cmpl-7-1a2b3c4d")
    assert handoff_owner("cmpl-7-9f8e7d6c") == owner
    assert handoff_owner("0_cmpl-7-9f8e7d6c") == handoff_owner("12_cmpl-7-9f8e7d6c") == owner
    assert handoff_owner("cmpl-7") == owner                          # no vLLM suffix
    for other in ("cmpl-8-1a2b3c4d", "cmpl-7-1a2b3c4d-9f8e7d6c", "cmpl-7x", "x_cmpl-7",
                  "0_0_cmpl-7", "cmpl-7-1A2B3C4D"):
        assert handoff_owner(other) != owner, other
    assert len(owner) == 32 and int(owner, 16) >= 0


def test_manifest_names_are_unique_per_request_id_and_name_their_owner() -> None:
    """A safe id is written as itself, any other as ``#`` and its SHA-256: the unsafe
    ``"req u"`` and the safe id equal to its hash get two names (one name before). Each
    name carries its request's owner, read back by ``key_owner``; a name without one
    (written before owners were) names none."""
    unsafe = "req u"
    safe = hashlib.sha256(unsafe.encode()).hexdigest()
    prefix = f"{PD_PREFIX}:fp:{WORLD}:"
    ku, ks = manifest_key("fp", WORLD, unsafe), manifest_key("fp", WORLD, safe)
    assert ku != ks
    assert ku == f"{prefix}{handoff_owner(unsafe)}:#{safe}"
    assert ks == f"{prefix}{handoff_owner(safe)}:{safe}"
    assert key_owner(ku, prefix) == handoff_owner(unsafe)
    assert key_owner(ks, prefix) == handoff_owner(safe)
    assert key_owner(f"{prefix}r", prefix) is None                   # an older name
    assert key_owner(f"{prefix}{'0' * 32}:", prefix) is None          # no request
    assert key_owner(f"{PD_PREFIX}:other:{WORLD}:{'0' * 32}:r", prefix) is None


def test_a_collection_retimes_only_the_requests_own_entries() -> None:
    """Keys k0, k1 and tail t: a manifest naming k0, k1 and, as its tail, t -- all
    three checked. The same with the tail entry replaced by another block's hash (a
    forged manifest): k0, k1 only, 1 unchecked. A request without the tail key: k0,
    k1, the tail entry unchecked."""
    keys = [bytes([i]) * 32 for i in (1, 2, 3)]
    hexes = [remote_hash(k).hex() for k in keys]
    m = Manifest(1, "fp", WORLD, 4, 11, hexes, time.time(), tail=1)
    assert checked_hashes(m, keys, remote_hash) == ([remote_hash(k) for k in keys], 0)
    forged = Manifest(1, "fp", WORLD, 4, 11, [*hexes[:2], "ff" * 32], time.time(), tail=1)
    assert checked_hashes(forged, keys, remote_hash) == (
        [remote_hash(k) for k in keys[:2]], 1)
    assert checked_hashes(m, keys[:2], remote_hash) == ([remote_hash(k) for k in keys[:2]], 1)


def test_a_vllm_child_on_the_decoder_collects_its_parents_handoff() -> None:
    """P (vLLM) hands off R as ``r-1a2b3c4d``. On D the request runs as two children,
    ``1_r-9f8e7d6c`` first: it is R's owner, so its load collects the manifest (deleted,
    collected 1, not_owner 0). The other child ``0_r-9f8e7d6c`` is served from D's CPU
    tier and collects nothing more (collected 1). A request ``x-9f8e7d6c`` naming the
    same manifest reads it (consumed, not_owner 1) and collects nothing."""
    index = HeldIndex()
    _, r, params = publish(index, req=Req("r-1a2b3c4d", 11, params=REMOTE))
    key = params["kvshm_manifest"]
    d = remote_rig(index)
    pd = d.m.remote.pd if d.m.remote is not None else None
    assert pd is not None

    def view(rid: str) -> RequestView:
        return RequestView(rid, r.h, 11, {"do_remote_prefill": True, **params}, tail_of(r))

    for rid in ("1_r-9f8e7d6c", "0_r-9f8e7d6c", "x-9f8e7d6c"):
        assert wait_for_hit(d, index, view(rid)) == 10
        d.m.allocated(rid, [d.gpu.allocate(3)], 10)
        plan = d.step()
        assert plan.load is not None
        d.ack(plan.load, ranks=range(WORLD))
        d.m.finished(rid, 11, [[]])
        assert key not in index.kv and pd.counters.collected == 1
    assert (pd.counters.collected, pd.counters.not_owner) == (1, 1)
    d.m.check_invariants()


def test_a_manifest_whose_strings_are_not_utf8_is_unreadable_not_a_crash() -> None:
    """The hazard: a manifest on the server (written by anyone with write access, or
    damaged) whose fingerprint holds the byte 0xA9: msgspec's JSON decoder raises
    UnicodeDecodeError there, no DecodeError, and it escaped ``check_manifest`` -- out of
    the decoder's lookup, into the serving engine's scheduler. Now it is an unreadable
    manifest: not trusted, the request served as ordinary cache."""
    keys = [bytes([i]) * 32 for i in (1, 2)]
    good = msgspec.json.encode(Manifest(1, "fp", WORLD, 4, 9,
                                        [remote_hash(k).hex() for k in keys], time.time()))
    assert check_manifest(good, keys, "fp", WORLD, 4, remote_hash)[1]
    bad = good.replace(b'"fp"', b'"\xa9"')
    assert check_manifest(bad, keys, "fp", WORLD, 4, remote_hash) == (None, False)
