"""kvshm.shm: unlinked segments, sizing, fd mapping across real processes, tensors, sweep."""

from __future__ import annotations

import errno
import gc
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import posix_ipc
import pytest
import torch

from kvshm import shm, shm_budget
from kvshm.errors import ConfigError


def _kvshm_entries() -> list[str]:
    return sorted(n for n in os.listdir(shm_budget.SHM_DIR) if "kvshm" in n.lower())


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _run_child(code: str, pass_fds: tuple[int, ...] = (), timeout: float = 60) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], pass_fds=pass_fds,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_create_segment_is_unlinked_private_and_reserved() -> None:
    seg = shm.create_segment(1 << 20, purpose="unit")
    try:
        st = os.fstat(seg.fd)
        assert st.st_nlink == 0  # unlinked before create_segment returned
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 1 << 20
        assert st.st_blocks * 512 >= 1 << 20  # fallocate reserved every page
        assert seg.name.startswith("/kvshm-unit-")
        assert not os.path.exists(shm_budget.SHM_DIR + seg.name)
        assert _kvshm_entries() == []
        assert bytes(seg.buf[:16]) == bytes(16)
        seg.buf[:5] = b"hello"
        assert seg.size == 1 << 20
    finally:
        fd = seg.fd
        seg.close()
    seg.close()  # idempotent
    assert seg.closed
    assert not _fd_is_open(fd)


def test_segment_context_manager_closes() -> None:
    with shm.create_segment(4096, purpose="ctx") as seg:
        fd = seg.fd
        seg.buf[0] = 1
    assert seg.closed and not _fd_is_open(fd)


def test_segment_contents_shared_with_child_process() -> None:
    with shm.create_segment(64 << 10, purpose="share") as seg:
        seg.buf[:11] = b"from parent"
        out = _run_child(f"""
            import os
            from kvshm.shm import map_segment
            seg = map_segment({seg.fd}, {seg.size})
            assert bytes(seg.buf[:11]) == b"from parent", bytes(seg.buf[:11])
            seg.buf[100:110] = b"from child"
            print(sorted(n for n in os.listdir("/dev/shm") if "kvshm" in n))
            seg.close()
        """, pass_fds=(seg.fd,))
        assert out.strip() == "[]"
        assert bytes(seg.buf[100:110]) == b"from child"
    assert _kvshm_entries() == []


def test_oversize_request_is_config_error_naming_sizes() -> None:
    before = _open_fds()
    too_big = shm_budget.available_shm_bytes() + (1 << 20)
    with pytest.raises(ConfigError, match=r"needs \d+ bytes .* only \d+ bytes .*/dev/shm"):
        shm.create_segment(too_big, purpose="oversize")
    assert _open_fds() == before
    assert _kvshm_entries() == []


def test_enospc_while_reserving_is_config_error_naming_dev_shm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Let the request past the size check so posix_fallocate itself hits ENOSPC.
    monkeypatch.setattr(shm, "available_shm_bytes", lambda: 1 << 62)
    before = _open_fds()
    with pytest.raises(ConfigError, match=r"cannot reserve .*/dev/shm has \d+ MiB in all"):
        shm.create_segment(1 << 50, purpose="enospc")
    assert _open_fds() == before
    assert _kvshm_entries() == []


@pytest.mark.parametrize("size", [0, -1])
def test_nonpositive_size_is_config_error(size: int) -> None:
    with pytest.raises(ConfigError, match="size must be > 0"):
        shm.create_segment(size, purpose="zero")


def test_available_shm_bytes_is_bounded_by_dev_shm() -> None:
    st = os.statvfs(shm_budget.SHM_DIR)
    avail = shm_budget.available_shm_bytes()
    assert 0 < avail <= st.f_bavail * st.f_frsize


def test_memory_available_is_the_base_of_the_shm_budget() -> None:
    """MemAvailable (and the cgroup's headroom), without /dev/shm's cap or the margin: at
    least what a segment may take (the vLLM connector's default tier is a share of it)."""
    from kvshm.shm_budget import memory_available_bytes

    mem = memory_available_bytes()
    assert mem >= shm_budget.available_shm_bytes() > 0


def test_map_segment_smaller_than_asked_is_config_error_and_closes_fd() -> None:
    with shm.create_segment(4096, purpose="small") as seg:
        fd = os.dup(seg.fd)
        with pytest.raises(ConfigError, match="has 4096 bytes, expected at least 8192"):
            shm.map_segment(fd, 8192)
        assert not _fd_is_open(fd)


def test_shared_tensor_round_trip_with_child_process() -> None:
    t = shm.shared_tensor((16, 32), torch.float32)
    assert t.shape == (16, 32) and t.dtype == torch.float32 and not t.any()
    t.copy_(torch.arange(16 * 32, dtype=torch.float32).view(16, 32))
    seg = shm.segment_of(t[3:, 5])  # a view finds the same segment
    assert seg is shm.segment_of(t)
    out = _run_child(f"""
        import torch
        from kvshm.shm import tensor_from_fd
        t = tensor_from_fd({seg.fd}, (16, 32), "float32")
        print(float(t.sum()))
        t.mul_(2)
    """, pass_fds=(seg.fd,))
    assert float(out.strip()) == float(sum(range(16 * 32)))
    assert torch.equal(t, 2 * torch.arange(16 * 32, dtype=torch.float32).view(16, 32))


def test_shared_tensor_keeps_segment_alive_and_releases_it_with_the_tensor() -> None:
    t = shm.shared_tensor((8,), torch.int64)
    view = t[2:]
    fd = shm.segment_of(t).fd
    del t
    gc.collect()
    view.fill_(5)  # mapping still there through the view
    assert shm.segment_of(view).fd == fd and _fd_is_open(fd)
    del view
    gc.collect()
    assert not _fd_is_open(fd)


def test_closing_a_tensors_segment_never_unmaps_under_the_tensor() -> None:
    t = shm.shared_tensor((1024,), torch.uint8)
    shm.segment_of(t).close()
    t.fill_(7)  # would segfault if close() had unmapped the memory
    assert int(t.sum()) == 7 * 1024
    with pytest.raises(ConfigError):
        shm.segment_of(t)


def test_segment_of_an_ordinary_tensor_is_config_error() -> None:
    with pytest.raises(ConfigError, match="shared_tensor"):
        shm.segment_of(torch.zeros(4))


def test_tensor_from_fd_takes_the_fd_and_keeps_the_mapping() -> None:
    t = shm.shared_tensor((4, 4), torch.float16)
    fd = os.dup(shm.segment_of(t).fd)
    peer = shm.tensor_from_fd(fd, (4, 4), torch.float16)
    assert not _fd_is_open(fd)
    t[1, 2] = 3.5
    assert float(peer[1, 2]) == 3.5


def test_tensor_from_fd_rejects_bad_dtype_and_short_segment() -> None:
    t = shm.shared_tensor((4,), torch.float32)
    fd = os.dup(shm.segment_of(t).fd)
    with pytest.raises(ConfigError, match="unknown torch dtype"):
        shm.tensor_from_fd(fd, (4,), "float99")
    assert not _fd_is_open(fd)
    fd = os.dup(shm.segment_of(t).fd)
    with pytest.raises(ConfigError, match="expected at least 32"):
        shm.tensor_from_fd(fd, (8,), "float32")
    assert not _fd_is_open(fd)


@pytest.mark.parametrize("shape", [(0, 4), (-1,)])
def test_shared_tensor_rejects_empty_or_negative_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError):
        shm.shared_tensor(shape, torch.float32)


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.uint8,
                  torch.int8, torch.float8_e4m3fn):
        name = shm.dtype_name(dtype)
        assert "torch" not in name
        assert shm.dtype_from_name(name) is dtype
    assert shm.dtype_from_name("torch.bfloat16") is torch.bfloat16
    assert shm.dtype_name("float16") == "float16"
    for bad in ("float99", "", "Tensor", "zeros"):
        with pytest.raises(ConfigError, match="unknown torch dtype"):
            shm.dtype_from_name(bad)


def test_sweep_lists_and_removes_a_planted_leftover(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted segment of a process that is gone is listed, then removed. The
    directory is a temporary stand-in for /dev/shm: planted in the real one, the entry
    was visible for a few ms to the other xdist process's leak checks (a false leak
    there)."""
    monkeypatch.setattr(shm_budget, "SHM_DIR", str(tmp_path))
    (tmp_path / "other-entry").write_bytes(b"y")  # not kvshm's: left alone
    name = f"kvshm-test-{_gone_pid()}-0123456789abcdef"
    (tmp_path / name).write_bytes(b"x")
    assert shm.sweep(remove=False) == [shm.Leftover(name, True)]
    assert (tmp_path / name).exists()
    assert shm.sweep() == [shm.Leftover(name, True)]
    assert not (tmp_path / name).exists()
    assert shm.sweep() == []
    assert (tmp_path / "other-entry").exists()


def _gone_pid() -> int:
    """The pid of a process that has exited (reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_keeps_a_slab_a_live_segment_and_reports_what_it_cannot_remove(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hazard: ``kvshm sweep`` removed every /dev/shm entry starting with ``kvshm``
    -- a running engine's disk-tier slab (``disk_path=/dev/shm`` is accepted: its file
    is ``kvshm-<name>.rank0-of-1.slab``), another user's files (as root), a segment
    whose creator was between create and unlink -- and as a user without the right
    to remove one it died with a PermissionError traceback. Now only names that
    kvshm's segments have are considered, a segment whose process runs is kept, and an
    entry it cannot remove is listed as kept with the reason."""
    monkeypatch.setattr(shm_budget, "SHM_DIR", str(tmp_path))
    slab = tmp_path / "kvshm-dsk.rank0-of-1.slab"
    slab.write_bytes(b"s")
    live = f"kvshm-test-{os.getpid()}-0123456789abcdef"
    (tmp_path / live).write_bytes(b"l")
    gone = f"kvshm-test-{_gone_pid()}-fedcba9876543210"
    (tmp_path / gone).write_bytes(b"g")

    def refuse(path: str) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", path)
    kept_live = shm.Leftover(live, False, f"its process {os.getpid()} is running")
    with monkeypatch.context() as m:
        m.setattr(os, "unlink", refuse)
        assert sorted(shm.sweep()) == sorted([
            kept_live, shm.Leftover(gone, False, "cannot remove it: Operation not permitted")])
    assert sorted(shm.sweep()) == sorted([kept_live, shm.Leftover(gone, True)])
    assert slab.exists() and (tmp_path / live).exists() and not (tmp_path / gone).exists()
    if os.geteuid() == 0:  # another user's leftover (root can make one): kept
        theirs = f"kvshm-test-{_gone_pid()}-00000000000000aa"
        (tmp_path / theirs).write_bytes(b"t")
        os.chown(tmp_path / theirs, 65534, 65534)
        assert shm.Leftover(theirs, False, "owned by uid 65534") in shm.sweep()
        assert (tmp_path / theirs).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's link")
def test_sweep_keeps_another_users_link_whatever_it_points_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user (``nobody``) puts a symbolic link named like a gone kvshm segment in
    /dev/shm, pointing at a root-owned file. The sweep read the owner through the link
    (root's), took the name for its own leftover and root's ``kvshm sweep`` removed
    nobody's link (a hostile probe). Now it reads the entry itself: another user's, and
    a link is not a segment -- kept, the target untouched."""
    monkeypatch.setattr(shm_budget, "SHM_DIR", str(tmp_path))
    target = tmp_path / "root-owned"
    target.write_bytes(b"r")
    theirs = f"kvshm-tensor-{_gone_pid()}-0123456789abcdef"
    (tmp_path / theirs).symlink_to(target)
    os.lchown(tmp_path / theirs, 65534, 65534)
    mine = f"kvshm-tensor-{_gone_pid()}-fedcba9876543210"
    (tmp_path / mine).symlink_to(target)  # root's own link: not a segment either
    got = {x.name: x for x in shm.sweep()}
    assert got[theirs] == shm.Leftover(theirs, False, "owned by uid 65534")
    assert got[mine] == shm.Leftover(mine, False, "not a regular file")
    assert (tmp_path / theirs).is_symlink() and (tmp_path / mine).is_symlink()
    assert target.read_bytes() == b"r"


def test_sigkilled_creator_leaves_nothing_in_dev_shm() -> None:
    code = """
        import sys, time, torch
        from kvshm import shm
        segs = [shm.create_segment(1 << 16, purpose="kill") for _ in range(4)]
        t = shm.shared_tensor((64, 64), torch.float32)
        print("ready", flush=True)
        time.sleep(60)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        assert _kvshm_entries() == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert _kvshm_entries() == []


@pytest.mark.parametrize(("shape", "dtype", "match"), [
    ((4, 4), "float16", "dtype must be a torch.dtype"),  # a bare AttributeError
    ((), torch.float16, "shape must be a sequence of one or more ints"),  # torch TypeError
    (4, torch.float16, "shape must be a sequence of one or more ints"),
    ((4, 2.5), torch.float16, "shape must be a sequence of one or more ints"),
    ((True, 4), torch.float16, "shape must be a sequence of one or more ints"),
])
def test_shared_tensor_refuses_a_bad_spec_before_making_memory(
        shape: object, dtype: object, match: str) -> None:
    """Found by a hostile probe: ``shared_tensor((4, 4), "float16")`` raised a bare
    AttributeError and a 0-d shape a torch TypeError, after the segment was made. Now a
    ConfigError names the argument before any memory is made."""
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ConfigError, match=match):
        shm.shared_tensor(shape, dtype)  # type: ignore[arg-type]
    assert set(os.listdir("/dev/shm")) <= before


def _cgroup_tree(root: Path, leaf: str, limits: dict[str, tuple[str, str]]) -> None:
    """A cgroup v2 tree under ``root``: ``limits`` maps a directory to its
    (``memory.max``, ``memory.current``); this process is in ``leaf``."""
    for d, (limit, usage) in limits.items():
        (root / d.strip("/")).mkdir(parents=True, exist_ok=True)
        (root / d.strip("/") / "memory.max").write_text(limit + "\n")
        (root / d.strip("/") / "memory.current").write_text(usage + "\n")
    (root / "proc_cgroup").write_text(f"0::{leaf}\n")


def test_a_memory_limit_on_a_parent_cgroup_bounds_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine runs in ``/slice/leaf``; the leaf has no limit, its parent (a systemd
    slice, ``docker --cgroup-parent``) 1,200 MiB with 200 MiB used. Only the leaf was
    read: the budget was the machine's (23 GiB in the probe), the CPU tier's reservation
    charged the parent past its limit and the OOM killer ended the scheduler with no
    line. Now every ancestor's limit counts: the headroom is the least of them."""
    monkeypatch.setattr(shm_budget, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(shm_budget, "PROC_CGROUP", str(tmp_path / "proc_cgroup"))
    mib = 1 << 20
    _cgroup_tree(tmp_path, "/slice/leaf", {
        "": ("max", str(5000 * mib)), "/slice": (str(1200 * mib), str(200 * mib)),
        "/slice/leaf": ("max", str(150 * mib))})
    assert shm_budget._cgroup_headroom() == 1000 * mib
    assert shm_budget.memory_available_bytes() <= 1000 * mib
    assert shm_budget.available_shm_bytes() <= 1000 * mib
    _cgroup_tree(tmp_path, "/slice/leaf", {"/slice/leaf": (str(400 * mib), str(150 * mib))})
    assert shm_budget._cgroup_headroom() == 250 * mib  # the leaf's own, now the least
    _cgroup_tree(tmp_path, "/other", {"/other": ("max", "0")})
    assert shm_budget._cgroup_headroom() is None  # no limit anywhere above /other


@pytest.mark.parametrize("where,err,hint", [
    ("create", errno.ENOSPC, "full or out of inodes"),
    ("create", errno.EROFS, "mounted read-only"),
    ("create", errno.EMFILE, "out of file descriptors"),
    ("map", errno.ENOMEM, "RLIMIT_AS"),
])
def test_a_segment_that_cannot_be_created_or_mapped_is_one_config_error(
        monkeypatch: pytest.MonkeyPatch, where: str, err: int, hint: str) -> None:
    """/dev/shm out of inodes (df shows room), mounted read-only, the process out of
    fds, or an address-space limit below the segment: ``Engine.launch`` raised a bare
    OSError ("[Errno 28] No space left on device") that said neither what failed nor
    why (a hostile probe). Now one ConfigError names the step, the size, the purpose
    and the likely cause; nothing is left in /dev/shm."""
    before = _kvshm_entries()

    def fail(*_: object, **__: object) -> None:
        if err == errno.EMFILE:  # as posix_ipc raises it: no errno, its own text
            raise OSError("This process already has the maximum number of files open")
        raise OSError(err, os.strerror(err))

    if where == "create":
        monkeypatch.setattr(posix_ipc, "SharedMemory", fail)
    else:
        monkeypatch.setattr(shm, "_Map", fail)
    with pytest.raises(ConfigError, match=f"cannot {where} a shared-memory segment of 4096 "
                       f"bytes .* for probe: .*{hint}"):
        shm.create_segment(4096, purpose="probe")
    assert _kvshm_entries() == before
