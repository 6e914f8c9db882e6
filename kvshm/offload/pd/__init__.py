"""The prefill/decode hand-off through the remote tier (the rules:
:mod:`kvshm.offload.pd.handoffs`).

One module per idea: the manifest record, its key and checks (:mod:`.manifest`); where
this engine's hand-offs live on the server (:mod:`.scope`); the prefill side's
publications (:mod:`.publish`); the decode side's manifest reads (:mod:`.consume`) and
its memory of the manifests it collected (:mod:`.collected`); the object an engine
builds from them (:mod:`.handoffs`); and the remote book's P/D side (:mod:`.side`).

Layering (``tests/unit/test_imports.py``): this package imports the rest of
``kvshm.offload`` one way, never a module that imports it back. The rest of offload
imports it only through a narrow seam: the remote book (:mod:`kvshm.offload.remote`)
holds the P/D side (:class:`~kvshm.offload.pd.side.HandoffSide`, composition), and the
stateless :mod:`.manifest` (the record and the pure predicates on a request's
``kv_transfer_params``) is importable from anywhere; :mod:`.manifest` and
:mod:`.collected` import nothing from offload.
"""

__all__: list[str] = []  # no names of its own: each is imported from its module above
