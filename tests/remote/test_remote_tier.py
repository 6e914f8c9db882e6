"""The remote tier's interface without a server: URLs and knobs, key names, the block
header (every field and the payload's checksum are checked), the circuit breaker (unit
cases and a Hypothesis state machine against a model)."""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvshm.errors import ConfigError
from kvshm.remote.breaker import BreakerState, CircuitBreaker
from kvshm.remote.glide_client import header_key, key_slot
from kvshm.remote.tier import (
    CHECKSUMS,
    GIL_FREE_BYTES,
    HEADER_BYTES,
    KEY_PREFIX,
    BlockHeader,
    RemoteSpec,
    block_key,
    header_checksum_id,
    ready_key,
)

# ---------------------------------------------------------------------------- URLs


def test_standalone_and_cluster_urls_parse_with_defaults_and_knobs() -> None:
    s = RemoteSpec.parse("valkey://127.0.0.1:6379")
    assert (s.nodes, s.cluster, s.request_timeout_ms, s.connect_timeout_ms, s.ttl_s,
            s.threads) == ((("127.0.0.1", 6379),), False, 500, 500, 3600, 4)
    c = RemoteSpec.parse("valkey+cluster://h1:7001,h2:7002,[::1]:7003?ttl_s=60&threads=2",
                         request_timeout_ms=250)
    assert c.cluster and c.nodes == (("h1", 7001), ("h2", 7002), ("::1", 7003))
    assert (c.ttl_s, c.threads, c.request_timeout_ms) == (60, 2, 250)
    assert RemoteSpec.parse("redis://h:1", ttl_s=None).ttl_s is None
    assert RemoteSpec.parse("valkey://h:1?ttl_s=none").ttl_s is None
    # keyword knobs win over the query
    assert RemoteSpec.parse("valkey://h:1?threads=8", threads=1).threads == 1


@pytest.mark.parametrize("url,says", [
    ("http://h:1", "expected valkey://"),
    ("h:1", "expected valkey://"),
    ("valkey://h", "not host:port"),
    ("valkey://h:port", "not host:port"),
    ("valkey://h:0", "out of range"),
    ("valkey://h:70000", "out of range"),
    ("valkey://a:1,b:2", "standalone URL names one"),
    ("valkey://h:1/3", "database number"),
    ("valkey://user:pw@h:1", "credentials"),
    ("valkey://h:1?color=red", "unknown knob"),
    ("valkey://h:1?threads=x", "is not an int"),
    ("valkey://h:1?threads=0", "threads must be an int > 0"),
    ("valkey://h:1?threads=65", "threads must be <= 64"),
    # non-ASCII digits: "²" made int() raise a bare ValueError, "٣" read as 3
    ("valkey://h:1?threads=\u00b2", "is not an int"),
    ("valkey://h:\u00b2", "not host:port"),
    ("valkey://h:1?ttl_s=\u0663", "is not an int"),
    # an unclosed bracket was read as host ":" port 1, and the janitor then reported a
    # name lookup failure instead of the URL; an unbracketed IPv6 address is ambiguous
    ("valkey://[::1", "not host:port"),
    ("valkey://[::1:6379", "not host:port"),
    ("valkey://::1:6379", "\\[addr\\]:port for an IPv6"),
    ("valkey://h]:1", "not host:port"),
    ("valkey+cluster://h1:7001,[::1]7003", "not host:port"),
])
def test_a_bad_url_is_a_config_error_that_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        RemoteSpec.parse(url)


def test_a_password_comes_from_a_private_file_and_stays_out_of_reprs(
        tmp_path: Path) -> None:
    """``password_file`` (the remote tier's password, ``AUTH``): read when the spec is
    made, a final newline dropped, never in the spec's repr; refused, naming the file,
    where group or others may read it, where it is missing, empty, not one line, or
    not a regular file."""
    f = tmp_path / "pw"
    f.write_text("s3cret-Pass\n")
    f.chmod(0o600)
    spec = RemoteSpec.parse(f"valkey://h:1?password_file={f}")
    assert spec.password == "s3cret-Pass" and "s3cret" not in repr(spec)
    assert RemoteSpec.parse("valkey://h:1", password_file=str(f)).password == "s3cret-Pass"
    f.chmod(0o640)
    with pytest.raises(ConfigError, match="may be read by others \\(mode 640\\): chmod 600"):
        RemoteSpec.parse(f"valkey://h:1?password_file={f}")
    for text in ("", "a\nb\n", " a ", "a\x00b"):  # empty, 2 lines, spaces, a control byte
        f.write_text(text)
        f.chmod(0o600)
        with pytest.raises(ConfigError, match="one line of printable text"):
            RemoteSpec.parse("valkey://h:1", password_file=str(f))
    for path, says in ((tmp_path / "none", "No such file"), (tmp_path, "not a regular")):
        with pytest.raises(ConfigError, match=says):
            RemoteSpec.parse("valkey://h:1", password_file=str(path))


@pytest.mark.parametrize("url,says", [
    ("valkey://h:1?request_timeout_ms=4294967296", "request_timeout_ms must be at most "
                                                   "86400000"),
    ("valkey://h:1?connect_timeout_ms=86400001", "connect_timeout_ms must be at most"),
    ("valkey://h:1?ttl_s=0", "ttl_s must be an int > 0 or none \\(no TTL\\), got 0"),
    ("valkey://h:1?ttl_s=", "ttl_s='' is not an int"),
])
def test_a_timeout_past_a_day_or_a_ttl_of_zero_is_refused_in_one_line(
        url: str, says: str) -> None:
    """The hazards (a hostile probe): a request or connect timeout had no upper bound --
    ``request_timeout_ms=4294967296`` parsed, then glide refused it at every connect
    ("Value out of range": the tier never worked, one ERROR line a round), ``kvshm
    janitor`` died with a traceback, and the index's close raised OverflowError. Now at
    most a day, as every other timeout of the engine. And ``ttl_s=0`` or an empty
    ``ttl_s=`` silently meant "no TTL" (keys ``volatile-lru`` can never evict) while
    ``ttl_s=00`` was refused: only ``none`` says that now."""
    with pytest.raises(ConfigError, match=says):
        RemoteSpec.parse(url)
    assert RemoteSpec.parse("valkey://h:1?request_timeout_ms=86400000").request_timeout_ms \
        == 86_400_000
    assert RemoteSpec.parse("valkey://h:1?ttl_s=NONE").ttl_s is None


def test_bad_knobs_are_config_errors() -> None:
    for knobs in ({"ttl_s": 0}, {"ttl_s": True}, {"request_timeout_ms": -1},
                  {"connect_timeout_ms": 1.5}, {"threads": 0}, {"retries": 3}):
        with pytest.raises(ConfigError):
            RemoteSpec.parse("valkey://h:1", **knobs)


# ---------------------------------------------------------------------------- keys


def test_keys_carry_fingerprint_rank_world_and_hash() -> None:
    h = bytes(range(16))
    assert block_key(KEY_PREFIX, "m.bf16.bs16", 1, 2, h) == \
        "kvshm:v1:m.bf16.bs16:1/2:000102030405060708090a0b0c0d0e0f"
    assert ready_key("m.bf16.bs16", 2, h) == \
        "kvshm:v1:m.bf16.bs16:ready/2:000102030405060708090a0b0c0d0e0f"
    with pytest.raises(ConfigError, match="no ':'"):
        block_key(KEY_PREFIX, "a:b", 0, 1, h)
    with pytest.raises(ConfigError, match="out of range"):
        block_key(KEY_PREFIX, "m", 2, 2, h)


def test_the_header_key_shares_the_payload_keys_slot() -> None:
    """In a cluster a block's payload and header live on one node (one MGET)."""
    for i in range(200):
        key = block_key(KEY_PREFIX, "m", i % 4, 4, i.to_bytes(16, "big"))
        assert key_slot(header_key(key)) == key_slot(key)
    # the reference values of the cluster spec (CRC16/XMODEM mod 16384)
    assert key_slot("123456789") == 0x31C3 % 16384
    assert key_slot("{user1000}.following") == key_slot("user1000")


# ---------------------------------------------------------------------------- header


def _header(**kw: object) -> BlockHeader:
    base: dict[str, object] = dict(fingerprint="m.bf16", block_hash=b"\x01" * 16, rank=0,
                                   world=2, length=8)
    base.update(kw)
    return BlockHeader(**base)  # type: ignore[arg-type]


def test_a_header_checks_every_field_and_the_payload() -> None:
    payload = memoryview(b"01234567")
    raw = _header().pack(payload)
    assert len(raw) == HEADER_BYTES
    assert _header().check(raw, payload)
    assert not _header().check(raw, memoryview(b"01234568"))          # checksum
    assert not _header(fingerprint="other").check(raw, payload)
    assert not _header(block_hash=b"\x02" * 16).check(raw, payload)
    assert not _header(block_hash=b"\x01" * 15).check(raw, payload)
    assert not _header(rank=1).check(raw, payload)
    assert not _header(world=4).check(raw, payload)
    assert not _header(length=7).check(raw, memoryview(b"0123456"))
    assert not _header(version=2).check(raw, payload)
    assert not _header().check(raw[:-1], payload)                     # cut short
    assert not _header().check(b"XXXX" + raw[4:], payload)            # magic
    assert not _header().check(b"\x00" * HEADER_BYTES, payload)


def test_the_reader_accepts_only_its_own_checksum() -> None:
    """The checksum is the reader's choice: a header naming another algorithm is refused
    whatever its payload -- ``none`` above all (a writer, or anyone who can write to the
    server, cannot turn the check off). Two sides configured alike agree, ``none`` with
    ``none`` included (a benchmark's)."""
    payload = memoryview(b"x" * 4096)
    names = sorted(n for n, _ in CHECKSUMS.values())
    assert {"none", "crc32"} <= set(names)
    for writer in names:
        raw = _header(length=4096, checksum=writer).pack(payload)
        assert header_checksum_id(raw) == _header(checksum=writer).checksum_id
        for reader in names:
            assert _header(length=4096, checksum=reader).check(raw, payload) is (
                reader == writer), (writer, reader)
    assert header_checksum_id(b"XXXX" + bytes(HEADER_BYTES - 4)) is None
    assert header_checksum_id(b"KVB1") is None
    with pytest.raises(ConfigError, match="not available"):
        _header(checksum="md5")
    with pytest.raises(ConfigError, match="payload is 3 bytes"):
        _header().pack(memoryview(b"abc"))


def test_a_blocks_crc32c_keeps_the_gil_below_gil_free_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC32C of a block under ``GIL_FREE_BYTES`` asks the library to keep the GIL
    (mode 0), of a larger one to release it (mode 1). The library's default released it
    from 32 KiB: in vLLM's process, whose main thread steps in Python, each release of a
    hand-off's 32 KiB blocks cost a re-acquisition of up to the 5 ms switch interval, the
    "busy engine starves its hand-off" of issue 31. The header checks the same."""
    crc32c = pytest.importorskip("crc32c")
    cid = next(c for c, (name, _) in CHECKSUMS.items() if name == "crc32c")
    modes: list[tuple[int, int]] = []
    real = crc32c.crc32c

    def spy(data: memoryview, value: int = 0, gil_release_mode: int = -1) -> int:
        modes.append((memoryview(data).nbytes, gil_release_mode))
        return int(real(data, value, gil_release_mode))
    monkeypatch.setattr(crc32c, "crc32c", spy)
    for n in (32 << 10, (GIL_FREE_BYTES - 1), GIL_FREE_BYTES, 2 << 20):
        payload = memoryview(bytes(n))
        header = _header(length=n, checksum="crc32c")
        assert header.check(header.pack(payload), payload)
        assert CHECKSUMS[cid][1](payload) == real(payload) & 0xFFFF_FFFF
    assert modes == [(n, int(n >= GIL_FREE_BYTES)) for n in (
        32 << 10, 32 << 10, 32 << 10, GIL_FREE_BYTES - 1, GIL_FREE_BYTES - 1,
        GIL_FREE_BYTES - 1, GIL_FREE_BYTES, GIL_FREE_BYTES, GIL_FREE_BYTES, 2 << 20,
        2 << 20, 2 << 20)]


# ---------------------------------------------------------------------------- breaker


def state(b: CircuitBreaker) -> BreakerState:
    return b.state  # a call: mypy does not keep the state narrowed across transitions


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_threshold_probes_after_backoff_and_closes() -> None:
    clock = Clock()
    b = CircuitBreaker(threshold=3, backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert state(b) is BreakerState.CLOSED
    b.success()  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.failure()
    assert state(b) is BreakerState.OPEN and b.opens == 1
    assert not b.allow() and b.rejected == 1
    clock.now = 1.0
    assert b.allow() and state(b) is BreakerState.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.failure()  # the probe failed: open again, backoff doubled
    assert state(b) is BreakerState.OPEN and b.backoff_s == 2.0 and b.opens == 2
    clock.now = 2.9
    assert not b.allow()
    clock.now = 3.0
    assert b.allow()
    b.failure()
    clock.now = 7.0
    assert b.allow()
    b.failure()
    assert b.backoff_s == 4.0  # capped
    clock.now = 11.0
    assert b.allow()
    b.success()
    assert state(b) is BreakerState.CLOSED and b.closes == 1 and b.backoff_s == 1.0


class BreakerMachine(RuleBasedStateMachine):
    """The breaker against a small model: it lets a request through exactly when the
    model says so, opens exactly at the threshold, probes once per backoff."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.b = CircuitBreaker(threshold=3, backoff_s=0.5, max_backoff_s=2.0,
                                clock=self.clock)
        self.state = "closed"
        self.consecutive = 0
        self.backoff = 0.5
        self.probe_at = 0.0
        self.outstanding = 0

    @rule(dt=st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def allow(self) -> None:
        expected = (self.state == "closed"
                    or (self.state == "open" and self.clock.now >= self.probe_at))
        assert self.b.allow() == expected
        if expected:
            if self.state == "open":
                self.state = "half_open"
            self.outstanding += 1

    @precondition(lambda self: self.outstanding > 0)
    @rule(ok=st.booleans())
    def report(self, ok: bool) -> None:
        self.outstanding -= 1
        if ok:
            self.b.success()
            self.consecutive = 0
            if self.state != "closed":
                self.state, self.backoff = "closed", 0.5
            return
        self.b.failure()
        self.consecutive += 1
        if self.state == "half_open":
            self.backoff = min(self.backoff * 2, 2.0)
            self.state, self.probe_at = "open", self.clock.now + self.backoff
        elif self.state == "closed" and self.consecutive >= 3:
            self.backoff = 0.5
            self.state, self.probe_at = "open", self.clock.now + self.backoff

    @invariant()
    def agrees(self) -> None:
        assert self.b.state.value == self.state
        assert self.b.backoff_s == self.backoff


BreakerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                            deadline=None)
TestBreakerMachine = BreakerMachine.TestCase
