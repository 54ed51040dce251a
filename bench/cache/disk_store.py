"""Disk store benchmark: write patterns, DiskStore throughput, and what the admission rule buys.

1. Write patterns, each record fsynced before the next (what a crash-consistent put needs): an
   append-only segment (write + fsync) against one file per block (write + fsync + rename, and the
   same with a folder fsync), at the block sizes of SmolLM2-135M (bf16) and of a 32B-class model.
2. ``DiskStore`` put and verified get throughput (one thread, and gets from 4 threads).
3. Admission: a prefix-sharing workload (Zipf-popular shared prefixes, one-shot tails) through an
   in-memory LRU tier that spills into a ``DiskStore``; disk hits and bytes written for several
   ``min_uses`` (1 = every evicted block goes to disk).

    .venv/bin/python -m bench.cache.disk_store [--dir /path/on/nvme] [--quick]

Prints tables and writes bench/results/cache/disk_store.json. Timings are of the filesystem under --dir.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from bench.common import results_dir
from confkv_engine.cache.disk.store import DiskStore, admit_reused

# One K (or V) block of 16 tokens over all layers incl. int32 positions (CacheSpec.block_bytes).
BLOCK_SIZES = {"16 KiB": 16 * 1024,
               "SmolLM2-135M bf16 (30 x 3 x 64)": 30 * 3 * (64 * 2 + 4) * 16,
               "32B-class bf16 (64 x 8 x 128)": 64 * 8 * (128 * 2 + 4) * 16}


def _mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def write_segment(folder: Path, payload: bytes, count: int) -> float:
    fd = os.open(folder / "segment.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    t0 = time.perf_counter()
    for _ in range(count):
        os.write(fd, payload)
        os.fsync(fd)
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return elapsed


def write_files(folder: Path, payload: bytes, count: int, sync_folder: bool = False) -> float:
    t0 = time.perf_counter()
    for i in range(count):
        tmp, final = folder / f"{i}.blk.tmp", folder / f"{i}.blk"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, payload)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, final)
        if sync_folder:
            dfd = os.open(folder, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)
    return time.perf_counter() - t0


def bench_patterns(base: Path, total_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for label, size in BLOCK_SIZES.items():
        count = max(8, total_bytes // size)
        payload = os.urandom(size)
        row: dict[str, Any] = {"block": label, "bytes": size, "records": count}
        for name, fn in (("segment", write_segment), ("file_per_block", write_files),
                         ("file_per_block_folder_fsync", functools.partial(write_files, sync_folder=True))):
            folder = Path(tempfile.mkdtemp(dir=base))
            elapsed = fn(folder, payload, count)
            row[f"{name}_records_s"] = count / elapsed
            row[f"{name}_mb_s"] = _mb_s(count * size, elapsed)
            shutil.rmtree(folder)
        rows.append(row)
    return rows


def bench_store(base: Path, size: int, count: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(dir=base))
    payloads = [os.urandom(size) for _ in range(16)]
    keys = [i.to_bytes(16, "little") for i in range(count)]
    with DiskStore(folder, capacity_bytes=2 * count * (size + 4096), admit=lambda uses: True) as store:
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i % 8 else None
            store.put(key, parent, list(range(16)), payloads[i % 16], {"codec": "none"})
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        served = sum(store.get(key) is not None for key in keys)
        get_s = time.perf_counter() - t0
        threads = [threading.Thread(target=lambda: [store.get(k) for k in keys]) for _ in range(4)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        get4_s = time.perf_counter() - t0
        store.close()
        t0 = time.perf_counter()
        reopened = DiskStore(folder, capacity_bytes=2 * count * (size + 4096))
        open_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = reopened.rebuild(verify_payloads=True)
        verify_s = time.perf_counter() - t0
        reopened.close()
    shutil.rmtree(folder)
    assert served == count == report.records
    return {"bytes": size, "records": count,
            "put_records_s": count / put_s, "put_mb_s": _mb_s(count * size, put_s),
            "get_records_s": count / get_s, "get_mb_s": _mb_s(count * size, get_s),
            "get_4_threads_records_s": 4 * count / get4_s,
            "open_rebuild_headers_s": open_s, "rebuild_verify_payloads_s": verify_s}


def zipf_trace(requests: int, prefixes: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** 1.1 for r in range(prefixes)]
    return rng.choices(range(prefixes), weights=weights, k=requests)


def simulate_admission(base: Path, min_uses: int, trace: list[int], gpu_blocks: int, disk_blocks: int,
                       prefix_blocks: int = 8, tail_blocks: int = 4) -> dict[str, Any]:
    """Serve ``trace`` (a prefix id per request) through an LRU memory tier spilling to disk."""
    payload = bytes(4096)
    folder = Path(tempfile.mkdtemp(dir=base))
    store = DiskStore(folder, disk_blocks * (len(payload) + 256),
                      admit=functools.partial(admit_reused, min_uses=min_uses), durable=False)
    gpu: OrderedDict[bytes, int] = OrderedDict()  # key -> uses during this stay
    counts = {"gpu_hits": 0, "disk_hits": 0, "computed": 0}
    for r, prefix in enumerate(trace):
        chain = [f"p{prefix}/{b}".encode() for b in range(prefix_blocks)]
        chain += [f"r{r}/{b}".encode() for b in range(tail_blocks)]
        for i, key in enumerate(chain):
            if key in gpu:
                gpu[key] += 1
                gpu.move_to_end(key)
                counts["gpu_hits"] += 1
                continue
            on_disk = store.get(key) is not None
            counts["disk_hits" if on_disk else "computed"] += 1
            gpu[key] = 1
            while len(gpu) > gpu_blocks:
                victim, uses = gpu.popitem(last=False)
                store.put(victim, None, [i], payload, uses=uses)
    st = store.stats()
    store.close()
    shutil.rmtree(folder)
    visits = sum(counts.values())
    return {"min_uses": min_uses, **counts, "blocks_written": st.puts, "rejected": st.rejected,
            "disk_hit_rate": counts["disk_hits"] / visits,
            "computed_rate": counts["computed"] / visits,
            "disk_hits_per_block_written": counts["disk_hits"] / max(1, st.puts)}


def print_tables(patterns: list[dict[str, Any]], store: list[dict[str, Any]],
                 admission: list[dict[str, Any]]) -> None:
    print("write pattern, records/s (MB/s):")
    for row in patterns:
        print(f"  {row['block']:<34} segment {row['segment_records_s']:7.0f} ({row['segment_mb_s']:5.0f})"
              f"  file per block {row['file_per_block_records_s']:7.0f} ({row['file_per_block_mb_s']:5.0f})"
              f"  + folder fsync {row['file_per_block_folder_fsync_records_s']:7.0f}"
              f" ({row['file_per_block_folder_fsync_mb_s']:5.0f})")
    print("DiskStore:")
    for row in store:
        print(f"  {row['bytes']:>8} B  put {row['put_records_s']:7.0f}/s {row['put_mb_s']:6.0f} MB/s"
              f"  get {row['get_records_s']:7.0f}/s {row['get_mb_s']:6.0f} MB/s"
              f"  4-thread get {row['get_4_threads_records_s']:7.0f}/s"
              f"  open {row['open_rebuild_headers_s']:.3f} s"
              f"  verify {row['rebuild_verify_payloads_s']:.3f} s")
    print("admission (memory 400 blocks, disk 800 blocks):")
    for row in admission:
        print(f"  min_uses {row['min_uses']}: disk hits {row['disk_hits']:6d}"
              f"  written {row['blocks_written']:6d}  hits/written {row['disk_hits_per_block_written']:.2f}"
              f"  recomputed {row['computed_rate']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    parser.add_argument("--out", type=Path, default=results_dir("cache") / "disk_store.json")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.dir))
    scale = 1 if args.quick else 4
    smollm2 = BLOCK_SIZES["SmolLM2-135M bf16 (30 x 3 x 64)"]
    try:
        patterns = bench_patterns(base, total_bytes=scale * 16 * 1024 * 1024)
        store = [bench_store(base, size, count=scale * n) for size, n in ((smollm2, 64), (16 * 1024, 256))]
        trace = zipf_trace(requests=scale * 500, prefixes=200, seed=7)
        admission = [simulate_admission(base, m, trace, gpu_blocks=400, disk_blocks=800) for m in (1, 2, 3)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_tables(patterns, store, admission)
    result = {"machine": platform.platform(), "cpus": os.cpu_count(),
              "dir": str(args.dir or "(the system temporary directory)"), "quick": args.quick,
              "write_patterns": patterns, "store": store, "admission": admission}
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
