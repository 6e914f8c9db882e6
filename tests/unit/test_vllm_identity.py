"""What the remote tier's layout fingerprint takes from a vLLM config: two deployments
whose KV bytes may differ never share a model identity (so never read each other's
blocks); two equal ones always do. Pure Python: vLLM's configs are stood in by plain
objects with the attributes the connector reads."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvshm.errors import ConfigError
from kvshm.integrations.vllm.config import check_extra_config, model_identity, weights_stamp


class HfConfig(SimpleNamespace):
    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def vllm_config(**over: Any) -> Any:
    model = dict(model="org/m", revision="r1", dtype="bfloat16", quantization=None,
                 hf_config=HfConfig(rope_scaling=None, num_layers=2))
    cache = dict(cache_dtype="auto")
    for k, v in over.items():
        (cache if k in cache else model)[k] = v
    return SimpleNamespace(model_config=SimpleNamespace(**model),
                           cache_config=SimpleNamespace(**cache))


@pytest.mark.parametrize("change", [
    {"model": "org/other"}, {"revision": "r2"}, {"dtype": "float16"},
    {"quantization": "fp8"}, {"cache_dtype": "fp8_e4m3"},
    {"hf_config": HfConfig(rope_scaling={"factor": 4.0}, num_layers=2)},
])
def test_anything_that_changes_kv_bytes_changes_the_identity(change: dict[str, Any]) -> None:
    assert model_identity(vllm_config()) != model_identity(vllm_config(**change))


def test_equal_deployments_share_it_and_a_namespace_separates_them() -> None:
    assert model_identity(vllm_config()) == model_identity(vllm_config())
    assert model_identity(vllm_config(), "a") != model_identity(vllm_config(), "b")
    assert len(model_identity(vllm_config(model="x" * 1000))) <= 400


def test_a_long_model_path_keeps_every_part_of_the_identity() -> None:
    """Hazard "an identity cut before its revision, dtype and quantization": with a
    409-character local model path the identity was cut at 400 characters before the
    revision, dtype and quantization, so a bf16 engine and an fp8-quantized one of the
    same checkpoint had one identity (a hostile probe): with one KV layout they would
    have read each other's blocks. A long identity now ends with a digest of the whole."""
    path = "/mnt/models/" + "org-team-experiments/" * 18 + "llama-3-8b-instruct"
    assert len(path) > 400
    a = model_identity(vllm_config(model=path))
    for change in ({"quantization": "fp8"}, {"revision": "r2"}, {"dtype": "float16"},
                   {"cache_dtype": "fp8_e4m3"}):
        b = model_identity(vllm_config(model=path, **change))
        assert a != b and len(b) == 400, change
    assert model_identity(vllm_config(model=path)) == a


def test_a_bad_namespace_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="remote_namespace"):
        check_extra_config({"remote_namespace": 7})


def test_the_weights_stamp_follows_the_weight_files_of_a_local_model(
        tmp_path: Path) -> None:
    """The disk tier's stamp (``weights_stamp``): a model directory's weight files,
    their sizes and times. Weights replaced in place -- same path, same config, even
    the same size -- give another stamp (a warm restart must not serve the old
    weights' KV); the config or tokenizer files do not count; a hub id has none (its
    revision is in the identity), nor has a directory without weight files."""
    (tmp_path / "config.json").write_text("{}")
    cfg = vllm_config(model=str(tmp_path))
    assert weights_stamp(cfg) == "" and weights_stamp(vllm_config()) == ""
    w = tmp_path / "model.safetensors"
    w.write_bytes(b"\x01" * 64)
    os.utime(w, ns=(1_000_000_000, 1_000_000_000))
    first = weights_stamp(cfg)
    assert len(first) == 16
    (tmp_path / "tokenizer.json").write_text("{}")
    assert weights_stamp(cfg) == first
    w.write_bytes(b"\x02" * 64)  # new weights, same size
    os.utime(w, ns=(2_000_000_000, 2_000_000_000))
    assert weights_stamp(cfg) not in ("", first)
    assert model_identity(cfg) == model_identity(vllm_config(model=str(tmp_path)))


def test_process_seeded_prefix_hashes_with_a_lower_tier_are_said_once_at_start() -> None:
    """A hostile probe: ``prefix_caching_hash_algo="xxhash"`` (or ``xxhash_cbor``)
    without ``PYTHONHASHSEED``: vLLM seeds its block hashes at random in each process,
    so a warm restart from the disk tier served 0 hits and nothing said why (the docs
    named ``PYTHONHASHSEED`` as needed for every algorithm, which sha256 is not). Now
    the connector's start says so for a disk or remote tier, and only then."""
    from kvshm.integrations.vllm.config import unshared_hashes

    def cfg(algo: str) -> Any:
        return SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))

    for algo in ("xxhash", "xxhash_cbor"):
        said = unshared_hashes(cfg(algo), disk=True, remote=False, env={})
        assert said is not None and "disk tier's warm restart" in said and algo in said
        said = unshared_hashes(cfg(algo), disk=False, remote=True, env={})
        assert said is not None and "the remote tier" in said
        assert unshared_hashes(cfg(algo), disk=False, remote=False, env={}) is None
        assert unshared_hashes(cfg(algo), disk=True, remote=True,
                               env={"PYTHONHASHSEED": "0"}) is None
    for algo in ("sha256", "sha256_cbor"):  # the same hashes in every process
        assert unshared_hashes(cfg(algo), disk=True, remote=True, env={}) is None
