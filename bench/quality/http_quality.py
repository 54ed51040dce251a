"""KV-retention quality as a user measures it: ``confkv serve`` processes over a real socket, the
``openai`` client, echo + logprobs, on held-out text (``testkit.held_out``: never used for tuning).

For every variant and budget one server starts with the server's defaults plus the variant's flags
and ``--kv-budget F`` (``none`` in ``--budgets``: no budget, thresholds only); each window goes in
as a token-id prompt with ``max_tokens=0, echo=True, logprobs=0`` and the returned prompt
log-probabilities give the perplexity. The reference is a
server with the same defaults and no budget (the full cache). Variants:

- ``h2o``: ``--kv-policy h2o``;
- ``conf-kv``: ``--kv-policy conf-kv`` (the default tiers: the precision chain FULL / int4 / k4v2 /
  int2 / DISCARD);
- ``conf-kv+tiers``: ``--kv-policy conf-kv --kv-tiers full,int4,k4v2,int2`` (``--tiers`` sets the chain);
- ``conf-kv+key_only``: ``--kv-policy conf-kv --kv-tiers full,key_only`` (FULL / KEY_ONLY / DISCARD).

Rows of ``conf-kv`` stored before the default tiers changed carry the same flags: re-measure them with
``--label`` or ``--force``.

Text kinds (two 1,024-token windows each by default): ``prose`` (plain English prose) and
``repeat`` (the same prose with passages re-inserted from 190-960 tokens back). Perplexity is over
every scored token of the windows, pooled (the first token of a window has no log-probability);
the second half's is recorded too. The cache is stored in bfloat16 (``--kv-cache-dtype``; the
default on CUDA, where a bf16 full cache is what a budget is a fraction of); everything else is
the server's default (quantized GGUF weights on CPU, decision interval 32, thresholds, window).

    python -m bench.quality.http_quality                          # full, h2o, conf-kv, conf-kv+tiers
    python -m bench.quality.http_quality --variants conf-kv+tiers --label mychange --force

Rows are checkpointed in ``bench/results/quality/http_quality.json`` keyed by variant, budget,
flags, text and ``--label`` (name the code state when comparing trees; ``--force`` re-measures).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import load_results, results_dir
from bench.serving.peers import ServerProcess, free_port, served_model_name, server_env
from testkit import held_out

RESULTS = results_dir("quality")
MODEL = "builtin:smollm2-135m"
VARIANTS = ("h2o", "conf-kv", "conf-kv+tiers")
KEY_ONLY_CHAIN = "full,key_only"
SIZE, HEAD, SPAN = 1024, 384, 64


def variant_flags(name: str, budget: float | None, tiers: str) -> list[str]:
    """The serve flags of one row, beyond the shared ones (``budget`` None: no ``--kv-budget``)."""
    if name == "full":
        return []
    policy = "h2o" if name == "h2o" else "conf-kv"
    chain = {"conf-kv+tiers": tiers, "conf-kv+key_only": KEY_ONLY_CHAIN}.get(name)
    flags = ["--kv-policy", policy] + ([] if budget is None else ["--kv-budget", str(budget)])
    return flags + ([] if chain is None else ["--kv-tiers", chain])


def texts(tokenizer: Any, count: int) -> dict[str, list[list[int]]]:
    """The held-out windows by kind: prose [1024, 1024 + count x 1024), repeats built after them."""
    tokens = tokenizer.encode(held_out.prose_text(), add_bos=False)
    start = held_out.PROSE_START + count * SIZE
    return {"prose": held_out.prose_windows(tokens, count, SIZE),
            "repeat": held_out.repeating_windows(tokens, count, SIZE, start, HEAD, SPAN)}


def measure(flags: list[str], kinds: dict[str, list[list[int]]], threads: int, logs: Path,
            tag: str) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "confkv_engine.cli", "serve", "--model", MODEL, "--port", str(port), *flags]
    t0 = time.time()
    with ServerProcess(argv, port, "/ready", server_env(threads), logs / f"{tag}.log") as srv:
        srv.wait_ready()
        model = served_model_name(srv.url)
        rows = {kind: held_out.echo_perplexity(srv.url, model, wins) for kind, wins in kinds.items()}
    return {"argv": argv[3:], "kinds": rows, "seconds": round(time.time() - t0, 1)}


def row_key(name: str, budget: float | None, flags: list[str], digest: str, label: str) -> str:
    blob = json.dumps([name, budget, flags, digest, label])
    return f"{name}@{budget}#{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def code_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def print_table(rows: list[dict[str, Any]], full: dict[str, Any]) -> None:
    kinds = list(full["kinds"])
    head = "".join(f"{k + ' ppl':>14}{'+%':>9}" for k in kinds)
    print(f"{'variant':<16}{'f':>7}{head}{'peak/full':>11}")
    for r in rows:
        cells = ""
        for k in kinds:
            ppl, ref = r["kinds"][k]["ppl"], full["kinds"][k]["ppl"]
            cells += f"{ppl:>14.3f}{100 * (ppl / ref - 1):>9.2f}"
        peak = max(r["kinds"][k]["peak_kv_bytes"] for k in kinds)
        ref_peak = max(full["kinds"][k]["peak_kv_bytes"] for k in kinds)
        f = "-" if r["f"] is None else f"{r['f']:.3f}"
        print(f"{r['name']:<16}{f:>7}{cells}{peak / max(ref_peak, 1):>11.3f}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated: h2o, conf-kv, conf-kv+tiers, conf-kv+key_only")
    ap.add_argument("--budgets", default="0.25,0.125",
                    help="comma-separated --kv-budget fractions; none: no budget")
    ap.add_argument("--tiers", default="full,int4,k4v2,int2", help="--kv-tiers of the conf-kv+tiers rows")
    ap.add_argument("--windows", type=int, default=2, help="1,024-token windows per text kind")
    ap.add_argument("--kv-cache-dtype", default="bfloat16", help="--kv-cache-dtype of every server")
    ap.add_argument("--extra", default="", help="more serve flags for the budgeted rows (one string)")
    ap.add_argument("--threads", type=int, default=2, help="CONFKV_THREADS of each server")
    ap.add_argument("--label", default="", help="names the code state in the row keys")
    ap.add_argument("--force", action="store_true", help="re-measure rows already stored")
    ap.add_argument("--out", default=str(RESULTS / "http_quality.json"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = texts(_tokenizer(), args.windows)
    digest = held_out.text_digest(json.dumps(kinds))
    out = Path(args.out)
    data = load_results(out)
    base = ["--kv-cache-dtype", args.kv_cache_dtype]
    plan: list[tuple[str, float | None]] = [("full", None)]
    budgets = [None if f == "none" else float(f) for f in args.budgets.split(",")]
    plan += [(v, f) for f in budgets for v in args.variants.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for name, f in plan:
            flags = base + variant_flags(name, f, args.tiers) + (args.extra.split() if name != "full" else [])
            key = row_key(name, f, flags, digest, args.label if name != "full" else "")
            if key not in data["results"] or (args.force and name != "full"):
                res = measure(flags, kinds, args.threads, Path(logs), key.replace("#", "-"))
                res.update({"name": name, "f": f, "label": args.label, "code": code_state()})
                data["results"][key] = res
                data["meta"] = {"model": MODEL, "window": SIZE, "windows": args.windows, "head": HEAD,
                                "span": SPAN, "text": str(held_out.PROSE_PATH), "text_digest": digest}
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, indent=1))
                ppl = ", ".join(f"{k} {v['ppl']:.3f}" for k, v in res["kinds"].items())
                print(f"  {name} f={f}: {ppl} ({res['seconds']} s)", flush=True)
            rows.append(data["results"][key])
    print_table(rows, rows[0])
    return 0


def _tokenizer() -> Any:
    """The embedded model's tokenizer alone (the server loads the model; the client needs only ids)."""
    import torch

    from confkv_engine.model.loader import load_model

    return load_model(MODEL, torch.float32, "cpu").tokenizer


if __name__ == "__main__":
    raise SystemExit(main())
