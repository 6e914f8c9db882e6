"""Ask the kvshm engine of a running vLLM ``LLM`` for its statistics (no vLLM import).

:func:`engine_stats` is ``kvshm stats --name NAME`` from Python, with NAME found the
way the connector finds it: ``kv_connector_extra_config['name']`` if set, else
``kvshm-<engine_id>`` (:func:`~kvshm.integrations.vllm.config.engine_name`; vLLM draws
the engine id in the process that builds the ``LLM``, so that process knows it).
The answer comes from the scheduler side's service thread, within about 20 ms even when
the engine is idle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvshm.errors import ConfigError
from kvshm.integrations.vllm.config import engine_name

__all__ = ["engine_stats", "hit_tokens", "kvshm_name"]


def kvshm_name(llm: Any) -> str:
    """The rendezvous name of the kvshm engine serving ``llm`` (a ``vllm.LLM``)."""
    kvt = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None),
                  "kv_transfer_config", None)
    if kvt is None:
        raise ConfigError("this LLM has no kv_transfer_config: kvshm is not its connector")
    name = (kvt.kv_connector_extra_config or {}).get("name")
    return str(name) if name is not None else engine_name(str(kvt.engine_id))


def engine_stats(llm: Any, timeout: float = 2.0) -> dict[str, Any]:
    """The statistics ``kvshm stats --name`` prints for ``llm``'s kvshm engine
    (:func:`hit_tokens` reads ``kvshm_hit_tokens_total`` from them).

    ConfigError if no kvshm engine of that name runs; TimeoutError if it does not
    answer within ``timeout`` seconds.
    """
    from kvshm.ipc.rendezvous_client import query_stats

    return query_stats(kvshm_name(llm), timeout=timeout)


def hit_tokens(stats: Mapping[str, Any]) -> int:
    """Prompt tokens served from kvshm's tiers in ``stats`` (:func:`engine_stats`): the
    value ``/metrics`` exports as ``kvshm_hit_tokens_total``, flattened by the same
    :func:`kvshm.series.scalars` the exporters use; a missing counter reads 0."""
    from kvshm.series import scalars

    return scalars(stats)[0].get("kvshm_hit_tokens", 0)
