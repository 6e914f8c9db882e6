"""The one table of kvshm's Prometheus series: each series' name, type and what it counts.

Both exporters read it, so a series has one name, one type and one HELP line wherever it
is scraped: ``kvshm stats --name NAME --prometheus`` (:func:`kvshm.stats.to_prometheus`
and :func:`kvshm.cli_ls.remote_prometheus`) and vLLM's ``/metrics``
(:mod:`kvshm.integrations.vllm.metrics`, the series marked :attr:`Series.vllm`). Every
series carries the label ``engine`` = the kvshm engine's name (``kvshm stats --name``
takes it); vLLM's ``/metrics`` adds vLLM's ``model_name``.

Names: ``kvshm_<key>`` for an engine counter or snapshot field (a counter's sample is
``kvshm_<key>_total``), ``kvshm_remote_<key>`` for the remote tier's section,
``kvshm_disk_<key>`` for the disk tier's (:data:`DISK_GAUGES` are gauges). HELP lines
say what the series counts and its unit, in one line each. A counter this table does not
describe (an engine newer than this table) is still exported by ``kvshm stats
--prometheus``, with a HELP that says so (:func:`help_of`); tests keep the table complete
for this version.

:func:`scalars` flattens one statistics snapshot (``EngineStats.as_dict()``) into the
counter and gauge values of every scalar series; both exporters take their values from
it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["BREAKER_STATES", "DISK_GAUGES", "SERIES", "Kind", "Series", "breaker_state", "help_of",
           "scalars", "series_names", "vllm_series"]


class Kind(enum.Enum):
    """A series' Prometheus type."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Series:
    """One series family: ``name`` (``kvshm_...``; a counter's sample adds ``_total``),
    its type, HELP, extra labels beyond ``engine``, and whether vLLM's ``/metrics``
    carries it too (``remote``: only with a remote tier configured; ``disk``: only with
    a disk tier)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    vllm: bool = False
    remote: bool = False
    disk: bool = False

    def samples(self) -> tuple[str, ...]:
        """The sample names Prometheus' text format gives this family."""
        if self.kind is Kind.COUNTER:
            return (f"{self.name}_total", f"{self.name}_created")
        if self.kind is Kind.HISTOGRAM:
            return tuple(f"{self.name}{s}" for s in ("_bucket", "_count", "_sum",
                                                     "_created"))
        return (self.name,)


#: The remote tier's circuit-breaker states (``kvshm_remote_breaker_state{state=...}``).
BREAKER_STATES: Final = ("closed", "half_open", "open")

# Engine counters (``EngineStats.counters``): key -> (HELP, in vLLM's /metrics).
_ENGINE_COUNTERS: Final[dict[str, tuple[str, bool]]] = {
    "hit_tokens": ("tokens the serving engine accepted from a CPU- or remote-tier hit, "
                   "once per request at its admission (vLLM: equals "
                   "external_prefix_cache_hits); tokens", True),
    "hit_tokens_readmitted": ("tokens accepted from a hit by a request admitted again "
                              "after a preemption; tokens", True),
    "lookups": ("lookups the CPU tier answered; a request waiting for the serving "
                "engine's KV space is looked up again each step and each answer counts; "
                "lookups", True),
    "lookup_hit_tokens": ("tokens offered by lookup answers, every answer counted (a "
                          "re-asked lookup again): not what was used, see hit_tokens; "
                          "tokens", False),
    "lookup_tokens": ("tokens asked for beyond the GPU's own hit, summed over lookup "
                      "answers (a re-asked lookup again); tokens", False),
    "lookups_hit": ("lookup answers that offered a hit (a re-asked lookup again); "
                    "lookups", False),
    "lookups_not_ready": ("lookups answered 0 because the engine was not READY (worker "
                          "ranks not all connected) or the request began before it was; "
                          "lookups", True),
    "lookups_asked_again": ("lookups answered 'ask again': the hit's blocks were being "
                            "loaded for another request; lookups", True),
    "lookups_unaligned": ("lookups whose GPU hit did not end on a block boundary "
                          "(answered 0); lookups", False),
    "lookups_during_reset": ("lookups answered 0 while a reset's abandoned transfers were "
                             "still in flight; lookups", False),
    "lookups_tier_overdue": ("lookups that started no disk or remote read (a miss "
                             "answered 0, or a short hit not extended) because an earlier "
                             "read is past its fetch timeout and still out (a rank not "
                             "serving tier jobs); lookups", True),
    "loads_planned": ("request loads queued after an accepted hit (CPU to GPU); loads",
                      False),
    "loaded_blocks": ("blocks loaded from the CPU tier into the GPU (successful loads); "
                      "blocks", True),
    "loads_failed": ("request loads that failed or could not be sent (the serving "
                     "engine recomputes their blocks); loads", True),
    "phase_b_unoffered": ("phase B calls that accepted external tokens no lookup had "
                          "offered (never looked up, or the lookup answered 0): their "
                          "load fails at once and the tokens are not counted in "
                          "hit_tokens; calls", False),
    "load_results_superseded": ("load outcomes not reported: the request ended, or was "
                                "admitted again, before the load's outcome came back (its "
                                "id may be in use by another load); loads", True),
    "stores_planned_blocks": ("blocks put into store jobs (GPU to CPU); blocks", False),
    "stored_blocks": ("blocks stored to the CPU tier and indexed (acked by every rank); "
                      "blocks", True),
    "store_jobs": ("store jobs posted to the worker ranks (GPU to CPU copies); jobs",
                   True),
    "load_jobs": ("load jobs posted to the worker ranks (CPU to GPU copies); jobs", True),
    "jobs_failed": ("transfer jobs that failed on at least one rank; jobs", True),
    "jobs_abandoned": ("transfer jobs abandoned in flight by a cache reset; jobs", True),
    "declined_cpu_full": ("store walks stopped because the CPU tier had no free block "
                          "(eager mode tries again next step); walks", True),
    "declined_in_flight": ("store candidates skipped: that GPU block or hash was being "
                           "stored already; blocks", False),
    "declined_already_cached": ("store candidates skipped: already cached in the CPU "
                                "tier; blocks", False),
    "declined_unhashed": ("store candidates skipped: no hash known for the block; "
                          "blocks", False),
    "declined_stale_window": ("store candidates skipped: a sliding-window block no "
                              "longer valid for its position; blocks", False),
    "declined_hash_mismatch": ("store candidates skipped: the GPU block carries other "
                               "hashes than its position's; blocks", False),
    "declined_engine_failed": ("finish-time stores dropped because a rank failed; "
                               "blocks", False),
    "declined_reset": ("finish-time stores dropped by a cache reset before they were "
                       "sent; blocks", False),
    "declined_engine_closed": ("finish-time stores dropped because the engine closed "
                               "before they were sent; blocks", False),
    "acks_unknown": ("acks (Done) for a job the engine no longer knows; acks", False),
    "acks_duplicate": ("acks from a rank already counted for that job, or not waited "
                       "for; acks", False),
    "invalid_calls": ("scheduler calls refused as invalid (InvalidRequest: nothing "
                      "changed); calls", True),
    "ranks_failed": ("worker ranks declared dead (lifeline lost, broken ring, hang); "
                     "ranks", True),
    "ranks_left": ("worker ranks that said Goodbye and closed while the engine ran (not "
                   "failures); ranks", True),
    "hangs": ("ranks declared dead because a job waited longer than hang_timeout_s; "
              "ranks", True),
    "ranks_killed_to_fence": ("kvshm-workers ranks SIGKILLed at a verdict that was no "
                              "fence (they offered it: fenced when their process exits); "
                              "ranks", True),
    "tick_errors": ("Engine ticks (hang checks, results, eviction upkeep) that raised; the "
                    "ticks go on; ticks", True),
    "protocol_errors": ("rank channels broken by an undecodable record (the rank is "
                        "declared dead); channels", True),
    "refused": ("worker connections the rendezvous refused (wrong engine, rank or "
                "layout); connections", False),
    "done_errors": ("acks whose handling raised (their jobs were failed); acks", True),
    "remote_jobs": ("remote-tier jobs (GET and PUT) posted to the ranks; jobs", False),
    "remote_acks": ("acks of remote-tier jobs from the ranks; acks", False),
    "remote_post_refused": ("remote-tier posts no rank's ring could hold (failed at "
                            "once); posts", False),
    "disk_jobs": ("disk-tier jobs (READ and WRITE) posted to the ranks; jobs", False),
    "disk_read_bad_crc": ("disk READs a rank failed because a slot's payload checksum "
                          "did not match (a miss; the slots are dropped); acks", False),
    "disk_read_bad_header": ("disk READs a rank failed because a slot's header was torn "
                             "or named another block (a miss; the slots are dropped); "
                             "acks", False),
    "disk_failed_no_space": ("disk WRITEs a rank failed because the disk was full or over "
                             "quota (ENOSPC, EDQUOT: the slots are not indexed; three in a "
                             "row pause write-back); acks", False),
    "disk_failed_other": ("disk jobs a rank failed for another reason (an I/O error); "
                          "acks", False),
}

# Snapshot fields (``EngineStats``): key -> (kind, HELP, in vLLM's /metrics).
_SNAPSHOT: Final[dict[str, tuple[Kind, str, bool]]] = {
    "stored_bytes": (Kind.COUNTER, "bytes stored to the CPU tier (stored blocks x bytes "
                     "per block over every rank); bytes", True),
    "loaded_bytes": (Kind.COUNTER, "bytes loaded from the CPU tier (loaded blocks x "
                     "bytes per block over every rank); bytes", True),
    "evictions": (Kind.COUNTER, "cached CPU-tier blocks reused for new data (evicted); "
                  "blocks", True),
    "num_cpu_blocks": (Kind.GAUGE, "capacity of the CPU tier; blocks", True),
    "cpu_blocks_cached": (Kind.GAUGE, "CPU-tier blocks holding cached KV; blocks", True),
    "cpu_tier_bytes": (Kind.GAUGE, "size of the CPU tier over every rank; bytes", True),
    "pins_held": (Kind.GAUGE, "pins held on GPU and CPU blocks by lookups, loads and "
                  "stores in progress; pins", True),
    "jobs_in_flight": (Kind.GAUGE, "transfer jobs posted and not yet acked by every "
                       "rank; jobs", True),
    "quarantined_gpu_blocks": (Kind.GAUGE, "GPU blocks pinned only because a rank "
                               "declared dead is not fenced yet; blocks", True),
    "quarantined_cpu_blocks": (Kind.GAUGE, "CPU blocks pinned only because a rank "
                               "declared dead is not fenced yet; blocks", True),
}

# The remote tier's section (``EngineStats.remote``): key -> (HELP, in vLLM's /metrics).
_REMOTE_COUNTERS: Final[dict[str, tuple[str, bool]]] = {
    "queries": ("remote lookups sent to the readiness index; queries", True),
    "queries_ahead": ("hand-off readiness queries sent with the manifest's read; "
                      "queries", False),
    "ahead_used": ("hand-offs fetched on the answer that came with their manifest (no "
                   "second round); lookups", False),
    "query_hits": ("remote lookups answered with at least one block present; queries",
                   True),
    "query_misses": ("remote lookups answered with no block present; queries", False),
    "query_timeouts": ("remote lookups not answered in time (a miss); queries", True),
    "fetch_timeouts": ("remote GETs not done in time (the request goes without them); "
                       "jobs", False),
    "answers_stale": ("remote answers that came after their request moved on "
                      "(ignored); answers", False),
    "skipped_unhealthy": ("remote lookups not sent because the index's breaker was open "
                          "(a miss at once); lookups", True),
    "asked_again": ("lookups answered 'ask again' while a remote query or GET was "
                    "pending; lookups", False),
    "get_jobs": ("GET jobs (remote tier to CPU tier) posted; jobs", False),
    "get_blocks": ("blocks asked for by GET jobs; blocks", False),
    "get_failed_jobs": ("GET jobs that failed; jobs", False),
    "get_failed_blocks": ("blocks of GET jobs that failed; blocks", True),
    "get_abandoned_jobs": ("GET jobs a reset abandoned (not failures); jobs", False),
    "get_declined_cpu_full": ("remote hits not fetched: no free CPU-tier block; "
                              "lookups", False),
    "get_declined_overdue": ("remote hits not fetched: an earlier read is past its fetch "
                             "timeout and still out (a rank not serving tier jobs); "
                             "lookups", True),
    "get_capped": ("remote hits cut short: the CPU tier had no room for the rest "
                   "(recomputed); lookups", False),
    "hit_blocks": ("blocks fetched from the remote tier into the CPU tier; blocks", True),
    "hit_bytes": ("bytes fetched from the remote tier (hit blocks x bytes per block); "
                  "bytes", True),
    "put_jobs": ("PUT jobs (CPU tier to remote tier) posted; jobs", False),
    "put_blocks": ("blocks sent in PUT jobs; blocks", False),
    "put_failed_blocks": ("blocks whose PUT failed; blocks", True),
    "put_abandoned_blocks": ("blocks of PUT jobs a reset abandoned (not failures; not "
                             "published); blocks", False),
    "put_skipped_duplicate": ("blocks not put: already published, queued or in flight; "
                              "blocks", False),
    "put_backpressure": ("plans that held PUTs back while a quarter of the CPU tier was "
                         "being put; plans", False),
    "publish_refused": ("readiness publishes the server refused (those blocks are put "
                        "again); publishes", False),
    "published_blocks": ("blocks whose readiness keys were published after a complete "
                         "PUT; blocks", True),
    "put_bytes": ("bytes published to the remote tier (published blocks x bytes per "
                  "block); bytes", True),
    "server_restarts": ("times the remote server was seen to have restarted or lost its "
                        "data (the put memory is cleared so write-through refills it); "
                        "restarts", False),
    "pd_not_owner": ("P/D manifests read by a request other than the one they name (its "
                     "blocks are read as cache, the manifest is never deleted or "
                     "re-timed); manifests", False),
    "pd_entries_unchecked": ("P/D manifest entries beyond the reading request's own "
                             "blocks, left untouched; entries", False),
    "pd_published": ("P/D hand-offs started by the prefill side; hand-offs", False),
    "pd_manifests_written": ("P/D manifests written to the server; manifests", False),
    "pd_publish_failed": ("P/D hand-offs whose blocks could not all be put; hand-offs",
                          False),
    "pd_publish_timeouts": ("P/D hand-offs not published within the publish timeout; "
                            "hand-offs", False),
    "pd_publish_empty": ("P/D hand-offs with no full block to publish; hand-offs", False),
    "pd_publish_superseded": ("P/D hand-offs still waiting for their blocks when a new "
                              "request under the same id published (no manifest: the "
                              "new one's replaces it); hand-offs", False),
    "pd_tails_dropped": ("P/D partial last blocks dropped from a hand-off; blocks", False),
    "pd_tails_declined": ("P/D partial last blocks not handed off: their store could not "
                          "be queued (a sliding-window group, a load writing the block, "
                          "another hash on it); blocks", False),
    "pd_tails_unkeyed": ("P/D partial last blocks not handed off: no key (inputs the token "
                         "ids do not describe, or the full blocks not yet hashed); blocks",
                         False),
    "pd_consumed": ("P/D manifests a decoder read and trusted; manifests", False),
    "pd_manifest_missing": ("P/D manifests a decoder did not find; manifests", False),
    "pd_manifest_refused": ("P/D manifests a decoder refused (another deployment's, "
                            "malformed); manifests", False),
    "pd_manifest_expired": ("P/D manifests a decoder found past their expiry; "
                            "manifests", False),
    "pd_manifest_reused": ("P/D manifests judged from the decoder's memory of collected "
                           "ones; manifests", False),
    "pd_collected": ("P/D manifests a decoder collected (deleted) after use; manifests",
                     False),
    "pd_unhealthy": ("P/D manifest reads skipped because the index's breaker was open; "
                     "reads", False),
    "pd_orphans_dropped": ("P/D manifest reads dropped with nothing collected; reads",
                           False),
    "index_run_id_checks": ("reads of the server's run_id (a restart or lost data is "
                            "noticed by its change); reads", False),
    "index_run_id_errors": ("reads of the server's run_id that failed; reads", False),
    "index_run_id_changes": ("changes of the server's run_id seen (a restart: the put "
                             "memory is cleared); changes", False),
    "index_flushes_seen": ("flushes of the server seen (its run_id unchanged, the index's "
                           "sentinel key gone: the put memory is cleared); flushes", False),
    "index_server_evictions": ("keys the server evicted (maxmemory reached), seen by the "
                               "index's periodic read; keys", False),
    "index_queries": ("readiness-index queries issued; queries", False),
    "index_answered": ("readiness-index queries answered; queries", False),
    "index_answered_zero": ("readiness-index queries answered with no key present; "
                            "queries", False),
    "index_keys_queried": ("readiness keys asked for; keys", False),
    "index_keys_present": ("readiness keys found present; keys", False),
    "index_published": ("readiness keys written; keys", False),
    "index_publish_failed": ("readiness keys whose write failed; keys", False),
    "index_errors": ("readiness-index round trips that failed; errors", True),
    "index_timeouts": ("readiness-index round trips that timed out; errors", False),
    "index_rejected": ("readiness-index batches refused by the open breaker; batches",
                       False),
    "index_round_trips": ("readiness-index round trips to the server; round trips",
                          False),
    "index_clients_created": ("connections the readiness index opened; connections",
                              False),
    "index_keys_shard_down": ("readiness keys answered absent because their cluster "
                              "shard was down (its breaker open or its batch failed); "
                              "keys", False),
    "index_values_shard_down": ("values (P/D manifests) read as missing because their "
                                "cluster shard was down; values", False),
    "index_slot_map_refreshes": ("cluster slot maps the readiness index read (after a "
                                 "shard's breaker opened); reads", False),
    "index_values_set": ("values (P/D manifests) the index wrote; values", False),
    "index_values_got": ("values (P/D manifests) the index read; values", False),
    "index_values_dropped": ("values (P/D manifests) not written because a readiness "
                             "key they vouch for was refused; values", False),
    "index_values_refused": ("value writes, deletes and re-timings (P/D manifests) the "
                             "server refused with an error reply (OOM, no permission); "
                             "commands", False),
    "index_drains_failed": ("readiness-index rounds that failed where nothing should "
                            "(a client fault): their lookups missed, a new client was "
                            "made; rounds", True),
    "index_breaker_opens": ("times the readiness index's circuit breaker opened; "
                            "events", True),
    "index_breaker_closes": ("times the readiness index's circuit breaker closed again; "
                             "events", False),
}


#: The disk tier's section (``EngineStats.disk``) that are gauges: key -> HELP.
DISK_GAUGES: Final[dict[str, str]] = {
    "slots": "slots of each rank's disk slab (the disk tier's capacity); blocks",
    "slots_used": "disk slots holding an indexed block; blocks",
    "slots_pinned": "disk slots being read or written by a job; blocks",
    "quarantined_slots": ("disk slots pinned only because a rank declared dead is not "
                          "fenced yet; blocks"),
    "bytes_per_rank": "the configured size of each rank's disk slab; bytes",
    "warming": ("1 while the start's scan of the slab headers runs (the disk tier "
                "indexes and writes nothing meanwhile), else 0; 0 or 1"),
    # a duration, not a count (it was exported as a counter, kvshm_..._total)
    "warm_scan_ms": ("how long the start's scan of the slab headers took (0 while it "
                     "runs); milliseconds"),
}

# The disk tier's counters (``EngineStats.disk``): key -> (HELP, in vLLM's /metrics).
_DISK_COUNTERS: Final[dict[str, tuple[str, bool]]] = {
    "lookups": ("lookups the disk tier was asked after a CPU-tier miss or short hit; "
                "lookups", True),
    "lookup_hits": ("disk lookups that found a prefix to read; lookups", True),
    "lookup_misses": ("disk lookups that found nothing; lookups", False),
    "asked_again": ("disk lookups answered 'ask again' while another request's READ "
                    "fetched the same blocks; lookups", False),
    "fetch_timeouts": ("disk READs not done in time (the request goes without them); "
                       "reads", False),
    "get_jobs": ("READ jobs (disk tier to CPU tier) posted; jobs", False),
    "get_blocks": ("blocks in READ jobs; blocks", True),
    "get_failed_jobs": ("READ jobs that failed on a rank (a miss: recomputed); jobs", True),
    "get_failed_blocks": ("blocks of failed READ jobs; blocks", False),
    "get_abandoned_jobs": ("READ jobs a reset abandoned (not failures); jobs", False),
    "get_declined_cpu_full": ("disk hits not read: no free CPU-tier block; lookups",
                              False),
    "get_declined_overdue": ("disk hits not read: an earlier read is past its fetch "
                             "timeout and still out (a rank not serving tier jobs); "
                             "lookups", True),
    "get_declined_gone": ("disk hits not read: the slots lost their blocks before the "
                          "READ; lookups", False),
    "get_capped": ("disk hits cut short: the CPU tier had no room for the rest "
                   "(recomputed); lookups", False),
    "hit_blocks": ("blocks read from the disk tier into the CPU tier; blocks", True),
    "read_bytes": ("bytes read from the disk tier (hit blocks x bytes per block over every "
                   "rank); bytes", True),
    "dropped_slots": ("disk slots dropped from the index after a failed READ (suspect); "
                      "slots", True),
    "write_jobs": ("WRITE jobs (CPU tier to disk tier) posted; jobs", False),
    "write_blocks": ("blocks in WRITE jobs; blocks", False),
    "written_blocks": ("blocks written to the disk tier by every rank and indexed; "
                       "blocks", True),
    "write_bytes": ("bytes written to the disk tier (written blocks x bytes per block "
                    "over every rank); bytes", True),
    "write_failed_jobs": ("WRITE jobs that failed on a rank (the slots stay unindexed); "
                          "jobs", True),
    "write_failed_blocks": ("blocks of failed WRITE jobs; blocks", False),
    "write_abandoned_jobs": ("WRITE jobs a reset abandoned (not failures; their slots stay "
                             "unindexed); jobs", False),
    "write_declined_no_slot": ("CPU blocks not written back: every disk slot was pinned; "
                               "blocks", True),
    "write_backpressure": ("plans that wrote nothing back: the in-flight write cap was "
                           "reached; plans", False),
    "writes_paused": ("times write-back paused after failed WRITEs in a row (a full or "
                      "failing disk); events", True),
    "write_skipped_paused": ("plans that wrote nothing back while paused; plans", False),
    "write_skipped_warming": ("plans that wrote nothing back while the start's scan of "
                              "the slabs ran; plans", False),
    "write_through_dropped": ("stored blocks forgotten before their write-through (the "
                              "queue was full); blocks", False),
    "evicted_on_disk": ("cached CPU blocks evicted that the disk held or was writing; "
                        "blocks", False),
    "evicted_written": ("cached CPU blocks evicted before write-back reached them, written "
                        "down before their reuse; blocks", True),
    "evicted_lost": ("cached CPU blocks evicted with no disk copy (no free slot, writing "
                     "paused, or the start's scan still running); blocks", True),
    "slot_evictions": ("disk slots reused for a new block (the old one dropped); slots",
                       True),
    "warm_slots": ("disk slots indexed at start from a previous run's slabs; slots",
                   False),
    "warm_disagreed": ("disk slots at start whose headers did not agree on every rank "
                       "(not indexed); slots", False),
    "scan_errors": ("slab files that could not be read at start (started cold); files",
                    False),
    "warm_voided": ("start scans whose result a reset made void (nothing indexed); "
                    "scans", False),
}


def _table() -> tuple[Series, ...]:
    out = [Series(f"kvshm_{k}", Kind.COUNTER, h, vllm=v)
           for k, (h, v) in _ENGINE_COUNTERS.items()]
    out += [Series(f"kvshm_{k}", kind, h, vllm=v) for k, (kind, h, v) in _SNAPSHOT.items()]
    out += [
        Series("kvshm_cpu_tier_occupancy", Kind.GAUGE, "fraction of the CPU tier's "
               "blocks holding cached KV (cpu_blocks_cached / num_cpu_blocks); 0..1",
               vllm=True),
        Series("kvshm_hit_rate", Kind.GAUGE, "lookup_hit_tokens / lookup_tokens: share "
               "of the tokens asked in lookup answers that a hit offered; 0..1"),
        Series("kvshm_uptime_seconds", Kind.GAUGE, "time since the engine opened its "
               "rendezvous; seconds"),
        Series("kvshm_state", Kind.GAUGE, "1 for the engine's lifecycle state (label "
               "state); 1", labels=("state",)),
        Series("kvshm_rank_alive", Kind.GAUGE, "1 while the worker rank is not declared "
               "dead; 0 or 1", labels=("rank",)),
        Series("kvshm_rank_acks", Kind.COUNTER, "acks (Done) received from the worker "
               "rank; acks", labels=("rank",)),
        Series("kvshm_rank_failed_acks", Kind.COUNTER, "acks from the worker rank that "
               "reported a failed job; acks", labels=("rank",)),
        Series("kvshm_ack_latency_seconds", Kind.HISTOGRAM, "time from posting a "
               "transfer job to the worker rank's ack, per rank; seconds",
               labels=("rank",), vllm=True),
    ]
    out += [Series(f"kvshm_remote_{k}", Kind.COUNTER, h, vllm=v, remote=True)
            for k, (h, v) in _REMOTE_COUNTERS.items()]
    out += [
        Series("kvshm_remote_breaker_state", Kind.GAUGE, "1 for the readiness index's "
               "circuit-breaker state (label state: closed, half_open, open), else 0; "
               "0 or 1", labels=("state",), vllm=True, remote=True),
        Series("kvshm_remote_info", Kind.GAUGE, "the remote tier's URL and mode (labels); "
               "always 1", labels=("url", "mode"), remote=True),
    ]
    out += [Series(f"kvshm_disk_{k}", Kind.COUNTER, h, vllm=v, disk=True)
            for k, (h, v) in _DISK_COUNTERS.items()]
    out += [Series(f"kvshm_disk_{k}", Kind.GAUGE, h, vllm=True, disk=True)
            for k, h in DISK_GAUGES.items()]
    out.append(Series("kvshm_disk_occupancy", Kind.GAUGE, "fraction of the disk tier's "
                      "slots holding an indexed block (slots_used / slots); 0..1",
                      vllm=True, disk=True))
    return tuple(out)


#: Every series kvshm exports, by family name.
SERIES: Final[dict[str, Series]] = {s.name: s for s in _table()}


def help_of(name: str) -> str:
    """The HELP of family ``name``; a family this table does not know (an engine newer
    than this kvshm) gets a line that says so."""
    s = SERIES.get(name)
    return s.help if s is not None else (f"{name}: a counter this kvshm version has no "
                                         "description for (a newer engine)")


def vllm_series(remote: bool, disk: bool = False) -> tuple[Series, ...]:
    """The families vLLM's ``/metrics`` carries (the remote ones with a remote tier, the
    disk ones with a disk tier)."""
    return tuple(s for s in SERIES.values() if s.vllm and (remote or not s.remote)
                 and (disk or not s.disk))


def series_names(series: Iterable[Series]) -> set[str]:
    """Every family and sample name of ``series`` (what a query may name)."""
    out: set[str] = set()
    for s in series:
        out.add(s.name)
        out.update(s.samples())
    return out


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def scalars(stats: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, float]]:
    """(counters, gauges) of one snapshot (``EngineStats.as_dict()``), keyed by family
    name: every engine counter, the snapshot's counters and gauges, the CPU tier's
    occupancy, the remote section's integer counters (``kvshm_remote_<key>``) and the disk
    section's counters and gauges (``kvshm_disk_<key>``, its occupancy). Keys
    the table does not know are kept (``help_of`` describes them as unknown)."""
    counters: dict[str, int] = {}
    gauges: dict[str, float] = {}
    for key, value in (stats.get("counters") or {}).items():
        n = _int(value)
        if n is not None:
            counters[f"kvshm_{key}"] = n
    for key, (kind, _, _) in _SNAPSHOT.items():
        n = _int(stats.get(key, 0)) or 0
        if kind is Kind.COUNTER:
            counters[f"kvshm_{key}"] = n
        else:
            gauges[f"kvshm_{key}"] = float(n)
    cap = _int(stats.get("num_cpu_blocks", 0)) or 0
    cached = _int(stats.get("cpu_blocks_cached", 0)) or 0
    gauges["kvshm_cpu_tier_occupancy"] = cached / cap if cap > 0 else 0.0
    for key, value in (stats.get("remote") or {}).items():
        n = _int(value)
        if n is not None:
            counters[f"kvshm_remote_{key}"] = n
    disk = stats.get("disk") or {}
    for key, value in disk.items():
        n = _int(value)
        if n is None:
            continue
        if key in DISK_GAUGES:
            gauges[f"kvshm_disk_{key}"] = float(n)
        else:
            counters[f"kvshm_disk_{key}"] = n
    if disk:
        slots = _int(disk.get("slots", 0)) or 0
        used = _int(disk.get("slots_used", 0)) or 0
        gauges["kvshm_disk_occupancy"] = used / slots if slots > 0 else 0.0
    return counters, gauges


def breaker_state(stats: Mapping[str, Any]) -> str | None:
    """The readiness index's breaker state (one of :data:`BREAKER_STATES`), None
    without a remote tier or before its index reports one."""
    state = (stats.get("remote") or {}).get("index_breaker_state")
    return str(state) if state is not None else None
