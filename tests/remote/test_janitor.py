"""``kvshm janitor`` against real Valkey servers: hand-offs published by the engine's own
:class:`~kvshm.offload.pd.handoffs.Handoffs` (blocks, headers and readiness keys put with the
hold TTL by the real store and index), one expired, one live, plus garbage and a manifest
of another version; the janitor demotes exactly the expired one (its keys get the
ordinary TTL, its manifest goes), leaves the rest as they were, changes nothing on a dry
run, scans every primary of a cluster, and a bad URL or a dead server is exit 2 with one
line on stderr."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pytest
from remote_rig import Rows

from kvshm.cli import main
from kvshm.offload.pd.handoffs import Handoffs
from kvshm.offload.pd.manifest import Manifest, Verdict, manifest_key
from kvshm.remote.glide_client import header_key, key_slot
from kvshm.remote.janitor import Judgement, handoff_keys, judge, sweep
from kvshm.remote.resp import command, parse_reply
from kvshm.remote.server import ValkeyCluster, ValkeyServer, free_port
from kvshm.remote.tier import KEY_PREFIX, BlockHeader, RemoteSpec, block_key, ready_key
from kvshm.remote.valkey import ValkeyBlockStore
from kvshm.remote.valkey_index import ValkeyReadyIndex

FP = "tiny-llama.bf16.bs16.nhd"
WORLD = 2
BLOCKS = 3
ROW = 4096
TTL = 600  # the ordinary TTL (the engines' URL says ttl_s=600)
# the hold TTL of a hand-off's blocks: shorter than TTL here, so that a demotion, which
# never shortens a TTL (EXPIRE ... GT: another live hand-off may name the same blocks),
# shows as the ordinary TTL on the expired hand-off's keys
HOLD = 180
MANIFEST_TTL = 600  # Handoffs' default: the manifest key lives 2x that
CALM = {"request_timeout_ms": 5000, "connect_timeout_ms": 5000}
# the same as URL knobs, for the janitor's command line: its default 500 ms connect
# timeout is a production value, and a loaded CI machine missed it to a local server
CALM_Q = "&".join(f"{k}={v}" for k, v in CALM.items())


def call(host: str, port: int, *args: str | bytes) -> Any:
    return parse_reply(command(host, port, *args))


class Node:
    """Raw commands to one server, or to the cluster node that owns a key's slot."""

    def __init__(self, servers: Sequence[ValkeyServer]) -> None:
        self.servers = list(servers)

    def of(self, key: str) -> ValkeyServer:
        if len(self.servers) == 1:
            return self.servers[0]
        slot = key_slot(key)
        s = self.servers[0]
        for lo, hi, primary, *_ in call(s.host, s.port, "CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return next(n for n in self.servers if n.port == primary[1])
        raise AssertionError(f"no primary serves slot {slot}")

    def __call__(self, key: str, *args: str | bytes) -> Any:
        s = self.of(key)
        return call(s.host, s.port, *args)

    def ttl(self, key: str) -> int:
        return int(self(key, "TTL", key))

    def get(self, key: str) -> bytes | None:
        value = self(key, "GET", key)
        return value if isinstance(value, bytes) else None


def hashes(first: int) -> list[bytes]:
    return [(first + i).to_bytes(16, "big") for i in range(BLOCKS)]


def every_key(hs: Sequence[bytes]) -> list[str]:
    """Each block's shards, their header keys, and the readiness keys."""
    keys = handoff_keys(FP, WORLD, [h.hex() for h in hs])
    blocks = [k for k in keys if ":ready/" not in k]
    return keys + [header_key(k) for k in blocks]


def shifted(seconds: float) -> Callable[[], float]:
    """The wall clock, ``seconds`` ahead (negative: behind)."""
    return lambda: time.time() + seconds


def publish(url: str, handoffs: dict[str, tuple[list[bytes], float]]) -> dict[str, str]:
    """Put each hand-off's blocks (every rank, hold TTL) and readiness keys (hold TTL),
    then write its manifest through ``Handoffs`` with the wall clock shifted by the given
    seconds (far in the past: already expired). Returns request -> manifest name."""
    spec = RemoteSpec.parse(url, ttl_s=TTL, hold_ttl_s=HOLD, **CALM)
    store, index = ValkeyBlockStore(spec), ValkeyReadyIndex(spec)
    names = {}
    try:
        for rid, (hs, shift) in handoffs.items():
            for rank in range(WORLD):
                hdrs = [BlockHeader(fingerprint=FP, block_hash=h, rank=rank, world=WORLD,
                                    length=ROW) for h in hs]
                keys = [block_key(KEY_PREFIX, FP, rank, WORLD, h) for h in hs]
                assert store.put_many(keys, Rows(BLOCKS, rank, row=ROW).views, hdrs,
                                      keep=True) == [True] * BLOCKS
            index.publish([ready_key(FP, WORLD, h) for h in hs], keep=True)
            pd = Handoffs(index, FP, WORLD, 16, lambda k: k,
                          lambda h: ready_key(FP, WORLD, h),
                          wall=shifted(shift))
            params = pd.publications.publish(rid, hs, 16 * BLOCKS, lambda k: True)
            assert params is not None
            names[rid] = str(params["kvshm_manifest"])
    finally:
        index.close()  # sends what is queued, then stops
        store.close()
    return names


def seed(url: str, node: Node) -> tuple[dict[str, str], str, str]:
    """An expired hand-off ("old"), a live one ("new"), garbage and a version-2 manifest.
    Returns the manifests' names and the two unreadable keys."""
    names = publish(url, {"old": (hashes(0), -2 * MANIFEST_TTL),
                          "new": (hashes(100), 0.0)})
    garbage = manifest_key(FP, WORLD, "garbage")
    node(garbage, "SET", garbage, b"{not json", "EX", "1200")
    v2 = manifest_key(FP, WORLD, "v2")
    doc = msgspec.json.decode(msgspec.json.encode(Manifest(
        1, FP, WORLD, 16, 48, [h.hex() for h in hashes(200)], time.time() - 10_000)))
    node(v2, "SET", v2, msgspec.json.encode({**doc, "version": 2}), "EX", "1200")
    for rid in ("old", "new"):  # as published: everything held
        assert node.get(names[rid]) is not None
        assert MANIFEST_TTL < node.ttl(names[rid]) <= 2 * MANIFEST_TTL
        for k in every_key(hashes(0 if rid == "old" else 100)):
            assert HOLD - 60 < node.ttl(k) <= HOLD, k
    return names, garbage, v2


def run_json(*argv: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["janitor", *argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    result: dict[str, Any] = json.loads(out[0])
    return result


def assert_demoted_old_only(node: Node, names: dict[str, str]) -> None:
    assert node.get(names["old"]) is None  # the expired manifest is gone
    for k in every_key(hashes(0)):  # ... and its keys have the ordinary TTL
        assert HOLD < node.ttl(k) <= TTL, k
    assert node.get(names["new"]) is not None  # the live one: untouched
    assert MANIFEST_TTL < node.ttl(names["new"]) <= 2 * MANIFEST_TTL
    for k in every_key(hashes(100)):
        assert HOLD - 60 < node.ttl(k) <= HOLD, k


def test_demotes_the_expired_manifest_only(valkey: ValkeyServer,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    node = Node([valkey])
    names, garbage, v2 = seed(valkey.url, node)
    report = run_json("--url", f"{valkey.url}?ttl_s={TTL}&{CALM_Q}", capsys=capsys)
    blocks = BLOCKS * WORLD
    assert report == {"url": f"{valkey.url}?ttl_s={TTL}&{CALM_Q}", "dry_run": False, "scanned": 4,
                      "live": 1, "expired": 1, "demoted": 1, "unreadable": 2,
                      "unreadable_deleted": 0, "vanished": 0, "failed": 0,
                      # each shard and its header; the readiness keys (no header)
                      "keys_given_ttl": 2 * blocks + BLOCKS}
    assert_demoted_old_only(node, names)
    assert node.get(garbage) == b"{not json" and node.get(v2) is not None
    # a second run finds nothing left to do
    again = run_json("--url", f"{valkey.url}?ttl_s={TTL}&{CALM_Q}", capsys=capsys)
    assert (again["scanned"], again["expired"], again["live"], again["unreadable"]) == \
        (3, 0, 1, 2)


def test_dry_run_changes_nothing_and_text_output(valkey: ValkeyServer,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    node = Node([valkey])
    names, garbage, v2 = seed(valkey.url, node)
    before = {k: node.get(k) for k in (*names.values(), garbage, v2)}
    url = f"{valkey.url}?{CALM_Q}"
    report = run_json("--url", url, "--dry-run", "--delete-unreadable", capsys=capsys)
    assert (report["scanned"], report["expired"], report["demoted"], report["live"],
            report["unreadable"], report["unreadable_deleted"], report["keys_given_ttl"]) \
        == (4, 1, 0, 1, 2, 0, 0)
    assert {k: node.get(k) for k in before} == before
    for k in every_key(hashes(0)) + every_key(hashes(100)):
        assert HOLD - 60 < node.ttl(k) <= HOLD, k
    assert main(["janitor", "--url", url, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out == (f"kvshm janitor {url}: 4 hand-off manifests scanned: 1 expired "
                   "(would be demoted), 1 live, 2 unreadable (left alone), 0 gone "
                   "meanwhile [dry run: nothing changed]\n")


def test_delete_unreadable_and_fingerprint_filter(valkey: ValkeyServer,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    node = Node([valkey])
    names, garbage, v2 = seed(valkey.url, node)
    other = manifest_key("another-model", WORLD, "x")
    node(other, "SET", other, b"junk", "EX", "1200")
    not_a_string = manifest_key(FP, WORLD, "hash")
    node(not_a_string, "HSET", not_a_string, "f", "v")
    report = run_json("--url", f"{valkey.url}?ttl_s={TTL}&{CALM_Q}", "--fingerprint", FP,
                      "--delete-unreadable", capsys=capsys)
    assert (report["scanned"], report["demoted"], report["unreadable"],
            report["unreadable_deleted"]) == (5, 1, 3, 2)
    assert node.get(garbage) is None and node.get(v2) is None
    assert node(not_a_string, "EXISTS", not_a_string) == 1  # never deleted
    assert node.get(other) == b"junk"  # another fingerprint's: not scanned
    assert_demoted_old_only(node, names)


def test_a_name_that_is_not_utf8_and_a_key_bomb_are_unreadable(
        valkey: ValkeyServer, capsys: pytest.CaptureFixture[str]) -> None:
    """The hazards: anyone who can write to the server could break every janitor run
    for good -- a key ``kvshm:v1:pd:\\xff\\xfe`` made each run die with a
    UnicodeDecodeError traceback (exit 1), ``--delete-unreadable`` included -- or make
    it exhaust its memory: an expired manifest of 200 bytes claiming world 65535 made
    it build (and expire) 65535 keys per hash. Now the first is unreadable (and deleted
    with ``--delete-unreadable``), the second unreadable with nothing built or sent."""
    node = Node([valkey])
    bad_name = b"kvshm:v1:pd:\xff\xfe"
    node(bad_name.decode("latin-1"), "SET", bad_name, b"garbage")
    bomb = manifest_key(FP, 65535, "bomb")
    doc = Manifest(1, FP, 65535, 16, 48, [bytes([i]).hex() * 32 for i in range(20)], 1.0)
    node(bomb, "SET", bomb, msgspec.json.encode(doc))
    report = run_json("--url", f"{valkey.url}?ttl_s={TTL}&{CALM_Q}", capsys=capsys)
    assert (report["scanned"], report["unreadable"], report["expired"],
            report["keys_given_ttl"]) == (2, 2, 0, 0)
    report = run_json("--url", f"{valkey.url}?ttl_s={TTL}&{CALM_Q}", "--delete-unreadable",
                      capsys=capsys)
    assert (report["unreadable"], report["unreadable_deleted"]) == (2, 2)
    assert node(bomb, "EXISTS", bomb) == 0
    assert node(bad_name.decode("latin-1"), "EXISTS", bad_name) == 0


def test_a_manifest_rewritten_meanwhile_is_not_deleted(valkey: ValkeyServer) -> None:
    """Compare-and-delete: the name re-published between the janitor's read and its DEL
    (simulated by the decoder) keeps the new manifest."""
    node = Node([valkey])
    names = publish(valkey.url, {"old": (hashes(0), -2 * MANIFEST_TTL)})
    fresh = b'{"fresh": 1}'

    def decode(raw: bytes) -> Manifest:
        node(names["old"], "SET", names["old"], fresh)
        return msgspec.json.decode(raw, type=Manifest)

    report = sweep(RemoteSpec.parse(valkey.url, ttl_s=TTL), decode)
    assert (report.expired, report.demoted, report.vanished, report.failed) == (1, 0, 1, 0)
    assert node.get(names["old"]) == fresh


def test_a_janitor_with_a_shorter_ttl_never_shortens_a_live_hand_offs_blocks(
        valkey: ValkeyServer, capsys: pytest.CaptureFixture[str]) -> None:
    """Hazard "a demotion shortened a live hand-off's blocks" (a hostile probe): an
    expired hand-off and a live one name the same blocks (two requests of one prompt);
    a janitor run with another deployment's URL, ``ttl_s=5``, demoted the expired one
    and put every shared key on a 5 s TTL: 6 s later they were gone, and the live
    hand-off's decoder recomputed. The demotion only lengthens TTLs now: the shared keys
    keep their hold, and the expired manifest still goes."""
    node = Node([valkey])
    names = publish(valkey.url, {"old": (hashes(0), -2 * MANIFEST_TTL),
                                 "new": (hashes(0), 0.0)})
    report = run_json("--url", f"{valkey.url}?ttl_s=5&{CALM_Q}", capsys=capsys)
    assert (report["demoted"], report["keys_given_ttl"], report["live"]) == (1, 0, 1)
    assert node.get(names["old"]) is None and node.get(names["new"]) is not None
    for k in every_key(hashes(0)):
        assert HOLD - 60 < node.ttl(k) <= HOLD, k


def test_a_dead_server_or_a_bad_url_is_exit_2_with_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    for url, start in ((f"valkey://127.0.0.1:{port}", "cannot reach valkey://"),
                       ("http://127.0.0.1:1", "remote URL 'http://127.0.0.1:1'"),
                       (f"valkey+cluster://127.0.0.1:{port}", "cannot reach valkey+")):
        assert main(["janitor", "--url", url]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"kvshm janitor: {start}"), err
        assert err.count("\n") == 1, err
    assert main(["janitor", "--url", f"valkey://127.0.0.1:{port}",
                 "--fingerprint", "a:b*"]) == 2
    assert "fingerprint" in capsys.readouterr().err


def test_subprocess_console_entry(valkey: ValkeyServer) -> None:
    """The installed command's entry point, in its own process: a run, then a dead
    server (exit 2, one line, no traceback)."""
    node = Node([valkey])
    names, _, _ = seed(valkey.url, node)
    cmd = [sys.executable, "-m", "kvshm.cli", "janitor", "--url"]
    done = subprocess.run([*cmd, f"{valkey.url}?ttl_s={TTL}&{CALM_Q}"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"kvshm janitor {valkey.url}?ttl_s={TTL}&{CALM_Q}: 4 hand-off "
                                  "manifests scanned: 1 expired (1 demoted, 15 keys")
    assert_demoted_old_only(node, names)
    dead = subprocess.run([*cmd, f"valkey://127.0.0.1:{free_port()}"], capture_output=True,
                          text=True, timeout=60)
    assert dead.returncode == 2 and dead.stdout == ""
    assert dead.stderr.count("\n") == 1 and "Traceback" not in dead.stderr, dead.stderr


def test_a_cluster_is_scanned_on_every_primary(valkey_cluster: ValkeyCluster,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    node = Node(valkey_cluster.nodes)
    handoffs = {f"old-{i}": (hashes(1000 * i), -2.0 * MANIFEST_TTL) for i in range(8)}
    handoffs |= {f"new-{i}": (hashes(1000 * i + 500), 0.0) for i in range(8)}
    names = publish(valkey_cluster.url, handoffs)
    owners = {node.of(n).port for n in names.values()}
    assert len(owners) == 3, owners  # the manifests live on every primary
    report = run_json("--url", f"{valkey_cluster.url}?ttl_s={TTL}&{CALM_Q}", capsys=capsys)
    assert (report["scanned"], report["expired"], report["demoted"], report["live"]) == \
        (16, 8, 8, 8)
    for i in range(8):
        assert node.get(names[f"old-{i}"]) is None
        assert node.get(names[f"new-{i}"]) is not None
        assert all(HOLD < node.ttl(k) <= TTL for k in every_key(hashes(1000 * i)))
        assert all(node.ttl(k) > HOLD - 60 for k in every_key(hashes(1000 * i + 500)))
    # one node's address as a standalone URL: refused, not a partial scan
    first = valkey_cluster.nodes[0]
    assert main(["janitor", "--url", f"valkey://{first.host}:{first.port}"]) == 2
    assert "is a cluster node" in capsys.readouterr().err


def test_a_stopped_primary_is_named_and_the_other_primaries_are_swept(
        valkey_cluster: ValkeyCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """Attack (a hostile probe): one primary and its replica stop (SIGSTOP by pid: their
    ports accept connections, nothing answers, nobody serves their slots; with
    ``cluster-require-full-coverage no`` the cluster says ok) -- when an operator's cron
    runs the janitor. glide's cluster scan waited for them without end: the janitor
    never returned (killed after 90 s). Now every primary is scanned with raw ``SCAN``
    pages, each bounded by the request timeout: exit 2 within seconds, one line naming
    the stopped primary, the expired manifests of the live primaries scanned (their
    blocks span every shard, so their demotion fails and they are kept: TTL first,
    delete last), and once the shard is back a second run demotes all 8 (exit 0)."""
    node = Node(valkey_cluster.nodes)
    handoffs = {f"old-{i}": (hashes(1000 * i), -2.0 * MANIFEST_TTL) for i in range(8)}
    names = publish(valkey_cluster.url, handoffs)
    victim = node.of(names["old-0"])
    stopped = [victim, valkey_cluster.replica_of(victim)]
    live = [n for n in names.values() if node.of(n) is not victim]
    assert live and len(live) < len(names)
    url = f"{valkey_cluster.url}?ttl_s={TTL}&connect_timeout_ms=1000&request_timeout_ms=1000"
    for n in stopped:
        os.kill(n.pid or 0, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        rc = main(["janitor", "--url", url])
        took = time.monotonic() - t0
        out, err = capsys.readouterr()
        assert rc == 2 and took < 30, (rc, took, err)
        assert out == "" and err.count("\n") == 1, err
        assert f"{victim.host}:{victim.port} (TimeoutError" in err, err
        assert f"did not answer SCAN: {victim.host}:{victim.port} " in err, err
        assert f"{len(live)} hand-off manifests scanned: {len(live)} expired" in err, err
        assert all(node.get(n) is not None for n in live)  # kept: their keys span all
    finally:
        for n in stopped:
            os.kill(n.pid or 0, signal.SIGCONT)
    valkey_cluster.wait_ok()
    report = run_json("--url", f"{valkey_cluster.url}?ttl_s={TTL}&{CALM_Q}", capsys=capsys)
    assert (report["scanned"], report["demoted"], report["failed"]) == (8, 8, 0), report


# ---------------------------------------------------------------------------- no server


class _Recorder:
    """A ReadyIndex that answers one GET with a given value and records the rest."""

    def __init__(self, value: bytes) -> None:
        self.value = value
        self.pending: list[tuple[int, bytes | None]] = []
        self.expired: list[str] = []
        self.deleted: list[str] = []

    def publish(self, keys: Sequence[str], *, keep: bool = False) -> None: ...

    def query(self, token: int, keys: Sequence[str]) -> None: ...

    def answers(self) -> list[tuple[int, int]]:
        return []

    def healthy(self) -> bool:
        return True

    def put_value(self, key: str, value: bytes, ttl_s: int, *,
                  after: Sequence[str] = ()) -> None: ...

    def get_value(self, token: int, key: str) -> None:
        self.pending.append((token, self.value))

    def delete_if_same(self, key: str, value: bytes) -> None:
        self.deleted.append(key)

    def expire(self, keys: Sequence[str]) -> None:
        self.expired += keys

    def values(self) -> list[tuple[int, bytes | None]]:
        out, self.pending = self.pending, []
        return out

    def refused(self) -> list[str]:
        return []

    def restarts(self) -> int:
        return 0

    def statistics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None: ...


def test_the_janitor_demotes_the_keys_an_engine_demotes() -> None:
    """An engine that finds the same manifest expired gives the same keys the ordinary
    TTL, in the same order, and deletes the same name."""
    hs = hashes(7)
    name = manifest_key(FP, WORLD, "r")
    m = Manifest(1, FP, WORLD, 16, 48, [h.hex() for h in hs], time.time() - 1)
    raw = msgspec.json.encode(m)
    index = _Recorder(raw)
    key: Callable[[bytes], str] = lambda h: ready_key(FP, WORLD, h)  # noqa: E731
    pd = Handoffs(index, FP, WORLD, 16, lambda k: k, key)
    assert pd.consumers.consume("r", {"do_remote_prefill": True, "kvshm_manifest": name},
                                lambda: list(hs)) is Verdict.WAIT
    pd.consumers.poll()
    assert pd.counters.manifest_expired == 1
    verdict, keys = judge(name, raw, lambda b: msgspec.json.decode(b, type=Manifest),
                          time.time())
    assert verdict is Judgement.EXPIRED and keys == index.expired and index.deleted == [name]


@pytest.mark.parametrize("name,doc,verdict", [
    ("r", {}, "live"),
    ("r", {"expires_at": 1.0}, "expired"),
    ("r", {"version": 2}, "unreadable"),
    ("r", {"world": 0}, "unreadable"),
    ("r", {"fingerprint": "bad fingerprint"}, "unreadable"),
    ("r", {"hashes": ["zz", "00ff"]}, "live"),  # a non-hex hash is skipped, as the engine
    (None, {}, "unreadable"),  # its name is another deployment's
])
def test_judge(name: str | None, doc: dict[str, Any], verdict: str) -> None:
    base = msgspec.to_builtins(Manifest(1, FP, WORLD, 16, 48, ["00ff"], time.time() + 600))
    fields = {**base, **doc}
    key = manifest_key(FP, WORLD, name) if name else manifest_key("other", WORLD, "r")
    raw = msgspec.json.encode(fields)
    got, keys = judge(key, raw, lambda b: msgspec.json.decode(b, type=Manifest), time.time())
    assert got is Judgement(verdict) and (keys != []) == (got is Judgement.EXPIRED)
    assert judge(key, b"\xff", lambda b: msgspec.json.decode(b, type=Manifest),
                 0.0) == (Judgement.UNREADABLE, [])
