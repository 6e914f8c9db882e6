"""The runtime that joins the offload policy to worker ranks over the IPC transport.

:class:`Engine` (asyncio) and :class:`SyncClient` (the caller's thread) are the public
faces (:mod:`~kvshm.engine.api`), sharing their scheduler calls and state guard
(:mod:`~kvshm.engine.facade`); both drive one :class:`~kvshm.engine.runtime.Runtime`,
which owns the manager, the CPU pool, the rendezvous and one channel per rank. The
runtime keeps requests listed before READY away from the manager
(:mod:`~kvshm.engine.admission`), posts Transfers and applies Dones
(:mod:`~kvshm.engine.dispatch`), supervises the ranks -- verdict, fence, hang check
(:mod:`~kvshm.engine.supervision`) --, provisions shared memory
(:mod:`~kvshm.engine.provision`), reports statistics (:mod:`~kvshm.engine.snapshot`)
and, in SPAWN mode, starts the worker processes (:mod:`~kvshm.engine.launcher`); its
start errors and lifecycle log lines are :mod:`~kvshm.engine.startup`'s. The
lifecycle diagram: :mod:`~kvshm.engine.lifecycle`.

May import: the shared leaves, ``kvshm.offload`` and ``kvshm.ipc``. Never: ``workers``
(ranks are separate processes or the serving engine's own), integrations, vLLM
(``tests/unit/test_imports.py``).

The invariant every change keeps: every call that touches the manager or a pool runs on
one thread (the event loop's for ``Engine``, the caller's for ``SyncClient``), and a rank
that failed is fenced before its quarantined pins are released.
"""

from kvshm.engine.api import ATTACH, SPAWN, Engine, SyncClient, WorkerMode
from kvshm.engine.lifecycle import EngineState
from kvshm.engine.startup import StartTimeout

__all__ = ["ATTACH", "SPAWN", "Engine", "EngineState", "StartTimeout", "SyncClient",
           "WorkerMode"]
