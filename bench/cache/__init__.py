"""Cache suite: prefix-cache hit rates on the real cache manager and through the engine
(``prefix_cache``), the eviction simulator's table (``prefix_sim``), the disk store (``disk_tier``)
and a live pool growth (``pool_grow``)."""

QUICK = [["bench.cache.prefix_cache", "--no-model"], ["bench.cache.prefix_sim"],
         ["bench.cache.disk_tier", "--quick"], ["bench.cache.pool_grow", "--repeats", "1"]]
