"""``remove_unheld``: a slab file is removed only when no process holds it, and only if
its path still names the file whose lock was taken."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from kvshm.disk import remove_unheld


def test_a_held_slab_stays_and_an_unheld_one_goes(tmp_path: Path) -> None:
    path = tmp_path / "kvshm-e.rank0-of-1.slab"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_unheld(str(path)) is False and path.exists()
    finally:
        os.close(fd)
    assert remove_unheld(str(path)) is True and not path.exists()
    with pytest.raises(FileNotFoundError):
        remove_unheld(str(path))


def test_a_file_put_at_the_path_while_it_is_being_removed_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the lock and the unlink a new engine creates its own slab at the same
    path (the old file was unlinked and recreated): the remover must not unlink the new
    one, which the new engine's rank is about to lock and fill."""
    path = tmp_path / "kvshm-e.rank0-of-1.slab"
    path.write_bytes(b"old")
    fresh = tmp_path / "fresh"
    fresh.write_bytes(b"new")
    real = fcntl.flock

    def flock_then_replace(fd: int, op: int) -> None:
        real(fd, op)
        os.replace(fresh, path)  # the new engine's file now has the name

    monkeypatch.setattr(fcntl, "flock", flock_then_replace)
    with pytest.raises(FileNotFoundError, match="replaced while being removed"):
        remove_unheld(str(path))
    assert path.read_bytes() == b"new"
