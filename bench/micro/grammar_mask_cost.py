"""Per-token cost of structured-output token masks: llguidance, xgrammar, outlines-core.

The libraries are the three vLLM supports. Each gets SmolLM2's vocabulary (the ``tokenizers`` BPE
the engine rebuilds from the GGUF) and the schema of nested objects, an enum and arrays that the
HTTP test uses; a valid document is tokenized and fed token by token, timing the mask computation
before every token (the work added to each decode step of a constrained sequence). Reported: the
one-off tokenizer preparation, the grammar compile, and mean / median / p99 mask time per token.
For llguidance, the engine's whole per-step path (``structured_output.apply_grammar_masks``:
bitmask, unpacking, masking the logits row) is timed as well. Libraries that are not installed are
skipped (only llguidance is a dependency; ``pip install xgrammar outlines-core`` for the others).

    python -m bench.micro.grammar_mask_cost        # -> bench/results/micro/grammar_mask_cost.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import torch

from bench.common import ROOT, results_dir
from testkit.gpt2_bytes import gpt2_byte_map

RESULTS = results_dir("micro")
PET_SCHEMA = json.loads((ROOT / "tests" / "integration" / "pet_schema.json").read_text())
REPEATS = 5
DOCUMENT = {"name": "Rex the dog", "kind": "dog", "owner": {"age": 42, "tags": ["kind", "busy"]},
            "scores": [15, 2, 325]}


def _stats(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"mean_us": 1e6 * statistics.fmean(times), "median_us": 1e6 * statistics.median(times),
            "p99_us": 1e6 * times[int(0.99 * (len(times) - 1))]}


def _check(accepted: bool, library: str) -> None:
    if not accepted:
        raise RuntimeError(f"{library} rejected a token of the valid document")


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def run_llguidance(tok: Any, vocab: int, ids: list[int]) -> dict[str, Any]:
    from confkv_engine.core import structured_output as so
    from confkv_engine.core.sampling_params import StructuredOutput

    _, prep = _timed(lambda: so.ll_tokenizer(tok, vocab, tok.eos_token_ids))
    spec = StructuredOutput("json_schema", json.dumps(PET_SCHEMA))
    _, compile_s = _timed(lambda: so.GrammarState(spec, tok, vocab, tok.eos_token_ids))
    mask_times, step_times = [], []
    for _ in range(REPEATS):
        state = so.GrammarState(spec, tok, vocab, tok.eos_token_ids)
        words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        for t in ids:
            mask_times.append(_timed(state.fill_bitmask, words)[1])
            step_times.append(_timed(so.apply_grammar_masks, torch.zeros(1, vocab), [state])[1])
            _check(state.accept(t), "llguidance")
    return {"version": metadata.version("llguidance"), "tokenizer_prep_ms": 1e3 * prep,
            "compile_ms": 1e3 * compile_s, "mask": _stats(mask_times), "engine_step": _stats(step_times)}


def run_xgrammar(tok: Any, vocab: int, ids: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    def prepare() -> Any:
        tokens = [tok.backend.id_to_token(i) or "" for i in range(vocab)]
        info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                 stop_token_ids=list(tok.eos_token_ids))
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiler, prep = _timed(prepare)
    compiled, compile_s = _timed(lambda: compiler.compile_json_schema(
        json.dumps(PET_SCHEMA), any_whitespace=False, separators=(",", ":")))  # compact JSON
    times = []
    for _ in range(REPEATS):
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        for t in ids:
            times.append(_timed(matcher.fill_next_token_bitmask, bitmask, 0)[1])
            _check(matcher.accept_token(t), "xgrammar")
    return {"version": metadata.version("xgrammar"), "tokenizer_prep_ms": 1e3 * prep,
            "compile_ms": 1e3 * compile_s, "mask": _stats(times)}


def run_outlines(tok: Any, vocab: int, ids: list[int]) -> dict[str, Any]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    byte_of = {c: b for b, c in gpt2_byte_map().items()}
    eos = tok.eos_token_ids[0]

    def prepare() -> Any:
        table: dict[bytes, list[int]] = {}
        for i in range(vocab):
            piece = tok.backend.id_to_token(i)
            if i == eos or piece is None:
                continue
            raw = piece.encode() if i in tok.special_ids else bytes(byte_of[c] for c in piece)
            table.setdefault(raw, []).append(i)
        return outlines_core.Vocabulary(eos, table)
    vocabulary, prep = _timed(prepare)
    regex = build_regex_from_schema(json.dumps(PET_SCHEMA), r"")
    index, compile_s = _timed(lambda: outlines_core.Index(regex, vocabulary))
    times = []
    for _ in range(REPEATS):
        guide = outlines_core.Guide(index)
        for t in ids:
            times.append(_timed(guide.get_tokens)[1])
            guide.advance(t)
    return {"version": metadata.version("outlines-core"), "tokenizer_prep_ms": 1e3 * prep,
            "compile_ms": 1e3 * compile_s, "mask": _stats(times)}


def main() -> int:
    from confkv_engine.model import gguf_loader
    from confkv_engine.model.loader import builtin_path
    from confkv_engine.model.tokenizer import Tokenizer

    torch.set_num_threads(1)
    gguf = gguf_loader.open_gguf(builtin_path("smollm2-135m"))
    tok = Tokenizer.from_gguf_metadata(gguf.metadata)
    vocab = gguf.args.vocab_size
    ids = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")))
    report: dict[str, Any] = {"vocab_size": vocab, "document_tokens": len(ids), "repeats": REPEATS,
                              "threads": 1, "libraries": {}}
    for name, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar),
                      ("outlines-core", run_outlines)):
        try:
            report["libraries"][name] = run(tok, vocab, ids)
        except ImportError as err:
            report["libraries"][name] = {"skipped": f"not installed ({err.name})"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grammar_mask_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    for name, row in report["libraries"].items():
        if "skipped" in row:
            print(f"{name:14s} {row['skipped']}")
            continue
        mask = row["mask"]
        print(f"{name:14s} prep {row['tokenizer_prep_ms']:7.1f} ms  compile {row['compile_ms']:7.1f} ms  "
              f"mask mean {mask['mean_us']:6.1f} us  median {mask['median_us']:6.1f} us  "
              f"p99 {mask['p99_us']:7.1f} us")
    if "engine_step" in report["libraries"].get("llguidance", {}):
        step = report["libraries"]["llguidance"]["engine_step"]
        print(f"engine path (llguidance mask + unpack + masked_fill): mean {step['mean_us']:.1f} us, "
              f"p99 {step['p99_us']:.1f} us per constrained token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
