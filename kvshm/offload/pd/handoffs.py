"""Prefill/decode hand-off through the remote tier: manifests, published last.

A P/D prefill request (``do_remote_decode``) must reach a decode engine whole. When it
finishes, the prefill side (:class:`~kvshm.offload.pd.publish.Publications`) records a
*publication*: its blocks' CPU keys (in prefix order) and token count, and the manifest
key it will write, ``kvshm:v1:pd:<fingerprint>:<world>:<owner>:<request>``
(:func:`~kvshm.offload.pd.manifest.manifest_key`), which the engine hands back
at once as the request's ``kv_transfer_params`` (``{"kvshm_manifest": key}``). The
manifest is written **last**: only once every one of its blocks was put and acked by
every rank (the remote book's write path reports each ok PUT); a failed PUT, or blocks
that never reach the server within ``publish_timeout_s`` (30 s), drop the publication
(counted) and no manifest is ever written. A manifest names the fingerprint, world size,
block size, token count, the blocks' remote hashes and an expiry (wall clock).

The decode side (:class:`~kvshm.offload.pd.consume.Consumers`, from a lookup whose
params carry ``do_remote_prefill`` and ``kvshm_manifest``) reads the manifest
asynchronously: "ask again" (None) until it arrives. Missing: ask again until ``wait_s``
(5 s; the prefill may still be publishing), then 0; an answer that never arrives at all:
0 after twice that. Present: it is checked -- fingerprint, world size and block size
equal the consumer's, not expired, its hashes are the request's own prefix -- and only
then does the ordinary remote lookup run (the readiness keys are still asked: a manifest
is never trusted alone). An expired one is deleted (demoted: its blocks keep their
ordinary TTL). A consumer that loaded the blocks deletes the manifest (collected); so
does one that trusted it but fetched nothing (it held every block already, or the server
no longer did), when its request ends -- a reset or a failed rank does not end it. Only
the hand-off's own request does either (its *owner*,
:func:`~kvshm.offload.pd.manifest.handoff_owner`: the prefill's request id, up to what
vLLM adds to it -- the children of one request are its owner too); any other request
whose prefix matches reads the blocks as ordinary cache and deletes or re-times nothing
(``pd_not_owner``). A collection re-times only the manifest's entries that are the
request's own blocks (a forged tail naming another hand-off's blocks is left alone,
``pd_entries_unchecked``). A
decoder whose CPU tier holds a prefix of the hand-off (a shared system prompt) still
fetches the rest (the manager asks the remote tier from the end of that hit, holding the
hit meanwhile); one whose CPU tier (or engine) holds all of it reads the manifest
without waiting for it, so that its end collects it too -- and never waits 5 s for a
manifest a sibling (vLLM's parallel sampling shares one hand-off) already collected. A
sibling that does need the server finds the manifest in the decoder's memory of those it
collected (the newest 8 MiB; ``pd_manifest_reused``; :mod:`kvshm.offload.pd.collected`),
judged by the same checks against its own prefix -- one that does not match, or has
expired, is not used: the server is asked. Collection deletes the manifest, not the
blocks (they keep the ordinary TTL). A request that ends while its manifest is still
being read leaves an *orphan* read, collected when it arrives if trusted; one that
collects nothing (no answer within ``2 * wait_s``, missing, untrusted) is counted
``pd_orphans_dropped``. Every refusal is a counted miss: the request recomputes.

Lifetime: a hand-off's blocks and readiness keys are put with the tier's *hold* TTL
(``keep``; ``RemoteSpec.hold_ttl_s``, 30 min), not the ordinary one; the decoder that
loaded them gives them the ordinary TTL (they stay useful as cache); so does the
publisher when its publication fails, and the first engine that finds a manifest expired
(demotion). Not "no TTL", as first planned: a hand-off nobody collects (the decode
request aborted or served from another tier, the manifest refused, the prefill killed
mid-publish) would pin server memory for ever, and ``volatile-lru`` can never evict a
key without a TTL -- the server would fill up and refuse writes. The price: under memory
pressure ``volatile-lru`` may evict a hand-off in flight (the decoder then recomputes,
counted).

The partial last block (a prompt that does not end on a block boundary) travels too: the
prefill stores it under a *tail key* (:func:`kvshm.hashing.tail_hash` of the last full
block's hash and the remaining tokens; the engine passes it to ``finished``), puts it
like the others and names it last in the manifest (``Manifest.tail``); the decoder
derives the same key from its own tokens (``RequestView.tail_hash``) and its hit covers
``num_tokens - 1`` tokens (:func:`~kvshm.offload.pd.manifest.handoff_extent`), so it
computes only the last token, as vLLM's own P/D connectors do. A decoder without the
tail key (or with another one) loads the full blocks only. The tail is an extra: when
its finish-time store is dropped for want of CPU blocks
(:meth:`~kvshm.offload.pd.publish.Publications.store_dropped`, from the store planner's
``on_dropped`` hook), the publication goes on without it rather than time out.

One object per side, built here and held by the remote book's P/D side
(:class:`~kvshm.offload.pd.side.HandoffSide`): the prefill side's
:class:`~kvshm.offload.pd.publish.Publications` and the decode side's
:class:`~kvshm.offload.pd.consume.Consumers`, sharing one
:class:`~kvshm.offload.pd.scope.HandoffScope` and one set of counters. The manifest
record, its key, its checks and the consumer's hit range:
:mod:`kvshm.offload.pd.manifest`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvshm.offload.pd.consume import Consumers
from kvshm.offload.pd.manifest import PdCounters
from kvshm.offload.pd.publish import Publications
from kvshm.offload.pd.scope import HandoffScope
from kvshm.remote.tier import ReadyIndex

__all__ = ["Handoffs"]


class Handoffs:
    """One engine's P/D hand-offs (see the module docstring): ``publications`` (the
    prefill side), ``consumers`` (the decode side), the ``scope`` both share and their
    shared ``counters``. It holds no state of its own: each side owns its own, and
    neither calls the other. ``remote_hash``: a CPU key's remote hash; ``ready_key``: a
    remote hash's readiness key."""

    def __init__(self, index: ReadyIndex, fingerprint: str, world: int, block_size: int,
                 remote_hash: Callable[[bytes], bytes], ready_key: Callable[[bytes], str],
                 *, wait_s: float = 5.0, publish_timeout_s: float = 30.0,
                 manifest_ttl_s: int = 600, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.scope = HandoffScope(index, fingerprint, world, block_size, remote_hash,
                                  ready_key)
        self.counters = PdCounters()
        self.publications = Publications(self.scope, self.counters,
                                         publish_timeout_s=publish_timeout_s,
                                         manifest_ttl_s=manifest_ttl_s, clock=clock,
                                         wall=wall)
        self.consumers = Consumers(self.scope, self.counters, wait_s=wait_s, clock=clock,
                                   wall=wall)

    @property
    def block_size(self) -> int:
        """The block size every manifest of this engine names."""
        return self.scope.block_size

    def tick(self) -> None:
        """A plan's upkeep, in this order: apply the manifests that arrived, then drop
        the publications past their timeout and the orphan reads past ``2 * wait_s``."""
        self.consumers.poll()
        self.publications.expire()
        self.consumers.expire()
