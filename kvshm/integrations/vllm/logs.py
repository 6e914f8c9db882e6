"""kvshm's log lines under vLLM: the ``kvshm`` logger tree goes through vLLM's handler.

Python loggers without a handler print nothing below WARNING, and vLLM configures only
its own ``vllm`` logger (``vllm.logger``'s ``DEFAULT_LOGGING_CONFIG``: one handler,
``propagate=False``). :func:`route_kvshm_logs` gives the ``kvshm`` logger vLLM's
handlers and level, so kvshm's INFO lines (the engine's name and how to query it, ready,
refused ranks, failure, shutdown) appear in vLLM's log with vLLM's format; per-request
lines are DEBUG and appear with ``VLLM_LOGGING_LEVEL=DEBUG``.

Rules: handlers someone else put on the ``kvshm`` logger (the user configured logging)
win: it is then left alone. Otherwise it gets the handlers of the ``vllm`` logger (those
attached by an earlier call are replaced: vLLM may have configured its logging again),
its level, and ``propagate=False`` like vLLM's own (no line printed twice). No effect
where vLLM's logging configuration is off (``VLLM_CONFIGURE_LOGGING=0``: the ``vllm``
logger has no handler).
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["KVSHM_LOGGER", "VLLM_LOGGER", "route_kvshm_logs"]

KVSHM_LOGGER: Final = "kvshm"
VLLM_LOGGER: Final = "vllm"
#: set on the handlers this module attached to the ``kvshm`` logger
_MARK: Final = "_kvshm_routed"


def route_kvshm_logs() -> bool:
    """Attach vLLM's handlers to the ``kvshm`` logger; True when it now has them."""
    import vllm.logger  # noqa: F401 - configures the "vllm" logger on import

    ours = logging.getLogger(KVSHM_LOGGER)
    theirs = logging.getLogger(VLLM_LOGGER)
    if not theirs.handlers:
        return False
    if any(not getattr(h, _MARK, False) and h not in theirs.handlers for h in ours.handlers):
        return False  # configured by the user: theirs to keep
    for handler in list(ours.handlers):
        ours.removeHandler(handler)
    for handler in theirs.handlers:
        setattr(handler, _MARK, True)
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False
    return True
