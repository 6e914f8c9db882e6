"""Inter-process transport between the scheduler side and the worker ranks.

The wire format (:mod:`~kvshm.ipc.protocol`, msgspec tagged unions), the shared-memory
rings (one ring's framing: :mod:`~kvshm.ipc.ring`; a rank's segment, its control block
and its two rings: :mod:`~kvshm.ipc.ring_pair`), eventfd doorbells
(:mod:`~kvshm.ipc.doorbell`), fd passing over a Unix socket (:mod:`~kvshm.ipc.fdpass`),
the rendezvous that hands each rank its rings (server: :mod:`~kvshm.ipc.rendezvous`,
with ``rendezvous_conns`` and ``rendezvous_events``; worker side:
:mod:`~kvshm.ipc.rendezvous_client`), and the two channel ends that put them together
(shared base: :mod:`~kvshm.ipc.channel`; worker side: :mod:`~kvshm.ipc.worker_channel`;
scheduler side: :mod:`~kvshm.ipc.sched_channel`).

May import: the shared leaves (errors, layout, shm) and each other. Never:
``kvshm.offload``, ``kvshm.engine``, ``workers`` or integrations: an embedded worker
imports this package and must not load the scheduler's policy or torch-heavy code
(``tests/unit/test_imports.py``).

The invariant every change keeps: a record becomes visible to the peer only after its
bytes are written (the publish store comes last), and a side that goes to sleep rechecks
the ring after announcing it, so no record is lost between a producer's check and the
consumer's park; see docs/design.md, "Ordering rules".
"""

__all__: list[str] = []  # no names of its own: each is imported from its module above
