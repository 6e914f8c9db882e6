"""The disk tier in the ``kvshm`` command (``kvshm.cli_disk``): ``kvshm sweep
--disk-path`` lists the slab files of engines that are not running and keeps them (the
warm-restart cache) unless asked to remove them, never one whose lock a process holds;
``kvshm stats --disk`` prints the section as text."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from kvshm.cli import main
from kvshm.cli_disk import format_disk, gone_slabs, remove_slabs
from kvshm.disk import PAGE, SlabFile, SlabSpec
from kvshm.errors import ConfigError


def _slab(d: Path, engine: str, rank: int = 0, world: int = 1) -> Path:
    p = d / f"kvshm-{engine}.rank{rank}-of-{world}.slab"
    p.write_bytes(b"\0" * 8192)
    return p


def test_slabs_of_engines_not_running_are_listed_and_kept(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    gone = _slab(tmp_path, "old-engine.v1", 1, 2)
    live = _slab(tmp_path, "live")
    (tmp_path / "notes.txt").write_text("not a slab")
    rows = gone_slabs(str(tmp_path), {"live"})
    assert [(r.path, r.engine, r.rank, r.world) for r in rows] == [
        (str(gone), "old-engine.v1", 1, 2)]
    assert main(["sweep", "--dry-run", "--disk-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"kept {gone}" in out and "--remove-slabs" in out and str(live) in out
    assert gone.exists() and live.exists()  # live: no engine of that name runs here either


def test_a_name_that_only_looks_like_a_slab_is_neither_listed_nor_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvshm-x.rank0-of-1.slab`` plus a final newline matched the slab pattern (``$``
    also matches before a final newline): ``kvshm sweep`` listed it, printed its name
    with the newline raw (a line of the file's own choosing in an operator's output),
    and ``--remove-slabs`` removed it. Nor are non-ASCII digits a rank. Only the real
    slab is listed."""
    real = _slab(tmp_path, "x")
    for odd in ("kvshm-x.rank0-of-1.slab\nremoved the-passwd-file",
                "kvshm-x.rank0-of-1.slab\n", "kvshm-x.rank\u0663-of-4.slab"):
        (tmp_path / odd).write_bytes(b"\0" * 8192)
    assert [r.path for r in gone_slabs(str(tmp_path), set())] == [str(real)]
    assert main(["sweep", "--dry-run", "--disk-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "passwd" not in out and "\u0663" not in out and f"kept {real} (" in out
    assert "1 slab file(s) kept" in out


def test_remove_slabs_removes_only_what_no_process_holds(tmp_path: Path) -> None:
    free, held = _slab(tmp_path, "a"), _slab(tmp_path, "b")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        got = remove_slabs(gone_slabs(str(tmp_path), set()))
    finally:
        os.close(fd)
    assert [(r.engine, what) for r, what in got] == [("a", "removed"), ("b", "in use")]
    assert not free.exists() and held.exists()


def test_a_slab_removed_between_its_open_and_its_lock_is_opened_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard "remove_slabs unlinks a slab a starting worker opened but has not locked
    yet": the worker opens its slab; before it takes the lock, ``kvshm sweep
    --remove-slabs`` finds the file unlocked, locks it and unlinks it; the worker's lock
    then succeeds -- on an unlinked inode. Its disk tier wrote into a file no path
    names (nothing survives a restart), and the next engine of that name creates a new
    file at the path while the first still believes it holds it. Now the open sees the
    path no longer names its file and opens again."""
    path = tmp_path / "kvshm-e.rank0-of-1.slab"
    path.write_bytes(b"\0" * 8192)  # a warm slab from before
    real_flock = fcntl.flock
    raced: list[str] = []

    def flock_after_a_sweep(fd: int, op: int) -> None:
        if not raced:  # the worker's first lock: the sweep runs first (its own flock
            raced.append("sweeping")  # comes back here and goes straight through)
            raced[0] = remove_slabs(gone_slabs(str(tmp_path), set()))[0][1]
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_sweep)  # slab.py calls fcntl.flock
    s = SlabFile.open(str(path), SlabSpec("m", 0, 1, 4, PAGE), direct=False)
    try:
        assert raced == ["removed"]
        held, named = os.fstat(s._fd), os.stat(path)
        assert (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
        assert remove_slabs(gone_slabs(str(tmp_path), set()))[0][1] == "in use"
    finally:
        s.close()


def test_the_disk_section_as_text() -> None:
    assert format_disk({}) == "no disk tier"
    text = format_disk({"path": "/d", "io": "direct", "bytes_per_rank": 1 << 30, "slots": 9,
                        "slots_used": 4, "slots_pinned": 1, "quarantined_slots": 0,
                        "warm_slots": 2, "lookups": 5, "lookup_hits": 3, "hit_blocks": 6,
                        "read_bytes": 6 << 20, "get_failed_jobs": 0, "dropped_slots": 0,
                        "written_blocks": 4, "write_bytes": 4 << 20,
                        "write_failed_jobs": 0, "write_declined_no_slot": 0,
                        "writes_paused": 0, "evicted_on_disk": 7, "evicted_written": 2,
                        "evicted_lost": 1})
    assert text.splitlines()[0] == "disk tier: /d (direct I/O, 1024.0 MiB per rank)"
    assert "4 used / 9" in text and "3 hits / 5 lookups, 6 blocks (6.0 MiB)" in text
    assert "7 on disk, 2 written down at eviction, 1 lost" in text


def test_a_demo_the_machine_cannot_run_is_one_line_and_exit_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvshm demo`` on a machine whose /dev/shm is too small (8-20 MiB): the
    ConfigError escaped as a 40-line traceback and exit 1, which the docs define as
    "the restored bytes and logits were not exact" (a hostile probe). Now it is one
    line on stderr and exit 2, as for any other start the machine refuses."""
    from kvshm.demo import driver

    def refused(**_: object) -> int:
        raise ConfigError("shared-memory segment for kv-shard-0 needs 5242880 bytes but "
                          "only 1048576 bytes may be used")

    monkeypatch.setattr(driver, "run_demo", refused)
    assert main(["demo", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvshm demo: shared-memory segment for kv-shard-0 needs")
    assert err.count("\n") == 1 and "Traceback" not in err
