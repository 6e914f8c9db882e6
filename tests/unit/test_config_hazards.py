"""EngineConfig hazards from the issue tracker: timeouts that are not finite positive
numbers (NaN disabled hang detection, NaN connect timeout failed late inside a
conversion, infinite shutdown grace hung aclose()), and default names with too few
random bits to stay unique."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import pytest

from kvshm.config import EngineConfig, default_name
from kvshm.errors import ConfigError

#: Every EngineConfig field that is a duration in seconds (checked against the class).
TIMEOUTS = ("hang_timeout_s", "connect_timeout_s", "shutdown_grace_s")
BAD_TIMEOUTS = [math.nan, math.inf, -math.inf, -1, -0.5, 0, 0.0, True, False, "5", None,
                1e300, 86_401, 10**400]  # past a day: as good as infinity, or overflows


def test_the_timeout_list_names_every_seconds_field() -> None:
    seconds = {f.name for f in dataclasses.fields(EngineConfig) if f.name.endswith("_s")}
    assert seconds == set(TIMEOUTS)


@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
@pytest.mark.parametrize("field", TIMEOUTS)
def test_nan_inf_nonpositive_or_bool_timeout_is_refused_naming_field_and_value(
        field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(block_size=16, **{field: value})  # type: ignore[arg-type]
    assert field in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("value", [1e-3, 0.5, 1, 30, 86_400.0])
@pytest.mark.parametrize("field", TIMEOUTS)
def test_finite_positive_timeouts_are_kept(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    assert getattr(EngineConfig(block_size=16, **kwargs), field) == value


def test_default_name_carries_at_least_64_random_bits() -> None:
    name = default_name()
    match = re.fullmatch(r"e(\d+)-([0-9a-f]+)", name)
    assert match is not None, name
    assert int(match.group(1)) == os.getpid()
    assert len(match.group(2)) * 4 >= 64
    assert EngineConfig(block_size=16).name != EngineConfig(block_size=16).name


def test_default_hang_timeout_is_the_measured_one() -> None:
    """The default comes from tools.bench_acks (worst per-rank stall 0.14 s under a
    saturating soak, with a wide margin): 10 s, also the vLLM connector's default
    (tests/vllm/test_vllm_config.py::test_defaults parses it)."""
    from kvshm.config import DEFAULT_HANG_TIMEOUT_S

    assert EngineConfig(block_size=16).hang_timeout_s == 10.0 == DEFAULT_HANG_TIMEOUT_S
