"""The wire messages (:mod:`kvshm.ipc.protocol`): round trips through the ring encoders,
packed ids, the version check, and schema evolution between releases."""

from __future__ import annotations

import msgspec
import pytest

from kvshm.errors import ProtocolError, VersionMismatch
from kvshm.ipc import protocol as p


def test_transfer_round_trip_with_packed_ids() -> None:
    """A Transfer survives the cmd ring's encoder and decoder whole: the same struct back,
    its ids packed as little-endian u32 (the largest, 2**32 - 1, included) and its
    direction an enum, not an int -- what a worker reads is exactly what the scheduler
    planned."""
    msg = p.Transfer(3, 7, p.Direction.LOAD, p.pack_ids([0, 5, 2**32 - 1]), p.pack_ids([1, 2, 3]))
    out = p.cmd_decoder().decode(p.cmd_encoder().encode(msg))
    assert out == msg
    assert isinstance(out, p.Transfer)
    assert p.unpack_ids(out.src_ids) == [0, 5, 2**32 - 1]
    assert out.direction is p.Direction.LOAD


def test_decode_from_memoryview_slice() -> None:
    """The decoders read a record in place from a slice of a larger buffer, as a ring hands
    them a memoryview into the segment: no copy is needed, and the bytes around the
    slice are not read."""
    buf = bytearray(64)
    enc = p.done_encoder().encode(p.Done(9, 1, False, "boom"))
    buf[8 : 8 + len(enc)] = enc
    out = p.done_decoder().decode(memoryview(buf)[8 : 8 + len(enc)])
    assert out == p.Done(9, 1, False, "boom")


def test_ragged_ids_are_a_protocol_error() -> None:
    """Packed ids whose length is not a multiple of 4 cannot come from our encoder:
    ProtocolError (a peer's garbage is refused with a typed error, never a struct.error
    or a silent truncation)."""
    with pytest.raises(ProtocolError):
        p.unpack_ids(b"\x01\x02\x03")


def test_version_mismatch_names_both_versions() -> None:
    """A peer speaking another protocol version is refused with VersionMismatch naming both
    versions, so the operator sees which side to upgrade."""
    with pytest.raises(VersionMismatch) as info:
        p.check_version(p.PROTOCOL_VERSION + 1)
    assert str(p.PROTOCOL_VERSION) in str(info.value)
    assert str(p.PROTOCOL_VERSION + 1) in str(info.value)


def test_wrong_tag_on_ring_is_a_decode_error() -> None:
    """A cmd-ring message (Shutdown) fed to the done ring's decoder fails validation: each
    ring accepts only its own tagged union, so a record on the wrong ring is an error,
    never a message of another type."""
    with pytest.raises(msgspec.ValidationError):
        p.done_decoder().decode(p.cmd_encoder().encode(p.Shutdown()))


def test_newer_message_with_appended_field_decodes_on_older_reader() -> None:
    """Schema evolution both ways: a Done with a field appended by a newer writer decodes
    on this reader (the extra field ignored), and this writer's Done decodes on the
    newer reader with the new field's default -- appending a defaulted field never needs
    a version bump."""
    class DoneV2(msgspec.Struct, array_like=True, frozen=True, gc=False, tag_field="t", tag=8):
        job_id: int
        rank: int
        ok: bool
        error: str = ""
        copy_ns: int = 0  # appended in a hypothetical newer version

    wire = msgspec.msgpack.encode(DoneV2(1, 0, True, "", 12345))
    assert p.done_decoder().decode(wire) == p.Done(1, 0, True, "")
    # ... and an older writer's message decodes on the newer reader with the default.
    old = p.done_encoder().encode(p.Done(2, 1, True))
    assert msgspec.msgpack.decode(old, type=DoneV2).copy_ns == 0
