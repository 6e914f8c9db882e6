"""The offload policy, sans-IO: which blocks go to the CPU tier, which come back, and when
a pin may be dropped.

The :class:`~kvshm.offload.manager.OffloadManager` is driven by plain calls (lookup,
allocated, step, on_done, finished) and answers with plain records: it performs no I/O,
starts no thread and never waits. Its only wire dependency is the message structs of
:mod:`kvshm.ipc.protocol` that a plan carries (``Transfer``).

May import: the shared leaves (errors, config, types, hashing) and
``kvshm.ipc.protocol``. Never: the rest of ``kvshm.ipc``, ``kvshm.engine``, ``workers``,
integrations, torch, asyncio, threading, socket (``tests/unit/test_imports.py``).

The invariant every change keeps: a block that any rank may still read or write is
pinned (CPU) or listed as a load destination / store source (GPU) until every rank has
acked the job that touches it, or the rank is proven gone; it is never handed out again
before. ``kvshm.offload.invariants.check_parts`` states the bookkeeping in full.
"""

__all__: list[str] = []  # no names of its own: each is imported from its module
