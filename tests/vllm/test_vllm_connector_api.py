"""The connector's contract with the pinned vLLM, and its vLLM-free building blocks.

* every vLLM hook ``KvshmConnector`` overrides exists in the installed vLLM with the same
  parameters (a vLLM upgrade that renames one fails here, naming it);
* ``kvshm.integrations.vllm`` imports without vLLM;
* ``VllmGpuBlocks`` over vLLM's real ``BlockPool``: pins, ``evict_first`` order, plain
  hashes, LRU iteration;
* ``kv_layout``: byte regions exactly over each layer's blocks, and what they mean.
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshm.errors import ConfigError
from kvshm.integrations.vllm import CONNECTOR_HOOKS, VLLM_VERSION
from kvshm.integrations.vllm.blocks import VllmGpuBlocks, kv_layout
from kvshm.layout import KVLayout
from kvshm.remote.fingerprint import layout_fingerprint
from kvshm.types import KVGroup

ROOT = Path(__file__).resolve().parents[2]


def _has_vllm() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


needs_vllm = pytest.mark.skipif(not _has_vllm(), reason="vLLM is not installed")


def test_module_imports_without_vllm() -> None:
    code = ("import sys, kvshm.integrations.vllm as m; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; "
            "assert 'KvshmConnector' in dir(m); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True,
                         text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------------ vLLM hooks


@needs_vllm
def test_pinned_vllm_version() -> None:
    import vllm

    assert vllm.__version__.startswith(VLLM_VERSION + "."), vllm.__version__


def _params(func: Any) -> list[tuple[str, Any]]:
    """Parameter names and kinds (a classmethod's function, ``cls`` included)."""
    if isinstance(func, classmethod):
        func = func.__func__
    return [(p.name, p.kind) for p in inspect.signature(func).parameters.values()]


@needs_vllm
@pytest.mark.parametrize("hook", CONNECTOR_HOOKS)
def test_every_overridden_hook_exists_in_vllm(hook: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    from kvshm.integrations.vllm import KvshmConnector

    base = next((c for c in (KVConnectorBase_V1, SupportsHMA) if hook in vars(c)), None)
    assert base is not None, f"vLLM {VLLM_VERSION} has no connector hook {hook!r}"
    assert hook in vars(KvshmConnector), f"KvshmConnector does not override {hook!r}"
    ours, theirs = vars(KvshmConnector)[hook], vars(base)[hook]
    if isinstance(theirs, property):
        assert isinstance(ours, property), hook
        return
    assert _params(ours) == _params(theirs), (
        f"{hook}: ours {inspect.signature(ours)} vs vLLM's {inspect.signature(theirs)}")


@needs_vllm
def test_every_override_is_listed_and_the_class_is_concrete() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    from kvshm.integrations.vllm import KvshmConnector

    vllm_names = set(vars(KVConnectorBase_V1)) | set(vars(SupportsHMA))
    overridden = {n for n in vars(KvshmConnector) if n in vllm_names and not n.startswith("_")}
    overridden |= {"__init__"}
    assert overridden == set(CONNECTOR_HOOKS)
    assert not KvshmConnector.__abstractmethods__
    assert issubclass(KvshmConnector, SupportsHMA)


@needs_vllm
def test_a_hook_of_the_other_role_is_a_state_error() -> None:
    """A worker hook called on the scheduler-side connector (or the reverse), or metadata
    of another connector bound to kvshm's worker, failed an ``assert``: a bare
    AssertionError, or under ``python -O`` an AttributeError on None further on. Each is
    a StateError naming the misuse now."""
    from kvshm.errors import StateError
    from kvshm.integrations.vllm import KvshmConnector

    conn = object.__new__(KvshmConnector)  # the role's halves only: no vLLM config needed
    conn._sched = conn._worker = None
    with pytest.raises(StateError, match="scheduler-side hook was called on kvshm's "
                                         "worker-side connector"):
        conn.scheduler_side  # noqa: B018
    with pytest.raises(StateError, match="worker-side hook was called on kvshm's "
                                         "scheduler-side connector"):
        conn.worker_side  # noqa: B018
    with pytest.raises(StateError, match="kvshm's worker was bound object, not the metadata"):
        conn.bind_connector_metadata(object())
    assert getattr(conn, "_connector_metadata", None) is None  # refused: nothing bound


# ------------------------------------------------------------------- GpuBlocks adapter


@needs_vllm
def test_gpu_blocks_over_vllm_block_pool() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=32)
    gpu = VllmGpuBlocks(pool)
    assert list(gpu.iter_free_from_lru()) == list(range(1, 8))  # block 0 is the null block
    blocks = pool.get_new_blocks(4)
    ids = [b.block_id for b in blocks]
    h = [bytes([i]) * 32 for i in range(4)]
    for b, hb in zip(blocks, h):
        pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(hb), 0), b, 32)
    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"s" * 32), 1), blocks[0], 32)
    assert gpu.block_hashes(ids[0]) == (h[0], b"s" * 32)  # primary, then secondary
    assert gpu.block_hashes(ids[1]) == (h[1],)
    assert gpu.block_hashes(7) == ()
    gpu.touch(ids[:2])  # pinned on top of the owner's ref
    pool.free_blocks(blocks)  # the owner lets go: 2 and 3 go to the LRU tail
    assert blocks[0].ref_cnt == 1 and blocks[2].ref_cnt == 0
    free = list(gpu.iter_free_from_lru())
    assert free[-2:] == ids[2:] and ids[0] not in free
    gpu.free([ids[1], ids[0]], evict_first=True)  # ids[1] must be evicted first
    assert list(gpu.iter_free_from_lru())[:2] == [ids[1], ids[0]]
    assert pool.free_block_queue.num_free_blocks == 7
    gpu.touch([ids[3]])
    gpu.free([ids[3]])  # a plain free of a hashed block: LRU tail
    assert list(gpu.iter_free_from_lru())[-1] == ids[3]


# ------------------------------------------------------------------------- KV regions


class _Rec:
    def __init__(self, layers: list[str], layer_stride: int, block_stride: int,
                 offset: int = 0) -> None:
        self.layers, self.layer_stride, self.block_stride = layers, layer_stride, block_stride
        self.offset = offset


def _layer_outer(num_blocks: int, page: tuple[int, ...], nlayers: int,
                 dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], _Rec]:
    """vLLM's CPU layout: one storage, layer-outermost, each layer [blocks, *page]."""
    per_block = int(torch.tensor(page).prod()) * torch.tensor([], dtype=dtype).element_size()
    raw = torch.zeros(nlayers * num_blocks * per_block, dtype=torch.uint8)
    caches = {}
    for li in range(nlayers):
        part = raw[li * num_blocks * per_block:(li + 1) * num_blocks * per_block]
        caches[f"layer.{li}"] = part.view(dtype).view(num_blocks, *page)
    return caches, _Rec(list(caches), num_blocks * per_block, per_block)


def test_kv_layout_layer_outer_cover_each_layers_blocks() -> None:
    caches, rec = _layer_outer(5, (2, 32, 64), 3, torch.bfloat16)
    for li, t in enumerate(caches.values()):
        for b in range(5):
            t[b].fill_(li * 10 + b)
    regions = kv_layout(caches, [rec], 5).rows
    assert len(regions) == 3
    for r, t in zip(regions, caches.values()):
        assert r.shape == (5, 2 * 32 * 64 * 2) and r.dtype == torch.uint8
        for b in range(5):
            assert torch.equal(r[b], t[b].reshape(-1).view(torch.uint8))
    regions[1][2].zero_()  # a view, not a copy
    assert not caches["layer.1"][2].any()


def test_kv_layout_block_outer_is_one_region() -> None:
    num_blocks, page, nl = 4, 256, 2
    raw = torch.arange(num_blocks * page * nl, dtype=torch.int32).view(torch.uint8)
    caches = {f"l{i}": raw[i * page:].as_strided((num_blocks, page), (page * nl, 1))
              for i in range(nl)}
    regions = kv_layout(caches, [_Rec(list(caches), page, page * nl)], num_blocks).rows
    assert len(regions) == 1 and regions[0].shape == (num_blocks, page * nl)
    assert torch.equal(regions[0][3], raw[3 * page * nl:4 * page * nl])


def test_kv_layouts_of_equal_bytes_but_another_order_do_not_share() -> None:
    """Hazard "a layout fingerprint that missed the shape" on vLLM's path (a review of
    its fix): the connector's regions are byte rows, so the block shape the fix added
    was every region's byte count, and two deployments of one model whose attention
    backends keep a block's KV in another order -- [blocks, block_size, heads, dim]
    (NHD) against [blocks, heads, block_size, dim] (HND), as many bytes -- still had one
    fingerprint and read each other's blocks. ``kv_layout`` now says what a row means,
    the worker's layout records it, and the fingerprints differ; the same layout twice
    still agrees, and so does one with other block counts."""
    def spec(page: tuple[int, ...], blocks: int = 6) -> Any:
        caches, rec = _layer_outer(blocks, page, 2, torch.bfloat16)
        kv = kv_layout(caches, [rec], blocks)
        assert kv.dtypes == ["bfloat16"] * 2
        assert kv.shapes[0] == (1, 1 + len(page), -1, *page, *range(1 + len(page)))
        return KVLayout(kv.rows, kv.dtypes, kv.shapes).to_spec()

    def fp(page: tuple[int, ...], blocks: int = 6) -> str:
        return layout_fingerprint("m", 16, (KVGroup.full(),), {0: spec(page, blocks)},
                                  (1, 1))

    nhd, hnd = (16, 4, 32), (4, 16, 32)
    assert spec(nhd).bytes_per_block == spec(hnd).bytes_per_block
    assert fp(nhd) != fp(hnd)
    # a block count equal to another dimension (here the head size, 32) is marked
    # only where it is the block dimension: a review found the fingerprint changed
    # with the count when every dimension of that size was marked
    assert fp(nhd) == fp(nhd) == fp(nhd, blocks=9) == fp(nhd, blocks=32)


def test_kv_layout_refuse_a_layer_where_the_record_does_not_put_it() -> None:
    caches, rec = _layer_outer(4, (64,), 2, torch.float32)
    rec.layer_stride += 64
    with pytest.raises(ConfigError, match="does not start layer_stride"):
        kv_layout(caches, [rec], 4)
    caches, rec = _layer_outer(4, (64,), 2, torch.float32)
    rec.layers.append("missing")
    with pytest.raises(ConfigError, match=r"layers \['missing'\] were not registered"):
        kv_layout(caches, [rec], 4)
    caches, rec = _layer_outer(4, (64,), 1, torch.float32)
    with pytest.raises(ConfigError, match="fall outside"):
        kv_layout(caches, [rec], 5)


# ----------------------------------------------- load failures with several KV groups


def _worker_side(per_request: bool) -> Any:
    from kvshm.integrations.vllm.config import ConnectorConfig
    from kvshm.integrations.vllm.worker import WorkerSide
    from kvshm.types import KVGroup, StoreMode

    groups = (KVGroup.full(), KVGroup.sliding_window(64)) if per_request else (KVGroup.full(),)
    cfg = ConnectorConfig("unit", 1, 1, 16, groups, StoreMode.EAGER, None, 64, None,
                          30.0, 5.0, 0)
    ws = WorkerSide(cfg)
    ws.reports.per_request_failures = per_request  # register() sets it from kv_cache_groups
    return ws


@pytest.mark.parametrize("per_request", [False, True])
def test_failed_load_is_reported_per_request_with_several_kv_groups(per_request: bool) -> None:
    """vLLM 0.32 raises on invalid_block_ids for a model with several KV cache groups
    (block ids are per group there), so with full + sliding-window groups a failed load
    travels as the request id in failed_recving and no block id is reported; with one
    group the destination blocks are reported (vLLM keeps the valid prefix)."""
    from kvshm.integrations.vllm.records import StepMeta

    ws = _worker_side(per_request)
    ws.bind(StepMeta(7, failed_loads={"r1": (4, 5, 6)}))
    assert ws.finished_loads() == {"r1"}  # every rank reports it as finished...
    if per_request:
        assert ws.reports.take_failed_requests() == {"r1"}  # ...and as failed, in one snapshot
        assert ws.reports.take_errors() == set()
    else:
        assert ws.reports.take_failed_requests() == set()
        assert ws.reports.take_errors() == {4, 5, 6}
    assert ws.reports.take_failed_requests() == set() and ws.reports.take_errors() == set()


# ----------------------------------------------------------- the per-step listing


def test_listing_covers_every_kind_of_scheduled_request() -> None:
    """``SchedulerSide._listing`` over a SchedulerOutput-shaped object (vLLM's fields,
    no vLLM): new, unchanged, grown, resumed, announced late (before READY), unknown to
    the block state, preempted-and-not-listed, and a request the side never saw. Exact
    ScheduledRequests, sliding-window allocations and counters, in listing order."""
    from types import SimpleNamespace as NS

    from kvshm.integrations.vllm.config import ConnectorConfig
    from kvshm.integrations.vllm.scheduler import SchedulerSide
    from kvshm.types import KVGroup, ScheduledRequest, StoreMode

    cfg = ConnectorConfig("unit", 1, 1, 16, (KVGroup.full(), KVGroup.sliding_window(64)),
                          StoreMode.EAGER, None, 64, None, 30.0, 5.0, 0)
    side = SchedulerSide(cfg)

    def req(rid: str, computed: int, placeholders: int = 0) -> Any:
        r = NS(request_id=rid, block_hashes=[rid.encode()], num_tokens=computed + 1,
               num_computed_tokens=computed, num_output_placeholders=placeholders,
               kv_transfer_params=None)
        side._requests[rid] = r  # what the lookup hook records
        return r

    for rid, computed in (("new", 16), ("steady", 40), ("grow", 48), ("back", 32),
                          ("late", 0), ("nostate", 0), ("gone", 20)):
        req(rid, computed, placeholders=1 if rid == "steady" else 0)
    side._announced |= {"steady", "grow", "back", "gone", "ghost"}  # listed before READY
    so = NS(
        scheduled_new_reqs=[NS(req_id="new", block_ids=([1, 2], [3, 4]), num_computed_tokens=16)],
        scheduled_cached_reqs=NS(
            req_ids=["steady", "grow", "back", "late", "nostate", "ghost"],
            resumed_req_ids={"back"},
            new_block_ids=[None, ([5], [6]), ([7, 8], [9, 10]), None, None, None],
            num_computed_tokens=[40, 48, 32, 0, 0, 0]),
        preempted_req_ids={"gone", "steady"},
        kv_connector_block_state=NS(
            get_block_ids=lambda rid: ([11], [12]) if rid == "late" else None))
    out, alloc = side._listing(so)
    none = ((), ())
    hashes = {rid: [rid.encode()] for rid in side._requests}
    assert out == [
        ScheduledRequest("new", hashes["new"], 17, ((1, 2), (3, 4)), True, 16),
        ScheduledRequest("steady", hashes["steady"], 41, none, False, 39),
        ScheduledRequest("grow", hashes["grow"], 49, ((5,), (6,)), False, 48),
        ScheduledRequest("back", hashes["back"], 33, ((7, 8), (9, 10)), True, 32),
        ScheduledRequest("late", hashes["late"], 1, ((11,), (12,)), True, 0),
        ScheduledRequest("gone", hashes["gone"], 21, none, False, 20, True),
    ]
    # sliding window: ids allocated this step (a new table from its first uncomputed
    # block on; appended ids as they are)
    assert alloc == {2, 4, 5, 6, 11, 12}
    c = side.counters
    assert (c.requests_resumed, c.requests_announced_late, c.requests_preempted,
            c.requests_unknown) == (1, 1, 1, 1)
    assert side._announced >= {"new", "late"} and "nostate" not in side._announced
