"""Host rows for the remote tier's tests: plain bytearray memory (no numpy, no torch), as
a CPU tier's rows would be, one writable view per row."""

from __future__ import annotations

import random


class Rows:
    """``n`` host rows of ``row`` bytes in one buffer (random when ``seed`` is given)."""

    def __init__(self, n: int, seed: int | None = None, *, row: int) -> None:
        self.row = row
        rnd = random.Random(seed)
        self.buf = (bytearray(b"".join(rnd.randbytes(row) for _ in range(n)))
                    if seed is not None else bytearray(n * row))
        self.views = [memoryview(self.buf)[i * row:(i + 1) * row] for i in range(n)]

    def __getitem__(self, i: int) -> memoryview:
        return self.views[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rows) and self.buf == other.buf

    __hash__ = None  # type: ignore[assignment]

    def clear(self) -> None:
        self.buf[:] = bytes(len(self.buf))
