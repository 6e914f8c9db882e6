"""examples/grafana/kvshm.json (issue 28, point 8): every query of the dashboard names
series that kvshm exports to vLLM's ``/metrics`` (:func:`kvshm.series.vllm_series`),
with labels those series have, and the dashboard covers hit tokens, stored / loaded
blocks and bytes, CPU tier occupancy, failures, ack latency and the remote breaker."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvshm.series import SERIES, Kind, series_names, vllm_series

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvshm.json"

#: PromQL functions, aggregations and keywords a query may use (not series).
PROMQL_WORDS = frozenset({
    "rate", "irate", "increase", "sum", "max", "min", "avg", "count", "by", "without",
    "histogram_quantile", "label_values", "clamp_min", "clamp_max", "topk", "bottomk",
    "delta", "deriv", "abs", "and", "or", "unless", "on", "ignoring", "group_left",
    "group_right", "offset", "bool", "time", "vector", "scalar", "max_over_time",
    "min_over_time", "avg_over_time", "last_over_time", "resets", "changes",
})
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _queries(node: Any) -> Iterator[str]:
    """Every ``expr`` of a panel target and every templating query in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and "(" in value:
                yield value
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def _labels_of(series_name: str) -> set[str]:
    """Labels a vLLM ``/metrics`` sample of ``series_name`` has."""
    for s in vllm_series(remote=True):
        if series_name == s.name or series_name in s.samples():
            labels = {"model_name", "engine", *s.labels}
            if s.kind is Kind.HISTOGRAM and series_name.endswith("_bucket"):
                labels.add("le")
            return labels
    return set()


def parse(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(series named, labels matched or grouped by, label_values' label) of ``expr``;
    an AssertionError names a label a matcher uses that its series lacks."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)
    names: set[str] = set()
    labels: set[str] = set()
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", text):
        used = {k.strip() for k in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*[=!]~?", m.group(2))}
        assert used <= _labels_of(m.group(1)), (expr, m.group(1), used)
        labels |= used
    text = re.sub(r"\{[^}]*\}", "", text)
    for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", text):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    text = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", text)
    values: set[str] = set()
    for m in re.finditer(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)",
                         text):
        names.add(m.group(1))
        values.add(m.group(2))
    text = re.sub(r"label_values\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)
    for word in _IDENT.findall(text):
        if word not in PROMQL_WORDS and not word.isdigit():
            names.add(word)
    return names, labels, values


def test_every_query_names_only_series_kvshm_exports_to_vllm() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = series_names(vllm_series(remote=True))
    queries = list(_queries(dash))
    assert len(queries) >= 20
    named: set[str] = set()
    for expr in queries:
        names, labels, values = parse(expr)
        assert names, expr
        assert names <= exported, (expr, names - exported)
        assert any(n.startswith("kvshm_") for n in names), expr
        for label in labels | values:
            assert any(label in _labels_of(n) for n in names), (expr, label)
        named |= names
    families = {n.removesuffix("_total").removesuffix("_bucket") for n in named}
    for need in ("kvshm_hit_tokens", "kvshm_stored_blocks", "kvshm_loaded_blocks",
                 "kvshm_stored_bytes", "kvshm_loaded_bytes", "kvshm_cpu_tier_occupancy",
                 "kvshm_jobs_failed", "kvshm_loads_failed", "kvshm_ranks_failed",
                 "kvshm_ack_latency_seconds", "kvshm_remote_breaker_state"):
        assert need in families, need


def test_the_parser_catches_a_misspelt_series_and_a_foreign_label() -> None:
    """The check can fail: a name or a label kvshm does not export is caught."""
    names, _, _ = parse('rate(kvshm_hit_token_total[1m])')
    assert names == {"kvshm_hit_token_total"}
    assert names - series_names(vllm_series(remote=True)) == names
    try:
        parse('kvshm_pins_held{rank="0"}')
    except AssertionError:
        pass
    else:
        raise AssertionError("a label kvshm_pins_held lacks was not caught")
    assert SERIES["kvshm_pins_held"].kind is Kind.GAUGE
