"""The local disk tier's slab file: one preallocated file per engine per rank, cut into
fixed-size slots, each holding one block's bytes on that rank behind a header page.

Byte layout (little-endian; ``PAGE`` = 4096; every offset is a multiple of ``PAGE``)::

    offset 0            file header page (PAGE bytes)
        0   8s  magic b"KVSHMSLB"
        8   H   format version (FORMAT_VERSION)
        10  H   0 (reserved)
        12  I   rank
        16  I   world
        20  Q   slots
        28  Q   row_bytes (one block's bytes on this rank: all host-pool regions' rows)
        36  Q   slot stride (PAGE + row_bytes rounded up to PAGE)
        44  16s fingerprint digest (BLAKE2b-128 of the layout fingerprint)
        60  H   fingerprint text length n (the text itself is for people: at most 2048)
        62  n   fingerprint text (UTF-8)
        ... I   CRC32 (zlib) of bytes [0, 62 + n), right after the text
        rest    zero
    offset PAGE + i * stride    slot i (0 <= i < slots)
        slot header page (PAGE bytes)
            0   8s  magic b"KVSLOT01" (all zero: EMPTY, never written or invalidated)
            8   H   format version
            10  B   payload checksum id (kvshm.remote.tier.CHECKSUMS: 2 = crc32c, 1 = crc32)
            11  B   block hash length (1..64)
            12  I   rank
            16  I   world
            20  Q   slot index (a header copied to another slot is not that slot's)
            28  Q   payload length (= row_bytes)
            36  I   checksum of the payload (the rows in region order)
            40  I   0 (reserved)
            44  Q   write sequence number (grows across the writes of a file's life)
            52  16s fingerprint digest
            68  64s block hash, zero-padded
            132 I   CRC32 (zlib) of bytes [0, 132): a torn or scribbled header is BAD
            rest    zero
        payload: the block's rows, region after region (row_bytes), zero-padded to PAGE

Writing a slot (:meth:`SlabFile.write`) is ONE vectored write of the header page and
the payload, in ascending file order; the header carries the checksum of the payload it
precedes. :meth:`SlabFile.write_many` writes neighbouring slots (a group: at most
:data:`GROUP_SLOTS` slots, :data:`GROUP_BYTES` bytes) in one vectored write, each slot's
header page right before its own payload, so the slots of a group that stops part way
are, in file order, whole new slots, at most one slot torn as below, and untouched old
ones. A SIGKILL stops the writer somewhere; what a later read finds of one slot:

* the write never started: the old header over the old payload, intact: a HIT only under
  the OLD block's hash, with its correct bytes (the scheduler no longer indexes it there:
  a read for the new block is BAD_HEADER, never a wrong HIT);
* the write stopped part way (a buffered write ends at a page boundary, in order: the new
  header and a prefix of the new payload over the rest of the old one): the header's
  checksum does not match the bytes found: BAD_CRC, never loaded;
* the write completed (an O_DIRECT write, once submitted, completes even for a killed
  process): the new header over the new payload: HIT.

No state can pair a header with a payload it does not describe and pass the check, but
for a checksum collision (2**-32 per torn slot; the header's own CRC guards the header).
One write per slot, not three (invalidate, payload, header): each O_DIRECT write waits for
the device, and at 128 KiB blocks the extra waits cost more than half the throughput.
A slot the scheduler drops (a READ failed its check on some rank) is not zeroed: it
goes back to the free slots, and the next write to it replaces its header. Until then a
warm restart may index it again; its READ then fails the same check (a miss, counted,
the slot dropped again), never a wrong block. :meth:`SlabFile.invalidate` (zero a
header page) is for tools and tests.

There is no fsync per slot: a SIGKILL leaves every write that returned in the page cache
(buffered) or on the device (O_DIRECT), in program order. A power loss may lose or
reorder writes that were not yet durable (the device may persist the new header and not
the payload, or the reverse, or some pages of a slot only); the header's payload checksum
then disagrees with the bytes found, so the slot reads BAD and is never loaded.

Reads (:meth:`SlabFile.read_into`) take the header page and the payload in one vectored
read (:meth:`SlabFile.read_many`: a group of neighbouring slots in one), check each
header against the expected spec, slot and hash, then the checksum over its payload
(lazily: :func:`scan` never reads payloads). Grouping is for the device: fewer, larger
requests (docs/disk.md, "Slab I/O", has the figures). With O_DIRECT, reads and writes
go straight between the file and the caller's rows when every row's address and length
are multiples of PAGE; otherwise through one PAGE-aligned bounce buffer per thread
(counted as ``bounce``). On the direct path a read that is not a HIT may have overwritten
the destination rows (the caller reads only into rows nothing else uses); the bounce path
copies into the rows only on a HIT.

Concurrency: one :class:`SlabFile` per file, held under an exclusive ``flock`` (a second
opener gets :class:`SlabLocked`); its methods may run on many threads at once on distinct
slots (the caller never reads a slot that is being written, nor writes one twice at once).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import re
import stat
import struct
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final, NamedTuple

from kvshm.errors import ConfigError
from kvshm.remote.tier import CHECKSUMS, DEFAULT_CHECKSUM

__all__ = ["FORMAT_VERSION", "MAX_HASH_BYTES", "PAGE", "SlabFile", "SlabLocked", "SlabSpec",
           "SlotOutcome", "check_directory", "refuse_special", "remove_unheld", "scan",
           "slab_path"]

log = logging.getLogger(__name__)

#: The alignment of every offset, length and direct-I/O buffer in a slab.
PAGE: Final = 4096
#: The slab format version (file header and slot headers).
FORMAT_VERSION: Final = 1
#: The longest block hash a slot header holds.
MAX_HASH_BYTES: Final = 64
#: The longest fingerprint text kept in the file header (the digest covers all of it).
_MAX_FP_TEXT: Final = 2048
#: Most buffers in one preadv/pwritev (Linux IOV_MAX is 1024; one is the header page).
_IOV_MAX: Final = 1000
#: Most neighbouring slots one vectored read or write moves (their header pages are one
#: per-thread buffer of this many pages).
GROUP_SLOTS: Final = 16
#: Most bytes (header pages and payloads) one vectored read or write of neighbouring slots
#: moves; a slot larger than this is a group of its own.
GROUP_BYTES: Final = 16 << 20

_FILE_MAGIC: Final = b"KVSHMSLB"
_SLOT_MAGIC: Final = b"KVSLOT01"
_FILE = struct.Struct("<8sHHIIQQQ16sH")
_SLOT = struct.Struct("<8sHBBIIQQIIQ16s64s")
_CRC = struct.Struct("<I")
_ZERO_PAGE: Final = bytes(PAGE)
_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)
_CHECKSUM_IDS: Final = {name: cid for cid, (name, _) in CHECKSUMS.items()}
#: How many slot headers :func:`scan` asks the kernel to read ahead of the one it parses.
SCAN_AHEAD: Final = 128
#: Slots :func:`scan` parses between two looks at its ``stop`` event.
SCAN_STOP_SLOTS: Final = 256
#: A slab whose slots are at most this far apart is scanned in sequential reads of
#: :data:`SCAN_RUN_BYTES` (headers and rows alike), not one read per header.
SCAN_SEQUENTIAL_STRIDE: Final = 64 << 10
#: Bytes of one of those reads.
SCAN_RUN_BYTES: Final = 4 << 20


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _digest(fingerprint: str) -> bytes:
    return hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()


# ---------------------------------------------------------------------------- checksums


def _crc32_update(view: memoryview, value: int) -> int:
    return zlib.crc32(view, value) & 0xFFFF_FFFF


def _updaters() -> dict[int, Callable[[memoryview, int], int]]:
    """Checksum id (the remote tier's ids, :data:`kvshm.remote.tier.CHECKSUMS`) -> an
    incremental update over one buffer (a payload spans several rows). crc32c releases
    the GIL on large buffers."""
    found: dict[int, Callable[[memoryview, int], int]] = {_CHECKSUM_IDS["crc32"]: _crc32_update}
    if "crc32c" in _CHECKSUM_IDS:
        import crc32c  # type: ignore[import-untyped,import-not-found,unused-ignore]

        def _crc32c_update(view: memoryview, value: int) -> int:
            return int(crc32c.crc32c(view, value)) & 0xFFFF_FFFF

        found[_CHECKSUM_IDS["crc32c"]] = _crc32c_update
    return found


_UPDATERS: Final = _updaters()
#: The checksum every slot is written with: the remote tier's default (crc32c, where the
#: package is installed, else crc32). A reader checks a slot with the id its header names.
_WRITE_CHECKSUM: Final = _CHECKSUM_IDS[DEFAULT_CHECKSUM]


def _checksum(cid: int, views: Sequence[memoryview]) -> int:
    update = _UPDATERS[cid]
    value = 0
    for v in views:
        value = update(v, value)
    return value


# ---------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class SlabSpec:
    """What a slab file is for: a layout fingerprint, one rank of ``world``, ``slots``
    slots of ``row_bytes`` payload each. Two specs are equal iff a file of one can be
    read as the other."""

    fingerprint: str
    rank: int
    world: int
    slots: int
    row_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise ConfigError("slab fingerprint must be a non-empty string")
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"slab rank {self.rank} / world {self.world} out of range")
        if self.slots <= 0:
            raise ConfigError(f"slab slots must be positive, got {self.slots}")
        if self.row_bytes <= 0:
            raise ConfigError(f"slab row_bytes must be positive, got {self.row_bytes}")

    @property
    def slot_stride(self) -> int:
        """Bytes from one slot to the next: a header page plus the padded payload."""
        return PAGE + _round_up(self.row_bytes)

    @property
    def file_bytes(self) -> int:
        """The whole file: the file header page plus every slot."""
        return PAGE + self.slots * self.slot_stride

    def slot_offset(self, slot: int) -> int:
        """Where slot ``slot``'s header page starts; ConfigError out of range."""
        if not 0 <= slot < self.slots:
            raise ConfigError(f"slot {slot} out of range [0, {self.slots})")
        return PAGE + slot * self.slot_stride

    def file_header(self) -> bytes:
        """The file header page of this spec."""
        text = self.fingerprint.encode()[:_MAX_FP_TEXT]
        body = _FILE.pack(_FILE_MAGIC, FORMAT_VERSION, 0, self.rank, self.world, self.slots,
                          self.row_bytes, self.slot_stride, _digest(self.fingerprint),
                          len(text)) + text
        raw = body + _CRC.pack(zlib.crc32(body))
        return raw + bytes(PAGE - len(raw))

    def matches_file_header(self, page: bytes | memoryview) -> bool:
        """Whether ``page`` is this spec's file header (never raises)."""
        return bytes(page[:PAGE]) == self.file_header()


_ENGINE_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,80}$")


def slab_path(directory: str, engine: str, rank: int, world: int) -> str:
    """The slab file of ``engine``'s rank ``rank`` of ``world`` under ``directory``.
    ConfigError for an engine name that is not a plain file-name part (a path separator,
    ``.`` / ``..``, or characters outside kvshm's engine-name set)."""
    if not _ENGINE_RE.fullmatch(engine) or engine in (".", ".."):
        raise ConfigError(f"engine name {engine!r} cannot name a slab file (letters, digits, "
                          "'.', '_', '-' only; no path separators)")
    if not 0 <= rank < world:
        raise ConfigError(f"slab rank {rank} / world {world} out of range")
    return os.path.join(directory, f"kvshm-{engine}.rank{rank}-of-{world}.slab")


# ---------------------------------------------------------------------------- directory


def _aligned_page() -> mmap.mmap:
    """One zero-filled PAGE-aligned page (anonymous mmap: page-aligned by construction)."""
    return mmap.mmap(-1, PAGE)


def _probe_o_direct(directory: str) -> str | None:
    """None if an O_DIRECT write and read of one page work in ``directory``, else why.

    The probe file is ``mkstemp``'s, opened again by name with O_DIRECT as a slab is
    (``F_SETFL`` on the first descriptor is not the same test: a filesystem may take it
    and refuse the open), with ``O_NOFOLLOW``, and written only when it is the same
    file: before, a local user who could write to a shared ``disk_path`` (no sticky
    bit) swapped the probe for a link between the two opens and the engine zeroed the
    first page of the file it named (a hostile probe won the race in 43 tries). A swap
    is a ConfigError of its own. Every close and the removal are best effort (an
    overlayfs close may fail: a review saw it replace the answer with a bare OSError
    and leave the file)."""
    fd0, probe = tempfile.mkstemp(prefix=".kvshm-odirect-", dir=directory)
    page = _aligned_page()
    try:
        made = os.fstat(fd0)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | _O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _swapped(directory) from None
            return _errno_reason(exc)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (made.st_dev, made.st_ino):
                raise _swapped(directory)
            os.pwritev(fd, [page], 0)
            os.preadv(fd, [page], 0)
            return None
        except OSError as exc:
            return _errno_reason(exc)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
        with contextlib.suppress(OSError):
            os.close(fd0)
        page.close()


def _swapped(directory: str) -> ConfigError:
    return ConfigError(f"disk_path {directory!r}: the start's probe file was replaced "
                       "while it was open: another user can write to this directory "
                       "(choose one only this user may write, or set its sticky bit)")


def _errno_reason(exc: OSError) -> str:
    return f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _held_bytes(path: str | None) -> int:
    """Bytes the file at ``path`` already holds on disk (0 if none)."""
    if path is None:
        return 0
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def check_directory(directory: str, bytes_needed: int, *, direct: bool,
                    reuse_path: str | None = None) -> None:
    """Refuse ``directory`` for a slab of ``bytes_needed`` bytes, with ONE line naming the
    first check that failed: not a directory, not writable, a file made there would not
    be trusted as a slab (:func:`untrusted`: owner squashed, mode ignored), not enough
    free space (needed vs free; ``reuse_path``: an existing slab whose allocated bytes
    will be reused count as free), or (``direct``) the filesystem refuses O_DIRECT.
    Probes with a small temp file, removed after. Raises ConfigError; returns None when
    all pass."""
    if not os.path.isdir(directory):
        raise ConfigError(f"disk_path {directory!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvshm-probe-", dir=directory)
        try:
            why = untrusted(os.fstat(fd))
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"disk_path {directory!r} is not writable ({exc.strerror})") from exc
    if why is not None:  # every slab would be refused (NFS root_squash, a 0777 mount):
        # one line now, not a disk tier failing on every rank after a start that worked
        raise ConfigError(f"disk_path {directory!r}: a file this process makes there "
                          f"{why}, so no slab could be trusted (a filesystem that "
                          "squashes or ignores owners and modes: choose a local one)")
    free = _free_bytes(directory) + _held_bytes(reuse_path)
    if free < bytes_needed:
        raise ConfigError(f"disk_path {directory!r} has not enough free space: the slab needs "
                          f"{bytes_needed} bytes, {free} are free")
    if direct:
        why = _probe_o_direct(directory)
        if why is not None:
            raise ConfigError(f"the filesystem of disk_path {directory!r} refuses O_DIRECT "
                              f"({why}): set disk_io=buffered to use the page cache")


# ---------------------------------------------------------------------------- slot headers


class SlotOutcome(Enum):
    """What :meth:`SlabFile.read_into` found. Only HIT loads; every other outcome is a
    miss (the rows' bytes are not the block's)."""

    HIT = "hit"
    #: No header: never written, invalidated, or a write that stopped before its header.
    EMPTY = "empty"
    #: A header that is torn (its own CRC fails), of another format, spec, slot or block.
    BAD_HEADER = "header"
    #: A well-formed header over a payload whose checksum differs (corrupt or torn).
    BAD_CRC = "crc"

    @property
    def bad(self) -> bool:
        return self in (SlotOutcome.BAD_HEADER, SlotOutcome.BAD_CRC)


class _SlotHeader(NamedTuple):
    checksum_id: int
    rank: int
    world: int
    slot: int
    length: int
    checksum: int
    seq: int
    digest: bytes
    block_hash: bytes


def _pack_slot_header(spec: SlabSpec, digest: bytes, slot: int, block_hash: bytes,
                      checksum: int, seq: int) -> bytes:
    body = _SLOT.pack(_SLOT_MAGIC, FORMAT_VERSION, _WRITE_CHECKSUM, len(block_hash),
                      spec.rank, spec.world, slot, spec.row_bytes, checksum, 0, seq, digest,
                      block_hash)
    return body + _CRC.pack(zlib.crc32(body))


def _parse_slot_header(raw: bytes | memoryview) -> _SlotHeader | SlotOutcome:
    """The header in ``raw``, or EMPTY (no magic) / BAD_HEADER (torn, other version)."""
    end = _SLOT.size + _CRC.size
    head = bytes(raw[:end])
    if len(head) < end or head[:8] != _SLOT_MAGIC:
        return SlotOutcome.EMPTY if not any(head) else SlotOutcome.BAD_HEADER
    if _CRC.unpack_from(head, _SLOT.size)[0] != zlib.crc32(head[:_SLOT.size]):
        return SlotOutcome.BAD_HEADER
    (_, version, cid, hlen, rank, world, slot, length, checksum, _, seq, digest,
     bhash) = _SLOT.unpack_from(head)
    if version != FORMAT_VERSION or not 0 < hlen <= MAX_HASH_BYTES:
        return SlotOutcome.BAD_HEADER
    return _SlotHeader(cid, rank, world, slot, length, checksum, seq, digest, bhash[:hlen])


def _header_fits(h: _SlotHeader, spec: SlabSpec, digest: bytes, slot: int) -> bool:
    return (h.rank == spec.rank and h.world == spec.world and h.slot == slot
            and h.length == spec.row_bytes and h.digest == digest
            and h.checksum_id in _UPDATERS)


def scan(path: str, spec: SlabSpec, *, ahead: int = SCAN_AHEAD,
         stop: threading.Event | None = None) -> dict[int, bytes]:
    """Slot -> block hash of every slot of the slab at ``path`` whose header parses and
    fits ``spec`` (format version, fingerprint, rank, world, row bytes, its own slot
    index). Payloads are not read: their checksums are checked on read. A missing file,
    one not exactly the spec's size, or a file header of another spec: ``{}`` -- the
    same test :meth:`SlabFile.open` makes before it reuses a file (it re-initialises
    any other), so the warm index never names a slot the worker then wipes. Never
    raises for content (an unreadable file: OSError).

    Read-ahead: slot headers are one page every ``slot_stride`` bytes, too far apart for
    the kernel's own read-ahead, so each ``pread`` of a cold file waited for the device
    alone (91 us a slot here: about 14 minutes for 1 TiB of 128 KiB rows). Before
    reading slot ``i`` the scan asks the kernel (``POSIX_FADV_WILLNEED``, which starts
    the read and does not wait for it) for the header page of slot ``i + ahead``, so
    ``ahead`` header reads are in flight while it parses (``ahead=0``: none, one at a
    time). A file system that refuses the advice is scanned one read at a time.

    ``stop``: once set, the scan ends within :data:`SCAN_STOP_SLOTS` slots and returns
    ``{}`` (the engine closes while its scan runs on a thread)."""
    try:  # never follows a link, never waits for a FIFO's writer (the scan runs on the
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:  # scheduler's loop before any Ready: a wait is a hang)
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != spec.file_bytes \
                or untrusted(st) is not None:  # (the worker's open refuses it too)
            return {}
        if not spec.matches_file_header(os.pread(fd, PAGE, 0)):
            return {}
        return _scan_slots(fd, spec, ahead, stop)
    finally:
        os.close(fd)


def _scan_slots(fd: int, spec: SlabSpec, ahead: int, stop: threading.Event | None
                ) -> dict[int, bytes]:
    """:func:`scan`'s loop over the slot headers of the open slab ``fd``: in sequential
    runs where the slots are close (:func:`_scan_runs`), else one read per header."""
    if spec.slot_stride <= SCAN_SEQUENTIAL_STRIDE:
        return _scan_runs(fd, spec, stop)
    digest = _digest(spec.fingerprint)
    out: dict[int, bytes] = {}
    need = _SLOT.size + _CRC.size
    slots, offset = spec.slots, spec.slot_offset
    advise = _advise_willneed if ahead > 0 else None
    if advise is not None:
        for slot in range(min(ahead, slots)):
            if not advise(fd, offset(slot)):
                advise = None
                break
    for slot in range(slots):
        if stop is not None and not slot % SCAN_STOP_SLOTS and stop.is_set():
            return {}
        if advise is not None and slot + ahead < slots and not advise(fd, offset(slot + ahead)):
            advise = None
        got = _parse_slot_header(os.pread(fd, need, offset(slot)))
        if isinstance(got, _SlotHeader) and _header_fits(got, spec, digest, slot):
            out[slot] = got.block_hash
    return out


def _scan_runs(fd: int, spec: SlabSpec, stop: threading.Event | None
               ) -> dict[int, bytes]:
    """:func:`_scan_slots` in reads of :data:`SCAN_RUN_BYTES` (whole slots, rows too),
    each header parsed from memory. Why: every ``pread`` lets go of the GIL, and the
    scan runs on a thread of the serving process -- while vLLM's loop spins (its first
    lookups ask again until the scan is applied) each read waited up to the
    interpreter's switch interval to get it back: 910 slots took 0.6 s beside a busy
    thread (4 ms idle) and 10 s in CI, past the start's wait, so a restarted engine
    recomputed its first request. Sequential reads also suit a cold file where rows are
    small (the kernel's own read-ahead); large rows keep the header reads."""
    digest = _digest(spec.fingerprint)
    out: dict[int, bytes] = {}
    need = _SLOT.size + _CRC.size
    stride, slots = spec.slot_stride, spec.slots
    per = max(1, SCAN_RUN_BYTES // stride)
    for first in range(0, slots, per):
        n = min(per, slots - first)
        view = memoryview(os.pread(fd, n * stride, spec.slot_offset(first)))
        for i in range(n):
            slot = first + i
            if stop is not None and not slot % SCAN_STOP_SLOTS and stop.is_set():
                return {}
            got = _parse_slot_header(view[i * stride:i * stride + need])
            if isinstance(got, _SlotHeader) and _header_fits(got, spec, digest, slot):
                out[slot] = got.block_hash
    return out


def _advise_willneed(fd: int, offset: int) -> bool:
    """Start reading the page at ``offset`` into the page cache; False: the file system
    (or the platform) refused, ask no more."""
    try:
        os.posix_fadvise(fd, offset, PAGE, os.POSIX_FADV_WILLNEED)
    except (OSError, AttributeError):
        return False
    return True


# ---------------------------------------------------------------------------- the file


#: The counter each read outcome adds to.
_OUTCOME_COUNTER: Final = {SlotOutcome.HIT: "reads", SlotOutcome.EMPTY: "empty",
                           SlotOutcome.BAD_HEADER: "bad_header",
                           SlotOutcome.BAD_CRC: "crc_mismatch"}


class SlabLocked(ConfigError):
    """Another process (or another SlabFile here) holds the slab file's lock: two engines
    never share a slab."""


class _Buffers:
    """One thread's PAGE-aligned buffers: the header page, and (made on first need) the
    bounce buffer of a header page plus a padded payload."""

    def __init__(self, stride: int) -> None:
        self._stride = stride
        self.header = _aligned_page()
        self._heads: mmap.mmap | None = None
        self._bounce: mmap.mmap | None = None

    def heads(self) -> memoryview:
        """GROUP_SLOTS header pages, one per slot of a group (made on first need)."""
        if self._heads is None:
            self._heads = mmap.mmap(-1, GROUP_SLOTS * PAGE)
        return memoryview(self._heads)

    def bounce(self) -> mmap.mmap:
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, self._stride)
        return self._bounce

    def close(self) -> None:
        """Unmap (a buffer still exported -- a view kept alive by a traceback -- is left
        to the garbage collector)."""
        for m in (self.header, self._heads, self._bounce):
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass


def _fallocate(fd: int, path: str, size: int) -> None:
    """Allocate ``size`` bytes for ``fd``; ENOSPC / EDQUOT -> ConfigError naming the size."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise ConfigError(f"slab file {path!r}: cannot allocate {size} bytes "
                              f"({exc.strerror})") from exc
        raise



#: Opens of a slab that ``kvshm disk --remove`` (or anything else) unlinked between
#: the open and the lock before :meth:`SlabFile.open` gives up.
_OPEN_TRIES: Final = 5


def _open_locked(path: str, *, direct: bool) -> tuple[int, bool] | None:
    """Open (creating) ``path`` and take its exclusive ``flock``: (fd, whether this call
    created the file); None when the path no longer names the locked file (a remover
    -- ``kvshm disk --remove`` locks a file no one holds, then unlinks it -- got in
    between the open and the lock: the lock would guard an unlinked inode while the
    next engine creates a new file at the path). ConfigError: cannot open; SlabLocked:
    another holder."""
    flags = (os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
             | (_O_DIRECT if direct else 0))
    refuse_special(path)
    created = not os.path.lexists(path)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if created:  # open(2) may create the file, then refuse O_DIRECT (EINVAL)
            with contextlib.suppress(OSError):
                os.unlink(path)
        if exc.errno == errno.ELOOP:  # a link put there since refuse_special looked
            raise ConfigError(f"slab file {path!r} is a symbolic link: kvshm never "
                              "writes through one (remove it)") from exc
        hint = (": the filesystem refuses O_DIRECT, set disk_io=buffered to use the page "
                "cache" if direct and exc.errno == errno.EINVAL else "")
        raise ConfigError(f"slab file {path!r}: cannot open ({exc.strerror}){hint}") \
            from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped in since refuse_special
            raise ConfigError(f"slab file {path!r} is not a regular file (remove it)")
        why = untrusted(st)
        if why is not None:
            raise ConfigError(f"slab file {path!r} {why}: kvshm never uses a slab another "
                              "user could write, nor one with a second name (remove it, "
                              "or choose another disk_path)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise SlabLocked(f"slab file {path!r} is in use by another engine "
                             "(its lock is held)") from exc
        if _names(path, fd):
            return fd, created
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def untrusted(st: os.stat_result) -> str | None:
    """Why a slab file with status ``st`` may not be used (None: it may). Its bytes are
    loaded as KV, and a checksum is no seal: a file another user owns, or may write,
    could hold any bytes with matching checksums (a probe had another user's 0666 file
    reused, rewritten and its forged blocks loaded as ok). A file with a second name (a
    hard link) would have its other name's file truncated and overwritten when it is
    re-initialised, as a symbolic link would (``refuse_special``)."""
    me = os.geteuid()
    if st.st_uid != me:
        return f"is owned by uid {st.st_uid}, not by this process's {me}"
    if st.st_mode & 0o022:
        return f"may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} names (a hard link)"
    return None


def refuse_special(path: str) -> None:
    """ConfigError unless ``path`` is absent or a regular file: a symbolic link would
    have kvshm truncate and overwrite its target (anywhere the engine may write), a
    FIFO would block the open (the scheduler's warm scan, a worker's start) until a
    writer came. Checked without following the last component."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:  # disk_path a file (ENOTDIR), a directory we may not search
        raise ConfigError(f"slab file {path!r}: {exc.strerror} (is disk_path a "
                          "directory kvshm may write?)") from None
    if stat.S_ISLNK(mode):
        raise ConfigError(f"slab file {path!r} is a symbolic link: kvshm never writes "
                          "through one (remove it, or choose another disk_path)")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"slab file {path!r} is not a regular file (remove it, or "
                          "choose another disk_path)")


def remove_unheld(path: str) -> bool:
    """Unlink the slab file at ``path`` if no process holds it: True when removed,
    False when its lock is held (a worker has it open). The unlink happens under the
    file's own lock, and only if ``path`` still names the locked file (a new engine may
    have created another there meanwhile). OSError: cannot open or unlink (gone:
    FileNotFoundError)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():  # (root could: another user's file is theirs to remove)
            raise PermissionError(errno.EPERM, f"owned by uid {owner}, not by this user",
                                  path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not _names(path, fd):
            raise FileNotFoundError(errno.ENOENT, "replaced while being removed", path)
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)

class SlabFile:
    """An open slab file (see the module docstring). Counters in :attr:`counts`:
    ``writes``, ``reads`` (HITs), ``bytes_written``, ``bytes_read``, ``bounce``,
    ``empty``, ``bad_header``, ``crc_mismatch``, ``invalidations``."""

    def __init__(self, path: str, spec: SlabSpec, fd: int, *, direct: bool) -> None:
        self.path, self.spec, self.direct = path, spec, direct
        self._fd = fd
        self._digest = _digest(spec.fingerprint)
        self._zero = _aligned_page()
        self._lock = threading.Lock()
        self._buffers: dict[int, _Buffers] = {}
        self._seq = itertools.count(time.time_ns() // 1000)
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(cls, path: str, spec: SlabSpec, *, direct: bool) -> SlabFile:
        """Open (creating and preallocating) the slab at ``path`` for ``spec``, under an
        exclusive lock. A file of the same spec is reused as is (its slots keep their
        blocks); any other content is re-initialised (every slot EMPTY; one log line).
        ConfigError: not enough space (names the size), O_DIRECT refused; SlabLocked:
        another holder. A file this call created is removed again when it fails."""
        for _ in range(_OPEN_TRIES):
            opened = _open_locked(path, direct=direct)
            if opened is not None:
                break
        else:
            raise SlabLocked(f"slab file {path!r} was removed under each of "
                             f"{_OPEN_TRIES} opens (another process keeps removing it)")
        fd, created = opened
        try:
            slab = cls(path, spec, fd, direct=direct)
        except BaseException:
            os.close(fd)
            raise
        try:
            slab._prepare()
        except BaseException:
            if created:  # leave no empty or half-allocated file of ours behind
                try:
                    os.unlink(path)
                except OSError:
                    pass
            slab.close()
            raise
        return slab

    def _prepare(self) -> None:
        """Reuse a file of this spec, else make it one: truncate (every slot zero), check
        the space, preallocate, then write the file header last (a kill before that leaves
        a file the next open re-initialises)."""
        size = os.fstat(self._fd).st_size
        if size == self.spec.file_bytes and self.spec.matches_file_header(self._pread_page(0)):
            return
        if size:
            log.warning("slab file %s holds another layout or size (%d bytes): "
                        "re-initialising it for %s", self.path, size, self.spec)
        os.ftruncate(self._fd, 0)
        need = self.spec.file_bytes
        free = _free_bytes(os.path.dirname(os.path.abspath(self.path)))
        if free < need:
            raise ConfigError(f"slab file {self.path!r}: cannot allocate {need} bytes "
                              f"({free} free)")
        _fallocate(self._fd, self.path, need)
        page = self._buffers_here().header
        page[:] = self.spec.file_header()
        self._pwrite_all([memoryview(page)], 0)

    def close(self, *, remove: bool = False) -> None:
        """Unlock and close (idempotent). No call may be running. ``remove``: unlink the
        file first, under the lock, if the path still names it (a slab no later start
        can serve: ``DiskSetup.keep``)."""
        if self._fd < 0:
            return
        if remove and _names(self.path, self._fd):
            with contextlib.suppress(OSError):  # (gone meanwhile: kvshm sweep) nothing to do
                os.unlink(self.path)
        os.close(self._fd)  # releases the flock
        self._fd = -1
        for b in self._buffers.values():
            b.close()
        self._buffers.clear()
        try:
            self._zero.close()
        except BufferError:
            pass

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # ------------------------------------------------------------------ slots

    def write(self, slot: int, rows: Sequence[memoryview], block_hash: bytes) -> None:
        """Store ``rows`` (the block's rows, region order, ``row_bytes`` in all) in
        ``slot`` under ``block_hash``, torn-write safe (module docstring). OSError on an
        I/O error (the slot then reads EMPTY or BAD, never a HIT of these rows)."""
        err = self.write_many([slot], [rows], [block_hash])[0]
        if err is not None:
            raise err

    def read_into(self, slot: int, rows: Sequence[memoryview],
                  block_hash: bytes) -> SlotOutcome:
        """Read ``slot`` into ``rows`` if it holds ``block_hash`` of this spec with an
        intact payload (HIT); otherwise EMPTY / BAD_HEADER / BAD_CRC (counted), where the
        direct path may have changed ``rows`` (module docstring). OSError on I/O errors."""
        got = self.read_many([slot], [rows], [block_hash])[0]
        if isinstance(got, OSError):
            raise got
        return got

    def write_many(self, slots: Sequence[int], rows: Sequence[Sequence[memoryview]],
                   hashes: Sequence[bytes]) -> list[OSError | None]:
        """Store block k (``rows[k]``, as :meth:`write`) in ``slots[k]`` under
        ``hashes[k]``, in order. Neighbouring slots (``slots[k + 1] == slots[k] + 1``)
        whose rows need no bounce go in one vectored write (a group: at most
        :data:`GROUP_SLOTS` slots and :data:`GROUP_BYTES` bytes), each slot's header page
        right before its payload, so a torn group is a run of whole slots, at most one
        torn slot (BAD_CRC) and untouched ones (module docstring). Per block: None
        (written) or the OSError of its group. ConfigError for bad input, before any I/O."""
        byte_rows = self._checked(slots, rows, hashes)
        out: list[OSError | None] = []
        done = bounced = 0
        for a, b, direct in self._groups(slots, byte_rows):
            try:
                if direct:
                    self._write_group(slots[a:b], byte_rows[a:b], hashes[a:b])
                else:
                    self._write_bounced(slots[a], byte_rows[a], hashes[a])
                    bounced += 1
                out += [None] * (b - a)
                done += b - a
            except OSError as exc:
                out += [exc] * (b - a)
        with self._lock:
            self.counts["writes"] += done
            self.counts["bytes_written"] += done * self.spec.row_bytes
            self.counts["bounce"] += bounced
        return out

    def read_many(self, slots: Sequence[int], rows: Sequence[Sequence[memoryview]],
                  hashes: Sequence[bytes]) -> list[SlotOutcome | OSError]:
        """Read ``slots[k]`` into ``rows[k]`` if it holds ``hashes[k]`` (each as
        :meth:`read_into`; neighbouring slots in one vectored read, grouped as
        :meth:`write_many` groups them). Per block: its outcome (counted), or the OSError
        of its group. ConfigError for bad input, before any I/O."""
        byte_rows = self._checked(slots, rows, hashes)
        out: list[SlotOutcome | OSError] = []
        bounced = 0
        for a, b, direct in self._groups(slots, byte_rows, descending=True):
            try:
                if direct:
                    out += self._read_group(slots[a:b], byte_rows[a:b], hashes[a:b])
                else:
                    out.append(self._read_bounced(slots[a], byte_rows[a], hashes[a]))
                    bounced += 1
            except OSError as exc:
                out += [exc] * (b - a)
        tally = Counter(_OUTCOME_COUNTER[o] for o in out if isinstance(o, SlotOutcome))
        with self._lock:
            self.counts.update(tally)
            self.counts["bounce"] += bounced
            self.counts["bytes_read"] += tally["reads"] * self.spec.row_bytes
        return out

    def invalidate(self, slot: int) -> None:
        """Make ``slot`` read EMPTY (its header page zeroed)."""
        self._pwrite_all([memoryview(self._zero)], self.spec.slot_offset(slot))
        self._count("invalidations")

    # ------------------------------------------------------------------ groups

    def _groups(self, slots: Sequence[int], rows: Sequence[list[memoryview]], *,
                descending: bool = False) -> Iterator[tuple[int, int, bool]]:
        """``(a, b, direct)``: blocks ``a..b-1`` go in one I/O; ``direct``: straight
        between their rows and the file (neighbouring slots, within the group limits),
        else one block through the bounce buffer. ``descending`` (reads): slots k, k - 1,
        ... are neighbours too (write-back writes a chain deepest block first, so a
        request reads its blocks in falling slot order; :meth:`_read_group` reads such a
        group in file order)."""
        n = len(slots)
        stride = self.spec.slot_stride
        # Neighbouring slots are neighbouring bytes only without padding between them.
        joinable = self.spec.row_bytes % PAGE == 0
        most = max(1, min(GROUP_SLOTS, GROUP_BYTES // stride)) if joinable else 1
        a = 0
        while a < n:
            if not self._zero_copy(rows[a]):
                yield a, a + 1, False
                a += 1
                continue
            b, iovs = a + 1, 1 + len(rows[a])
            step = -1 if descending and b < n and slots[b] == slots[a] - 1 else 1
            while (b < n and b - a < most and slots[b] == slots[b - 1] + step
                   and iovs + 1 + len(rows[b]) <= _IOV_MAX and self._zero_copy(rows[b])):
                iovs += 1 + len(rows[b])
                b += 1
            yield a, b, True
            a = b

    def _write_group(self, slots: Sequence[int], rows: Sequence[list[memoryview]],
                     hashes: Sequence[bytes]) -> None:
        heads = self._buffers_here().heads()
        iovs: list[memoryview] = []
        for j, (slot, r, h) in enumerate(zip(slots, rows, hashes)):
            head = _pack_slot_header(self.spec, self._digest, slot, h,
                                     _checksum(_WRITE_CHECKSUM, r), next(self._seq))
            page = heads[j * PAGE:(j + 1) * PAGE]  # reads land here too: zero past the header
            page[:] = _ZERO_PAGE
            page[:len(head)] = head
            iovs.append(page)
            iovs += r
        self._pwrite_all(iovs, self.spec.slot_offset(slots[0]))

    def _read_group(self, slots: Sequence[int], rows: Sequence[list[memoryview]],
                    hashes: Sequence[bytes]) -> list[SlotOutcome]:
        if len(slots) > 1 and slots[1] < slots[0]:  # a falling group: read in file order
            return self._read_group(slots[::-1], rows[::-1], hashes[::-1])[::-1]
        heads = self._buffers_here().heads()
        iovs: list[memoryview] = []
        for j, r in enumerate(rows):
            iovs.append(heads[j * PAGE:(j + 1) * PAGE])
            iovs += r
        got = self._preadv_all(iovs, self.spec.slot_offset(slots[0]))
        stride, need = self.spec.slot_stride, PAGE + self.spec.row_bytes
        return [self._verify(heads[j * PAGE:(j + 1) * PAGE], r, slot, h,
                             whole=got >= j * stride + need)
                for j, (slot, r, h) in enumerate(zip(slots, rows, hashes))]

    def _write_bounced(self, slot: int, rows: list[memoryview], block_hash: bytes) -> None:
        head = _pack_slot_header(self.spec, self._digest, slot, block_hash,
                                 _checksum(_WRITE_CHECKSUM, rows), next(self._seq))
        buf = self._buffers_here().bounce()
        buf[:PAGE] = _ZERO_PAGE
        buf[:len(head)] = head
        at = PAGE
        for r in rows:
            buf[at:at + r.nbytes] = r
            at += r.nbytes
        self._pwrite_all([memoryview(buf)[:self._span()]], self.spec.slot_offset(slot))

    def _read_bounced(self, slot: int, rows: list[memoryview],
                      block_hash: bytes) -> SlotOutcome:
        """One slot through the bounce buffer; the rows change only on a HIT."""
        view = memoryview(self._buffers_here().bounce())
        got = self._preadv_all([view[:self._span()]], self.spec.slot_offset(slot))
        outcome = self._verify(view[:PAGE], [view[PAGE:PAGE + self.spec.row_bytes]], slot,
                               block_hash, whole=got >= PAGE + self.spec.row_bytes)
        if outcome is SlotOutcome.HIT:
            at = PAGE
            for r in rows:
                r[:] = view[at:at + r.nbytes]
                at += r.nbytes
        return outcome

    # ------------------------------------------------------------------ helpers

    def _verify(self, head: memoryview, payload: Sequence[memoryview], slot: int,
                block_hash: bytes, *, whole: bool) -> SlotOutcome:
        parsed = _parse_slot_header(head)
        if not isinstance(parsed, _SlotHeader):
            return parsed
        if not _header_fits(parsed, self.spec, self._digest, slot) \
                or parsed.block_hash != block_hash:
            return SlotOutcome.BAD_HEADER
        if not whole or _checksum(parsed.checksum_id, payload) != parsed.checksum:
            return SlotOutcome.BAD_CRC
        return SlotOutcome.HIT

    def _checked(self, slots: Sequence[int], rows: Sequence[Sequence[memoryview]],
                 hashes: Sequence[bytes]) -> list[list[memoryview]]:
        """Every block's rows as flat byte views, after checking the whole call: open,
        as many rows as slots and hashes, slots in range, hashes 1..MAX_HASH_BYTES,
        ``row_bytes`` per block (ConfigError, before any I/O)."""
        if self._fd < 0:
            raise ConfigError(f"slab file {self.path!r} is closed")
        if not len(slots) == len(rows) == len(hashes):
            raise ConfigError(f"{len(slots)} slots, {len(rows)} rows and {len(hashes)} "
                              "hashes: one each per block")
        out = []
        for slot, r, h in zip(slots, rows, hashes):
            self.spec.slot_offset(slot)
            if not 0 < len(h) <= MAX_HASH_BYTES:
                raise ConfigError(f"block hash must be 1..{MAX_HASH_BYTES} bytes, "
                                  f"got {len(h)}")
            flat = _byte_rows(r)
            total = sum(v.nbytes for v in flat)
            if total != self.spec.row_bytes:
                raise ConfigError(f"rows hold {total} bytes, the slab's slots "
                                  f"{self.spec.row_bytes}")
            out.append(flat)
        return out

    def _zero_copy(self, rows: Sequence[memoryview]) -> bool:
        """Whether ``rows`` can be the I/O buffers themselves: always with buffered I/O;
        with O_DIRECT only when every row's address and length are PAGE multiples."""
        if not self.direct:
            return len(rows) < _IOV_MAX
        return len(rows) < _IOV_MAX and all(
            r.nbytes % PAGE == 0 and _address(r) % PAGE == 0 for r in rows)

    def _span(self) -> int:
        """Bytes of one slot's I/O through the bounce buffer (padded under O_DIRECT)."""
        return self.spec.slot_stride if self.direct else PAGE + self.spec.row_bytes

    def _buffers_here(self) -> _Buffers:
        tid = threading.get_ident()
        bufs = self._buffers.get(tid)
        if bufs is None:
            with self._lock:
                bufs = self._buffers[tid] = _Buffers(self.spec.slot_stride)
        return bufs

    def _pread_page(self, off: int) -> bytes:
        page = self._buffers_here().header
        n = self._preadv_all([memoryview(page)], off)
        return bytes(page[:n])

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def _pwrite_all(self, bufs: list[memoryview], off: int) -> None:
        """pwritev until every byte is written (a short write continues where it ended)."""
        while bufs:
            n = os.pwritev(self._fd, bufs, off)
            off += n
            bufs = _advance(bufs, n)

    def _preadv_all(self, bufs: list[memoryview], off: int) -> int:
        """preadv until every buffer is full or the file ends; the bytes read."""
        total = 0
        while bufs:
            n = os.preadv(self._fd, bufs, off)
            if n == 0:
                break
            off += n
            total += n
            bufs = _advance(bufs, n)
        return total


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs[0].nbytes
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def _address(view: memoryview) -> int:
    """The address of a contiguous byte view's first byte; 1 (never PAGE-aligned) for a
    read-only one, whose address ctypes cannot take: such rows go through the bounce."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:
        return 1


def _byte_rows(rows: Sequence[memoryview]) -> list[memoryview]:
    """``rows`` as flat unsigned-byte views (ConfigError for a non-contiguous one)."""
    out = []
    for r in rows:
        if not r.c_contiguous:
            raise ConfigError("slab rows must be contiguous buffers")
        out.append(r if r.format == "B" and r.ndim == 1 else r.cast("B"))
    return out
