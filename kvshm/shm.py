"""Shared-memory segments: created, size-checked, reserved, **unlinked at once**, mapped by fd.

A segment is a POSIX shared-memory object (``posix_ipc``) that exists under a name only for
the few microseconds between ``shm_open`` and ``shm_unlink``; from then on it is reachable
only through file descriptors (passed to peers with SCM_RIGHTS) and mappings, and the
kernel frees it when the last fd and the last mapping are gone, however the processes end.
Nothing named outlives a crash; :func:`sweep` exists only to clean up after a bug.

Order inside :func:`create_segment` (each step undone on any error path):

1. size check against :func:`available_shm_bytes` (nothing created on failure);
2. ``shm_open(O_CREAT | O_EXCL, 0600)`` under a random ``/kvshm-...`` name;
3. ``shm_unlink`` at once -- before any step that can fail or take long;
4. ``posix_fallocate`` reserves every page (ENOSPC becomes a :class:`ConfigError` naming the
   /dev/shm size, never a SIGBUS on first touch later), then ``ftruncate``; a segment of
   :data:`PROGRESS_BYTES` or more is reserved in :data:`PROGRESS_CHUNK` pieces with an
   INFO line (logger ``kvshm.shm``) before, after each piece and at the end: it takes
   0.5 - 2 s a GiB, which must not look like a hang;
5. ``mmap(MAP_SHARED)``.

Segments are never registered with ``multiprocessing.resource_tracker``. How many bytes
one may take (/dev/shm, MemAvailable, the memory cgroup): :mod:`kvshm.shm_budget`.

Torch is imported lazily (only the tensor helpers need it), so the rings and the
rendezvous can use this module without paying for ``import torch``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import posix_ipc

from kvshm import shm_budget
from kvshm.errors import ConfigError
from kvshm.pids import pid_running
from kvshm.shm_budget import available_shm_bytes, shm_size_text, statvfs_free

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = ["SHM_PREFIX", "Leftover", "Segment", "create_segment", "dtype_from_name",
           "dtype_name", "map_segment", "segment_of", "shared_tensor", "sweep",
           "tensor_from_fd"]

#: Every name kvshm creates starts with this (after the leading slash).
SHM_PREFIX: Final = "kvshm"
#: Segments at least this large are reserved with progress lines (INFO, ``kvshm.shm``).
PROGRESS_BYTES: Final = 4 << 30
#: The piece reserved between two progress lines.
PROGRESS_CHUNK: Final = 2 << 30
#: Where the progress of large reservations is logged.
log: Final = logging.getLogger("kvshm.shm")


class _Map(mmap.mmap):
    """An mmap that can carry the owning :class:`Segment` of a shared tensor."""

    segment: Segment


class Segment:
    """An unlinked shared-memory segment: its fd, its size and a writable mapping.

    Owns ``fd`` and ``buf``. :meth:`close` is idempotent: it unmaps (unless memoryviews
    or tensors still export the mapping, which then lives until the last one is gone) and
    closes the fd; the memory itself is freed by the kernel when no process maps it or
    holds an fd to it. A segment that is garbage-collected unclosed still closes its fd.
    """

    __slots__ = ("fd", "size", "buf", "name", "_close_fd", "__weakref__")

    def __init__(self, fd: int, size: int, buf: mmap.mmap, name: str = "") -> None:
        self.fd = fd
        self.size = size
        self.buf = buf
        #: The (already unlinked) name it was created under; "" when mapped from an fd.
        self.name = name
        self._close_fd = weakref.finalize(self, os.close, fd)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return not self._close_fd.alive

    def close(self) -> None:
        """Unmap and close the fd (idempotent)."""
        if not self._close_fd.alive:
            return
        try:
            self.buf.close()
        except BufferError:  # still exported (tensor, memoryview): unmapped when they go
            pass
        self._close_fd()

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.fd}"
        return f"Segment({state}, size={self.size}, name={self.name!r})"


# ----------------------------------------------------------------------------- segments


def _segment_name(purpose: str) -> str:
    tag = re.sub(r"[^A-Za-z0-9_.]", "_", purpose)[:40]
    return f"/{SHM_PREFIX}-{tag}-{os.getpid()}-{secrets.token_hex(8)}"


def _unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:  # already gone (e.g. removed by a sweep)
        pass


def create_segment(size: int, *, purpose: str) -> Segment:
    """A fresh, zero-filled, fully reserved segment of ``size`` bytes, already unlinked.

    ``purpose`` names the segment in error messages and in its short-lived name.
    Raises :class:`ConfigError` for a size <= 0, a size above :func:`available_shm_bytes`,
    or ENOSPC while reserving (the message names the sizes and the /dev/shm size).
    """
    if size <= 0:
        raise ConfigError(f"shared-memory segment for {purpose}: size must be > 0, got {size}")
    available = available_shm_bytes()
    if size > available:
        raise ConfigError(
            f"shared-memory segment for {purpose} needs {size} bytes ({size / 2**20:.1f} MiB) "
            f"but only {available} bytes ({available / 2**20:.1f} MiB) may be used "
            f"({shm_size_text()}; MemAvailable and a safety margin also count)")
    name = _segment_name(purpose)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    except (OSError, posix_ipc.PermissionsError) as e:  # out of fds, /dev/shm out of
        raise _segment_error("create", size, purpose, e) from e  # inodes or read-only
    fd: int = shm.fd
    _unlink_quietly(name)
    try:
        _reserve(fd, size, purpose)
        try:
            buf = _Map(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:  # an address-space limit (RLIMIT_AS) below the segment
            raise _segment_error("map", size, purpose, e) from e
    except BaseException:
        os.close(fd)
        raise
    return Segment(fd, size, buf, name)


def _segment_error(what: str, size: int, purpose: str,
                   e: OSError | posix_ipc.PermissionsError) -> ConfigError:
    """A segment that cannot be created or mapped, as one line that says which and why
    (a bare OSError reached ``Engine.launch`` callers: "[Errno 28] No space left on
    device" while df showed room -- /dev/shm out of inodes). posix_ipc raises some
    errors with no errno (EMFILE: "This process already has the maximum number of
    files open") or as its own classes (EACCES): the text says those."""
    code = getattr(e, "errno", None)
    text = (getattr(e, "strerror", None) if code is not None else None) or str(e)
    if code is None and "maximum number of files" in text:
        code = errno.EMFILE
    hint = {errno.EMFILE: "this process is out of file descriptors (raise `ulimit -n`)",
            errno.ENFILE: "the system is out of file descriptors",
            errno.ENOSPC: f"{shm_budget.SHM_DIR} is full or out of inodes",
            errno.EROFS: f"{shm_budget.SHM_DIR} is mounted read-only",
            errno.ENOMEM: "the address space is too small (RLIMIT_AS, `ulimit -v`)",
            }.get(code or 0, "")
    return ConfigError(f"cannot {what} a shared-memory segment of {size} bytes "
                       f"({size / 2**20:.1f} MiB) for {purpose}: {text}"
                       + (f": {hint}" if hint else ""))


def _reserve(fd: int, size: int, purpose: str) -> None:
    """Reserve every page of ``fd`` up to ``size`` (see the module docstring, step 4)."""
    if size < PROGRESS_BYTES:
        _fallocate(fd, 0, size, size, purpose)
    else:
        if size > statvfs_free(shm_budget.SHM_DIR):  # fail at once, not after filling /dev/shm
            raise _reserve_error(size, purpose, errno.ENOSPC)
        t0 = time.monotonic()
        log.info("kvshm: reserving %s of shared memory for %s (posix_fallocate, "
                 "0.5 - 2 s a GiB)", _size_text(size), purpose)
        done = 0
        while done < size:
            piece = min(PROGRESS_CHUNK, size - done)
            _fallocate(fd, done, piece, size, purpose)
            done += piece
            log.info("kvshm: %s: %s of %s reserved (%.1f s)", purpose, _size_text(done),
                     _size_text(size), time.monotonic() - t0)
    os.ftruncate(fd, size)


def _size_text(n: int) -> str:
    """``n`` bytes for a person: GiB with one decimal from 1 GiB up, else MiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"


def _fallocate(fd: int, offset: int, length: int, size: int, purpose: str) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise _reserve_error(size, purpose, e.errno) from e
        raise


def _reserve_error(size: int, purpose: str, err: int) -> ConfigError:
    return ConfigError(
        f"cannot reserve {size} bytes ({size / 2**20:.1f} MiB) of shared memory for "
        f"{purpose}: {os.strerror(err)} ({shm_size_text()}); enlarge {shm_budget.SHM_DIR} "
        f"(e.g. docker --shm-size) or use fewer CPU blocks")


def map_segment(fd: int, size: int) -> Segment:
    """Map a peer's segment from ``fd`` (takes ownership of ``fd``: closed on error too).

    Raises :class:`ConfigError` if ``size`` <= 0 or the segment is smaller than ``size``.
    """
    try:
        if size <= 0:
            raise ConfigError(f"cannot map a segment of {size} bytes")
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ConfigError(f"segment behind fd {fd} has {actual} bytes, "
                              f"expected at least {size}")
        buf = _Map(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return Segment(fd, size, buf)


#: What :func:`_segment_name` makes (the leading slash is not part of the file name):
#: tag, the creator's pid, a random token.
_SEGMENT_RE: Final = re.compile(
    rf"{SHM_PREFIX}-[A-Za-z0-9_.]{{1,40}}-(?P<pid>[0-9]+)-[0-9a-f]{{16}}")


class Leftover(NamedTuple):
    """A /dev/shm entry :func:`sweep` found: ``removed`` (or would remove, in a dry
    run), else ``why`` it was kept."""

    name: str
    removed: bool
    why: str = ""


def sweep(remove: bool = True) -> list[Leftover]:
    """The leftover kvshm segments in /dev/shm, removed unless ``remove=False``.

    There should never be any: a segment is unlinked right after its creation, so one
    is left only by a process killed in between. Only entries named as
    :func:`create_segment` names them are considered -- never a disk tier's slab file
    that a ``disk_path`` of /dev/shm put there, nor another program's ``kvshm*`` file --
    and of those, an entry owned by another user, or whose creating process still runs
    (it is between create and unlink), is kept. Sorted by name; an entry that vanishes
    meanwhile is skipped; one that cannot be removed is reported kept with the error.
    """
    try:
        names = sorted(n for n in os.listdir(shm_budget.SHM_DIR) if _SEGMENT_RE.fullmatch(n))
    except FileNotFoundError:
        return []
    found = []
    for n in names:
        path = os.path.join(shm_budget.SHM_DIR, n)
        try:
            why = _keep_reason(path, n)
            if why is None and remove:
                os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            why = f"cannot remove it: {exc.strerror or exc}"
        found.append(Leftover(n, why is None, why or ""))
    return found


def _keep_reason(path: str, name: str) -> str | None:
    """Why the segment file ``name`` must stay, or None (its creator is gone). Read
    without following a link: a link another user put there is theirs, whatever it
    points at (root's sweep removed one that pointed at a root-owned file)."""
    st = os.lstat(path)
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    match = _SEGMENT_RE.fullmatch(name)
    assert match is not None
    pid = int(match["pid"])
    return f"its process {pid} is running" if pid_running(pid) else None


# ----------------------------------------------------------------------------- tensors


def dtype_name(dtype: torch.dtype | str) -> str:
    """The wire name of a torch dtype (``torch.float16`` -> ``"float16"``); validates strings."""
    import torch

    if isinstance(dtype, str):
        return dtype_name(dtype_from_name(dtype))
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"not a torch dtype: {dtype!r}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` (also accepts ``"torch.float16"``); ConfigError if unknown."""
    import torch

    value = getattr(torch, name.removeprefix("torch."), None) if name else None
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"unknown torch dtype name {name!r}")
    return value


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
    numel = 1
    for dim in shape:
        if int(dim) < 0:
            raise ConfigError(f"negative dimension in shape {tuple(shape)}")
        numel *= int(dim)
    if numel == 0:
        raise ConfigError(f"a shared tensor needs at least one element, shape {tuple(shape)}")
    return numel, numel * dtype.itemsize


def _as_tensor(buf: _Map, numel: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    import torch

    # frombuffer keeps a reference to the object it is given but does NOT hold a buffer
    # export, so given the mmap itself a later ``mmap.close()`` would unmap under the
    # tensor (segfault). A memoryview holds the export: close() then raises BufferError
    # and the mapping lives until the storage releases the view.
    view = memoryview(buf)
    return torch.frombuffer(view, dtype=dtype, count=numel).view(*[int(d) for d in shape])


#: data_ptr of a shared tensor's storage -> its Segment. Weak: the tensor's storage keeps
#: the mapping alive, and the mapping keeps the Segment alive (``_Map.segment``).
_TENSOR_SEGMENTS: weakref.WeakValueDictionary[int, Segment] = weakref.WeakValueDictionary()


def shared_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor backed by a fresh (created-and-unlinked) segment.

    The tensor (and any view of it) keeps its mapping and its :class:`Segment` alive;
    :func:`segment_of` finds the segment to pass its fd to a worker.
    """
    _check_spec(shape, dtype)
    numel, nbytes = _nbytes(shape, dtype)
    seg = create_segment(nbytes, purpose="tensor")
    assert isinstance(seg.buf, _Map)
    seg.buf.segment = seg  # storage -> map -> segment keeps the fd open
    tensor = _as_tensor(seg.buf, numel, shape, dtype)
    _TENSOR_SEGMENTS[tensor.untyped_storage().data_ptr()] = seg
    return tensor


def _check_spec(shape: object, dtype: object) -> None:
    """ConfigError unless ``shape`` is a sequence of one or more ints and ``dtype`` a
    ``torch.dtype`` (checked before any memory is made)."""
    import torch

    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a torch.dtype (e.g. torch.float16), got {dtype!r}")
    if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)) or not shape \
            or any(isinstance(d, bool) or not hasattr(type(d), "__index__") for d in shape):
        raise ConfigError(f"shape must be a sequence of one or more ints, got {shape!r}")


def segment_of(t: torch.Tensor) -> Segment:
    """The segment behind a tensor made by :func:`shared_tensor` (or a view of one).

    Do not close it while the tensor lives. Raises :class:`ConfigError` otherwise.
    """
    seg = _TENSOR_SEGMENTS.get(t.untyped_storage().data_ptr())
    if seg is None or seg.closed:
        raise ConfigError("tensor is not backed by kvshm.shm.shared_tensor() memory "
                          "(allocate device caches for standalone workers with shared_tensor)")
    return seg


def tensor_from_fd(fd: int, shape: Sequence[int], dtype: str | torch.dtype) -> torch.Tensor:
    """Map a peer's segment as a tensor (worker side). Takes ownership of ``fd``.

    The fd is closed before returning (also on error); the mapping lives as long as the
    tensor or any view of it. Raises :class:`ConfigError` for a bad dtype name or shape,
    or a segment smaller than ``shape`` x itemsize.
    """
    try:
        torch_dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        numel, nbytes = _nbytes(shape, torch_dtype)
    except BaseException:
        os.close(fd)
        raise
    seg = map_segment(fd, nbytes)
    assert isinstance(seg.buf, _Map)
    tensor = _as_tensor(seg.buf, numel, shape, torch_dtype)
    seg.close()  # closes the fd; the mapping stays exported by the tensor
    return tensor
