"""Commands to a Valkey server or cluster, one pipelined round trip per shard, each shard
under its own circuit breaker: the readiness index's transport
(:class:`~kvshm.remote.valkey_index.ValkeyReadyIndex` holds one :class:`ShardBatches`).

A batch of :class:`Command` s is grouped by its keys' shard (the server; in a cluster,
each primary, from the slot map of :class:`~kvshm.remote.glide_client.Shards`) and each
group goes as one non-atomic batch, the groups one after the other. A shard whose breaker
refuses, or whose batch failed (an exception, or a reply saying its node was not
reached), answers :data:`DOWN` for every command of its group -- a miss, never an
answer -- and feeds its breaker; the other shards answer as usual, so one dead cluster
primary does not blind the others. In a cluster each primary has a standalone client of
its own, made on first use and anew once its breaker opened (one cluster client for
every shard would let a stopped primary stall the others: glide's topology refresh
after its timeout made the next batch to a live primary time out too, measured); an
opened breaker also re-reads the slot map (a replica may have taken over).

Replies come back in the commands' order, one per command (an :attr:`Op.EXPIRE` sends two
commands -- the key's and its header key's -- and answers with the first's reply).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from enum import Enum
from typing import Any, Final, NamedTuple

from kvshm.remote.breaker import BreakerState
from kvshm.remote.glide_client import (
    UNSERVED,
    Counters,
    Shards,
    expiry_of,
    header_key,
    make_client,
    report_failure,
)
from kvshm.remote.tier import RemoteSpec

__all__ = ["DEL_IF_SAME", "DOWN", "SERVER", "Command", "Op", "ShardBatches"]

#: The shard name of a standalone server (:class:`~kvshm.remote.glide_client.Shards`).
SERVER: Final = "server"


class _Down:
    """The reply of a command whose shard was down (its breaker refused, or the batch
    failed): a miss, never an answer."""

    def __repr__(self) -> str:
        return "DOWN"


DOWN: Final = _Down()
#: Words of a batch's error reply that mean its node was not reached (glide puts them in
#: the batch instead of raising: a stopped primary's commands come back ``Moved`` from
#: the node glide tried instead, or timed out).
_UNREACHABLE: Final = ("Moved", "MOVED", "CLUSTERDOWN", "TRYAGAIN", "timed out",
                       "onnection", "onnect ", "broken pipe", "Broken pipe")


class Op(Enum):
    """What a :class:`Command` does to its key (``arg`` in brackets)."""

    MARK = "mark"  # SET key "1" with the tier's TTL, or the hold TTL [keep: bool]
    EXISTS = "exists"
    SET_VALUE = "set_value"  # SET key value EX ttl [(value, ttl_s)]
    GET = "get"
    EXPIRE = "expire"  # EXPIRE key and its header key GT [seconds]
    DELETE_IF_SAME = "delete_if_same"  # DEL key if it still holds [value]

#: Deletes ``KEYS[1]`` only while it holds ``ARGV[1]`` (1 if deleted, else 0): a small
#: value collected by its reader, never one written again since it was read.
DEL_IF_SAME: Final = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
                      "return redis.call('DEL', KEYS[1]) end return 0")


class Command(NamedTuple):
    """One command of a batch: ``op`` on ``key`` (``arg``: see :class:`Op`)."""

    op: Op
    key: str
    arg: Any = None


class ShardBatches:
    """See the module docstring. ``counters`` is the index's (this adds ``round_trips``,
    ``rejected``, ``errors``, ``timeouts``, ``clients_created``)."""

    def __init__(self, spec: RemoteSpec, glide: Any, shards: Shards,
                 counters: Counters) -> None:
        self.spec = spec
        self._glide = glide
        self._shards = shards
        self._n = counters
        self._ttl = expiry_of(glide, spec)
        self._hold = glide.ExpirySet(glide.ExpiryType.SEC, spec.hold_ttl_s)
        self._clients: dict[str, Any] = {}  # cluster: primary -> its own client
        self._map: frozenset[str] | None = None  # the slot map _clients was pruned to

    def run(self, client: Any, cmds: Sequence[Command]) -> list[Any]:
        """``cmds`` grouped by their key's shard, one round trip per shard, each under
        that shard's breaker; the replies in ``cmds``' order (:data:`DOWN` for every
        command of a shard that is down). ``client``: the server's (standalone), or the
        cluster client used where no slot map was read."""
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(cmds):
            groups.setdefault(self._shards.shard_of(c.key), []).append(i)
        self._prune()
        out: list[Any] = [DOWN] * len(cmds)
        for shard, idx in groups.items():
            got = self._batch(self._client_of(shard, client), shard, [cmds[i] for i in idx])
            if got is not None:
                for i, r in zip(idx, got, strict=True):
                    out[i] = r
        return out

    def close(self) -> None:
        """Close every shard's own client (the caller closes ``client``)."""
        for shard in list(self._clients):
            self._drop_client(shard)

    def _prune(self) -> None:
        """Once a new slot map is read: close the client of every primary it does not
        name (a primary that left without its breaker opening kept its client, and
        its connections, for good)."""
        now = self._shards.current()
        if now is self._map:
            return
        self._map = now
        for shard in [s for s in self._clients if now is None or s not in now]:
            self._drop_client(shard)

    def _client_of(self, shard: str, client: Any) -> Any:
        """The client for ``shard``: ``client`` for a standalone server, where no slot
        map was read, and for slots no primary serves (:data:`UNSERVED`: a partial map,
        whose every round failed on a client made for "cluster"); in a cluster a
        standalone client of that primary alone."""
        if not self.spec.cluster or shard == UNSERVED \
                or shard not in (self._shards.current() or ()):
            return client
        found = self._clients.get(shard)
        if found is None:
            host, _, port = shard.rpartition(":")
            found = make_client(dataclasses.replace(
                self.spec, url=f"valkey://{shard}", nodes=((host, int(port)),), cluster=False))
            self._clients[shard] = found
            self._n.add(clients_created=1)
        return found

    def _drop_client(self, shard: str) -> None:
        old = self._clients.pop(shard, None)
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - a broken client: drop it
                pass

    def _add(self, batch: Any, c: Command) -> None:
        g = self._glide
        if c.op is Op.MARK:
            batch.set(c.key, b"1", expiry=self._hold if c.arg else self._ttl)
        elif c.op is Op.EXISTS:
            batch.exists([c.key])
        elif c.op is Op.SET_VALUE:
            value, ttl_s = c.arg
            batch.set(c.key, value, expiry=g.ExpirySet(g.ExpiryType.SEC, ttl_s))
        elif c.op is Op.GET:
            batch.get(c.key)
        elif c.op is Op.EXPIRE:  # a block key's header key too (none: a no-op)
            # GT: never shorter -- another live hand-off may hold the same blocks
            gt = g.ExpireOptions.NewExpiryGreaterThanCurrent
            batch.expire(c.key, c.arg, gt)
            batch.expire(header_key(c.key), c.arg, gt)
        else:
            assert c.op is Op.DELETE_IF_SAME, c.op
            batch.custom_command(["EVAL", DEL_IF_SAME, "1", c.key, c.arg])

    def _batch(self, client: Any, shard: str, cmds: list[Command]) -> list[Any] | None:
        """One shard's commands in one non-atomic batch; None when its breaker refused
        or the batch failed (counted; the breaker told)."""
        g = self._glide
        breaker = self._shards.breaker(shard)
        if not breaker.allow():
            self._n.add(rejected=1)
            if breaker.state is BreakerState.OPEN:
                self._shards.refresh()  # maybe its slots moved (failover)
            return None
        batch = (g.ClusterBatch if self.spec.cluster else g.Batch)(is_atomic=False)
        for c in cmds:
            self._add(batch, c)
        try:
            result = list(client.exec(batch, raise_on_error=False) or [])
            self._n.add(round_trips=1)
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            self._failed(shard, exc)
            return None
        down = next((r for r in result if self._unreachable(r)), None)
        if down is not None:  # glide may answer a node it cannot reach (or a slot that
            self._failed(shard, down)  # moved) with errors in the batch
            return None
        breaker.success()
        replies, pos = [], 0
        for c in cmds:  # one reply per command, two per EXPIRE
            replies.append(result[pos] if pos < len(result) else None)
            pos += 2 if c.op is Op.EXPIRE else 1
        return replies

    def _failed(self, shard: str, exc: BaseException) -> None:
        breaker = self._shards.breaker(shard)
        before = breaker.opens
        breaker.failure()
        self._n.add(errors=1, timeouts=int(isinstance(exc, self._glide.TimeoutError)))
        report_failure(self.spec, "index", shard, exc)
        if breaker.opens != before and self.spec.cluster:  # a new client once it is back;
            self._drop_client(shard)  # maybe its slots moved (failover): a new map
            self._shards.refresh(force=True)

    def _unreachable(self, reply: Any) -> bool:
        """Whether a batch's reply says its node could not be reached (a timeout, a
        closed connection, a redirection glide could not follow), not that the server
        refused the command (OOM, WRONGTYPE: an answer)."""
        g = self._glide
        if isinstance(reply, (g.TimeoutError, g.ConnectionError, g.ClosingError)):
            return True
        return isinstance(reply, g.GlideError) and any(m in str(reply) for m in _UNREACHABLE)
