"""The engine's link to its local disk tier: the directory check, each rank's slab, the
warm index, and what builds the manager's disk book.

Order (each step before the next; none of it moves a block's bytes -- the workers do):

1. ``Runtime.open`` (:func:`open_disk`): ``EngineConfig.disk_path`` is checked for the
   whole engine's slabs (``world x disk_bytes_per_rank``, less what this engine's slab
   files already hold): not a directory, not writable, too little space, ``O_DIRECT``
   refused -- one line (:func:`kvshm.disk.check_directory`), before anything
   listens; first, the slabs of generated-name engines whose process is gone are
   removed (:func:`remove_dead_generated`: a whole engine killed at once leaves them).
2. Once every rank said hello (:meth:`DiskLink.setups`, from ``make_ready``, before
   any Ready is sent and so before any worker opens its slab): the layout fingerprint
   of all ranks (:func:`kvshm.remote.fingerprint.layout_fingerprint`, as the remote tier
   builds it), the slot count (every rank's ``disk_bytes_per_rank`` less the file
   header page, over its slot stride -- its row rounded up to 4 KiB plus a 4 KiB header
   page --, the smallest over the ranks: one slot number names a block on every rank),
   and each rank's :class:`~kvshm.ipc.protocol.DiskSetup` (its own slab path). Then
   the warm scan starts on a thread of its own (:mod:`kvshm.engine.warm_scan`: every
   rank's slab headers are read with :func:`kvshm.disk.scan`; checksums are checked
   lazily by the workers, on read); a slot is indexed only where every rank's header
   names the same block (a torn or half-done write leaves the ranks disagreeing, or a
   header whose checksum fails on read: a miss).
3. READY (:meth:`DiskLink.book_factory`): the manager's
   :class:`~kvshm.offload.disk.DiskBook` over a fresh LRU slot table, *warming* while
   the scan runs (it indexes and writes nothing); the scheduler's thread applies the
   scan's result when it ends (:meth:`DiskLink.poll`, each step, pump, tick and
   lookup): the slot table the scan's thread indexed (warm slots as most recently used)
   is swapped in, and writes resume. The engine serves meanwhile, its disk tier empty.

4. Close (:meth:`DiskLink.close`, after the channels closed): a scan still running
   stops; a slab no later start
   can serve (``EngineConfig.disk_keep`` False: a generated name) is removed by its rank
   when its mover closes; one whose rank died without doing so (SIGKILL, the OOM
   killer) is removed here if no process holds its lock -- a live rank holds it until
   it has removed its own.

Kept slab files stay after the engine closes: they are the next start's warm cache
(``kvshm sweep`` lists those of engines that are gone).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvshm.config import DiskIO, DiskMode, EngineConfig
from kvshm.disk import (
    PAGE,
    SlabSpec,
    check_directory,
    refuse_special,
    remove_unheld,
    slab_path,
)
from kvshm.engine.warm_scan import WarmScan
from kvshm.errors import ConfigError
from kvshm.ipc.protocol import DiskSetup, LayoutSpec
from kvshm.offload.disk import DiskBook, max_disk_blocks
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import JobTable
from kvshm.offload.pool import BlockPool
from kvshm.pids import pid_running, process_start
from kvshm.remote.fingerprint import layout_fingerprint
from kvshm.slab_files import generated_pid, list_slabs

__all__ = ["DiskLink", "open_disk", "slot_count", "slot_stride"]

log = logging.getLogger("kvshm.engine.runtime")

BookFactory = Callable[[BlockPool, GroupSet, JobTable], DiskBook]


def slot_stride(row_bytes: int) -> int:
    """Bytes one slot takes in a slab: a header page plus the row rounded up to a page."""
    return PAGE + -(-row_bytes // PAGE) * PAGE


def slot_count(bytes_per_rank: int, rows: Mapping[int, int]) -> int:
    """Slots every rank's slab of at most ``bytes_per_rank`` bytes holds (``rows``: rank
    -> row bytes): the file header page, then whole slots."""
    return min((bytes_per_rank - PAGE) // slot_stride(r) for r in rows.values())


def _held(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


@dataclass
class DiskLink:
    """The engine's disk tier (``config`` None: none) and, from ``make_ready`` on, its
    ranks' setups and the warm scan (until its result is applied)."""

    config: EngineConfig | None
    setups: dict[int, DiskSetup] = field(default_factory=dict)
    scan: WarmScan | None = None  # the start's scan, until its result is applied
    orphans_removed: int = 0  # slabs of dead ranks removed at close (:meth:`close`)

    @classmethod
    def none(cls) -> DiskLink:
        """No disk tier."""
        return cls(None)

    @property
    def slots(self) -> int:
        """Slots of every rank's slab (0 before :meth:`make_setups` or without a tier)."""
        return next(iter(self.setups.values())).slots if self.setups else 0

    def path(self, rank: int) -> str:
        cfg = self.config
        assert cfg is not None and cfg.disk_path is not None
        return slab_path(cfg.disk_path, cfg.name, rank, cfg.world_size)

    def make_setups(self, layouts: Mapping[int, LayoutSpec]) -> dict[int, DiskSetup]:
        """Every rank's DiskSetup (module docstring, step 2), then the warm scan starts; {}
        without a disk tier. ConfigError: the slab size holds no slot of a rank's row."""
        cfg = self.config
        if cfg is None or cfg.disk_path is None or cfg.disk_bytes_per_rank is None:
            return {}
        rows = {r: spec.bytes_per_block for r, spec in layouts.items()}
        slots = slot_count(cfg.disk_bytes_per_rank, rows)
        if slots < 1:
            need = PAGE + max(slot_stride(r) for r in rows.values())
            raise ConfigError(f"disk_bytes_per_rank={cfg.disk_bytes_per_rank} holds no "
                              f"slot: one block's slab takes {need} bytes")
        model = f"{cfg.model_id}|disk:{cfg.disk_stamp}" if cfg.disk_stamp else cfg.model_id
        fp = layout_fingerprint(model, cfg.block_size, cfg.groups, layouts, (cfg.tp, cfg.pp))
        direct = cfg.disk_io is DiskIO.DIRECT
        self.setups = {r: DiskSetup(self.path(r), slots, fp, direct, bool(cfg.disk_keep))
                       for r in sorted(layouts)}
        world = len(self.setups)
        self.scan = WarmScan([(st.path, SlabSpec(st.fingerprint, r, world, st.slots, rows[r]))
                              for r, st in self.setups.items()], slots)
        self.scan.start()
        return self.setups

    def poll(self, book: DiskBook | None) -> None:
        """The scheduler's thread: once the warm scan has ended, apply its result to
        ``book`` (:meth:`DiskBook.end_warming`: a swap of slot tables; nothing without a
        book: the engine did not reach READY). Cheap while it runs: one event test."""
        scan = self.scan
        if scan is None or book is None:
            return
        got = scan.take()
        if got is None:
            return
        self.scan = None
        if book.end_warming(got.table, disagreed=got.disagreed, errors=got.errors,
                            seconds=got.seconds):
            log.info("kvshm: disk tier warm after %.1f s: %d of %d slots hold blocks from "
                     "a previous run", got.seconds, book.slots.num_hashes, self.slots)

    def close(self) -> int:
        """Remove the slabs of an engine that keeps none (``disk_keep`` False) that no
        rank holds any more: those of ranks that died before removing their own (step
        4). Returns how many; never raises (a failure is logged: ``kvshm sweep
        --remove-slabs`` is the remedy). Idempotent."""
        if self.scan is not None:
            self.scan.close()
            self.scan = None
        cfg = self.config
        if cfg is None or cfg.disk_keep:
            return 0
        removed = 0
        for rank, setup in sorted(self.setups.items()):
            try:
                if remove_unheld(setup.path):
                    removed += 1
                    log.info("kvshm: removed the disk slab %s of rank %d (it did not "
                             "remove it itself)", setup.path, rank)
            except FileNotFoundError:
                pass  # the rank removed it: the normal case
            except OSError as exc:
                log.warning("kvshm: cannot remove the disk slab %s of rank %d (%s); "
                            "`kvshm sweep --disk-path %s --remove-slabs` removes it", setup.path,
                            rank, exc.strerror or exc, cfg.disk_path)
        self.orphans_removed += removed
        return removed

    def book_factory(self, max_record: int) -> BookFactory | None:
        """What builds the manager's disk book (None without a disk tier);
        ``max_record``: the largest command every rank's ring takes (bounds a job)."""
        if self.config is None or not self.setups:
            return None
        slots, warming = self.slots, self.scan is not None
        through = self.config.disk_mode is DiskMode.WRITE_THROUGH

        def make(cpu: BlockPool, gs: GroupSet, jobs: JobTable) -> DiskBook:
            book = DiskBook(cpu, gs, jobs, BlockPool(slots), write_through=through,
                            max_job_blocks=max_disk_blocks(max_record))
            if warming:
                book.begin_warming()
            return book
        return make


#: Seconds a process's start may seem to follow its own slab's last write: /proc
#: gives the boot time to the second.
START_SLACK_S = 2.0


def remove_dead_generated(directory: str) -> int:
    """Remove the slab files in ``directory`` that no start can serve again: an engine
    with a generated name (``e<pid>-<hex>``, never taken twice) whose process no longer
    runs (:func:`_may_be_alive`), this user's, held by no process (``remove_unheld``:
    under the file's own lock). Such files are left when a whole engine is killed at
    once (``docker kill``, a cgroup's OOM kill: its ranks die before they remove their
    own, and so does the scheduler that would remove theirs at close); each crash left
    one per rank until ``disk_path`` had no room for the next start's (a hostile probe:
    the third start was refused). How many went; never raises (a directory it cannot list: 0)."""
    try:
        rows = list_slabs(directory)
    except OSError:
        return 0  # (check_directory says what is wrong with it)
    removed = 0
    for row in rows:
        pid = generated_pid(row.engine)
        if pid is None or _may_be_alive(pid, row.path):
            continue
        try:
            removed += remove_unheld(row.path)
        except OSError:  # another user's, gone meanwhile, or replaced: not ours to remove
            continue
    return removed


def _may_be_alive(pid: int, path: str) -> bool:
    """Whether the engine process ``pid`` that wrote the slab at ``path`` may still run:
    a process with that pid that started no later than the file's last write (plus
    :data:`START_SLACK_S` for the clocks' resolution). A thread's id, or a process that
    started after the write -- a pid reused, e.g. in a container restarted after a kill,
    which numbers from 1 again -- is not that engine (a review)."""
    try:
        written = os.stat(path).st_mtime
    except OSError:
        return True  # (gone, or unreadable: left alone)
    if not os.path.exists("/proc/self/stat"):  # no /proc here: the pid is all we have
        return pid_running(pid)
    started = process_start(pid)
    return started is not None and started <= written + START_SLACK_S


def open_disk(config: EngineConfig) -> DiskLink:
    """The engine's disk link (no tier where ``config.disk_path`` is None), after the
    directory check and a check that no rank's slab path is a link or other non-file
    (ConfigError, one line). Before the space check, the slabs of generated-name
    engines that are gone are removed (:func:`remove_dead_generated`)."""
    if config.disk_path is None or config.disk_bytes_per_rank is None:
        return DiskLink.none()
    link = DiskLink(config)
    for r in range(config.world_size):  # a link or FIFO where a slab goes: one line now
        refuse_special(link.path(r))
    gone = remove_dead_generated(config.disk_path)
    if gone:
        log.warning("kvshm disk tier: removed %d slab file(s) in %s of engines with a "
                    "generated name whose process is gone (killed before they removed "
                    "their own)", gone, config.disk_path)
    held = sum(_held(link.path(r)) for r in range(config.world_size))
    need = max(0, config.world_size * config.disk_bytes_per_rank - held)
    _say_other_worlds(config)  # before the space check: they may be why it refuses
    check_directory(config.disk_path, need, direct=config.disk_io is DiskIO.DIRECT)
    _say_open_directory(config.disk_path)
    return link


def _say_open_directory(directory: str) -> None:
    """One line where every user may write ``directory`` and it is not sticky: another
    user could remove this engine's slabs and put files of theirs in their place (each
    refused when opened: the rank then runs without a disk tier). Said, not refused: a
    Kubernetes emptyDir is such a directory, and a container that is not root cannot
    change its mode (a review)."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        log.warning("kvshm disk tier: disk_path %s is writable by every user and not "
                    "sticky (mode %o): another user could remove its slabs or put files "
                    "in their place (each refused when opened: that rank's disk tier is "
                    "then off); chmod o-w (or +t) it where you can", directory,
                    stat.S_IMODE(mode))


def _say_other_worlds(config: EngineConfig) -> None:
    """One line where ``disk_path`` holds slabs of this engine's name for another world
    size: no start of this config reads them (they hold their space until removed), and
    nothing said so (a hostile probe: a tp=1 slab kept, whole, after a move to tp=2)."""
    assert config.disk_path is not None
    try:
        rows = [r for r in list_slabs(config.disk_path)
                if r.engine == config.name and r.world != config.world_size]
    except OSError:
        return
    if rows:
        log.warning("kvshm disk tier: %s holds %d slab file(s) of engine %r for world "
                    "size %s (%.2f GiB), which this start (world size %d) never reads: "
                    "`kvshm sweep --disk-path %s --remove-slabs` removes them once no "
                    "engine runs under that name", config.disk_path, len(rows),
                    config.name, "/".join(sorted({str(r.world) for r in rows})),
                    sum(r.bytes for r in rows) / 2**30, config.world_size, config.disk_path)
