"""The fds a Ready carries: duplicated all or nothing."""

from __future__ import annotations

import os

import pytest
import torch

from kvshm.engine.provision import provision
from kvshm.errors import ConfigError
from kvshm.ipc.protocol import PROTOCOL_VERSION, Hello
from kvshm.layout import KVLayout


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_dup_that_fails_part_way_leaves_no_fd_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of fds (EMFILE) at the third of a Ready's four duplicates: the two made
    before it are closed again and a ConfigError naming the fd limit is raised; a later
    try, with fds to spare, duplicates all four (they were leaked before, one set per
    failed try)."""
    layout = KVLayout.from_tensors([torch.zeros((8, 256), dtype=torch.uint8)])
    hello = Hello(PROTOCOL_VERSION, 0, 1, os.getpid(), layout.to_spec())
    prov = provision({0: hello}, world_size=1, device_caches=None, num_cpu_blocks=8,
                     cpu_bytes_per_rank=None)
    res = prov.ranks[0]
    try:
        real_dup, calls = os.dup, [0]

        def dup(fd: int) -> int:
            calls[0] += 1
            if calls[0] == 3:
                raise OSError(24, "Too many open files")
            return real_dup(fd)

        before = _open_fds()
        monkeypatch.setattr(os, "dup", dup)
        with pytest.raises(ConfigError, match="cannot pass a rank its 4 fds: Too many open "
                           "files .*raise `ulimit -n`"):  # (a bare OSError before)
            res.ready_fds()
        monkeypatch.undo()
        assert _open_fds() == before
        fds = res.ready_fds()
        assert len(fds) == 4 and len(_open_fds() - before) == 4
    finally:
        prov.close_sent_fds()
        for r in prov.ranks.values():
            r.close()
