"""``kvshm demo --plot FILE.png``: the demo's summary as a picture.

Two panels from the ``--json`` summary (:func:`kvshm.demo.driver.run_demo`):

* time to first token of every request in replay order, offload off and on (log
  scale; dotted lines separate the turn numbers: turn 1 of every conversation comes
  first, then turn 2, ...);
* the CPU-tier hit rate per turn number (hit tokens / prompt tokens).

matplotlib is an optional extra (``pip install 'kvshm[plot]'``): imported only here,
with the non-interactive Agg backend (no display needed). :func:`require_matplotlib`
is called before the demo runs, so a missing matplotlib is said at once, not after
minutes of replay.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["INSTALL_HINT", "PlotUnavailable", "draw", "require_matplotlib"]

#: What to run when matplotlib is missing.
INSTALL_HINT: Final = "pip install 'kvshm[plot]'"


class PlotUnavailable(RuntimeError):
    """matplotlib cannot be imported; the message names :data:`INSTALL_HINT`."""


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or PlotUnavailable."""
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed ({e}); "
                              f"install it with: {INSTALL_HINT}") from None


def draw(summary: Mapping[str, Any], path: str) -> None:
    """Write the two panels for ``summary`` (the demo's JSON dict) to ``path`` (PNG)."""
    plt = require_matplotlib()
    per_turn = summary["per_turn"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7),
                                      gridspec_kw={"height_ratios": [3, 2]})
    xs = range(1, len(per_turn) + 1)
    top.plot(xs, [r["ttft_off_ms"] for r in per_turn], label="offload off (recompute)")
    top.plot(xs, [r["ttft_on_ms"] for r in per_turn], label="offload on (kvshm)")
    for i in range(1, len(per_turn)):
        if per_turn[i]["turn"] != per_turn[i - 1]["turn"]:
            top.axvline(i + 0.5, color="grey", linestyle=":", linewidth=1)
    top.set_yscale("log")
    plain = importlib.import_module("matplotlib.ticker").FuncFormatter(lambda v, _: f"{v:g}")
    top.yaxis.set_major_formatter(plain)
    top.yaxis.set_minor_formatter(plain)
    top.set_xlabel("request, in replay order (turn 1 of every conversation, then turn 2, ...)")
    top.set_ylabel("time to first token (ms)")
    top.set_title(f"kvshm demo: median TTFT turns 2+ {summary['ttft_off_ms']:.0f} -> "
                  f"{summary['ttft_on_ms']:.0f} ms ({summary['ttft_ratio']:.1f}x)")
    top.legend()
    rates = summary["hit_rate_by_turn"]
    turns = [str(t + 1) for t in range(len(rates))]
    bottom.bar(turns, [100 * r for r in rates], color="tab:orange")
    bottom.set_xlabel("turn")
    bottom.set_ylabel("CPU-tier hit rate (% of prompt tokens)")
    bottom.set_ylim(0, 100)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
