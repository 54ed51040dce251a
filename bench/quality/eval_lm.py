"""EleutherAI lm-evaluation-harness against the running server, checked against the engine itself.

lm-eval's ``local-completions`` model is pointed at ``/v1/completions`` with its ``remote``
tokenizer backend, which reads vLLM's ``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` from
the server: nothing is downloaded and no local tokenizer is needed. The task is a perplexity task
(``loglikelihood_rolling``: word_perplexity, byte_perplexity, bits_per_byte) over documents built
from local text, the ``pydoc_data.topics`` pages ``bench.quality.kv_quality`` uses, written to a
JSON-lines file and loaded through a task YAML in a temporary ``include_path``. HF_DATASETS_OFFLINE and
HF_HUB_OFFLINE are set, so a run that tried to reach the network would fail instead.

The same documents are then scored in-process by ``LLMEngine`` (prompt logprobs, ``max_tokens=0``)
over the same rolling windows (lm-eval's own window function; its prefix token is BOS, else EOS,
as its remote tokenizer derives it from /tokenizer_info), and every metric must agree within ``--rtol``
(default 1e-3, relative). Exit status 1 when it does not.

    python -m bench.quality.eval_lm        # starts a server on a free port, 8 documents
    python -m bench.quality.eval_lm --base-url http://127.0.0.1:8000 --model smollm2-135m

Needs the ``eval`` extra (``pip install -e .[eval]``). Results: bench/results/quality/eval_lm.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import results_dir
from bench.serving import peers

RESULTS = results_dir("quality")
MODEL = "builtin:smollm2-135m"
TASK = "confkv_pydoc_perplexity"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")
MAX_LENGTH = 2048  # lm-eval's default max_length (its windows hold max_length - 2 scored tokens)
CACHE_SIZE = "256Mi"


def documents(count: int, max_chars: int) -> list[str]:
    """The first ``count`` pydoc topics (sorted by name), each cut to ``max_chars`` at a line end."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics)[:count]:
        text = topics[name].strip()
        if len(text) > max_chars:
            text = text[:text.rfind("\n", 0, max_chars)].rstrip()
        docs.append(text)
    return docs


def write_task(directory: Path, docs: list[str]) -> None:
    """The documents as JSON lines plus a task YAML that reads them with the ``json`` builder."""
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    metrics = "".join(f"  - metric: {m}\n" for m in METRICS)
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        f"doc_to_target: text\nmetric_list:\n{metrics}")


def run_lm_eval(base_url: str, model: str, task_dir: Path,
                max_length: int) -> tuple[dict[str, float], list[float]]:
    """lm-eval's metrics and its per-document log-likelihoods (in document order)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{base_url}/v1/completions", "model": model, "tokenizer_backend": "remote",
                    "max_length": max_length, "num_concurrent": 1, "max_retries": 1},
        tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
        bootstrap_iters=0)
    scores = results["results"][TASK]
    metrics = {m: float(scores[f"{m},none"]) for m in METRICS}
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return metrics, [float(s["resps"][0][0]) for s in samples]


def engine_loglikelihoods(docs: list[str], max_length: int, weights: str = "fp32") -> list[float]:
    """Each document's log-likelihood from LLMEngine over lm-eval's rolling windows."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from confkv_api.config import ConfKVConfig
    from confkv_engine.core.engine import LLMEngine
    from confkv_engine.core.sampling_params import SamplingParams
    from confkv_engine.model.loader import load_model

    loaded = load_model("builtin:smollm2-135m", weights=weights)
    tok = loaded.tokenizer
    engine = LLMEngine(loaded, ConfKVConfig.model_validate({"confkv": {"maxCacheSize": CACHE_SIZE}}))
    # lm-eval's remote tokenizer: prefix = encode(bos_token)[0] or encode(eos_token)[0]
    prefix = (tok.encode(tok.bos_token)[0] if tok.bos_token else None) or tok.encode(tok.eos_token)[0]
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0)
    totals = []
    for doc in docs:
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=tok.encode(doc), prefix_token=prefix, max_seq_len=max_length - 2, context_len=1)]
        outs = engine.generate([ctx + cont for ctx, cont in windows], params)
        totals.append(sum(e.logprob for (ctx, _), out in zip(windows, outs, strict=True)
                          for e in out.prompt_logprobs[len(ctx):]))
    return totals


def perplexities(docs: list[str], loglikelihoods: list[float]) -> dict[str, float]:
    """lm-eval's aggregation: words split on whitespace runs, bytes of the UTF-8 text."""
    import re

    ll = sum(loglikelihoods)
    words = sum(len(re.split(r"\s+", d)) for d in docs)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    return {"word_perplexity": math.exp(-ll / words), "byte_perplexity": math.exp(-ll / nbytes),
            "bits_per_byte": -ll / nbytes / math.log(2)}


def compare(served: dict[str, float], own: dict[str, float], served_ll: list[float], own_ll: list[float],
            rtol: float) -> dict[str, Any]:
    rel = {m: abs(served[m] - own[m]) / abs(own[m]) for m in METRICS}
    per_doc = max(abs(a - b) / abs(b) for a, b in zip(served_ll, own_ll, strict=True))
    return {"lm_eval": served, "engine": own, "relative_difference": rel,
            "max_document_relative_difference": per_doc, "rtol": rtol,
            "ok": all(v <= rtol for v in rel.values()) and per_doc <= rtol,
            "per_document_loglikelihood": {"lm_eval": served_ll, "engine": own_ll}}


def evaluate(base_url: str, model: str, docs: list[str], rtol: float, max_length: int,
             weights: str = "fp32") -> dict[str, Any]:
    """Run lm-eval against ``base_url`` and the engine in-process; the comparison report."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="confkv-lm-eval-") as tmp:
        os.environ.setdefault("HF_HOME", str(Path(tmp) / "hf"))
        write_task(Path(tmp), docs)
        served, served_ll = run_lm_eval(base_url, model, Path(tmp), max_length)
    own_ll = engine_loglikelihoods(docs, max_length, weights)
    report = compare(served, perplexities(docs, own_ll), served_ll, own_ll, rtol)
    report.update(documents=len(docs), max_length=max_length)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server (default: start one on a free port)")
    parser.add_argument("--model", default="smollm2-135m", help="model name the server serves")
    parser.add_argument("--docs", type=int, default=8, help="number of pydoc topics")
    parser.add_argument("--max-chars", type=int, default=8000, help="characters per document at most")
    parser.add_argument("--max-length", type=int, default=MAX_LENGTH,
                        help="lm-eval's max_length: longer documents are scored in several windows")
    parser.add_argument("--rtol", type=float, default=1e-3)
    # fp32 by default: the quantized kernels are chosen per matmul by the number of rows, so their
    # rounding depends on how requests are batched, and this checks the client, not the kernels.
    parser.add_argument("--weights", default="fp32",
                        help="--weights of the server it starts and of the in-process reference")
    parser.add_argument("--out", type=Path, default=RESULTS / "eval_lm.json", help="the report's JSON path")
    args = parser.parse_args(argv)
    docs = documents(args.docs, args.max_chars)
    if args.base_url:
        report = evaluate(args.base_url.rstrip("/"), args.model, docs, args.rtol, args.max_length,
                          args.weights)
    else:
        threads = int(os.environ.get("CONFKV_THREADS", "0")) or os.cpu_count() or 1
        with tempfile.TemporaryDirectory(prefix="confkv-eval-server-") as logs, \
                peers.confkv_server(MODEL, args.weights, threads, 64, Path(logs),
                                    extra=["--max-cache-size", CACHE_SIZE]) as srv:
            srv.wait_ready()
            report = evaluate(srv.url, peers.served_model_name(srv.url), docs, args.rtol, args.max_length,
                              args.weights)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for m in METRICS:
        print(f"{m:16s} lm-eval {report['lm_eval'][m]:.6f}  engine {report['engine'][m]:.6f}  "
              f"rel diff {report['relative_difference'][m]:.2e}")
    print(f"per document: max rel diff {report['max_document_relative_difference']:.2e}")
    print("OK" if report["ok"] else f"MISMATCH (rtol {args.rtol})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
