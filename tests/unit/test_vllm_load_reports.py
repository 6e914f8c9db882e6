"""A vLLM worker rank's load reports alone (:class:`kvshm.integrations.vllm.load_reports.
LoadReports`), fed StepMeta records and Dones as the worker side hands them (no vLLM)."""

from __future__ import annotations

from kvshm.integrations.vllm.load_reports import LoadReports
from kvshm.integrations.vllm.records import StepMeta, WorkerCounters
from kvshm.ipc.protocol import Done


def _reports(per_request: bool = False) -> LoadReports:
    r = LoadReports(WorkerCounters())
    r.per_request_failures = per_request
    return r


def test_a_synchronous_requests_load_is_never_reported_finished_and_fails_as_blocks() -> None:
    """Job 4 loads requests a (synchronous: vLLM runs it this step) and b. Its failure
    reports only b as finished -- vLLM asserts a running request is not in
    ``finished_recving`` -- and both requests' destinations 10, 11 as error blocks."""
    r = _reports()
    r.listed(StepMeta(1, load_jobs={4: ("a", "b")}, load_dsts={4: (10, 11)},
                      sync_reqs=("a",)))
    r.collected([Done(4, 0, False, "CopyError: late")])
    assert r.report([], gone=False) == {"b"}
    assert r.take_errors() == {10, 11} and r.take_errors() == set()
    assert r.take_failed_requests() == set()
    assert (r.counters.loads_failed, r.counters.error_blocks) == (1, 2)


def test_jobs_left_when_the_worker_is_gone_are_reported_failed_once() -> None:
    """Jobs 1 and 2 are listed; 1's Done arrives; the Worker then leaves for good. Job 2
    is reported failed (``loads_orphaned`` 1) -- no Done will ever come for it -- and a
    later report, the worker still gone, reports nothing again."""
    r = _reports()
    r.listed(StepMeta(1, load_jobs={1: ("x",), 2: ("y",)}, load_dsts={1: (5,), 2: (6,)}))
    assert r.unreported([1]) == [2]
    assert r.report([Done(1, 0, True)], gone=True) == {"x", "y"}
    assert r.take_errors() == {6}
    assert (r.counters.loads_done, r.counters.loads_failed,
            r.counters.loads_orphaned) == (1, 1, 1)
    assert r.report([], gone=True) == set() and not r.waiting


def test_collected_dones_are_not_waited_for_again() -> None:
    """A synchronous wait collected job 3's Done before ``get_finished``: the CPU
    device's wait for unreported jobs must not wait for it a second time, and the next
    report carries it."""
    r = _reports(per_request=True)
    r.listed(StepMeta(1, load_jobs={3: ("q",), 9: ("z",)}, load_dsts={3: (1,), 9: (2,)}))
    r.collected([Done(3, 0, False)])
    assert r.unreported([]) == [9]
    assert r.report([], gone=False) == {"q"}
    assert r.take_failed_requests() == {"q"} and r.take_errors() == set()
