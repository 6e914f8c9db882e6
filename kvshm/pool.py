"""Deprecated path of :mod:`kvshm.offload.pool` (kept for kvshm 0.2, removed in 0.3)."""

from kvshm._moved import redirect

redirect(__name__)
