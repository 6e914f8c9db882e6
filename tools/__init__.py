"""Benchmarks and operator tools (run as ``python -m tools.<name>``)."""
