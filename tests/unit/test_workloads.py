"""tools/workloads.py: every workload is a pure function of its seed and sizes, in
arrival order, with the prefix structure its docstring promises (a chat turn starts
with the whole previous turn, RAG prompts start with a shared system prompt and a
document, the scan's long prompts are never seen twice)."""

from __future__ import annotations

import pytest

from tools.chat_trace import Turn
from tools.workloads import WORKLOADS, make


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_workload_is_deterministic_in_its_seed_and_ordered_by_arrival(name: str) -> None:
    a, b, c = make(name, 3, scale=0.1), make(name, 3, scale=0.1), make(name, 4, scale=0.1)
    assert [(t.req_id, t.prompt, t.answer) for t in a.requests] == \
        [(t.req_id, t.prompt, t.answer) for t in b.requests]
    assert [t.prompt for t in a.requests] != [t.prompt for t in c.requests]
    assert a.arrivals == sorted(a.arrivals) and len(a.arrivals) == len(a.requests)
    assert len({t.req_id for t in a.requests}) == len(a.requests)
    assert all(4 <= x < 32000 for t in a.requests for x in t.tokens)
    d = a.describe()
    assert d["name"] == name and d["seed"] == 3 and d["requests"] == len(a.requests)
    assert isinstance(d["params"], dict) and d["params"]


def _sessions(requests: list[Turn]) -> dict[int, list[Turn]]:
    out: dict[int, list[Turn]] = {}
    for t in requests:
        out.setdefault(t.conversation, []).append(t)
    return out


@pytest.mark.parametrize("name", ["chat", "chat_sync", "agentic"])
def test_a_session_step_starts_with_the_whole_previous_step(name: str) -> None:
    steps = 0
    for turns in _sessions(make(name, 0, scale=0.2).requests).values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for prev, t in zip(turns, turns[1:]):
            assert t.prompt[:len(prev.tokens)] == prev.tokens
            steps += 1
    assert steps > 10


def test_rag_prompts_share_the_system_prompt_and_popular_documents() -> None:
    reqs = make("rag", 0, scale=0.2).requests
    system = reqs[0].prompt[:128]
    assert all(t.prompt[:128] == system for t in reqs)
    firsts = [t.prompt[128:384] for t in reqs]  # the first 256 tokens of the 1st document
    assert len(set(firsts)) < len(firsts) // 2  # Zipf: documents repeat


def test_the_scan_prompts_are_long_one_offs_in_three_bursts() -> None:
    w = make("scan", 0, scale=0.25)
    scans = [i for i, t in enumerate(w.requests) if t.req_id.startswith("scan")]
    assert len(scans) == 3 * 4
    assert all(1536 <= len(w.requests[i].prompt) <= 6144 for i in scans)
    assert len({w.requests[i].prompt[:64] for i in scans}) == len(scans)
    bursts = [scans[k:k + 4] for k in (0, 4, 8)]
    assert all(b[-1] - b[0] == 3 for b in bursts)  # each burst back to back


def test_unknown_names_and_bad_scales_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make("nope")
    with pytest.raises(ValueError, match="scale"):
        make("chat", scale=0.0)
