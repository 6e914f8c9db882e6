"""route_kvshm_logs' rules: vLLM's handlers on the ``kvshm`` logger unless the user put
their own there; handlers from an earlier routing replaced (issue 14, point 3)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm.logger", reason="vLLM is not installed (see tools/vllm_install.sh)")

from kvshm.integrations.vllm.logs import route_kvshm_logs


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger]]:
    """The ``kvshm`` and ``vllm`` loggers, restored afterwards."""
    ours, theirs = logging.getLogger("kvshm"), logging.getLogger("vllm")
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (ours, theirs)]
    try:
        yield ours, theirs
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate


def test_kvshm_gets_vllms_handlers_and_level(
        loggers: tuple[logging.Logger, logging.Logger]) -> None:
    ours, theirs = loggers
    old, new = logging.StreamHandler(), logging.StreamHandler()
    ours.handlers[:] = []
    theirs.handlers[:] = [old]
    theirs.setLevel(logging.INFO)
    assert route_kvshm_logs()
    assert ours.handlers == [old] and ours.level == logging.INFO and not ours.propagate
    theirs.handlers[:] = [new]  # vLLM configured its logging again
    theirs.setLevel(logging.DEBUG)
    assert route_kvshm_logs()
    assert ours.handlers == [new] and ours.level == logging.DEBUG


def test_a_user_configured_kvshm_logger_is_left_alone(
        loggers: tuple[logging.Logger, logging.Logger]) -> None:
    ours, theirs = loggers
    mine = logging.StreamHandler()
    ours.handlers[:] = [mine]
    ours.setLevel(logging.WARNING)
    ours.propagate = True
    theirs.handlers[:] = [logging.StreamHandler()]
    assert not route_kvshm_logs()
    assert ours.handlers == [mine] and ours.level == logging.WARNING and ours.propagate


def test_no_vllm_handler_no_routing(loggers: tuple[logging.Logger, logging.Logger]) -> None:
    ours, theirs = loggers
    ours.handlers[:] = []
    theirs.handlers[:] = []  # VLLM_CONFIGURE_LOGGING=0
    assert not route_kvshm_logs()
    assert ours.handlers == []
