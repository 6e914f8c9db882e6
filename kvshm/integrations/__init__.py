"""Integrations with serving engines: :mod:`kvshm.integrations.vllm` (vLLM's KV connector).

No names of its own: each is imported from its subpackage."""

__all__: list[str] = []
