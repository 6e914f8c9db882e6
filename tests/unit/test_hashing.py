"""Chained block hashes: stable across processes and runs, distinct for distinct prefixes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from kvshm.errors import ConfigError
from kvshm.hashing import HASH_BYTES, chain_hashes, hash_block

TOKENS = [7, 0, 2**32 - 1, 42, 5, 5, 5, 5, 9, 8, 7, 6, 1]

_CHILD = """
import json, sys
from kvshm.hashing import chain_hashes, hash_block
toks = json.loads(sys.argv[1])
out = [h.hex() for h in chain_hashes(toks, 4)]
out += [h.hex() for h in chain_hashes(toks, 3, extra=b"lora:1")]
out.append(hash_block(None, toks[:2]).hex())
out.append(str(hash(b"salted")))
print(json.dumps(out))
"""


def _local() -> list[str]:
    out = [h.hex() for h in chain_hashes(TOKENS, 4)]
    out += [h.hex() for h in chain_hashes(TOKENS, 3, extra=b"lora:1")]
    out.append(hash_block(None, TOKENS[:2]).hex())
    return out


def _child(seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(TOKENS)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    out: list[str] = json.loads(res.stdout)
    return out


def test_identical_in_fresh_processes_with_other_hash_seeds() -> None:
    one, two = _child("1"), _child("2")
    # builtin hash() differs between the children (the seed took effect) ...
    assert one[-1] != two[-1]
    # ... but the block hashes agree with each other and with this process
    assert one[:-1] == two[:-1] == _local()


def test_matches_the_documented_encoding_and_a_golden_value() -> None:
    h = hashlib.sha256(b"kvshm.block.v1")
    h.update(b"\x00")
    h.update(struct.pack("<5I", 4, 1, 2, 3, 4))
    assert hash_block(None, [1, 2, 3, 4]) == h.digest()[:HASH_BYTES]
    assert hash_block(None, [1, 2, 3, 4]).hex() == "66ab5909817d93aacdb7b332cd0b2311"
    second = chain_hashes(list(range(8)), 4, extra=b"m")[1]
    assert second.hex() == "3c1125fa96cd41ecebb4c6359bca334d"


def test_chain_is_parent_linked_and_full_blocks_only() -> None:
    hs = chain_hashes(TOKENS, 4)
    assert len(hs) == 3  # 13 tokens: the 13th is a partial block
    assert hs[0] == hash_block(None, TOKENS[0:4])
    assert hs[1] == hash_block(hs[0], TOKENS[4:8])
    assert hs[2] == hash_block(hs[1], TOKENS[8:12])
    assert all(len(h) == HASH_BYTES for h in hs)
    assert chain_hashes(TOKENS[:3], 4) == []
    assert chain_hashes([], 4) == []


def test_parent_continues_a_chain() -> None:
    whole = chain_hashes(TOKENS[:12], 4)
    head = chain_hashes(TOKENS[:4], 4)
    tail = chain_hashes(TOKENS[4:12], 4, parent=head[-1])
    assert head + tail == whole


def test_different_prefixes_give_different_hashes() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes([1, 2, 3, 9, 5, 6, 7, 8], 4)
    # same second-block tokens, different first block: every hash differs
    assert a[0] != b[0] and a[1] != b[1]
    # same tokens as a first block vs. as a continuation
    assert hash_block(None, [5, 6, 7, 8]) != a[1]
    # extra separates otherwise identical blocks
    assert chain_hashes([1, 2, 3, 4], 4, extra=b"x") != chain_hashes([1, 2, 3, 4], 4)
    # token order matters
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_field_boundaries_are_unambiguous() -> None:
    # a token moved into `extra` must not collide (tokens are length-prefixed)
    assert hash_block(None, [1], b"") != hash_block(None, [], struct.pack("<I", 1))
    # an empty block with a parent differs from a block without one
    p = hash_block(None, [3])
    assert hash_block(p, []) != hash_block(None, [], p)


def test_many_distinct_blocks_do_not_collide() -> None:
    seen = {hash_block(None, [i, j]) for i in range(64) for j in range(64)}
    assert len(seen) == 64 * 64


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_outside_u32_is_a_config_error(bad: int) -> None:
    with pytest.raises(ConfigError, match="u32"):
        hash_block(None, [1, bad])


def test_bad_block_size_and_parent_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        chain_hashes([1, 2], 0)
    with pytest.raises(ConfigError):
        hash_block(b"", [1])
    with pytest.raises(ConfigError):
        hash_block(b"x" * 256, [1])


@pytest.mark.parametrize(("tokens", "block_size", "match"), [
    ("abcdefgh", 4, "token_ids must be a sequence of ints, got str"),
    (b"abcdefgh", 4, "token_ids must be a sequence of ints, got bytes"),
    ([1.5] * 8, 4, "got 1.5 in list"),            # it named "token id None"
    ([1, 2, 3, "x"], 4, "got 'x' in list"),       # a bare ValueError from int('x')
    ([1, 2], True, "block_size must be an int >= 1, got True"),
    ([1, 2], "2", "block_size must be an int >= 1, got '2'"),  # a bare TypeError
])
def test_chain_hashes_refuses_what_is_no_token_list_naming_it(
        tokens: object, block_size: object, match: str) -> None:
    """Found by a hostile probe: a str of token ids raised a bare ValueError from inside
    the packing, and a float was reported as "token id None". Each is a ConfigError that
    names the value."""
    with pytest.raises(ConfigError, match=match):
        chain_hashes(tokens, block_size)  # type: ignore[arg-type]
