"""A toy decoder-only transformer with paged attention over a sharded block KV cache.

It exists so that ``kvshm demo`` moves real KV bytes whose loss or corruption shows up in
the logits. Random weights (seed 0), float32, RMSNorm, rotary positions, SwiGLU MLP,
separate LM head.

KV cache layout (the contract with kvshm): ``tp_shards`` tensors, split by heads (shard
``s`` holds heads ``[s * heads_per_shard, (s + 1) * heads_per_shard)``), each of shape
``(num_gpu_blocks, num_layers, 2, block_size, heads_per_shard, head_dim)`` float32 and
contiguous. Dim 0 is the block, so one block of one shard is one opaque contiguous row
(128 KiB with the default config) -- exactly what a kvshm worker copies. Index 0 of dim 2
is K (after rotary), 1 is V. Token position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at slot ``p % block_size``.

Invariants:

* ``forward_chunk`` writes the chunk's K/V for every layer into the shards *before* it
  reads the context back; the KV of positions ``< start_pos`` comes only from the shards,
  never from a Python-side cache, so blocks loaded by kvshm are what the model attends to.
* Rotary angles come from a table indexed by absolute position, so a token's K/V does not
  depend on where a chunk starts.
* Determinism: no nondeterministic ops are used; with the same weights, the same thread
  count and the same chunk boundaries (``start_pos`` and lengths of every chunk), logits
  are bitwise identical, whatever block ids hold the context. Different chunk boundaries
  agree only to float tolerance (BLAS kernels round differently for different row
  counts), so a bit-exact reference must replay the same boundaries (every
  ``forward_chunk``'s ``start_pos`` and length, decode steps included).

Speed (2-core EPYC, float32, 1 torch thread, CPU time): a 1,024-token prefill from
position 0 in two 512-token chunks ~0.42 s; one decode step with 1,500 tokens of context
~10-12 ms, bound by memory traffic (42 MB of weights plus ~24 MB of context K/V per
step). Two torch threads help only on an idle machine: when other processes hold a core,
OpenMP's barriers make two threads several times slower than one, so a driver sharing the
cores with kvshm workers should call ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from kvshm.errors import ConfigError

__all__ = ["ShardAlloc", "ToyConfig", "ToyModel", "greedy"]


class ShardAlloc(Protocol):
    """Allocates one KV shard: ``torch.zeros`` or ``kvshm.shm.shared_tensor``."""

    def __call__(self, shape: tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class ToyConfig:
    """Shape of the toy model; validated on construction (``ConfigError``)."""

    num_layers: int = 4
    hidden: int = 512
    num_heads: int = 8
    head_dim: int = 64
    ffn_hidden: int = 1024
    vocab_size: int = 1024
    block_size: int = 16
    tp_shards: int = 2
    max_positions: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden", "num_heads", "head_dim", "ffn_hidden",
                    "vocab_size", "block_size", "tp_shards", "max_positions")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"ToyConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads * self.head_dim != self.hidden:
            raise ConfigError("ToyConfig: num_heads * head_dim must equal hidden")
        if self.num_heads % self.tp_shards:
            raise ConfigError("ToyConfig: num_heads must be a multiple of tp_shards")
        if self.head_dim % 2:
            raise ConfigError("ToyConfig: head_dim must be even (rotary pairs)")

    @property
    def heads_per_shard(self) -> int:
        return self.num_heads // self.tp_shards

    def shard_shape(self, num_gpu_blocks: int) -> tuple[int, ...]:
        """Shape of one KV shard tensor holding ``num_gpu_blocks`` blocks."""
        return (num_gpu_blocks, self.num_layers, 2, self.block_size, self.heads_per_shard,
                self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block in one shard (one row of dim 0; 4 bytes per float32)."""
        return math.prod(self.shard_shape(1)) * 4


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor  # (hidden,)
    wqkv: torch.Tensor  # (3 * hidden, hidden): rows q, then k, then v; head-major
    wo: torch.Tensor  # (hidden, hidden)
    mlp_norm: torch.Tensor  # (hidden,)
    wgate_up: torch.Tensor  # (2 * ffn_hidden, hidden): gate rows, then up rows
    wdown: torch.Tensor  # (hidden, ffn_hidden)


class _Rows(NamedTuple):
    """Layer-0 shard rows: ``chunk`` = K rows then V rows of the chunk's positions;
    ``context`` = K rows then V rows of positions ``[0, end)``."""

    chunk: torch.Tensor
    context: torch.Tensor


def greedy(logits: torch.Tensor) -> int:
    """The greedy next token: the first index of the maximum (ties go to the lower id)."""
    return int(torch.argmax(logits).item())


def _randn(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


class ToyModel:
    """The toy transformer. Weights are drawn in a fixed order from ``torch.Generator(seed)``.

    Not thread-safe: calls reuse one scratch buffer, so use a model from one thread at
    a time. Apart from that it holds only read-only weights; all sequence state is in the
    KV shards the caller passes in.
    """

    def __init__(self, config: ToyConfig = ToyConfig(), *, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        self.seed = seed
        #: Where weights, activations and the KV shards live. Weights are drawn on the CPU
        #: (the same values on every device) and then moved.
        self.device = torch.device(device)
        c = config
        gen = torch.Generator().manual_seed(seed)
        self.embedding = _randn(gen, (c.vocab_size, c.hidden), 1.0)
        scale = 1.0 / math.sqrt(c.hidden)
        resid = scale / math.sqrt(2 * c.num_layers)
        layers = []
        for _ in range(c.num_layers):
            layers.append(_Layer(
                attn_norm=torch.ones(c.hidden),
                wqkv=_randn(gen, (3 * c.hidden, c.hidden), scale),
                wo=_randn(gen, (c.hidden, c.hidden), resid),
                mlp_norm=torch.ones(c.hidden),
                wgate_up=_randn(gen, (2 * c.ffn_hidden, c.hidden), scale),
                wdown=_randn(gen, (c.hidden, c.ffn_hidden), 1.0 / math.sqrt(c.ffn_hidden)),
            ))
        self.layers: tuple[_Layer, ...] = tuple(layers)
        self.final_norm = torch.ones(c.hidden)
        self.lm_head = _randn(gen, (c.vocab_size, c.hidden), scale)
        self._cos, self._sin = self._rope_tables()
        self._scale = 1.0 / math.sqrt(c.head_dim)
        # Reused destination of the context gather: a fresh multi-MiB tensor per layer
        # and shard would be mmapped and page-faulted on every call (~8x slower).
        self._gather_buffer = torch.empty(2 * c.max_positions, c.heads_per_shard, c.head_dim)
        if self.device.type != "cpu":
            self._move_to_device()

    def _move_to_device(self) -> None:
        move = self.device
        self.embedding = self.embedding.to(move)
        self.layers = tuple(_Layer(*(w.to(move) for w in (
            lay.attn_norm, lay.wqkv, lay.wo, lay.mlp_norm, lay.wgate_up, lay.wdown)))
            for lay in self.layers)
        self.final_norm, self.lm_head = self.final_norm.to(move), self.lm_head.to(move)
        self._cos, self._sin = self._cos.to(move), self._sin.to(move)
        self._gather_buffer = self._gather_buffer.to(move)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        half = c.head_dim // 2
        inv_freq = c.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(c.max_positions, dtype=torch.float64)[:, None] * inv_freq[None]
        return angles.cos().to(torch.float32), angles.sin().to(torch.float32)

    # ----------------------------------------------------------------- KV shards

    def _zeros(self, shape: tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def make_kv_shards(self, num_gpu_blocks: int,
                       alloc: ShardAlloc | None = None) -> list[torch.Tensor]:
        """Allocate ``tp_shards`` KV shard tensors of ``num_gpu_blocks`` blocks each with
        ``alloc(shape, dtype=torch.float32)`` (default: ``torch.zeros`` on the model's
        device)."""
        if num_gpu_blocks <= 0:
            raise ConfigError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}")
        shape = self.config.shard_shape(num_gpu_blocks)
        make = self._zeros if alloc is None else alloc
        return [make(shape, dtype=torch.float32) for _ in range(self.config.tp_shards)]

    def _check_shards(self, kv_shards: Sequence[torch.Tensor]) -> int:
        c = self.config
        if len(kv_shards) != c.tp_shards:
            raise ConfigError(f"expected {c.tp_shards} KV shards, got {len(kv_shards)}")
        num_blocks = kv_shards[0].shape[0]
        want = c.shard_shape(num_blocks)
        for shard in kv_shards:
            if (tuple(shard.shape) != want or shard.dtype != torch.float32
                    or shard.device.type != self.device.type):
                raise ConfigError(f"KV shard must be a {self.device.type} float32 {want}, got "
                                  f"{shard.device} {shard.dtype} {tuple(shard.shape)}")
            if not shard.is_contiguous():
                raise ConfigError("KV shards must be contiguous (one row per block)")
        return num_blocks

    def _check_chunk(self, token_ids: Sequence[int], start_pos: int,
                     block_table: Sequence[int], num_blocks: int) -> None:
        c = self.config
        end = start_pos + len(token_ids)
        if not token_ids:
            raise ConfigError("forward_chunk needs at least one token")
        if start_pos < 0 or end > c.max_positions:
            raise ConfigError(f"positions [{start_pos}, {end}) outside [0, {c.max_positions})")
        if min(token_ids) < 0 or max(token_ids) >= c.vocab_size:
            raise ConfigError(f"token ids must be in [0, {c.vocab_size})")
        needed = -(-end // c.block_size)
        if len(block_table) < needed:
            raise ConfigError(f"block table has {len(block_table)} blocks, positions up to "
                              f"{end} need {needed}")
        used = block_table[:needed]
        if min(used) < 0 or max(used) >= num_blocks:
            raise ConfigError(f"block ids must be in [0, {num_blocks})")
        if len(set(used)) != needed:
            raise ConfigError("block table repeats a block id")

    # ----------------------------------------------------------------- forward

    def forward_chunk(self, kv_shards: Sequence[torch.Tensor], token_ids: Sequence[int],
                      start_pos: int, block_table: Sequence[int], *,
                      all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions ``[start_pos, start_pos + len(token_ids))``.

        Order per layer: project Q/K/V, write K/V into the shards at
        ``(block_table[p // block_size], p % block_size)``, gather positions
        ``[0, start_pos + len)`` back from the shards, attend causally. Returns the
        logits of the last token, shape ``(vocab,)``, or of every token,
        ``(len, vocab)``, with ``all_logits``. The KV of positions ``< start_pos`` must
        already be in the shards (computed earlier, or loaded by kvshm).

        On CUDA the call returns only once its kernels have finished: the chunk's K/V is
        in the shards before the caller can tell kvshm to store them, since kvshm's
        workers copy from other processes, on streams that know nothing of this one.
        """
        num_blocks = self._check_shards(kv_shards)
        self._check_chunk(token_ids, start_pos, block_table, num_blocks)
        with torch.inference_mode():
            logits = self._forward(kv_shards, token_ids, start_pos, block_table, all_logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits

    def _forward(self, kv_shards: Sequence[torch.Tensor], token_ids: Sequence[int],
                 start_pos: int, block_table: Sequence[int], all_logits: bool) -> torch.Tensor:
        c = self.config
        n = len(token_ids)
        end = start_pos + n
        dev = self.device
        positions = torch.arange(start_pos, end, device=dev)
        rows = self._rows(block_table, start_pos, end)
        cos = self._cos[start_pos:end][:, None, :]
        sin = self._sin[start_pos:end][:, None, :]
        blocked = None  # a single token (decode) attends to all of [0, end)
        if n > 1:
            blocked = torch.arange(end, device=dev)[None, :] > positions[:, None]  # future
        h = self.embedding[torch.tensor(list(token_ids), dtype=torch.long, device=dev)]
        for index, layer in enumerate(self.layers):
            h = self._layer(kv_shards, layer, index, h, rows, cos, sin, blocked)
        if not all_logits:
            h = h[-1:]
        logits = F.linear(_rms_norm(h, self.final_norm, c.norm_eps), self.lm_head)
        return logits if all_logits else logits[0]

    def _rows(self, block_table: Sequence[int], start_pos: int, end: int) -> _Rows:
        """Shard rows (of a shard viewed as ``(blocks * layers * 2 * B, Hs, D)``) of layer 0
        for the chunk and for the whole context; layer ``l`` adds ``2 * l * B``."""
        c = self.config
        bs = c.block_size
        table = torch.tensor(list(block_table[:-(-end // bs)]), dtype=torch.long,
                             device=self.device)
        positions = torch.arange(end, device=self.device)
        k_rows = table[positions // bs] * (c.num_layers * 2 * bs) + positions % bs
        v_rows = k_rows + bs
        return _Rows(chunk=torch.cat((k_rows[start_pos:], v_rows[start_pos:])),
                     context=torch.cat((k_rows, v_rows)))

    def _layer(self, kv_shards: Sequence[torch.Tensor], layer: _Layer, index: int,
               h: torch.Tensor, rows: _Rows, cos: torch.Tensor, sin: torch.Tensor,
               blocked: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        n = h.shape[0]
        qkv = F.linear(_rms_norm(h, layer.attn_norm, c.norm_eps), layer.wqkv)
        q, k, v = qkv.view(n, 3, c.num_heads, c.head_dim).unbind(1)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attn = self._attend(kv_shards, index, q, torch.cat((k, v)), rows, blocked)
        h = h + F.linear(attn, layer.wo)
        gate, up = F.linear(_rms_norm(h, layer.mlp_norm, c.norm_eps), layer.wgate_up).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, layer.wdown)

    def _attend(self, kv_shards: Sequence[torch.Tensor], index: int, q: torch.Tensor,
                kv: torch.Tensor, rows: _Rows, blocked: torch.Tensor | None) -> torch.Tensor:
        """Store this layer's chunk K/V (``kv``: K rows then V rows, ``(2n, H, D)``), then
        read the whole context ``[0, end)`` back from each shard and attend, shard by
        shard (heads are independent). Returns ``(n, hidden)``, heads in order."""
        c = self.config
        hs, d = c.heads_per_shard, c.head_dim
        layer_offset = 2 * index * c.block_size
        chunk_rows = rows.chunk + layer_offset
        context_rows = rows.context + layer_offset
        end = context_rows.shape[0] // 2
        outputs = []
        for s, shard in enumerate(kv_shards):
            flat = shard.view(-1, hs, d)  # row = (block, layer, k|v, slot)
            flat.index_copy_(0, chunk_rows, kv[:, s * hs:(s + 1) * hs])
            context = self._gather_buffer[:2 * end]  # (2 * end, Hs, D)
            torch.index_select(flat, 0, context_rows, out=context)
            # Strided (Hs, end, D) views: BLAS reads them in place, no transposing copy.
            keys, values = context[:end].transpose(0, 1), context[end:].transpose(0, 1)
            query = q[:, s * hs:(s + 1) * hs].transpose(0, 1)
            outputs.append(_attention(query, keys, values, blocked, self._scale))
        return torch.cat(outputs).transpose(0, 1).reshape(q.shape[0], c.hidden)

    # ----------------------------------------------------------------- helpers

    def prefill(self, kv_shards: Sequence[torch.Tensor], token_ids: Sequence[int],
                block_table: Sequence[int], *, start_pos: int = 0,
                chunk_tokens: int = 512) -> torch.Tensor:
        """Run ``token_ids`` at ``[start_pos, start_pos + len)`` in fixed chunks.

        Chunk ``i`` covers ``[start_pos + i * chunk_tokens, start_pos + (i + 1) *
        chunk_tokens)`` (the last one shorter); ``chunk_tokens`` must be a multiple of
        the block size, so boundaries are block-aligned whenever ``start_pos`` is.
        Returns the last token's logits.
        """
        if chunk_tokens <= 0 or chunk_tokens % self.config.block_size:
            raise ConfigError(f"chunk_tokens must be a positive multiple of "
                              f"{self.config.block_size}, got {chunk_tokens}")
        if not token_ids:
            raise ConfigError("prefill needs at least one token")
        logits = None
        for offset in range(0, len(token_ids), chunk_tokens):
            chunk = token_ids[offset:offset + chunk_tokens]
            logits = self.forward_chunk(kv_shards, chunk, start_pos + offset, block_table)
        assert logits is not None
        return logits

    def decode_step(self, kv_shards: Sequence[torch.Tensor], token_id: int, pos: int,
                    block_table: Sequence[int]) -> int:
        """Run one token at ``pos`` (context ``[0, pos)`` in the shards); return the greedy
        next token."""
        return greedy(self.forward_chunk(kv_shards, [token_id], pos, block_table))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               blocked: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention, ``query`` (H, n, D), ``keys``/``values`` (H, end, D);
    ``blocked`` (n, end) True where a query may not attend (never a whole row)."""
    scores = torch.matmul(query, keys.transpose(1, 2)).mul_(scale)
    if blocked is not None:
        scores.masked_fill_(blocked, float("-inf"))
    return torch.matmul(scores.softmax(-1), values)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding; ``x`` is (n, heads, head_dim), cos/sin (n, 1, half)."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)
