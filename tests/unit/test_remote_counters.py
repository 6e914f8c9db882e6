"""The remote tier's named counters: declared up front, and a call adds all or nothing."""

from __future__ import annotations

import pytest

from kvshm.remote.glide_client import Counters


def test_an_undeclared_name_changes_nothing() -> None:
    c = Counters("puts", "errors")
    c.add(puts=2)
    with pytest.raises(KeyError, match="undeclared counters \\['typo'\\]"):
        c.add(errors=1, typo=1)
    assert c.snapshot() == {"puts": 2, "errors": 0}
