"""A process that writes disk-store records in a loop until it is killed (``test_cache_disk_crash``).

Every record is a pure function of its key's (seed, index), so whoever reopens the directory can
check that each served record is exactly what was written for its key.

    python -m tests.engine.disk_crash_writer DIRECTORY SEED
"""

from __future__ import annotations

import hashlib
import random
import sys

from confkv_engine.cache.disk.store import DiskStore

CAPACITY = 768 * 1024  # small, so that eviction runs all the time
CHAIN = 4  # every 4th block starts a new chain
REBUILD_EVERY = 25


def block_key(seed: int, i: int) -> bytes:
    return hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).digest()


def block_parent(seed: int, i: int) -> bytes | None:
    return None if i % CHAIN == 0 else block_key(seed, i - 1)


def block_tokens(seed: int, i: int) -> list[int]:
    return [(seed * 7919 + i * 16 + t) % 49152 for t in range(16)]


def block_payload(seed: int, i: int) -> bytes:
    digest = hashlib.blake2b(f"payload {seed}/{i}".encode()).digest()
    size = 2048 + digest[0] * 384  # 2-98 KB, so kills land inside writes as well as between them
    return (digest * (size // len(digest) + 1))[:size]


def main(directory: str, seed: int) -> None:
    rng = random.Random(seed)
    store = DiskStore(directory, CAPACITY, admit=lambda uses: True)
    print("ready", flush=True)
    i = 0
    while True:
        store.put(block_key(seed, i), block_parent(seed, i), block_tokens(seed, i), block_payload(seed, i),
                  {"seed": seed, "i": i})
        if i and rng.random() < 0.3:
            store.get(block_key(seed, rng.randrange(i)))
        if i % REBUILD_EVERY == REBUILD_EVERY - 1:  # so that some kills land inside a rebuild
            store.rebuild(verify_payloads=rng.random() < 0.5)
        i += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
