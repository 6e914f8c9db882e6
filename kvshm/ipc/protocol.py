"""Wire messages between the scheduler side and the workers (msgspec, msgpack).

Every message is a frozen, array-like, gc-free ``msgspec.Struct`` with an integer tag, so
one encoded record is ``[tag, field0, field1, ...]``. Schema evolution rule: a field is
only ever *appended*, with a default; an older reader ignores trailing fields it does not
know and a newer reader fills defaults for fields an older writer did not send. Tags are
never reused.

Three channels, each with one encoder and one typed decoder per direction (reuse them:
building a decoder costs far more than decoding):

* ``cmd`` ring, scheduler -> worker: :data:`CmdMsg` = Transfer | Flush | Shutdown | Remote
  | Disk
* ``done`` ring, worker -> scheduler: :data:`DoneMsg` = Done
* rendezvous socket, both ways: :data:`ControlMsg` = Hello | Ready | StatsRequest | Stats
  | Shutdown | Goodbye | SetupFailed

Block ids travel as packed little-endian u32 ``bytes`` (:func:`pack_ids` /
:func:`unpack_ids`): a msgpack list of 2,048 ints costs ~26 us to decode, packed bytes
~0.2 us.

``Ready`` carries file descriptors out of band (SCM_RIGHTS), always in this order:
``[ring segment, host pool segment, cmd eventfd, done eventfd, *device cache segments]``
(:data:`READY_FIXED_FDS` fixed ones, then one per CPU ``Ready.device_caches`` entry; a
CUDA device cache travels as a :class:`CudaIpc` handle inside its ``TensorSpec``, no fd).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from enum import IntEnum
from typing import Any, Final

import msgspec

from kvshm.errors import ProtocolError, VersionMismatch

#: Bumped on any incompatible change; checked in the Hello/Ready handshake.
PROTOCOL_VERSION: Final = 2

#: Number of fds every ``Ready`` carries before the device-cache fds.
READY_FIXED_FDS: Final = 4

if sys.byteorder != "little":  # pragma: no cover - every supported platform is LE
    raise ImportError("kvshm's wire format assumes a little-endian host")


class Direction(IntEnum):
    """Which way a transfer copies: STORE is device -> CPU tier, LOAD the reverse."""

    STORE = 0
    LOAD = 1


class _Msg(msgspec.Struct, array_like=True, frozen=True, gc=False, tag_field="t"):
    """Base of wire messages (array-like, frozen, untracked by the GC)."""


class RemoteOp(IntEnum):
    """Which way a :class:`Remote` job moves a block: PUT is CPU tier -> remote tier, GET
    the reverse (into CPU rows the scheduler allocated; a load to the GPU follows as its
    own Transfer once every rank acked the GET)."""

    PUT = 0
    GET = 1


class RegionSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One KV region of a rank: ``num_blocks`` rows of ``bytes_per_block`` bytes, each
    row one block of elements of ``dtype`` in the C-order shape ``block_shape`` (what
    its bytes mean: two regions of equal size but another shape hold other KV; version
    2 of the protocol added it)."""

    bytes_per_block: int
    num_blocks: int
    dtype: str
    block_shape: tuple[int, ...] = ()


class LayoutSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A rank's KV layout as plain data (``kvshm.layout.KVLayout`` converts)."""

    regions: tuple[RegionSpec, ...]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id covers across every region of this rank."""
        return sum(r.bytes_per_block for r in self.regions)

    @property
    def num_blocks(self) -> int:
        """Device blocks per region (all regions of a rank have the same count)."""
        return min((r.num_blocks for r in self.regions), default=0)


class CudaIpc(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where a CUDA device cache lives, for another process on the machine to open
    (made and opened by :mod:`kvshm.cuda_ipc`, which documents the contract).

    ``handle`` is the ``cudaIpcMemHandle`` of the CUDA allocation holding the tensor;
    ``storage_offset_bytes``/``storage_bytes`` place the tensor's storage in it and
    ``tensor_offset`` (elements) the tensor in its storage. ``device_uuid`` names the GPU
    (a worker may number its GPUs differently: CUDA_VISIBLE_DEVICES). The ref-counter and
    event fields are torch's IPC bookkeeping, passed through unchanged.
    """

    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class TensorSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Shape and dtype of a device cache sent to a standalone worker: a shared-memory
    segment (its fd rides along with Ready) or, with ``cuda``, a CUDA IPC handle."""

    shape: tuple[int, ...]
    dtype: str
    cuda: CudaIpc | None = None


class DiskOp(IntEnum):
    """Which way a :class:`Disk` job moves a block: WRITE is CPU tier -> this rank's slab
    file (write-back of a block the CPU tier is about to evict), READ the reverse (into
    fresh CPU rows nothing else uses)."""

    WRITE = 0
    READ = 1


class DiskSetup(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The local disk tier of one rank (in ``Ready``): the path of its slab file, the
    number of slots the scheduler hands out in it, the layout fingerprint every slot
    header carries, whether the rank reads and writes it with ``O_DIRECT`` (False only
    where the user asked for buffered I/O), and whether the file outlives the rank
    (``EngineConfig.disk_keep``; False: the rank removes it when its mover closes)."""

    path: str
    slots: int
    fingerprint: str
    direct: bool = True
    keep: bool = True


class RemoteSetup(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The remote tier a worker connects to (in ``Ready``): its URL (the knobs included,
    ``kvshm.remote.tier.RemoteSpec`` parses it) and the layout fingerprint every key and
    header of this engine carries."""

    url: str
    fingerprint: str


class Hello(_Msg, tag=1, frozen=True, array_like=True, gc=False):
    """Worker -> scheduler, first message on the rendezvous socket."""

    version: int
    rank: int
    world_size: int
    pid: int
    layout: LayoutSpec | None = None
    #: A standalone worker's ``--device`` ("cpu" or "cuda"); "" from an embedded worker
    #: (it brings its own ``layout``) or an older one.
    device: str = ""
    #: The worker's process runs nothing but kvshm's copies (a ``kvshm-workers`` rank):
    #: at a verdict that is no fence (a hang, a broken ring) the engine may SIGKILL it
    #: to fence it. Besides the ranks it spawned, the engine signals no process that
    #: did not offer this.
    fence_by_kill: bool = False


class Ready(_Msg, tag=2, frozen=True, array_like=True, gc=False):
    """Scheduler -> worker once every rank has said hello; fds ride along (see module doc)."""

    version: int
    rank: int
    layout: LayoutSpec
    num_cpu_blocks: int
    cmd_capacity: int
    done_capacity: int
    host_offsets: tuple[int, ...]
    host_bytes: int
    device_caches: tuple[TensorSpec, ...] = ()
    remote: RemoteSetup | None = None
    disk: DiskSetup | None = None


class StatsRequest(_Msg, tag=3, frozen=True, array_like=True, gc=False):
    """Anyone -> scheduler: answer with a ``Stats`` on this connection."""


class Stats(_Msg, tag=4, frozen=True, array_like=True, gc=False):
    """Scheduler -> asker: a statistics snapshot (plain JSON-like data), or
    :func:`stats_failure`'s answer when there is none to give."""

    data: dict[str, Any]


def stats_failure(problem: str) -> Stats:
    """A ``Stats`` answer with no statistics, only why (they could not be built, or are
    too large to send): ``{"error": problem}``, no ``state``."""
    return Stats(data={"error": problem})


def is_stats_failure(data: dict[str, Any]) -> bool:
    """Whether a ``Stats`` answer's data is :func:`stats_failure`'s."""
    return "error" in data and "state" not in data


class Transfer(_Msg, tag=5, frozen=True, array_like=True, gc=False):
    """Copy row ``src_ids[i]`` to row ``dst_ids[i]`` in every region of the rank."""

    step: int
    job_id: int
    direction: Direction
    src_ids: bytes
    dst_ids: bytes


class Flush(_Msg, tag=6, frozen=True, array_like=True, gc=False):
    """The worker must finish ``job_ids`` before the compute of ``step``."""

    step: int
    job_ids: bytes


class Shutdown(_Msg, tag=7, frozen=True, array_like=True, gc=False):
    """Stop after finishing what is queued."""


class Done(_Msg, tag=8, frozen=True, array_like=True, gc=False):
    """Worker -> scheduler: ``job_id`` has really finished on ``rank`` (or failed)."""

    job_id: int
    rank: int
    ok: bool
    error: str = ""


class Goodbye(_Msg, tag=9, frozen=True, array_like=True, gc=False):
    """Worker -> scheduler on the rendezvous socket, just before a worker that was closed
    by its own host (not detached by a fault) closes the socket: the EOF that follows is
    a clean departure, not a death. Sent once none of its copies runs."""

    rank: int
    reason: str


class SetupFailed(_Msg, tag=12, frozen=True, array_like=True, gc=False):
    """Worker -> scheduler on the rendezvous socket, just before a worker that could not
    set up what its Ready named (map a segment, open its device caches: an address-space
    or fd limit, a wrong device) closes the socket: why, so the engine's line names the
    cause and not only "lifeline lost" (the cause used to be on the rank's stderr
    alone). The EOF that follows is a death as before (nothing of the rank runs)."""

    rank: int
    reason: str


class Remote(_Msg, tag=10, frozen=True, array_like=True, gc=False):
    """Move CPU rows ``cpu_ids[i]`` to or from the remote tier under block ``hashes[i]``
    (``hash_len`` bytes each, concatenated); the worker builds each key from its rank and
    ``Ready.remote``. Runs on arrival (no step: a PUT is posted only after its rows' store
    was acked by every rank; a GET goes into fresh rows, which on a rank with a disk tier
    it fills only once no Disk WRITE received before it still reads them -- the
    write-down of the blocks its allocation evicted)."""

    job_id: int
    op: RemoteOp
    cpu_ids: bytes
    hashes: bytes
    hash_len: int
    #: PUT only: store with the tier's hold TTL instead of the ordinary one (a P/D
    #: hand-off's blocks, until the decoder gives them the ordinary TTL).
    keep: bool = False


class Disk(_Msg, tag=11, frozen=True, array_like=True, gc=False):
    """Move CPU rows ``cpu_ids[i]`` to or from slot ``slots[i]`` of the rank's slab file
    (``Ready.disk``) under block ``hashes[i]`` (``hash_len`` bytes each, concatenated).
    Runs on arrival (no step, no fence): the scheduler posts a WRITE only for rows whose
    store every rank acked, into slots no job reads, and a READ only from slots no job
    writes, into rows nothing else uses. A READ whose slot header or checksum does not
    match fails the job (failure = miss = recompute); the scheduler drops its slots."""

    job_id: int
    op: DiskOp
    cpu_ids: bytes
    slots: bytes
    hashes: bytes
    hash_len: int


CmdMsg = Transfer | Flush | Shutdown | Remote | Disk
DoneMsg = Done
ControlMsg = Hello | Ready | StatsRequest | Stats | Shutdown | Goodbye | SetupFailed


def pack_ids(ids: Iterable[int]) -> bytes:
    """Block ids as packed little-endian u32."""
    return array("I", ids).tobytes()


def ids_array(data: bytes | memoryview) -> array[int]:
    """The ids of a :func:`pack_ids` payload as an ``array('I')`` (one copy, no Python
    ints: a copy engine wraps it in a tensor); raises ProtocolError on a ragged length."""
    if len(data) % 4:
        raise ProtocolError(f"block id payload of {len(data)} bytes is not a multiple of 4")
    out = array("I")
    out.frombytes(data)
    return out


def unpack_ids(data: bytes | memoryview) -> list[int]:
    """Inverse of :func:`pack_ids`; raises ProtocolError on a ragged length."""
    return ids_array(data).tolist()


def cmd_encoder() -> msgspec.msgpack.Encoder:
    """Encoder for the scheduler -> worker ``cmd`` ring."""
    return msgspec.msgpack.Encoder()


def cmd_decoder() -> msgspec.msgpack.Decoder[CmdMsg]:
    """Typed decoder for the ``cmd`` ring (worker side)."""
    return msgspec.msgpack.Decoder(CmdMsg)


def done_encoder() -> msgspec.msgpack.Encoder:
    """Encoder for the worker -> scheduler ``done`` ring."""
    return msgspec.msgpack.Encoder()


def done_decoder() -> msgspec.msgpack.Decoder[Done]:
    """Typed decoder for the ``done`` ring (scheduler side)."""
    return msgspec.msgpack.Decoder(Done)


def control_encoder() -> msgspec.msgpack.Encoder:
    """Encoder for rendezvous-socket messages."""
    return msgspec.msgpack.Encoder()


def control_decoder() -> msgspec.msgpack.Decoder[ControlMsg]:
    """Typed decoder for rendezvous-socket messages."""
    return msgspec.msgpack.Decoder(ControlMsg)


def check_version(theirs: int) -> None:
    """Raise :class:`VersionMismatch` unless ``theirs`` is our PROTOCOL_VERSION."""
    if theirs != PROTOCOL_VERSION:
        raise VersionMismatch(PROTOCOL_VERSION, theirs)
