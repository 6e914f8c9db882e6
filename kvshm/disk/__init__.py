"""The local disk tier (issue 32): CPU-tier evictions go to a slab file per rank on local
disk and come back as CPU blocks, surviving an engine restart.

The worker side moves bytes (:mod:`workers.disk_mover` over :class:`SlabFile`); the
scheduler side checks the directory (:func:`check_directory`), names each rank's file
(:func:`slab_path`) and rebuilds its index from the slot headers (:func:`scan`). The
file format is drawn in :mod:`kvshm.disk.slab`. Stdlib only (plus the remote tier's
checksum table): no torch, importable anywhere.
"""

from kvshm.disk.slab import (
    FORMAT_VERSION,
    MAX_HASH_BYTES,
    PAGE,
    SlabFile,
    SlabLocked,
    SlabSpec,
    SlotOutcome,
    check_directory,
    refuse_special,
    remove_unheld,
    scan,
    slab_path,
)

__all__ = ["FORMAT_VERSION", "MAX_HASH_BYTES", "PAGE", "SlabFile", "SlabLocked", "SlabSpec",
           "SlotOutcome", "check_directory", "refuse_special", "remove_unheld", "scan",
           "slab_path"]
