"""Chaos run: fresh engines under byte-pattern traffic, one injected fault each.

``python -m tools.chaos [--engines N] [--seed S] [--quick] [--json]``

Method
------
Engines (tp=2, CPU workers, shared-memory KV shards allocated here) run one after
another, alternating SPAWN and ATTACH; ATTACH ranks are ``python -m workers --name NAME
--tp 2`` processes started by this tool (its own process tree) and stopped by pid. The
next engine's workers start while the current engine runs, so start-up (torch imports)
overlaps the traffic.

Traffic: a request's prompt is one of a few shared prefixes plus unique blocks; its
chained block hashes name its bytes. "Compute" writes ``pattern(hash of block j, rank)``
into block j of the request's GPU blocks in each rank's shard, then a step confirms the
tokens and the engine stores them. Later requests with the same prefix look up, get GPU
blocks from a small pool (blocks freed by earlier requests are handed out again first,
so a stale copy lands in somebody else's blocks) and load; every successful load
(``LoadResult.ok``) is verified byte by byte against the pattern (``wrong_bytes``).
Before a request finishes, all its blocks are verified again: nothing may have written
into blocks a live request owns that it did not load into (the canary rule). After the
fault a canary request takes every free GPU block, writes its own pattern, waits while
any stopped rank is resumed (SIGCONT) and fenced, then checks that nothing overwrote it:
the hazard of a rank declared dead that wakes up and finishes a queued LOAD into blocks
freed and handed out again.

Faults, one per engine, kinds in rotation, details (rank, moment, variant) random:

* ``sigkill``: SIGKILL a rank mid-traffic;
* ``sigstop``: SIGSTOP a rank with a load queued on it (``hang_timeout_s`` 1 s); SIGCONT
  it only after the engine declared it dead and the canary owns the free blocks;
* ``corrupt_done``: a garbage record in a rank's done ring (an undecodable payload or an
  impossible record header), written through this process's mapping of the ring segment
  while the rank is frozen for the moment (so no real Done races it) with a store
  outstanding on it; the rank is resumed in the canary phase;
* ``rogue_conn``: connections to the rendezvous socket ``\\0kvshm.NAME``: garbage, deeply
  nested msgpack, an oversize frame, Hellos with a wrong rank / a live rank's number / a
  wrong version / a wrong world size, a StatsRequest never read, and idle connections
  beyond the pending cap, all held open until the engine is closed;
* ``bad_call``: invalid API calls among valid ones (a hash that is not bytes, GPU ids out
  of range in ``allocated`` and ``finished``, a lookup past the prompt, a request listed
  twice, unknown requests, a double finish); each exception is caught and the client
  goes on; the engine must then still serve (a store + load round trip).

After the fault: the engine must answer every call (FAILED is the documented outcome of
the first three kinds, with loads recomputed; the last two must leave it READY and
loading). Then the engine settles (no job pending, quarantine lifted), its statistics
give ``pins_held`` with every request finished: pins beyond the quarantined blocks
(``quarantined_*_blocks``, read with getattr so older engines work) are leaked. It is
closed; none of its processes may be left and no new kvshm entry may be in /dev/shm.
Every await has a deadline: one that passes counts as a hang and the tool moves on
(SIGKILLing that engine's processes where needed).

Output: one line per engine, then as the last line one JSON object ``{"engines",
"faults", "survived", "wrong_bytes", "hangs", "leaked_pins", "shm_leftovers",
"quarantined_blocks"}``; ``survived`` counts engines whose API stayed usable and whose
processes ended cleanly. Exit code 0 whenever the run completed (the numbers are the
verdict), 2 for bad usage, 1 for a bug of this tool.

Layout: :mod:`tools.chaos.rig` (sizes, deadlines, records), :mod:`tools.chaos.traffic`,
:mod:`tools.chaos.faults` and :mod:`tools.chaos.bad_calls` (the injected faults),
:mod:`tools.chaos.engines` (start, scenario, checks, close), :mod:`tools.chaos.run`
(the run and the command line; ``python -m tools.chaos`` runs its ``main``).
"""
