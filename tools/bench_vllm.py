"""vLLM on the CPU with no connector vs with kvshm: multi-turn chat whose history does not
fit the device KV pool.

``python -m tools.bench_vllm --json`` (needs vLLM; see tools/vllm_install.sh). A random
Llama built offline (default 8 layers, hidden 512, 8 heads, 4 KV heads, bfloat16) and a
word-level tokenizer (one token per word). The prompt set: ``--conversations`` (16)
conversations x ``--turns`` (4); turn 1 is ``--first-tokens`` (1024) unique tokens, each
later turn is the whole history (earlier prompts and answers) plus ``--user-tokens``
(256) new ones; every answer is ``--answer-tokens`` (16) greedy tokens. Turns run
turn-major (every conversation's turn 1, then every turn 2, ...), one request at a time,
so by a conversation's next turn the other 15 have pushed its blocks out of the
``--device-blocks`` (160) device pool: without a connector every turn recomputes its
history, with kvshm it is loaded back from the CPU tier.

In-process vLLM engines, one after the other in this process: the baseline pass, then the
kvshm pass (two in-process engines cannot coexist once one has a connector). Time to
first token is vLLM's own ``first_token_latency``; wall time sums each pass's request
times (for kvshm including the steps that finish its stores). Answers are compared
token for token between the passes (each answer is fed back into its conversation, so a
restore that changed a logit enough to flip a greedy token would show).

Last line with ``--json``: ``{"ttft_ratio": <no connector / kvshm, median TTFT of turns
2+>, "wall_ratio": <no connector / kvshm>, "cpu_hit_tokens": <int>}``. Target: ttft_ratio
>= 2.

``--chat``: the capacity-bound variant. The prompts are :func:`tools.chat_trace.chat_trace`
(``--conversations`` 32 x ``--turns`` 6, ``--think`` 32: every conversation open at once,
one coming back after about 32 other turns, in 32-token blocks; the trace's answers are
part of the next prompt, the engine generates ``--answer-tokens`` 1 token), one request
at a time. The CPU tier holds ``--cpu-frac`` (0.5) of the trace's distinct blocks
(``num_cpu_blocks``). Passes, one engine at a time: no connector, kvshm with an unbounded
tier (the denominator of ``hit_fraction``), then kvshm with each ``--evictions`` order
(default ``lru adaptive``: plain LRU and kvshm's default order; the benchmark makes the
engine's CPU pool use that order, as ``EngineConfig(eviction=...)`` asks), and with
``--simplecpu`` vLLM's own
``SimpleCPUOffloadConnector`` at the same capacity (its scheduler side unchanged, a
synchronous CPU copy worker: :mod:`tools.simplecpu_shim`; the passes are in
:mod:`tools.bench_vllm_chat`). Reported per pass: median
TTFT of turns 2+, wall time, CPU-hit tokens and ``hit_fraction`` (hit tokens over the
unbounded tier's).
Last line: ``{"hit_fraction": {"<pass>": ..}, "ttft_ratio": {"<pass>": <no connector /
that pass, median TTFT of turns 2+>}, "ttft_mean_ratio": {..the same of the means},
"ttft_mean_vs_lru": <lru / the last other ``--evictions`` order's mean TTFT of turns
2+>}``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _k, _v in (("OMP_NUM_THREADS", "1"), ("TORCH_COMPILE_DISABLE", "1"),
               ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
               ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_k, _v)

BLOCK = 32
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")


@dataclass
class Side:
    """One engine's measurements."""

    name: str
    ttft: dict[int, list[float]] = field(default_factory=dict)  # turn -> seconds
    wall: float = 0.0
    answers: list[list[int]] = field(default_factory=list)


def build_model(folder: Path, args: argparse.Namespace) -> None:
    """A random Llama and a word-level tokenizer, offline, fixed seed."""
    import torch

    tokenizers = importlib.import_module("tokenizers")
    transformers = importlib.import_module("transformers")
    words = args.vocab - len(SPECIALS)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(words)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>").save_pretrained(str(folder))
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.kv_heads, max_position_embeddings=4096, bos_token_id=1,
        eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(str(folder), safe_serialization=True)


def make_llm(folder: Path, args: argparse.Namespace, kvshm: bool,
             device_blocks: int | None = None, extra: dict[str, Any] | None = None,
             connector: tuple[str, str] = ("KvshmConnector", "kvshm.integrations.vllm")) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_bytes = (2 * args.layers * args.kv_heads * 64 * BLOCK
                * (2 if args.dtype == "bfloat16" else 4))
    kw: dict[str, Any] = {}
    if kvshm:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=connector[0], kv_connector_module_path=connector[1],
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra or {"cpu_bytes": args.cpu_gib << 30,
                                                "mode": args.mode})
    return LLM(model=str(folder), enforce_eager=True, dtype=args.dtype,
               max_model_len=getattr(args, "max_model_len", 2304),
               enable_prefix_caching=True, block_size=BLOCK, max_num_seqs=4, seed=0,
               kv_cache_memory_bytes=(device_blocks or args.device_blocks) * kv_bytes,
               disable_log_stats=False,
               **kw)


def drain(llm: Any) -> None:
    """Run the steps an in-process engine still owes (finish notification, stores)."""
    core = llm.llm_engine.engine_core.engine_core
    for _ in range(10_000):
        if not core.scheduler.has_requests():
            return
        _, ran = core.step_fn()
        core.post_step(model_executed=ran)
    raise RuntimeError("engine still busy after 10000 steps")


def tokens(n: int, start: int, vocab_words: int) -> list[int]:
    """``n`` token ids of ordinary words (ids past the special tokens), from ``start``."""
    return [len(SPECIALS) + (start + 7 * i) % vocab_words for i in range(n)]


def one(llm: Any, prompt: list[int], args: argparse.Namespace,
        kvshm: bool) -> tuple[float, float, list[int]]:
    """(ttft, elapsed, answer token ids) of one request."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    if kvshm:
        drain(llm)
    elapsed = time.perf_counter() - t0
    ttft = out.metrics.first_token_latency if out.metrics is not None else float("nan")
    return ttft, elapsed, list(out.outputs[0].token_ids)


def prefill_probe(llm: Any, args: argparse.Namespace) -> float:
    """Median seconds of a 2k-token prefill (+1 token) on the baseline engine."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for rep in range(3):
        prompt = tokens(2048, 991 * rep + 5, args.vocab - len(SPECIALS))
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_pass(folder: Path, args: argparse.Namespace, kvshm: bool,
             device_blocks: int | None = None) -> tuple[Side, dict[str, Any], float]:
    """Every conversation turn on one engine: (its side, kvshm's statistics, prefill s)."""
    vocab_words = args.vocab - len(SPECIALS)
    side = Side("kvshm" if kvshm else "no connector")
    llm = make_llm(folder, args, kvshm, device_blocks)
    stats: dict[str, Any] = {}
    try:
        # Also the warm-up: the first request pays one-time costs (kvshm: the workers
        # connect and the CPU tier is reserved), kept out of the measured turns.
        prefill_s = prefill_probe(llm, args)
        if kvshm:
            drain(llm)
        history = [tokens(args.first_tokens, 4099 * c, vocab_words)
                   for c in range(args.conversations)]
        for turn in range(1, args.turns + 1):
            for c in range(args.conversations):
                if turn > 1:
                    history[c] += tokens(args.user_tokens, 4099 * c + 131 * turn, vocab_words)
                ttft, elapsed, ans = one(llm, list(history[c]), args, kvshm)
                side.ttft.setdefault(turn, []).append(ttft)
                side.wall += elapsed
                side.answers.append(ans)
                history[c] += ans
        if kvshm:
            stats = llm.llm_engine.engine_core.engine_core.scheduler.connector \
                .scheduler_side.statistics()
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30)
        del llm
        gc.collect()
    return side, stats, prefill_s


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The baseline pass, then the kvshm pass (in-process vLLM engines cannot coexist
    once one has a connector: the worker-side connector is process-global)."""
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        folder = Path(tmp)
        build_model(folder, args)
        base, _, prefill_s = run_pass(folder, args, kvshm=False)
        kv, stats, _ = run_pass(folder, args, kvshm=True)
        ref = None
        if args.ref_device_blocks:
            ref, _, _ = run_pass(folder, args, kvshm=False, device_blocks=args.ref_device_blocks)
    res = summarize({False: base, True: kv}, stats, prefill_s, args)
    if ref is not None:
        res["kvshm_vs_keep_all_mismatches"] = sum(
            a != b for a, b in zip(kv.answers, ref.answers))
        res["recompute_vs_keep_all_mismatches"] = sum(
            a != b for a, b in zip(base.answers, ref.answers))
    return res


def summarize(sides: dict[bool, Side], stats: dict[str, Any], prefill_s: float,
              args: argparse.Namespace) -> dict[str, Any]:
    def later(side: Side) -> list[float]:
        return [t for turn, ts in side.ttft.items() if turn > 1 for t in ts]

    base, kv = sides[False], sides[True]
    mismatches = sum(a != b for a, b in zip(base.answers, kv.answers))
    per_turn = {turn: (statistics.median(base.ttft[turn]), statistics.median(kv.ttft[turn]))
                for turn in sorted(base.ttft)}
    return {
        "prefill_2k_s": prefill_s,
        "ttft_turn1_s": per_turn[1],
        "ttft_by_turn_s": per_turn,
        "ttft_later_s": (statistics.median(later(base)), statistics.median(later(kv))),
        "wall_s": (base.wall, kv.wall),
        "answer_mismatches": mismatches,
        "num_answers": len(kv.answers),
        "cpu_hit_tokens": int(stats["connector"]["loaded_tokens"]),
        "loaded_blocks": int(stats["counters"]["loaded_blocks"]),
        "stored_blocks": int(stats["counters"]["stored_blocks"]),
        "loads_failed": int(stats["counters"]["loads_failed"]),
        "num_cpu_blocks": int(stats["num_cpu_blocks"]),
        "args": vars(args),
    }


def print_table(res: dict[str, Any]) -> None:
    print(f"2k-token prefill (baseline): {res['prefill_2k_s'] * 1e3:.0f} ms")
    print(f"{'turn':>6} {'no connector TTFT':>18} {'kvshm TTFT':>11} {'ratio':>6}")
    for turn, (b, k) in res["ttft_by_turn_s"].items():
        print(f"{turn:>6} {b * 1e3:>15.0f} ms {k * 1e3:>8.0f} ms {b / k:>6.2f}")
    b, k = res["ttft_later_s"]
    print(f"{'2+':>6} {b * 1e3:>15.0f} ms {k * 1e3:>8.0f} ms {b / k:>6.2f}")
    wb, wk = res["wall_s"]
    print(f"wall: {wb:.1f} s vs {wk:.1f} s ({wb / wk:.2f}x); kvshm hit tokens "
          f"{res['cpu_hit_tokens']}, loaded {res['loaded_blocks']} / stored "
          f"{res['stored_blocks']} blocks of {res['num_cpu_blocks']}, failed loads "
          f"{res['loads_failed']}")
    print(f"answers differing from recompute: {res['answer_mismatches']} of "
          f"{res['num_answers']}")
    if "kvshm_vs_keep_all_mismatches" in res:
        print(f"answers differing from vLLM's own prefix cache keeping everything: kvshm "
              f"{res['kvshm_vs_keep_all_mismatches']}, recompute "
              f"{res['recompute_vs_keep_all_mismatches']}")

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    ap.add_argument("--chat", action="store_true",
                    help="the capacity-bound chat variant (module docstring)")
    ap.add_argument("--conversations", type=int, default=None, help="16; --chat: 32")
    ap.add_argument("--turns", type=int, default=None, help="4; --chat: 6")
    ap.add_argument("--think", type=float, default=32.0, help="--chat: mean think time")
    ap.add_argument("--cpu-frac", type=float, default=0.5,
                    help="--chat: CPU tier as a fraction of the distinct blocks")
    ap.add_argument("--simplecpu", action="store_true",
                    help="--chat: also vLLM's SimpleCPUOffloadConnector (its scheduler "
                    "side unchanged, a synchronous CPU copy worker: tools/simplecpu_shim)")
    ap.add_argument("--evictions", nargs="+", default=["lru", "adaptive"],
                    help="--chat: the CPU tier's orders to run (kvshm.config.Eviction values)")
    ap.add_argument("--first-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=None, help="16; --chat: 1")
    ap.add_argument("--device-blocks", type=int, default=160)
    ap.add_argument("--ref-device-blocks", type=int, default=1280,
                    help="a third pass without connector whose device pool keeps every "
                    "conversation (vLLM's own prefix cache): kvshm's answers must equal "
                    "its answers token for token; 0 skips it")
    ap.add_argument("--layers", type=int, default=None, help="8; --chat: 4")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--mode", default="eager", choices=["eager", "lazy"])
    ap.add_argument("--cpu-gib", type=int, default=2)
    args = ap.parse_args(argv)
    for key, plain, chat in (("conversations", 16, 32), ("turns", 4, 6),
                             ("answer_tokens", 16, 1), ("layers", 8, 4)):
        if getattr(args, key) is None:
            setattr(args, key, chat if args.chat else plain)
    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed (see tools/vllm_install.sh)", file=sys.stderr)
        return 2
    if args.chat:
        from tools.bench_vllm_chat import print_chat, run_chat  # imports this module

        summary = print_chat(run_chat(args))
        if args.json:
            print(json.dumps(summary))
        return 0
    res = run(args)
    print_table(res)
    if args.json:
        b, k = res["ttft_later_s"]
        wb, wk = res["wall_s"]
        print(json.dumps({"ttft_ratio": round(b / k, 3), "wall_ratio": round(wb / wk, 3),
                          "cpu_hit_tokens": res["cpu_hit_tokens"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
