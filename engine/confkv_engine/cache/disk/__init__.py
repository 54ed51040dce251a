"""The disk room: the disk store of evicted prefix blocks (``maxDiskCacheSize``) and its rebuild.

Owns the cache directory: record files (``format``, ``files``), the crash-consistent SQLite index
(``index``), which blocks deserve the disk and which come back warm (``policy``), the store itself
(``store.DiskStore``: spill, read back, rebuild after a restart) and ``sink.DiskSink``, the sink the
cache core spills evicted blocks into and reads chains back from off the engine thread.

Imports the cache core's data types (``cache.prefix.CachedBlock``, the ``cache.readback`` contract)
and never the reverse: the cache core knows the disk only through its ``EvictionSink`` protocol.

The names other rooms use are re-exported here.
"""

from confkv_engine.cache.disk.sink import DiskSink
from confkv_engine.cache.disk.store import DiskStore, RebuildReport, admit_reused, capacity_from_volume

__all__ = ["DiskStore", "DiskSink", "RebuildReport", "admit_reused", "capacity_from_volume"]
