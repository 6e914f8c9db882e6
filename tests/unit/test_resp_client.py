"""The raw RESP client (:mod:`kvshm.remote.resp`) and the cluster slot map
(:class:`~kvshm.remote.glide_client.Shards`) against peers that misbehave: real loopback
sockets served by threads of this process, each scripted to be a broken "server".

Found by a hostile probe of ``kvshm janitor --url`` pointed at things that are not
Valkey, and of a cluster whose primary was stopped (SIGSTOP: its port still accepts
connections, nothing ever answers):

* a peer that trickles a reply a byte at a time held ``command`` for ever (its timeout
  bounded each ``recv``, not the exchange);
* a peer that sends bytes without a line end grew the reply without bound (3 GB in 10 s);
* a reply nested 5,000 levels deep raised RecursionError (a traceback, exit 1);
* ``Shards.refresh`` counted its interval from its start, so a refresh past dead nodes
  that took longer than the interval was due again at once, and it asked the nodes in
  sorted order, dead ones first every time: every part of a block-store call for a
  stopped shard paid it again (10 s calls at 0.3 s timeouts).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvshm.errors import ConfigError
from kvshm.remote.breaker import BreakerState, CircuitBreaker
from kvshm.remote.glide_client import Shards, key_slot, read_slot_map
from kvshm.remote.resp import MAX_DEPTH, command, parse_reply
from kvshm.remote.tier import MAX_TTL_S, RemoteSpec

Script = Callable[[socket.socket], None]


@contextmanager
def peer(script: Script, above: int = 0) -> Iterator[int]:
    """A loopback listener whose every connection runs ``script``; yields its port (one
    above ``above`` where given)."""
    lst = socket.socket()
    for port in ([0] if not above else range(above + 1, min(above + 2000, 65536))):
        try:
            lst.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    lst.listen(16)
    stop = threading.Event()

    def serve() -> None:
        lst.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = lst.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=_run, args=(script, conn, stop), daemon=True).start()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield lst.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        lst.close()


def _run(script: Script, conn: socket.socket, stop: threading.Event) -> None:
    with conn:
        try:
            conn.recv(65536)
            script(conn)
            while not stop.is_set():  # hold the connection open, answer nothing more
                time.sleep(0.02)
        except OSError:
            pass


def drip(conn: socket.socket) -> None:
    conn.sendall(b"$100000\r\n")
    for _ in range(100):
        conn.sendall(b"x")
        time.sleep(0.05)


def flood(conn: socket.socket) -> None:
    blob = b"A" * 65536
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        conn.sendall(blob)


def deep(conn: socket.socket) -> None:
    conn.sendall(b"*1\r\n" * 5000 + b":1\r\n")


def silent(conn: socket.socket) -> None:
    pass


def test_a_trickling_peer_is_bounded_by_the_whole_exchanges_timeout() -> None:
    """A byte every 50 ms: each ``recv`` returns in time, but ``command`` gives up at its
    0.3 s deadline (TimeoutError, an OSError) -- not after 5 s of trickle."""
    with peer(drip) as port:
        t0 = time.monotonic()
        with pytest.raises(OSError):
            command("127.0.0.1", port, "PING", timeout=0.3)
        assert time.monotonic() - t0 < 1.0


def test_a_flooding_peer_is_refused_past_the_reply_cap(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Bytes without a line end: refused (ValueError) once the reply passes the cap (1
    MiB here), not buffered for ever."""
    import kvshm.remote.resp as resp

    monkeypatch.setattr(resp, "MAX_REPLY_BYTES", 1 << 20)
    with peer(flood) as port, pytest.raises(ValueError, match="longer than"):
        command("127.0.0.1", port, "PING", timeout=5.0)


def test_a_reply_nested_too_deep_is_a_value_error_not_a_recursion_error() -> None:
    with peer(deep) as port, pytest.raises(ValueError, match="nested deeper"):
        command("127.0.0.1", port, "PING", timeout=2.0)
    ok = b"*1\r\n" * MAX_DEPTH + b":1\r\n"
    inner = parse_reply(ok)
    for _ in range(MAX_DEPTH):
        inner = inner[0]
    assert inner == 1
    with pytest.raises(ValueError, match="nested deeper"):
        parse_reply(b"*1\r\n" + ok)
    with pytest.raises(ValueError):
        parse_reply(b"$5\r\nab")  # truncated


def _slots_reply(host: str, port: int) -> bytes:
    """A CLUSTER SLOTS reply: one primary (``host:port``) serving every slot."""
    node = b"*2\r\n$%d\r\n%s\r\n:%d\r\n" % (len(host), host.encode(), port)
    return b"*1\r\n*3\r\n:0\r\n:16383\r\n" + node


def test_the_slot_map_is_read_past_dead_nodes_once_then_from_the_one_that_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two seed nodes that accept and never answer (a stopped primary and replica) sort
    before the one that answers. The first refresh waits out both (2 x 0.3 s, longer
    than the 0.5 s interval); the map names the live node. Unforced refreshes right
    after it (every part of a call for the stopped shard asks for one) run none: the
    interval counts from the refresh's *end* (from its start, each one was due at once).
    A refresh forced then asks the node that answered first: no wait (in sorted order,
    the dead ones first again: 0.6 s each time)."""
    import kvshm.remote.glide_client as gc

    monkeypatch.setattr(gc, "_REFRESH_EVERY_S", 0.5)
    with peer(silent) as d1, peer(silent) as d2:
        def answer(conn: socket.socket) -> None:
            conn.sendall(_slots_reply("127.0.0.1", live))
        with peer(answer, above=max(d1, d2)) as live:
            nodes = sorted([("127.0.0.1", d1), ("127.0.0.1", d2)]) + [("127.0.0.1", live)]
            url = "valkey+cluster://" + ",".join(f"{h}:{p}" for h, p in nodes)
            spec = RemoteSpec.parse(url, connect_timeout_ms=300)
            shards = Shards(spec, CircuitBreaker)
            t0 = time.monotonic()
            shards.refresh(force=True)
            first = time.monotonic() - t0
            assert 0.55 < first < 2.0, first
            assert shards.shard_of("k") == f"127.0.0.1:{live}"
            assert key_slot("k") >= 0 and shards.refreshes == 1
            t0 = time.monotonic()
            for _ in range(20):  # every part of a call for a stopped shard
                shards.refresh()
            assert time.monotonic() - t0 < 0.25 and shards.refreshes == 1
            t0 = time.monotonic()
            shards.refresh(force=True)
            assert time.monotonic() - t0 < 0.25 and shards.refreshes == 2


def test_a_ttl_the_server_cannot_take_is_refused_at_parse() -> None:
    """``ttl_s`` (or ``hold_ttl_s``) past ~68 years: ConfigError naming the knob. It
    used to parse, and the server refused every put (``invalid expire time``): the tier
    stored nothing, only a counter said so."""
    RemoteSpec.parse(f"valkey://h:1?ttl_s={MAX_TTL_S}")
    for knob in ("ttl_s", "hold_ttl_s"):
        with pytest.raises(ConfigError, match=knob):
            RemoteSpec.parse(f"valkey://h:1?{knob}=100000000000000000")


def _answering(reply: bytes) -> Script:
    def script(conn: socket.socket) -> None:
        conn.sendall(reply)
    return script


def _node(host: bytes | None, port: int) -> bytes:
    h = b"$-1\r\n" if host is None else b"$%d\r\n%s\r\n" % (len(host), host)
    return b"*2\r\n" + h + b":%d\r\n" % port


def test_a_slot_map_names_each_node_once_and_a_null_host_is_the_one_asked() -> None:
    """A primary serving three ranges (any reshard leaves split ranges), its replica
    listed with each: the map names each node once (a review: one entry per range
    before, and a refresh past them silent cost a connect timeout per copy). A NULL
    host (``cluster-preferred-endpoint-type unknown-endpoint``) is the address asked:
    it raised AttributeError out of the janitor, the slot map and the store."""
    ranges = [(0, 99), (100, 199), (200, 16383)]
    reply = b"*3\r\n" + b"".join(
        b"*4\r\n:%d\r\n:%d\r\n" % r + _node(None, 7000) + _node(b"10.0.0.2", 7001)
        for r in ranges)
    with peer(_answering(reply)) as port:
        got = read_slot_map(("127.0.0.1", port), 2.0)
    assert got is not None
    slots, nodes = got
    assert nodes == [("127.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert set(slots) == {"127.0.0.1:7000"}


@pytest.mark.parametrize("entry", [
    b"*3\r\n:0\r\n:16383\r\n*2\r\n:5\r\n:7000\r\n",                  # an int host
    b"*3\r\n:0\r\n:50000000\r\n" + _node(b"h", 7000),                   # past the slots
    b"*3\r\n:9\r\n:3\r\n" + _node(b"h", 7000),                          # backwards
    b"*3\r\n:0\r\n:16383\r\n*2\r\n$1\r\nh\r\n$4\r\n7000\r\n",           # a bulk port
])
def test_a_slot_map_that_is_not_one_is_no_answer(entry: bytes) -> None:
    """Junk in a ``CLUSTER SLOTS`` reply (a hostile or broken peer) is no answer (None),
    never an exception on the data path nor a 50-million-entry map (763 MiB: a review)."""
    with peer(_answering(b"*1\r\n" + entry)) as port:
        assert read_slot_map(("127.0.0.1", port), 2.0) is None


@pytest.mark.parametrize(("reply", "why"), [
    (b"+OK\r\n", "not a SCAN reply"),
    (b"*2\r\n$1\r\n5\r\n*0\r\n", "came again"),  # a cursor that never ends the scan
])
def test_the_janitors_scan_names_a_peer_that_does_not_scan(reply: bytes, why: str) -> None:
    """The janitor's raw SCAN against a peer that is not Valkey: a reply of another shape
    (TypeError and a traceback before) or a cursor that comes back (an endless loop
    before, 29,637 pages in 16 s) names the peer in ``down`` at once; nothing is
    yielded past it (a review)."""
    from kvshm.remote.janitor import _scan

    with peer(_answering(reply)) as port:
        spec = RemoteSpec.parse(f"valkey://127.0.0.1:{port}")
        down: list[str] = []
        t0 = time.monotonic()
        pages = list(_scan(spec, "kvshm:v1:pd:*", 2.0, down))
    assert time.monotonic() - t0 < 3.0
    assert len(pages) <= 1 and len(down) == 1 and why in down[0], down


def test_a_cluster_whose_primaries_keep_moving_keeps_only_the_nodes_its_map_names() -> None:
    """Hazard (a soak probe): every node a slot map ever named stayed in the list a
    refresh asks, and every primary ever used kept its breaker -- a cluster whose
    primaries come back at new addresses (a restarted pod: a new IP) grew both by one a
    failover, for good (1,003 nodes after 1,000 failovers; a refresh past the dead ones
    paid a connect timeout each). Here one seed node stays up and announces, at each of
    30 failovers, a new primary at a new address: the list keeps the seed and the
    current primary, the breakers the current primary's, and the opens counted on the
    primaries that left stay in the sum."""
    current = {"port": 0}

    def announce(conn: socket.socket) -> None:
        conn.sendall(_slots_reply("127.0.0.1", current["port"]))

    with peer(announce) as seed:
        spec = RemoteSpec.parse(f"valkey+cluster://127.0.0.1:{seed}", connect_timeout_ms=300)
        shards = Shards(spec, lambda: CircuitBreaker(1, 1.0))
        held = None
        for i in range(30):
            current["port"] = 40000 + i  # named only: never asked while the seed answers
            shards.refresh(force=True)
            primary = shards.shard_of("k")
            assert primary == f"127.0.0.1:{40000 + i}"
            held = shards.breaker(primary)
            held.failure()  # each primary's breaker opens once
        assert shards.refreshes == 30
        # before: 31 nodes and 30 breakers
        assert shards._known == [("127.0.0.1", seed), ("127.0.0.1", 40029)]
        assert list(shards.breakers.live()) == ["127.0.0.1:40029"]
        assert shards.breakers.totals() == (30, 0)
        # one more failover while a thread still holds the last primary's breaker (a
        # request in flight): what it records there still counts, under its name
        current["port"] = 40030
        shards.refresh(force=True)
        assert held is not None and held.state is BreakerState.OPEN
        time.sleep(1.05)  # its backoff: a probe is let through, and fails
        assert held.allow()
        held.failure()
        assert shards.breakers.totals() == (31, 0)
        assert shards.name_of(held) == "127.0.0.1:40029"
        assert list(shards.breakers.live()) == []  # the new primary's: made on first use


def test_a_partial_slot_map_and_a_primary_that_left_cost_no_client_and_no_round() -> None:
    """Two faults a review found beside the slot map's bounds (the index's per-primary
    clients): with a map that leaves slots unserved, the shard name of those slots
    (``UNSERVED``, "cluster") is in the map, and the index made a client for it --
    ``int("cluster")``: ValueError out of every round that touched such a key, so every
    query answered 0; and a primary that left the map without its breaker opening kept
    its client, and its connections, for good (20 clients after 20 moves). Real glide
    clients (lazy: never connected) and a real scripted seed node."""
    pytest.importorskip("glide_sync")
    from kvshm.remote.glide_client import UNSERVED, Counters, glide_module
    from kvshm.remote.shard_batches import ShardBatches

    primary = {"port": 41000}

    def announce(conn: socket.socket) -> None:  # slots 0-8191 only: a partial map
        node = b"*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % primary["port"]
        conn.sendall(b"*1\r\n*3\r\n:0\r\n:8191\r\n" + node)

    with peer(announce) as seed:
        spec = RemoteSpec.parse(f"valkey+cluster://127.0.0.1:{seed}", connect_timeout_ms=300)
        shards = Shards(spec, CircuitBreaker)
        batches = ShardBatches(spec, glide_module(), shards, Counters("clients_created"))
        try:
            shards.refresh(force=True)
            assert shards.current() == frozenset({"127.0.0.1:41000", UNSERVED})
            cluster_client = object()  # what the index passes: returned as it is
            assert batches._client_of(UNSERVED, cluster_client) is cluster_client
            first = batches._client_of("127.0.0.1:41000", cluster_client)
            assert first is not cluster_client and list(batches._clients) == ["127.0.0.1:41000"]
            primary["port"] = 41001  # it moved; its breaker never opened
            shards.refresh(force=True)
            assert batches.run(cluster_client, []) == []  # each round prunes first
            assert batches._clients == {}
        finally:
            batches.close()
