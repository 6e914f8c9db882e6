"""The disk tier's settings: ``EngineConfig.disk_path`` / ``disk_bytes_per_rank`` /
``disk_io`` and the vLLM connector's extra-config keys of the same names, each refusal a
ConfigError of one line naming the setting; the slot count rule of the engine's disk
link (a slab holds its file header page, then whole slots of a header page plus the
row rounded up to 4 KiB)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest

from kvshm.config import DiskIO, DiskMode, EngineConfig, default_name
from kvshm.disk import PAGE, SlabFile, SlabSpec
from kvshm.engine.disk_link import remove_dead_generated, slot_count, slot_stride
from kvshm.errors import ConfigError
from kvshm.integrations.vllm.config import check_extra_config
from kvshm.pids import pid_running
from kvshm.types import KVGroup


def test_a_disk_tier_needs_both_its_directory_and_its_size() -> None:
    cfg = EngineConfig(block_size=16, disk_path="/tmp", disk_bytes_per_rank=1 << 20)
    assert cfg.disk_io is DiskIO.DIRECT
    with pytest.raises(ConfigError, match="disk_path needs disk_bytes_per_rank"):
        EngineConfig(block_size=16, disk_path="/tmp")
    with pytest.raises(ConfigError, match="disk_bytes_per_rank is set but disk_path"):
        EngineConfig(block_size=16, disk_bytes_per_rank=1 << 20)
    with pytest.raises(ConfigError, match="disk_bytes_per_rank must be > 0"):
        EngineConfig(block_size=16, disk_path="/tmp", disk_bytes_per_rank=0)
    with pytest.raises(ConfigError, match="disk_io must be a DiskIO"):
        EngineConfig(block_size=16, disk_path="/tmp", disk_bytes_per_rank=1,
                     disk_io="direct")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="full-attention KV groups only"):
        EngineConfig(block_size=16, disk_path="/tmp", disk_bytes_per_rank=1 << 20,
                     groups=(KVGroup.full(), KVGroup.sliding_window(64)))


def test_a_disk_path_that_is_not_utf8_is_refused_in_one_line() -> None:
    """A directory whose name is Latin-1 bytes (``os.fsdecode`` gives a str with a lone
    surrogate) went into each rank's Ready, which could not be encoded: the start hung
    for its whole connect timeout and then blamed the ranks (a hostile probe). It is the
    config's ConfigError now, naming the path."""
    with pytest.raises(ConfigError, match="disk_path must be valid UTF-8"):
        EngineConfig(block_size=16, disk_path=os.fsdecode(b"/tmp/latin1-\xe9"),
                     disk_bytes_per_rank=1 << 20)


def test_a_relative_disk_path_under_a_non_utf8_directory_is_refused_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: the check ran before the path was made absolute, so a relative
    ``disk_path`` in a working directory with a Latin-1 name passed it."""
    odd = tmp_path / os.fsdecode(b"latin1-\xe9")
    odd.mkdir()
    monkeypatch.chdir(odd)
    with pytest.raises(ConfigError, match="disk_path must be valid UTF-8"):
        EngineConfig(block_size=16, disk_path="slabs", disk_bytes_per_rank=1 << 20)


def test_slabs_are_kept_where_the_name_was_given_and_removed_where_it_was_generated(
        ) -> None:
    """``disk_keep`` None resolves at construction: False for the generated default
    name (new every start: its slabs could never serve a restart), True for a given
    one -- even one made by ``default_name()`` and passed in, as a caller that restarts
    under it does; a copy keeps what was resolved; an explicit value wins; the name is
    a plain str either way."""
    d = dict(block_size=16, disk_path="/tmp", disk_bytes_per_rank=1 << 20)
    gen = EngineConfig(**d)  # type: ignore[arg-type]
    assert gen.disk_keep is False and type(gen.name) is str
    assert dataclasses.replace(gen, tp=2).disk_keep is False
    assert EngineConfig(name=default_name(), **d).disk_keep is True  # type: ignore[arg-type]
    assert EngineConfig(disk_keep=True, **d).disk_keep is True  # type: ignore[arg-type]
    assert EngineConfig(name="x", disk_keep=False, **d).disk_keep is False  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="disk_keep must be"):
        EngineConfig(disk_keep="no", **d)  # type: ignore[arg-type]


def test_a_relative_disk_path_is_made_absolute_where_the_config_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``disk_path="slabs"``: the scheduler checked and scanned ``./slabs`` of its own
    working directory, but the slab paths it sent the ranks were relative too, so a
    ``kvshm-workers`` started in another directory created its slabs there (or failed)
    and a restart's warm scan never saw them. Resolved at construction now."""
    monkeypatch.chdir(tmp_path)
    cfg = EngineConfig(block_size=16, disk_path="slabs", disk_bytes_per_rank=1 << 20)
    assert cfg.disk_path == str(tmp_path / "slabs")
    assert dataclasses.replace(cfg, tp=2).disk_path == str(tmp_path / "slabs")


def test_the_vllm_keys_parse_and_refuse_in_one_line() -> None:
    s = check_extra_config({"disk_path": "/d", "disk_bytes_per_rank": 2e9,
                            "disk_io": "buffered", "disk_mode": "write_through"})
    assert (s.disk_path, s.disk_bytes_per_rank, s.disk_io) == ("/d", 2_000_000_000,
                                                                DiskIO.BUFFERED)
    assert s.disk_mode is DiskMode.WRITE_THROUGH
    assert check_extra_config({}).disk_path is None
    cases: list[tuple[dict[str, object], str]] = [
        ({"disk_path": "/d"}, "go together"),
        ({"disk_bytes_per_rank": 10}, "go together"),
        ({"disk_path": 3, "disk_bytes_per_rank": 10}, "directory path"),
        ({"disk_path": "/d", "disk_bytes_per_rank": -1}, "must be > 0"),
        ({"disk_path": "/d", "disk_bytes_per_rank": 9, "disk_io": "odirect"},
         "must be one of ['buffered', 'direct']"),
        ({"disk_path": "/d", "disk_bytes_per_rank": 9, "disk_mode": "back"},
         "must be one of ['write_back', 'write_through']"),
        # unhashable values: a ConfigError naming the key, not a bare TypeError
        ({"disk_path": "/d", "disk_bytes_per_rank": 9, "disk_io": {"x": 1}},
         "['disk_io'] must be one of ['buffered', 'direct']"),
        ({"disk_path": "/d", "disk_bytes_per_rank": 9, "disk_mode": ["write_back"]},
         "['disk_mode'] must be one of ['write_back', 'write_through']"),
        ({"remote_url": "valkey://127.0.0.1:6379", "remote_mode": ["on_evict"]},
         "['remote_mode'] must be one of ['on_evict', 'write_through']"),
        # a tier's own keys without its anchor: the user believes the tier is on, and
        # the engine used to start without it, silently
        ({"disk_mode": "write_through"}, "['disk_mode'] set but 'disk_path' is not"),
        ({"disk_io": "buffered", "disk_mode": "write_back"},
         "['disk_io', 'disk_mode'] set but 'disk_path' is not"),
        ({"remote_mode": "on_evict"}, "'remote_mode' is set but 'remote_url' is not")]
    # the anchor given as None: a template's explicit "tier off", accepted as before
    assert check_extra_config({"remote_url": None, "remote_mode": "on_evict"}).remote_url \
        is None
    assert check_extra_config({"disk_path": None, "disk_bytes_per_rank": None,
                               "disk_mode": "write_through"}).disk_path is None
    # every key given as None means its default, these four too (a hostile probe's
    # template failed on them alone: "must be a string")
    nulls = check_extra_config({"remote_url": "valkey://127.0.0.1:6379", "remote_mode": None,
                                "remote_namespace": None, "disk_path": "/d",
                                "disk_bytes_per_rank": 1 << 20, "disk_io": None,
                                "disk_mode": None})
    assert (nulls.remote_mode.value, nulls.remote_namespace, nulls.disk_io.value,
            nulls.disk_mode.value) == ("write_through", "", "direct", "write_back")
    assert check_extra_config({"remote_mode": None, "disk_mode": None}).remote_url is None
    for extra, msg in cases:
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")) \
                as info:
            check_extra_config(extra)
        assert "\n" not in str(info.value)


def test_slots_are_whole_slots_after_the_file_header_on_every_rank() -> None:
    """A 128 KiB row takes 132 KiB a slot; a 1 MiB + 4 KiB slab holds 7 of them (the
    file header page first); a 5000-byte row rounds up to 8 KiB + the header page;
    every rank gets the smallest count of any rank."""
    assert slot_stride(128 << 10) == 132 << 10 and slot_stride(5000) == 12 << 10
    assert slot_count((1 << 20) + 4096, {0: 128 << 10}) == 7
    assert slot_count(1 << 20, {0: 5000, 1: 128 << 10}) == 7  # rank 1: 7, rank 0: 85


def test_a_start_removes_the_slabs_of_generated_name_engines_that_are_gone(
        tmp_path: Path) -> None:
    """A whole engine killed at once (``docker kill``, a cgroup OOM kill) under a
    generated name left one slab per rank: its ranks died before removing their own,
    and so did the scheduler that removes theirs at close. No start can take such a
    name again, yet each crash added files until ``disk_path`` had no room for the next
    start's slabs (a hostile probe: the third start refused, the message not naming
    them). Now every start with a disk tier first removes them -- a generated name's
    slab whose pid is gone and which no process holds -- and keeps: a given name's (a
    warm-restart cache), a running pid's, one held by a live process, and another
    user's. A "running pid" is a process that started before the slab was last
    written: a thread's id, or a process that started later (a pid reused: a container
    restarted after ``docker kill`` numbers from 1 again), is not the engine (a review:
    ``kill(pid, 0)`` alone kept those for good)."""
    dead = 2**22 + 12345  # above pid_max's default: no process runs with it
    while pid_running(dead):
        dead += 1
    gone = f"e{dead}-0123456789abcdef"
    alive = default_name()  # this process's pid: it runs
    files = {name: tmp_path / f"kvshm-{name}.rank0-of-1.slab"
             for name in (gone, alive, "given-name", f"e{dead}-notgenerated")}
    for f in files.values():
        f.write_bytes(b"\0" * PAGE)
    # a reused pid: a thread's id (not a process), and this process's pid on a slab
    # written before this process started (a container restarted after a kill)
    ticker = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    ticker.start()
    assert ticker.native_id is not None and pid_running(ticker.native_id)
    tid_slab = tmp_path / f"kvshm-e{ticker.native_id}-00000000000000aa.rank0-of-1.slab"
    tid_slab.write_bytes(b"\0" * PAGE)
    before_me = tmp_path / f"kvshm-e{os.getpid()}-00000000000000bb.rank0-of-1.slab"
    before_me.write_bytes(b"\0" * PAGE)
    old = time.time() - 3600  # written an hour before this process started
    os.utime(before_me, (old, old))
    held_path = tmp_path / f"kvshm-{gone}.rank1-of-2.slab"
    held = SlabFile.open(str(held_path), SlabSpec("fp", 1, 2, 1, PAGE), direct=False)
    try:
        assert remove_dead_generated(str(tmp_path)) == 3
        assert not files[gone].exists() and not tid_slab.exists() and not before_me.exists()
        assert all(files[n].exists() for n in (alive, "given-name", f"e{dead}-notgenerated"))
        assert held_path.exists()
    finally:
        held.close()
    assert remove_dead_generated(str(tmp_path)) == 1 and not held_path.exists()
    assert remove_dead_generated(str(tmp_path / "absent")) == 0
