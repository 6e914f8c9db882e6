"""Measure what recomputing a token at position ``p`` costs: the model behind the CPU
tier's cost-aware eviction (:mod:`kvshm.offload.evict_cost`).

``python -m tools.prefill_cost [--backend toy|llama] [--device cpu|cuda] [--json]``

Method: the situation a prefix-cache miss creates. With ``s`` tokens of context already
in the KV cache, time one prefill chunk of ``C`` new tokens at positions
``[s, s + C)``, for several ``s`` (median of ``--repeats`` runs after a warm-up). The
model of a token's cost is ``a + b * p`` (the projections and MLP are the same for
every token; attention reads the ``p`` keys before it), so the chunk takes
``T(s) = C * a + b * C * (s + (C - 1) / 2)``: a least-squares line through
``(s, T(s))`` gives ``b = slope / C`` and ``a = (intercept - slope * (C - 1) / 2) / C``.
Reported: ``a``, ``b``, the fit's worst relative residual, and ``half = a / b``, the
position at which attention costs a token as much as everything else (the one constant
the eviction order needs: a token at ``p`` costs ``1 + p / half`` units).

Backends:

* ``toy``: :class:`kvshm.demo.model.ToyModel` (the demo's engine: float32, paged KV
  gather, default shape), one torch thread; positions up to its 4096.
* ``llama``: a stack of Llama-shaped decoder layers with random weights (RMSNorm,
  grouped-query attention through ``torch.nn.functional.scaled_dot_product_attention``
  with a lower-right causal mask, so the chunk attends to the context before it as a
  chunked prefill does; SwiGLU MLP); ``--shape`` picks the layer sizes (``llama3-8b``:
  hidden 4096, 32 query heads, 8 KV heads, head dim 128, MLP 14336; ``tinyllama``:
  2048 / 32 / 4 / 64 / 5632), ``--layers`` how many (the ratio ``a / b`` does not depend
  on it). bfloat16 on CUDA, float32 on CPU.

Measured (the constants kvshm uses; commands and full output in the commit that set
them): see :data:`kvshm.offload.evict_cost.ATTN_HALF_TOKENS`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    # hidden, query heads, KV heads, head dim, MLP hidden
    "llama3-8b": (4096, 32, 8, 128, 14336),
    "llama3-70b": (8192, 64, 8, 128, 28672),
    "tinyllama": (2048, 32, 4, 64, 5632),
}


@dataclass(frozen=True)
class Fit:
    """``a + b * p`` per token (seconds), from chunks of ``chunk`` tokens."""

    a: float
    b: float
    chunk: int
    starts: list[int]
    seconds: list[float]

    @property
    def half(self) -> float:
        """The position where attention costs a token as much as the rest."""
        return self.a / self.b if self.b > 0 else math.inf

    def predict(self, s: int) -> float:
        c = self.chunk
        return c * self.a + self.b * c * (s + (c - 1) / 2)

    @property
    def worst_residual(self) -> float:
        return max(abs(self.predict(s) - t) / t for s, t in zip(self.starts, self.seconds))


def fit(starts: list[int], seconds: list[float], chunk: int) -> Fit:
    """Least squares of ``T(s)`` on ``s`` (module docstring)."""
    n = len(starts)
    ms, mt = sum(starts) / n, sum(seconds) / n
    sxx = sum((s - ms) ** 2 for s in starts)
    slope = sum((s - ms) * (t - mt) for s, t in zip(starts, seconds)) / sxx
    intercept = mt - slope * ms
    b = slope / chunk
    a = (intercept - slope * (chunk - 1) / 2) / chunk
    return Fit(a, b, chunk, starts, seconds)


def _timed(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    run()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure_toy(starts: list[int], chunk: int, repeats: int) -> list[float]:
    from kvshm.demo.model import ToyConfig, ToyModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = ToyConfig()
        model = ToyModel(cfg)
        n_blocks = cfg.max_positions // cfg.block_size
        shards = model.make_kv_shards(n_blocks)
        table = list(range(n_blocks))
        toks = [(7 * i) % cfg.vocab_size for i in range(chunk)]
        out = []
        for s in starts:
            def run(s: int = s) -> None:
                model.forward_chunk(shards, toks, s, table)
            out.append(_timed(run, repeats, lambda: None))
        return out
    finally:
        torch.set_num_threads(threads)


class _LlamaStack:
    """Random-weight Llama-shaped layers; :meth:`chunk` runs ``C`` tokens after ``s``
    tokens of cached K/V (module docstring)."""

    def __init__(self, shape: str, layers: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        hid, nq, nkv, hd, ffn = SHAPES[shape]
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(*size: int) -> torch.Tensor:
            return (torch.randn(size, generator=g) / math.sqrt(size[-1])).to(device, dtype)

        self.nq, self.nkv, self.hd, self.hid = nq, nkv, hd, hid
        self.layers = [(w((nq + 2 * nkv) * hd, hid), w(hid, nq * hd), w(2 * ffn, hid),
                        w(hid, ffn)) for _ in range(layers)]
        self.device, self.dtype = device, dtype

    def cache(self, s: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (1, self.nkv, s, self.hd)
        return [(torch.randn(shape, device=self.device, dtype=self.dtype),
                 torch.randn(shape, device=self.device, dtype=self.dtype))
                for _ in self.layers]

    def chunk(self, x: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from torch.nn.attention.bias import causal_lower_right

        n = x.shape[0]
        nq, nkv, hd = self.nq, self.nkv, self.hd
        with torch.inference_mode():
            h = x
            for (wqkv, wo, wgu, wd), (ck, cv) in zip(self.layers, cache):
                qkv = F.linear(F.rms_norm(h, (self.hid,)), wqkv)
                q, k, v = torch.split(qkv, [nq * hd, nkv * hd, nkv * hd], -1)
                q = q.view(1, n, nq, hd).transpose(1, 2)
                k = torch.cat((ck, k.view(1, n, nkv, hd).transpose(1, 2)), 2)
                v = torch.cat((cv, v.view(1, n, nkv, hd).transpose(1, 2)), 2)
                mask = causal_lower_right(n, k.shape[2])
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                h = h + F.linear(o.transpose(1, 2).reshape(n, nq * hd), wo)
                gate, up = F.linear(F.rms_norm(h, (self.hid,)), wgu).chunk(2, -1)
                h = h + F.linear(F.silu(gate) * up, wd)


def measure_llama(starts: list[int], chunk: int, repeats: int, shape: str, layers: int,
                  device: torch.device) -> list[float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stack = _LlamaStack(shape, layers, device, dtype)
    x = torch.randn(chunk, stack.hid, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for s in starts:
        cache = stack.cache(s)

        def run(cache: list[tuple[torch.Tensor, torch.Tensor]] = cache) -> None:
            stack.chunk(x, cache)
        out.append(_timed(run, repeats, sync))
        del cache
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("toy", "llama"), default="toy")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=0, help="0: 256 (toy) / 2048 (llama)")
    ap.add_argument("--starts", type=int, nargs="*", default=[])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.backend == "toy":
        chunk = args.chunk or 256
        starts = args.starts or list(range(0, 4096 - chunk + 1, 512))
        secs = measure_toy(starts, chunk, args.repeats)
        label = "toy (kvshm.demo.model, float32, 1 thread)"
    else:
        chunk = args.chunk or 2048
        starts = args.starts or [0, 2048, 4096, 8192, 12288, 16384, 24576, 30720]
        dev = torch.device(args.device)
        secs = measure_llama(starts, chunk, args.repeats, args.shape, args.layers, dev)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        label = f"{args.shape} x{args.layers} layers on {name}"
    f = fit(starts, secs, chunk)
    for s, t in zip(starts, secs):
        print(f"start {s:>6}: {t * 1e3:9.3f} ms  (fit {f.predict(s) * 1e3:9.3f})")
    print(f"{label}: a = {f.a * 1e6:.4f} us/token, b = {f.b * 1e9:.4f} ns/token/position, "
          f"half = {f.half:.0f} positions, worst residual {f.worst_residual:.1%}")
    if args.json:
        print(json.dumps(summary(label, f)))
    return 0


def summary(label: str, f: Fit) -> dict[str, object]:
    """The JSON line. ``half`` is null where the fit's slope is not positive: timings
    that do not grow with position (a loaded machine, or chunks too short to see
    attention) have no half-way position, and the run still reports what it measured."""
    half = round(f.half) if f.b > 0 and math.isfinite(f.half) else None
    return {"model": label, "chunk": f.chunk, "starts": f.starts,
            "seconds": [round(t, 9) for t in f.seconds], "a": f.a, "b": f.b,
            "half": half, "worst_residual": round(f.worst_residual, 4)}


if __name__ == "__main__":
    sys.exit(main())
