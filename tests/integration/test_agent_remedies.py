"""The agent's remedies end to end: ``confkv serve`` on the embedded model, ``confkv-agent`` remediating
it over the Unix socket, short ``for`` durations and intervals, every wait bounded.

(a) hitRate -> raiseLruK. Raising K from 2 to 3 does NOT help a typical chat + scan trace (measured
    beforehand, LRU-3 is worse there: one-off scan blocks have one reference, which LRU-2 already
    evicts first, and LRU-3 protects a shared prefix only from its third reference). It helps one
    pattern, which this trace is built around: shared system prompts reused every round, and
    one-off long documents each sent exactly twice (a client retrying once). Under LRU-2 the retried
    document has two references, the more recent of them newer than a shared prefix's second-newest
    one, so it is kept and the shared prefixes are flushed; under LRU-3 the document (two references)
    has an infinite backward 3-distance and goes first. The cache is made small (confkv.maxCacheSize)
    so that eviction happens. A live engine cannot be reset, so the same trace segment is replayed:
    once to warm up, once under K=2 (the "before" hit ratio), then the rule is armed by a config
    edit (``alerts.hitRate.enabled``; armed from the start, the agent would switch in the middle of
    the "before" segment), the agent raises K, and the segment is replayed under K=3 ("after").
    Each segment's hit ratio is the increase of the engine's prefix hit / queried token counters over
    that segment (the window ratio over exactly the segment's span), read from stats snapshots that
    include every answered request.
(b) vram -> compress, then lowerMaxCacheSize. On a CPU the VRAM signal is the engine's own memory
    report (effective_used_bytes / total_bytes of GetStatus device_memory): the test drives the rule
    with ``alerts.vram.threshold`` 0.001, which any running engine exceeds.
(c) oomPerHour -> halveBatchSize, then compress, with OOMs injected by the engine's test-only fault
    switch ``CONFKV_FAULT_OOM_EVERY`` (an OOM every N-th step, before the model runs).

Requests in flight during a remedy must finish correctly: under (a) (eviction order only) and (c)
(OOM recovery recomputes) the greedy tokens equal a reference run of the same prompt, except where
the reference's top-2 logprob gap at the first difference is below ``NEAR_TIE`` (batch composition
changes float order; the rule of tests/engine/test_batching_embedded.py). Under (b) int8 compression
changes the K/V the request attends to, so a token may change without a near tie: the request must
finish with finish_reason length and non-empty text, and the tokens it shares with the reference
are logged.

"Breach -> remedy in effect" is logged for each remedy (``REMEDY`` lines: from the agent's pending
or firing transition to the remediation it logged as applied, and to the test seeing the change in
GetStatus); it is reported, not asserted (no wall-clock assertions).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from remedy_processes import FOR, Agent, Engine, log, wait_for

pytestmark = pytest.mark.timeout(600)

BS = 16
NEAR_TIE = 1e-3
# KV bytes of one block (K or V) of SmolLM2-135M in fp32, with the int32 position of every slot.
BLOCK_BYTES = 30 * 3 * (64 * 4 + 4) * BS
# The hit-rate trace: HOT shared prefixes of HOT_BLOCKS blocks, one DOC_BLOCKS-block document per round
# sent twice, ROUNDS rounds per segment; the cache holds the hot set, one document and SPARE entries.
HOT, HOT_BLOCKS, DOC_BLOCKS, SPARE, ROUNDS = 3, 2, 4, 2, 3
CACHE_ENTRIES = HOT * HOT_BLOCKS + DOC_BLOCKS + SPARE
HIT_THRESHOLD = 0.5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rem")  # short: a Unix socket path holds at most 107 bytes


@pytest.fixture(scope="module")
def small_cache(workdir: Path) -> Iterator[Engine]:
    """A cache of CACHE_ENTRIES prefix entries; background compression off (it would add room)."""
    size = str((2 * CACHE_ENTRIES + 1) * BLOCK_BYTES)  # + the null block
    engine = Engine(workdir, "a", {"maxCacheSize": size, "eviction": {"k": 2},
                                   "compression": {"enabled": False}})
    try:
        assert engine.status().kv_blocks_total == 2 * CACHE_ENTRIES
        yield engine
    finally:
        engine.close()


# ---- requests in flight ---------------------------------------------------------------------
def tokens_and_tops(choice: dict[str, Any]) -> tuple[list[str], list[list[float]]]:
    lp = choice["logprobs"]
    tops = [sorted(d.values(), reverse=True) for d in lp["top_logprobs"]]
    return lp["tokens"], tops


def assert_same_greedy(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    """Same tokens as the reference, up to a first difference at a reference near tie."""
    assert got["finish_reason"] == "length" and got["text"], f"{what}: {got}"
    ours, _ = tokens_and_tops(got)
    theirs, tops = tokens_and_tops(ref)
    diff = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if diff is not None:
        gap = tops[diff][0] - tops[diff][1] if len(tops[diff]) > 1 else 0.0  # two tokens, one text
        assert gap < NEAR_TIE, f"{what}: differs at token {diff} with a clear top-2 gap {gap:.4g}"


class InFlight:
    """A request run on a thread; ``finished_at`` says when its answer came."""

    def __init__(self, engine: Engine, prompt: list[int], max_tokens: int) -> None:
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(engine, prompt, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, engine: Engine, prompt: list[int], max_tokens: int) -> None:
        try:
            self.result = engine.complete(prompt, max_tokens, logprobs=2)
        except BaseException as err:  # reported by join()
            self.error = err
        self.finished_at = time.time()

    def join(self) -> dict[str, Any]:
        self.thread.join(timeout=300)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "the in-flight request did not finish"
        return self.result


def assert_was_in_flight(requests: list[InFlight], remedy_at: float, what: str) -> None:
    finished = [r.finished_at for r in requests if r.finished_at is not None and r.finished_at < remedy_at]
    assert len(finished) < len(requests), f"{what}: every request finished before the remedy landed"


# ---- (a) hitRate -> raiseLruK -----------------------------------------------------------------
def trace_segment() -> list[list[int]]:
    """One replayable segment: per round every hot prefix once, then a new document twice."""
    hot = [list(range(1000 + 100 * i, 1000 + 100 * i + HOT_BLOCKS * BS)) for i in range(HOT)]
    prompts = []
    for r in range(ROUNDS):
        prompts += [p + [30 + r, 40 + i, 50] for i, p in enumerate(hot)]
        doc = [5000 + 500 * r + j for j in range(DOC_BLOCKS * BS)] + [60, 61, 62]
        prompts += [doc, doc]
    return prompts


def replay(engine: Engine, prompts: list[list[int]]) -> float:
    """Send the segment one request at a time; the segment's prefix hit ratio."""
    before = engine.settled_status()
    for prompt in prompts:
        engine.complete(prompt, 1)
    after = engine.settled_status()
    queried = after.prefix_queried_tokens - before.prefix_queried_tokens
    return (after.prefix_hit_tokens - before.prefix_hit_tokens) / queried


def test_hit_rate_breach_raises_lru_k_and_the_hit_rate_recovers(small_cache: Engine, workdir: Path) -> None:
    engine = small_cache
    flight_prompt = [7000 + j for j in range(8)]
    reference = engine.complete(flight_prompt, 64, logprobs=2)
    rule = {"threshold": HIT_THRESHOLD, "for": FOR}
    remediation = {"cooldown": "1h", "allowedActions": ["raiseLruK"]}
    config = engine.agent_config(workdir / "agent-a.json", {"hitRate": {**rule, "enabled": False}},
                                 remediation)
    agent = Agent(workdir, config, "a")
    try:
        agent.wait_up()
        segment = trace_segment()
        warm = replay(engine, segment)
        before = replay(engine, segment)
        assert engine.status().eviction_k == 2
        assert before < HIT_THRESHOLD, f"the trace does not breach the threshold under K=2: {before:.3f}"
        flight = InFlight(engine, flight_prompt, 64)
        wait_for(lambda: engine.status().num_running == 1, "the in-flight request running")
        engine.agent_config(config, {"hitRate": rule}, remediation)  # arm the rule
        wait_for(lambda: engine.status().eviction_k == 3, "raiseLruK", tail=agent.tail)
        seen = time.time()
        assert_was_in_flight([flight], seen, "raiseLruK")
        assert_same_greedy(flight.join(), reference, "in flight during raiseLruK")
        assert engine.policy()["confkv"]["eviction"]["k"] == 3
        assert agent.remediations("hitRate", "raiseLruK") == 1
        after = replay(engine, segment)
        log(f"hitRate: segment hit ratio warm-up {warm:.3f}, K=2 {before:.3f}, K=3 {after:.3f} "
            f"(engine window ratio now {engine.status().prefix_hit_ratio_window:.3f})")
        assert after > before
        agent.report("hitRate", "raiseLruK", seen)
    finally:
        agent.stop()


# ---- (b) vram -> compress, lowerMaxCacheSize ----------------------------------------------------
def kv_used_in_metrics(engine: Engine) -> float:
    samples = engine.server.metrics()
    return samples['confkv_kv_cache_bytes{tier="full"}'] + samples['confkv_kv_cache_bytes{tier="key_only"}']


def test_vram_breach_compresses_then_lowers_the_cache_size(small_cache: Engine, workdir: Path) -> None:
    engine = small_cache
    prompt = [8000 + j for j in range(3 * BS + 4)]
    reference = engine.complete(prompt, 24, logprobs=2)  # also leaves its blocks cached
    for doc in trace_segment()[:4]:  # more cached prefix blocks
        engine.complete(doc, 1)
    total = engine.status().kv_bytes_total
    flight = InFlight(engine, prompt, 24)
    wait_for(lambda: engine.status().num_running == 1, "the in-flight request running")
    used_before, metric_before = engine.status().kv_bytes_used, kv_used_in_metrics(engine)
    rule = {"threshold": 0.001, "for": FOR}  # any engine's own memory report is above 0.1 %
    config = engine.agent_config(workdir / "agent-b.json", {"vram": rule},
                                 {"cooldown": "2s", "allowedActions": ["compress", "lowerMaxCacheSize"]})
    agent = Agent(workdir, config, "b")
    try:
        wait_for(lambda: engine.status().kv_blocks_compressed > 0, "compress", tail=agent.tail)
        seen = time.time()
        status = engine.status()
        assert status.kv_bytes_used < used_before and kv_used_in_metrics(engine) < metric_before
        log(f"vram: kv_bytes_used {used_before} -> {status.kv_bytes_used} after compress "
            f"({status.kv_blocks_compressed} blocks compressed, /metrics full+key_only {metric_before:.0f} "
            f"-> {kv_used_in_metrics(engine):.0f})")
        assert_was_in_flight([flight], seen, "compress")
        got = flight.join()
        assert got["finish_reason"] == "length" and got["text"], got
        ours, theirs = tokens_and_tops(got)[0], tokens_and_tops(reference)[0]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
        log(f"vram: the request in flight during compress finished ({got['finish_reason']}); its first "
            f"{same} of {len(ours)} tokens equal the uncompressed reference")
        agent.report("vram", "compress", seen)
        wait_for(lambda: engine.status().kv_bytes_total < total, "lowerMaxCacheSize", tail=agent.tail)
        lowered_seen = time.time()
        lowered = engine.policy()["confkv"]["maxCacheSize"]
        assert int(lowered) == int(total * 0.8)
        # kv_bytes_total is the pool maxCacheSize sizes (the null block included): the cut is 20%.
        assert engine.status().kv_bytes_total == int(total * 0.8) // BLOCK_BYTES * BLOCK_BYTES
        log(f"vram: still above the threshold after the cooldown: maxCacheSize -> {lowered} "
            f"(kv_bytes_total {total} -> {engine.status().kv_bytes_total})")
        agent.report("vram", "lowerMaxCacheSize", lowered_seen)  # the second step waits for the 2s cooldown
        assert agent.remediations("vram", "compress") == 1
        assert agent.remediations("vram", "lowerMaxCacheSize") == 1
    finally:
        agent.stop()


# ---- (c) oomPerHour -> halveBatchSize, compress ------------------------------------------------
OOM_EVERY = 12  # a request fails after 3 OOMs alone (36 passes), more than any request here runs
OOM_PROMPTS = [[9000 + 50 * i + j for j in range(5 + i)] for i in range(6)]
OOM_NEW = 12


def keep_requests_in_flight(engine: Engine, agent: Agent,
                            threshold: int) -> tuple[list[tuple[int, InFlight]], float, float]:
    """Keep four requests in flight until the agent has compressed; returns them (prompt index,
    request) and when the test saw the OOM count pass ``threshold`` and the batch halved."""
    flights: list[tuple[int, InFlight]] = []
    breach_seen = halved_seen = None
    deadline = time.monotonic() + 150
    while agent.remediations("oomPerHour", "compress") < 1:
        assert time.monotonic() < deadline, f"no compress after the OOMs\n{agent.tail()}"
        if sum(f.finished_at is None for _, f in flights) < 4:
            i = len(flights) % len(OOM_PROMPTS)
            flights.append((i, InFlight(engine, OOM_PROMPTS[i], OOM_NEW)))
        status = engine.status()
        if breach_seen is None and status.oom_total > threshold:
            breach_seen = time.time()
        if halved_seen is None and json.loads(status.policy_json)["engine"]["maxBatchSize"] == 4:
            halved_seen = time.time()
            assert_was_in_flight([f for _, f in flights], halved_seen, "halveBatchSize")
        time.sleep(0.05)
    assert breach_seen is not None and halved_seen is not None, agent.tail()
    return flights, breach_seen, halved_seen


def test_injected_ooms_halve_the_batch_then_compress(small_cache: Engine, workdir: Path) -> None:
    references = [small_cache.complete(p, OOM_NEW, logprobs=2) for p in OOM_PROMPTS]
    engine = Engine(workdir, "c", {"maxCacheSize": "64Mi"}, env={"CONFKV_FAULT_OOM_EVERY": str(OOM_EVERY)})
    agent = None
    try:
        assert "FAULT INJECTION ON" in engine.server.log_tail(20000)
        rule = {"threshold": 2, "for": "0s"}
        config = engine.agent_config(workdir / "agent-c.json", {"oomPerHour": rule},
                                     {"cooldown": "1s", "allowedActions": ["halveBatchSize", "compress"]})
        agent = Agent(workdir, config, "c")
        agent.wait_up()
        flights, breach_seen, halved_seen = keep_requests_in_flight(engine, agent, rule["threshold"])
        for i, flight in flights:
            assert_same_greedy(flight.join(), references[i], f"OOM prompt {i}")
        status = engine.status()
        log(f"oomPerHour: {status.oom_total} injected OOMs over {len(flights)} requests, all finished; "
            f"engine-side breach -> batch halved seen {halved_seen - breach_seen:.3f}s")
        agent.report("oomPerHour", "halveBatchSize", halved_seen, rule["for"])
        agent.report("oomPerHour", "compress", time.time(), rule["for"])  # after the 1s cooldown
        assert agent.remediations("oomPerHour", "halveBatchSize") == 1
        # The finished requests' blocks stay cached: the forced compression found them.
        wait_for(lambda: engine.status().kv_blocks_compressed > 0, "blocks compressed", tail=agent.tail)
    finally:
        if agent is not None:
            agent.stop()
        engine.close()
