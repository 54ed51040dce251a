"""Cache suite: prefix-cache hit rates on the real cache manager and through the engine
(``prefix_cache``), the eviction simulator's table (``prefix_sim``), the disk store (``disk_tier``)
and a live pool growth (``pool_grow``)."""

# Quick runs write their own files, never over a full run's results.
QUICK = [["bench.cache.prefix_cache", "--no-model", "--out", "bench/results/cache/prefix_cache-quick.json"],
         ["bench.cache.prefix_sim"],
         ["bench.cache.disk_store", "--quick", "--out", "bench/results/cache/disk_store-quick.json"],
         ["bench.cache.pool_grow", "--repeats", "1", "--out", "bench/results/cache/pool_grow-quick.json"]]
