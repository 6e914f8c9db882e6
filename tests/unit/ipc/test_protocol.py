"""Wire messages: round trips, packed ids, version check, schema evolution."""

from __future__ import annotations

import msgspec
import pytest

from kvshm.errors import ProtocolError, VersionMismatch
from kvshm.ipc import protocol as p


def test_transfer_round_trip_with_packed_ids() -> None:
    msg = p.Transfer(3, 7, p.Direction.LOAD, p.pack_ids([0, 5, 2**32 - 1]), p.pack_ids([1, 2, 3]))
    out = p.cmd_decoder().decode(p.cmd_encoder().encode(msg))
    assert out == msg
    assert isinstance(out, p.Transfer)
    assert p.unpack_ids(out.src_ids) == [0, 5, 2**32 - 1]
    assert out.direction is p.Direction.LOAD


def test_decode_from_memoryview_slice() -> None:
    buf = bytearray(64)
    enc = p.done_encoder().encode(p.Done(9, 1, False, "boom"))
    buf[8 : 8 + len(enc)] = enc
    out = p.done_decoder().decode(memoryview(buf)[8 : 8 + len(enc)])
    assert out == p.Done(9, 1, False, "boom")


def test_ragged_ids_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        p.unpack_ids(b"\x01\x02\x03")


def test_version_mismatch_names_both_versions() -> None:
    with pytest.raises(VersionMismatch) as info:
        p.check_version(p.PROTOCOL_VERSION + 1)
    assert str(p.PROTOCOL_VERSION) in str(info.value)
    assert str(p.PROTOCOL_VERSION + 1) in str(info.value)


def test_wrong_tag_on_ring_is_a_decode_error() -> None:
    with pytest.raises(msgspec.ValidationError):
        p.done_decoder().decode(p.cmd_encoder().encode(p.Shutdown()))


def test_newer_message_with_appended_field_decodes_on_older_reader() -> None:
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
