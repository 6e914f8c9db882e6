"""``kvshm ls``: the kvshm engines running on this machine, one line each; and the remote
tier's section of ``kvshm stats`` (:func:`format_remote`, :func:`remote_prometheus`).

An engine listens on the abstract socket ``\\0kvshm.<name>``; the kernel lists every
unix socket in ``/proc/net/unix``, abstract names with a leading ``@``. A listener is a
line whose flags carry ``__SO_ACCEPTCON`` (0x10000); its rank connections carry the same
name without the flag and are skipped. Each listener found is asked for its statistics
(the ``StatsRequest`` ``kvshm stats`` sends); one that does not answer -- another uid's,
one that is stuck, one that closed meanwhile -- is still listed, with why in place of
its state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

__all__ = ["EngineRow", "engine_names", "format_remote", "format_table", "list_engines",
           "remote_prometheus"]

_PREFIX_B: Final = b"@kvshm."
_ACCEPTCON: Final = 0x10000
_HEADER: Final = ("NAME", "PID", "STATE", "WORLD", "CPU TIER", "CACHED", "UPTIME",
                   "DISK TIER")


@dataclass(frozen=True)
class EngineRow:
    """One engine of ``kvshm ls``; ``error`` set when it did not answer."""

    name: str
    pid: int = 0
    state: str = "?"
    world_size: int = 0
    num_cpu_blocks: int = 0
    cpu_tier_bytes: int = 0
    cpu_blocks_cached: int = 0
    uptime_s: float = 0.0
    error: str = ""
    disk: str = "-"


def engine_names(proc_net_unix: str = "/proc/net/unix") -> list[str]:
    """Names of the kvshm listeners in ``proc_net_unix``, sorted, each once. The file
    lists every user's sockets with their names' raw bytes -- any byte, a newline (a
    forged line) or a terminal escape included: a line whose name is not UTF-8, whose
    flags are not hex, or whose name no engine can have (:func:`kvshm.config.check_name`)
    is skipped, never a traceback, never printed. (A forged line can at most list a
    name nothing answers for: ``ls`` shows it unanswered, ``sweep`` keeps its slabs.)"""
    from kvshm.config import check_name
    from kvshm.errors import ConfigError

    names: set[str] = set()
    with open(proc_net_unix, "rb") as f:
        next(f, None)  # the header
        for line in f:
            parts = line.rstrip(b"\n").split(None, 7)
            if len(parts) < 8 or not parts[7].startswith(_PREFIX_B):
                continue
            try:
                flags = int(parts[3], 16)
                name = parts[7][len(_PREFIX_B):].decode()
                check_name(name)
            except (ValueError, ConfigError):  # (a UnicodeDecodeError is a ValueError)
                continue
            if flags & _ACCEPTCON:
                names.add(name)
    return sorted(names)


def _row(name: str, data: dict[str, Any]) -> EngineRow:
    from kvshm.ipc.protocol import is_stats_failure

    if is_stats_failure(data):
        return EngineRow(name, error=str(data["error"]))
    return EngineRow(name, pid=int(data.get("pid", 0)), state=str(data.get("state", "?")),
                     world_size=int(data.get("world_size", 0)),
                     num_cpu_blocks=int(data.get("num_cpu_blocks", 0)),
                     cpu_tier_bytes=int(data.get("cpu_tier_bytes", 0)),
                     cpu_blocks_cached=int(data.get("cpu_blocks_cached", 0)),
                     uptime_s=float(data.get("uptime_s", 0.0)),
                     disk=_disk_cell(data.get("disk") or {}))


def _disk_cell(disk: dict[str, Any]) -> str:
    """``kvshm ls``'s disk tier: its directory and slots used / total ("-": none)."""
    if not disk:
        return "-"
    slots = f"{disk.get('slots_used', '?')}/{disk['slots']} slots" if "slots" in disk \
        else "starting"
    return f"{slots} in {disk.get('path', '?')}"


def list_engines(timeout: float = 1.0) -> list[EngineRow]:
    """Every engine :func:`engine_names` finds, with its statistics (``timeout`` each)."""
    from kvshm.errors import KvshmError
    from kvshm.ipc.rendezvous_client import query_stats

    rows = []
    for name in engine_names():
        try:
            data = query_stats(name, timeout=timeout)
        except (KvshmError, TimeoutError, OSError) as exc:
            rows.append(EngineRow(name, error=f"{type(exc).__name__}: {exc}"))
            continue
        try:  # a listener of this uid may answer anything: its row says so, alone
            rows.append(_row(name, data))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            rows.append(EngineRow(name, error=f"a malformed answer ({type(exc).__name__}: "
                                              f"{exc})"))
    return rows


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_table(rows: list[EngineRow]) -> str:
    """The table ``kvshm ls`` prints (a header, then one line per engine)."""
    lines = [_HEADER]
    for r in rows:
        if r.error:
            lines.append((r.name, "-", f"no answer: {r.error}", "-", "-", "-", "-", "-"))
            continue
        tier = f"{r.num_cpu_blocks} blocks / {_gib(r.cpu_tier_bytes)}"
        lines.append((r.name, str(r.pid), r.state, str(r.world_size), tier,
                      str(r.cpu_blocks_cached), f"{r.uptime_s:.0f}s", r.disk))
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line, widths)), line[-1]])
                     .rstrip() for line in lines)


# ---------------------------------------------------------------------------- remote tier


def _mib(n: object) -> str:
    return f"{int(n) / 2**20:.1f} MiB" if isinstance(n, int) else "?"


def format_remote(remote: dict[str, Any]) -> str:
    """``kvshm stats --remote``: the ``remote`` section of an engine's statistics
    (``EngineStats.remote``) as a few lines; "no remote tier" when it is empty."""
    if not remote:
        return "no remote tier"

    def g(key: str) -> object:
        return remote.get(key, "?")

    lines = [f"remote tier: {g('url')} ({g('mode')})"]
    if len(remote) <= 2:  # URL and mode only: the engine is not READY yet
        return "\n".join([*lines, "  (no counters yet: the engine is not ready)"])
    lines += [
        f"  lookups:  {g('queries')} queries, {g('query_hits')} hits, {g('query_misses')} "
        f"misses, {g('query_timeouts')} timed out, {g('skipped_unhealthy')} skipped "
        f"(breaker open)",
        f"  fetched:  {g('get_jobs')} GET jobs, {g('hit_blocks')} blocks "
        f"({_mib(remote.get('hit_bytes'))}); failed: {g('get_failed_jobs')} jobs, "
        f"{g('get_failed_blocks')} blocks; declined (CPU tier full): "
        f"{g('get_declined_cpu_full')}",
        f"  written:  {g('put_jobs')} PUT jobs, {g('published_blocks')} blocks published "
        f"({_mib(remote.get('put_bytes'))}); failed: {g('put_failed_blocks')} blocks; "
        f"duplicates skipped: {g('put_skipped_duplicate')}",
        f"  index:    breaker {g('index_breaker_state')} (opened {g('index_breaker_opens')}, "
        f"closed {g('index_breaker_closes')}); errors {g('index_errors')}, timeouts "
        f"{g('index_timeouts')}, rejected {g('index_rejected')}, publish failed "
        f"{g('index_publish_failed')}; server restarts seen {g('server_restarts')}",
    ]
    return "\n".join(lines)


def remote_prometheus(engine: str, remote: dict[str, Any]) -> bytes:
    """Prometheus text of the ``remote`` section (empty without a remote tier): every
    integer counter as ``kvshm_remote_<name>_total``, the breaker state as
    ``kvshm_remote_breaker_state{state=...}`` (1 for the current state, 0 for the
    others), the URL and mode as ``kvshm_remote_info{url=...,mode=...} 1``; names and
    HELP from :mod:`kvshm.series`. ImportError (naming the extra) without
    prometheus-client."""
    if not remote:
        return b""
    from kvshm.series import BREAKER_STATES, breaker_state, help_of, scalars
    from kvshm.stats import PROMETHEUS_MISSING

    try:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as exc:
        raise ImportError(PROMETHEUS_MISSING) from exc

    def families() -> list[Any]:
        out: list[Any] = []
        info = GaugeMetricFamily("kvshm_remote_info", help_of("kvshm_remote_info"),
                                 labels=["engine", "url", "mode"])
        info.add_metric([engine, str(remote.get("url", "")), str(remote.get("mode", ""))], 1)
        out.append(info)
        counters, _ = scalars({"remote": remote})
        for name, value in sorted(counters.items()):
            if name.startswith("kvshm_remote_"):
                c = CounterMetricFamily(name, help_of(name), labels=["engine"])
                c.add_metric([engine], float(value))
                out.append(c)
        state = breaker_state({"remote": remote})
        if state is not None:
            b = GaugeMetricFamily("kvshm_remote_breaker_state",
                                  help_of("kvshm_remote_breaker_state"),
                                  labels=["engine", "state"])
            for s in BREAKER_STATES:
                b.add_metric([engine, s], float(s == state))
            out.append(b)
        return out

    class _Remote:
        def collect(self) -> Any:
            return iter(families())

    reg = CollectorRegistry()
    reg.register(_Remote())
    text: bytes = generate_latest(reg)
    return text
