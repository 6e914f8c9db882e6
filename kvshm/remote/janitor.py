"""The P/D janitor: demote the hand-off manifests nobody collected (``kvshm janitor``).

A P/D hand-off (:mod:`kvshm.offload.pd.handoffs`) keeps its blocks and readiness keys with
the tier's *hold* TTL until a decoder collects them; a manifest nobody collects is
demoted today only by the next engine that happens to read it. :func:`sweep` does it for
a whole server or cluster, on demand:

1. ``SCAN ... MATCH kvshm:v1:pd:*`` (never ``KEYS``; on a cluster, on every primary of
   the slot map in turn, each page a raw request under the request timeout: a primary
   that does not answer is named in the RemoteError raised once the others are swept),
   each name once even where SCAN repeats it;
2. ``GET`` each manifest (one pipelined batch per page) and judge it with the caller's
   decoder (:func:`judge`): *live* (not expired), *expired*, or *unreadable* (no value
   the decoder accepts, another version, a name that does not match its content, a
   fingerprint or world size no key can carry, a key that is not a string);
3. demote each expired one exactly as an engine does (``Handoffs._collect``): every key
   of :func:`handoff_keys` and each one's header key (:func:`~kvshm.remote.valkey.
   header_key`; a readiness key has none: a no-op, as in the engine) gets the ordinary
   TTL (the URL's ``RemoteSpec.ttl_s``; ``ttl_s=none``: no EXPIRE, as in the engine)
   where that is longer than what it has left, then the manifest goes. ``EXPIRE ...
   GT``, never shorter, as in the engine: another live hand-off, of this deployment or
   another with the same blocks, may name the key (a janitor run with a shorter
   ``ttl_s`` than a deployment's put that deployment's live hand-offs on its TTL: a
   hostile probe).

Ordering and invariants, per manifest:

* **TTL first, delete last.** The manifest is deleted only once every EXPIRE was
  answered without an error; a failure in between leaves it, and the next run (or the
  next engine that reads it) demotes it again: both steps are idempotent.
* **Compare-and-delete.** The DEL is one Lua script that deletes the manifest only if it
  still holds the bytes judged expired: one re-published under the same name meanwhile
  stays (counted ``vanished``, like one collected or demoted by an engine meanwhile).
* Nothing else is written: a live manifest and its keys are never touched; an unreadable
  one only with ``delete_unreadable`` (then by the same compare-and-delete; a key that
  is not a string is never deleted); ``dry_run`` writes nothing at all.
* Expiry is ``expires_at < now`` on this machine's wall clock, as in the engine (keep the
  clocks of the engines and the janitor in sync).

Layering: this part never imports :mod:`kvshm.offload`; the caller decodes a manifest
(``kvshm janitor`` with ``Manifest`` itself) into anything with the fields of
:class:`HandoffRecord`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Final, Protocol

from kvshm.errors import ConfigError, RemoteError
from kvshm.remote.glide_client import UNSERVED
from kvshm.remote.resp import ServerReplyError, command, info_field, parse_reply
from kvshm.remote.shard_batches import DEL_IF_SAME
from kvshm.remote.tier import KEY_PREFIX, RemoteSpec, block_key, ready_key

__all__ = ["MANIFEST_VERSION", "MAX_HANDOFF_KEYS", "PD_PREFIX", "Decoder", "HandoffRecord",
           "JanitorReport", "Judgement", "handoff_keys", "judge", "sweep"]

#: The prefix of every hand-off manifest's name (``kvshm.offload.pd.manifest.manifest_key``).
PD_PREFIX: Final = f"{KEY_PREFIX}:pd"
#: The manifest version kvshm writes and demotes; any other is unreadable here.
MANIFEST_VERSION: Final = 1
_MAX_WORLD: Final = 0xFFFF  # a block header's limit
#: A manifest whose blocks x world size exceed this is unreadable here (a forged one of
#: 300 bytes could name millions of keys: world 65535 x a few hashes); a real hand-off
#: of 1M tokens in 16-token blocks on 16 ranks names exactly this many.
MAX_HANDOFF_KEYS: Final = 1 << 20
#: Keys per GET batch; commands per EXPIRE batch.
_PAGE: Final = 256
_CHUNK: Final = 512
#: A sweep's request deadline at least (a batch of 512 EXPIREs on a loaded server).
_MIN_TIMEOUT_MS: Final = 5000


class HandoffRecord(Protocol):
    """The fields of a decoded manifest the janitor needs (``Manifest`` has them)."""

    @property
    def version(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def world(self) -> int: ...

    @property
    def hashes(self) -> Sequence[str]: ...

    @property
    def expires_at(self) -> float: ...


#: The caller's decoder: a manifest's bytes -> its record; None when they are none.
Decoder = Callable[[bytes], HandoffRecord | None]


def handoff_keys(fingerprint: str, world: int, hashes: Iterable[str]) -> list[str]:
    """The keys a demotion (or a collection) of a hand-off gives the ordinary TTL, in the
    engine's order: every rank's shard of each block (block by block, rank order), then
    each block's readiness key. A hash that is not hex is skipped, as the engine does.
    ConfigError: a fingerprint or world size no key can carry."""
    raw: list[bytes] = []
    for h in hashes:
        try:
            raw.append(bytes.fromhex(h))
        except (TypeError, ValueError):
            continue
    if not 1 <= world <= _MAX_WORLD:
        raise ConfigError(f"world size {world} out of range 1..{_MAX_WORLD}")
    blocks = [block_key(KEY_PREFIX, fingerprint, r, world, b) for b in raw
              for r in range(world)]
    return blocks + [ready_key(fingerprint, world, b) for b in raw]


class Judgement(Enum):
    """What the janitor makes of one manifest on the server (:func:`judge`)."""

    LIVE = "live"
    """Not expired: its request may still collect it; left alone."""
    EXPIRED = "expired"
    """Past its expiry: its keys are demoted."""
    UNREADABLE = "unreadable"
    """Not kvshm's, another deployment's, another version's, or damaged: counted (and
    deleted only when the operator asks)."""


def judge(name: str | bytes, raw: bytes, decode: Decoder, now: float
          ) -> tuple[Judgement, list[str]]:
    """``(verdict, keys)``: what the manifest ``raw`` stored
    under ``name`` is; ``keys`` (:func:`handoff_keys`) only when it is expired. Never
    raises: whatever the decoder refuses (any exception, or None), a name that is not
    UTF-8 (bytes) and a manifest naming more than :data:`MAX_HANDOFF_KEYS` keys are
    unreadable."""
    try:
        m = decode(raw)
    except Exception:  # noqa: BLE001 - a value nobody can read: counted, left alone
        m = None
    if m is None or type(m.version) is not int or m.version != MANIFEST_VERSION:
        return Judgement.UNREADABLE, []
    try:
        if not isinstance(name, str) or not name.startswith(
                f"{PD_PREFIX}:{m.fingerprint}:{m.world}:"):
            return Judgement.UNREADABLE, []  # another deployment's content under this name
        if (m.world + 1) * len(m.hashes) > MAX_HANDOFF_KEYS:
            return Judgement.UNREADABLE, []  # no engine writes one: a forgery's key bomb
        keys = handoff_keys(m.fingerprint, m.world, m.hashes)
        expired = float(m.expires_at) < now
    except (ConfigError, TypeError, ValueError):
        return Judgement.UNREADABLE, []
    return (Judgement.EXPIRED, keys) if expired else (Judgement.LIVE, [])


@dataclass
class JanitorReport:
    """What one :func:`sweep` found and did (every field an int but ``url``, ``dry_run``).

    ``scanned`` = ``live`` + ``expired`` + ``unreadable`` + ``vanished``; ``demoted`` +
    ``failed`` <= ``expired`` (equal but for ``vanished`` ones, and ``dry_run``: 0)."""

    url: str
    dry_run: bool
    scanned: int = 0
    live: int = 0
    expired: int = 0
    demoted: int = 0
    unreadable: int = 0
    unreadable_deleted: int = 0
    vanished: int = 0
    failed: int = 0
    keys_given_ttl: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Every field by name (``kvshm janitor --json``)."""
        return asdict(self)

    def summary(self) -> str:
        """One line: the counts."""
        if self.dry_run:
            fate = "would be demoted"
        else:
            fate = f"{self.demoted} demoted, {self.keys_given_ttl} keys given the ordinary TTL"
        kept = (f"{self.unreadable_deleted} deleted" if self.unreadable_deleted
                else "left alone")
        text = (f"{self.scanned} hand-off manifests scanned: {self.expired} expired "
                f"({fate}), {self.live} live, {self.unreadable} unreadable ({kept}), "
                f"{self.vanished} gone meanwhile")
        if self.failed:
            text += f", {self.failed} failed (kept: run again)"
        return text + (" [dry run: nothing changed]" if self.dry_run else "")


def _probe(spec: RemoteSpec) -> None:
    """One raw ``INFO cluster`` per seed node, before any glide client exists (a glide
    client that cannot connect prints on stderr): RemoteError naming the URL when no
    node answers or one refuses; ConfigError when the URL's kind (standalone or
    cluster) is not the server's."""
    last: BaseException | None = None
    for host, port in spec.nodes:
        try:
            reply = parse_reply(command(host, port, "INFO", "cluster",
                                        timeout=spec.connect_timeout_ms / 1000,
                                        password=spec.password))
        except (OSError, ValueError, IndexError) as exc:
            last = exc
            continue
        if isinstance(reply, ServerReplyError):
            raise RemoteError(f"{spec.url}: {host}:{port} refused INFO: {reply}")
        enabled = info_field(reply if isinstance(reply, bytes) else b"", "cluster_enabled")
        if spec.cluster and enabled != "1":
            raise ConfigError(f"{spec.url}: {host}:{port} is not a cluster node: use "
                              f"valkey://{host}:{port}")
        if not spec.cluster and enabled == "1":
            raise ConfigError(f"{spec.url}: {host}:{port} is a cluster node: use "
                              f"valkey+cluster://{host}:{port}")
        return
    raise RemoteError(f"cannot reach {spec.url}: {last or 'no node'}")


def _primaries(spec: RemoteSpec, timeout: float) -> list[tuple[str, int]]:
    """The nodes to scan: the server; on a cluster every primary of the slot map the
    first seed node that answers gives (RemoteError when none does)."""
    if not spec.cluster:
        return list(spec.nodes[:1])
    from kvshm.remote.glide_client import read_slot_map

    for node in spec.nodes:
        got = read_slot_map(node, timeout, spec.password)
        if got is not None:
            names = sorted(set(got[0]) - {UNSERVED})
            return [(h, int(p)) for h, p in (n.rsplit(":", 1) for n in names)]
    raise RemoteError(f"{spec.url}: no seed node answered CLUSTER SLOTS")


def _scan(spec: RemoteSpec, match: str, timeout: float, down: list[str]
          ) -> Iterator[list[str | bytes]]:
    """Pages of names (``SCAN ... COUNT 1000`` on the server, or on each primary of a
    cluster in turn), each page one raw request bounded by ``timeout`` as a whole -- not
    glide's cluster scan, which waited without end for a primary that was stopped or
    killed with its slots uncovered (a hostile probe). A primary that does not answer
    is named in ``down`` (with why) and the others are still scanned. A name that is
    not UTF-8 (anyone may write one) stays bytes: no manifest's, unreadable."""
    for host, port in _primaries(spec, spec.connect_timeout_ms / 1000):
        cursor, seen = b"0", {b"0"}
        while True:
            try:
                cursor, keys = _scan_page(host, port, cursor, match, timeout,
                                          spec.password)
                if cursor in seen and cursor != b"0":  # a scan goes round once
                    raise ValueError(f"the SCAN cursor {cursor!r:.40} came again")
                seen.add(cursor)
            except (OSError, ValueError) as exc:
                down.append(f"{host}:{port} ({type(exc).__name__}: {exc})")
                break
            yield [_name(k) for k in keys]
            if cursor == b"0":
                break


def _scan_page(host: str, port: int, cursor: bytes, match: str, timeout: float,
               password: str | None = None) -> tuple[bytes, list[bytes]]:
    """One ``SCAN`` page: the next cursor and the names. ValueError for any reply but
    ``[cursor, [name, ...]]`` (an error reply, a peer that is not Valkey)."""
    reply = parse_reply(command(host, port, "SCAN", cursor, "MATCH", match, "COUNT",
                                "1000", timeout=timeout, password=password))
    if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[0], bytes)
            and reply[0].isdigit() and isinstance(reply[1], list)
            and all(isinstance(k, bytes) for k in reply[1])):
        raise ValueError(f"not a SCAN reply: {reply!r:.80}")
    return reply[0], reply[1]


def _name(key: Any) -> str | bytes:
    if not isinstance(key, bytes):
        return str(key)
    try:
        return key.decode()
    except UnicodeDecodeError:
        return key


class _Sweep:
    def __init__(self, spec: RemoteSpec, glide: Any, client: Any, report: JanitorReport,
                 delete_unreadable: bool) -> None:
        self.spec, self.g, self.client, self.report = spec, glide, client, report
        self.delete_unreadable = delete_unreadable
        self.script = glide.Script(DEL_IF_SAME)

    def batch(self) -> Any:
        return (self.g.ClusterBatch if self.spec.cluster else self.g.Batch)(is_atomic=False)

    def exec(self, batch: Any) -> list[Any]:
        return list(self.client.exec(batch, raise_on_error=False) or [])

    def get_all(self, names: Sequence[str | bytes]) -> list[Any]:
        b = self.batch()
        for n in names:
            b.get(n)
        return self.exec(b)

    def delete_if_same(self, name: str | bytes, raw: bytes) -> bool:
        return bool(self.client.invoke_script(self.script, keys=[name], args=[raw]) == 1)

    def demote(self, name: str | bytes, raw: bytes, keys: list[str]) -> None:
        """EXPIRE every key and its header key; all answered: compare-and-delete."""
        from kvshm.remote.glide_client import header_key

        r = self.report
        ttl = self.spec.ttl_s
        step = _CHUNK // 2  # keys a batch: each with its header key
        for i in range(0, 0 if ttl is None else len(keys), step):
            cmds = [k for key in keys[i:i + step] for k in (key, header_key(key))]
            b = self.batch()
            gt = self.g.ExpireOptions.NewExpiryGreaterThanCurrent
            for k in cmds:  # never shorter: another live hand-off may name these blocks
                b.expire(k, ttl, gt)
            out = self.exec(b)
            if len(out) != len(cmds) or any(isinstance(x, Exception) for x in out):
                r.failed += 1
                return
            r.keys_given_ttl += sum(1 for x in out if x == 1)
        if self.delete_if_same(name, raw):
            r.demoted += 1
        else:
            r.vanished += 1

    def page(self, names: Sequence[str | bytes], decode: Decoder, now: float) -> None:
        r = self.report
        for name, value in zip(names, self.get_all(names), strict=True):
            r.scanned += 1
            if value is None:
                r.vanished += 1
                continue
            if not isinstance(value, bytes):  # an error reply: not a string
                r.unreadable += 1
                continue
            verdict, keys = judge(name, value, decode, now)
            if verdict is Judgement.LIVE:
                r.live += 1
            elif verdict is Judgement.UNREADABLE:
                r.unreadable += 1
                if self.delete_unreadable and not r.dry_run \
                        and self.delete_if_same(name, value):
                    r.unreadable_deleted += 1
            else:
                r.expired += 1
                if not r.dry_run:
                    self.demote(name, value, keys)


def sweep(spec: RemoteSpec, decode: Decoder, *, dry_run: bool = False,
          delete_unreadable: bool = False, fingerprint: str | None = None,
          now: Callable[[], float] = time.time) -> JanitorReport:
    """Scan ``spec``'s server (every primary of a cluster) for hand-off manifests (only
    ``fingerprint``'s, if given), judge each (:func:`judge`, at ``now()`` taken once)
    and demote the expired ones (see the module for the order). Returns the counts.

    ConfigError: a bad fingerprint, a standalone URL naming a cluster node or the other
    way round; MissingExtra: no glide; RemoteError: no node answers, or the server
    failed mid-sweep (the message has the counts so far; every step done is kept)."""
    match = f"{PD_PREFIX}:*"
    if fingerprint is not None:
        ready_key(fingerprint, 1, b"")  # ConfigError: not a fingerprint (no glob either)
        match = f"{PD_PREFIX}:{fingerprint}:*"
    from kvshm.remote.glide_client import glide_module, make_client

    glide = glide_module()
    _probe(spec)
    report = JanitorReport(spec.url, dry_run)
    timeout_ms = max(spec.request_timeout_ms, _MIN_TIMEOUT_MS)
    timeout = timeout_ms / 1000
    client = make_client(spec, timeout_ms)
    t = now()
    try:
        work = _Sweep(spec, glide, client, report, delete_unreadable)
        seen: set[str | bytes] = set()
        down: list[str] = []
        for names in _scan(spec, match, timeout, down):
            fresh = [n for n in dict.fromkeys(names) if n not in seen]
            seen.update(fresh)
            for i in range(0, len(fresh), _PAGE):
                work.page(fresh[i:i + _PAGE], decode, t)
        if down:
            raise RemoteError(f"{spec.url}: did not answer SCAN: {'; '.join(down)}; the "
                              f"rest was swept (so far: {report.summary()})")
    except glide.GlideError as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise RemoteError(f"{spec.url}: {text} (so far: {report.summary()})") from exc
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing: nothing to do
            pass
    return report
