"""kvshm's worker side: one rank's worker copies KV blocks between that rank's device cache
and its share of the host pool, as the scheduler (``kvshm.engine``) commands over the
rank's rings, and sends a ``Done`` back for every job.

It runs embedded in a serving engine's worker process (:class:`workers.worker.Worker`,
driven by the host's step calls) or standalone (``python -m workers``, see
:mod:`workers.loop`). Modules: ``worker`` (the public API) with ``phases``, ``session``
(handshake and what Ready maps), ``step_queue``, ``done_book`` (the Done path),
``revocation``; the copy engines ``copy_engine`` (contract), ``cpu_copy``, ``cuda_copy``
(+ ``cuda_batch``) over ``host_pool``.

Imports: the shared leaves (today ``kvshm.errors``, ``layout``, ``shm``, ``worker_cli``)
and ``kvshm.ipc``; never ``kvshm.offload``, ``kvshm.engine`` or ``kvshm.integrations``
(tests/unit/test_imports.py enforces it).

The invariant every change must keep: no copy starts after the rank's revocation word
is set, and the lifeline closes only when no copy of this worker runs -- the scheduler
hands a dead rank's blocks out again on that proof (:mod:`workers.revocation`).
"""
