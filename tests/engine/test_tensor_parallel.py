"""Tensor parallel = 2 against tensor parallel = 1 on CPU with gloo (tiny random Llama / Qwen2 /
Qwen3, fp32): greedy outputs identical, logits within 1e-4, the same retention decisions (the
union of the ranks' KV heads is TP = 1's, each rank keeps the same count), per-rank KV bytes
halved; without and with the prefix cache, under conf-kv and conf-kv with precision tiers.

The ranks are real processes (``torch.multiprocessing`` spawn) in one gloo process group; the
TP = 1 reference runs in the test process without any process group. Each rank records its
retention decisions by wrapping ``RetentionManager.after_step`` (a spy, in that process only), and
what each rank would have decided from its own heads' scores alone by wrapping ``policies.select``
(the counterfactual that shows why the scores are gathered across ranks).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from confkv_engine.retention import policies
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.tiers import Tier
from testkit.ranks import spawn_ranks
from tests.engine.tiny_models import dense_logits, make_tiny_hf_model

pytest.importorskip("transformers")

COMMON = [(i * 37 + 11) % 250 for i in range(40)]
WAVES = [[COMMON + [5, 6, 7]], [COMMON + [9] * 21, [(i * 37 + 11) % 250 for i in range(150)]]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
KEY_ONLY = ["full", "key_only"]  # the conf-kv rows below keep this chain; -tiers is the default one
CASES = {  # name: (prefix cache, confkv section)
    "full-prefix": (True, {"kvPolicy": "full"}),
    "conf-kv": (False, {"kvPolicy": "conf-kv", "budget": 0.5, "tiers": KEY_ONLY}),
    # Every unit ranks its slots by the mean confidence over all KV heads: a decision that needs
    # every rank's scores, and the ranks must keep exactly the same tokens.
    "conf-kv-token": (False, {"kvPolicy": "conf-kv", "budget": 0.5, "tiers": KEY_ONLY}),
    # A budget above the window and the sinks: the rest of it keeps tokens for their scores.
    "conf-kv-token-scored": (False, {"kvPolicy": "conf-kv", "budget": 0.75, "tiers": KEY_ONLY}),
    "conf-kv-tiers-prefix": (True, {"kvPolicy": "conf-kv", "budget": 0.5, "tiers": ["full", "int4", "int2"]}),
}


def _config(case: str) -> ConfKVConfig:
    prefix, section = CASES[case]
    return ConfKVConfig.model_validate({
        "engine": {"prefillChunk": 32, "maxNumBatchedTokens": 256, "blockSize": 16},
        "confkv": {"maxCacheSize": "8Mi", "window": 32, "prefixCache": {"enabled": prefix},
                   "compression": {"enabled": False}, **section}})


def _granularity(engine: LLMEngine, case: str) -> None:
    if "-token" in case:
        cfg = engine.retention.defaults
        engine.retention.set_defaults(replace(cfg, tiers=replace(cfg.tiers, granularity="token")))


def _spy_decisions() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Wrap after_step in this process: (length, kept positions [L, h, n], tiers) per decision."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    original = RetentionManager.after_step

    def after_step(self, seq, state, num_computed):  # type: ignore[no-untyped-def]
        freed = original(self, seq, state, num_computed)
        if state is not None:
            seen.append((num_computed, state.pos.clone(), state.tiers.clone()))
        return freed

    RetentionManager.after_step = after_step  # type: ignore[method-assign]
    return seen


def _split_view(view: policies.SlotView, world: int, rank: int) -> policies.SlotView:
    """Rank ``rank``'s own units of a gathered view: what it would decide from without the gather."""
    h = view.heads // world

    def part(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        return x.reshape(-1, view.heads, n)[:, rank * h:(rank + 1) * h].reshape(-1, n)

    return replace(view, heads=h, pos=part(view.pos), tiers=part(view.tiers), acc=part(view.acc),
                   norm=part(view.norm), c_samp=part(view.c_samp))


def _kept(view: policies.SlotView, tiers: torch.Tensor) -> list[list[int]]:
    """Kept positions of each unit (layer-major), as lists."""
    return [p[t != Tier.DISCARD].tolist() for p, t in zip(view.pos, tiers, strict=True)]


def _spy_without_gather(world: int) -> list[tuple[list[list[list[int]]], list[list[list[int]]]]]:
    """Wrap policies.select in a rank process: per decision, each rank's kept positions as decided
    (from the gathered scores) and as that rank would decide from its own heads' scores alone."""
    seen: list[tuple[list[list[list[int]]], list[list[list[int]]]]] = []
    original = policies.select

    def select(view, cfg, acct, target):  # type: ignore[no-untyped-def]
        new = original(view, cfg, acct, target)
        halves = [_split_view(replace(view, tiers=new), world, r) for r in range(world)]
        alone = [_split_view(view, world, r) for r in range(world)]
        seen.append(([_kept(h, h.tiers) for h in halves],
                     [_kept(a, original(a, cfg, acct, target)) for a in alone]))
        return new

    policies.select = select  # type: ignore[assignment]
    return seen


def _drive(engine: LLMEngine, usage) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Run the waves one after the other (later ones hit the prefix cache); outputs in order."""
    outputs: list[list[int]] = []
    for w, wave in enumerate(WAVES):
        for i, prompt in enumerate(wave):
            engine.add_request(f"w{w}-{i}", prompt, GREEDY)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
            usage(engine)
        outputs += [done[f"w{w}-{i}"] for i in range(len(wave))]
    return outputs


def _rank_main(rank: int, world: int, port: int, model_dir: str, case: str, out: str) -> None:
    from confkv_engine.parallel.group import destroy_group, init_group
    from confkv_engine.parallel.launch import build_rank

    torch.set_num_threads(1)
    loaded = load_model(model_dir, dtype=torch.float32, device="cpu")
    group = init_group(rank, world, port, "cpu", timeout_s=60)
    decisions = _spy_decisions()
    counterfactual = _spy_without_gather(world)
    engine = build_rank(loaded, _config(case), group, leader=rank == 0)
    _granularity(engine, case)
    peak = [0] * world
    result: dict = {}
    if rank == 0:
        def usage(eng):  # type: ignore[no-untyped-def]
            for u in eng.usage_by_rank():
                peak[u.rank] = max(peak[u.rank], u.kv_bytes_used)
        result["outputs"] = _drive(engine, usage)
        engine.close()
    else:
        engine.serve_forever()  # type: ignore[union-attr]
    tokens = COMMON + [5, 6, 7] + result.get("outputs", [[0] * 8])[0][:8]
    tokens = group.broadcast_object(tokens)
    result.update(logits=dense_logits(loaded.model, tokens, 43), tokens=tokens, decisions=decisions,
                  peak=peak, block_bytes=engine.cache.spec.block_bytes, counterfactual=counterfactual)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    destroy_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {arch: make_tiny_hf_model(arch, root)[1] for arch in ("llama", "qwen2", "qwen3")}


def _reference(model_dir: Path, case: str, monkeypatch) -> dict:  # type: ignore[no-untyped-def]
    loaded = load_model(str(model_dir), dtype=torch.float32, device="cpu")
    monkeypatch.setattr(RetentionManager, "after_step", RetentionManager.after_step)  # restored after
    seen = _spy_decisions()
    engine = LLMEngine(loaded, _config(case))
    _granularity(engine, case)
    peak = [0]
    outputs = _drive(engine, lambda eng: peak.__setitem__(0, max(peak[0], eng.cache.used_bytes)))
    engine.close()
    return {"outputs": outputs, "decisions": seen, "peak": peak[0], "loaded": loaded,
            "block_bytes": engine.cache.spec.block_bytes}


def _run_ranks(model_dir: Path, case: str, out: Path) -> list[dict]:
    spawn_ranks(_rank_main, 2, str(model_dir), case, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize(("arch", "case"), [
    ("llama", "full-prefix"), ("llama", "conf-kv"), ("llama", "conf-kv-tiers-prefix"),
    ("llama", "conf-kv-token"), ("llama", "conf-kv-token-scored"),
    ("qwen2", "conf-kv-tiers-prefix"), ("qwen3", "conf-kv")])
def test_tensor_parallel_2_equals_1(models, arch: str, case: str, tmp_path, monkeypatch) -> None:
    ranks = _run_ranks(models[arch], case, tmp_path)
    ref = _reference(models[arch], case, monkeypatch)

    assert ranks[0]["outputs"] == ref["outputs"]  # greedy, token for token
    want = dense_logits(ref["loaded"].model, ranks[0]["tokens"], 43)
    for r in ranks:
        torch.testing.assert_close(r["logits"], want, rtol=0, atol=1e-4)
    # Per-rank KV: blocks half the bytes, and the pools peaked at half of TP = 1's.
    assert ranks[0]["block_bytes"] * 2 == ref["block_bytes"]
    assert ranks[0]["peak"] == [ref["peak"] // 2] * 2
    # Retention: the same decisions at the same lengths; each rank holds its half of the KV heads.
    d0, d1 = ranks[0]["decisions"], ranks[1]["decisions"]
    assert len(d0) == len(d1) == len(ref["decisions"])
    for (n0, p0, t0), (n1, p1, t1), (n, p, t) in zip(d0, d1, ref["decisions"], strict=True):
        assert n0 == n1 == n
        assert torch.equal(torch.cat([p0, p1], dim=1), p) and torch.equal(torch.cat([t0, t1], dim=1), t)
        if "-token" in case:  # every rank keeps the very same positions
            assert torch.equal(p0, p1)
    if CASES[case][1]["kvPolicy"] != "full":
        evicted = [n - p.shape[-1] for n, p, _ in ref["decisions"]]
        assert max(evicted) > 0, "the budget must evict something for the comparison to mean anything"


def test_tensor_parallel_retention_needs_the_scores_of_every_rank(models, tmp_path) -> None:
    """Token-granular conf-kv ranks each token by its confidence over all KV heads of a layer. Decided
    from the scores gathered over both ranks, both ranks keep the same tokens at every decision; had
    each rank decided from its own heads' scores alone (computed here from the same decision's
    scores, split by rank), they would have kept different tokens, and each rank's cache would hold
    another sequence than its peer's."""
    ranks = _run_ranks(models["llama"], "conf-kv-token-scored", tmp_path)
    seen = ranks[0]["counterfactual"]
    assert seen and seen == ranks[1]["counterfactual"]  # every rank saw the same gathered scores
    differ = 0
    for gathered, alone in seen:
        for unit in range(len(gathered[0])):
            assert gathered[0][unit] == gathered[1][unit]  # with the gather: the same tokens
        differ += any(set(a) != set(b) for a, b in zip(alone[0], alone[1], strict=True))
    assert differ > 0, "without the gather the ranks would have evicted the same tokens"
