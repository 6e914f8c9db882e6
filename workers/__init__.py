"""kvshm's worker side: copies KV blocks between a rank's device cache and its host pool.

Imports only kvshm's leaf modules (protocol, layout, shm, ring, doorbell, channel,
rendezvous, errors, stats, config) -- never the manager, pool or engine.
"""
