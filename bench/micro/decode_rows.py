"""Decode step time of the real engine at a few batch sizes, this tree against another, interleaved.

Each worker process loads the model (``--weights``, default ``auto``), queues ``B`` greedy requests of
``--prompt`` random tokens, prefills them, takes warm-up steps and times ``--steps`` decode steps (median
wall ms per step) for every ``--batches`` B. With ``--against DIR`` (a checkout of another revision, its
native libraries built) the same worker runs on DIR's sources as well, the two alternating for
``--rounds`` rounds so that outside load hits both alike; the table gives each round's medians and the
ratio of the medians over the rounds (new / base). Only ratios within one run mean anything on a
shared machine.

    python -m bench.micro.decode_rows --model builtin:smollm2-135m --batches 1,32 --against BASE_DIR
    python -m bench.micro.decode_rows --model builtin:gemma3-270m --threads 2 --rounds 3 --against BASE_DIR

``--blocks`` measures one change inside one process instead: the layers' native row-wise blocks
(``model.rowops``) against the PyTorch reference functions, alternating ``--rounds`` times per batch
(no second checkout, no process-to-process drift).

    python -m bench.micro.decode_rows --model builtin:gemma3-270m --blocks --rounds 6 --steps 15

``--native-int8`` is the same kind of in-process A/B for the native int8 matmul (``q8n``): two
engines on the same model, one loaded as served and one with ``CONFKV_NATIVE_INT8=0`` (PyTorch's
int8 / dense kernels for the int8 weights), stepped alternately ``--rounds`` times per batch.

    python -m bench.micro.decode_rows --model builtin:gemma3-270m --native-int8 --rounds 6 --steps 10

``--out NAME`` writes ``bench/results/micro/NAME`` (labels, no paths).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parents[1] / "results" / "micro"
SOURCE_DIRS = ("", "api", "engine", "agent", "operator")


def worker(args: argparse.Namespace) -> dict[str, float]:
    import torch

    torch.set_num_threads(args.threads)
    if args.native_int8:
        return native_int8_ab(args)
    engine = make_engine(args)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for batch in (int(b) for b in args.batches.split(",")):
        timed_steps = args.steps * (2 * args.rounds if args.blocks else 1) + 2 * args.rounds
        start_batch(engine, batch, timed_steps, args, gen)
        if args.blocks:
            out.update(blocks_ab(engine, batch, args.steps, args.rounds))
        else:
            out[f"decode@{batch}"] = timed(engine, args.steps)
        end_batch(engine, batch)
    return out


def make_engine(args: argparse.Namespace) -> Any:
    import torch

    from confkv_api.config import ConfKVConfig
    from confkv_engine.core.engine import LLMEngine
    from confkv_engine.model.loader import load_model

    return LLMEngine(load_model(args.model, torch.float32, "cpu", weights=args.weights), ConfKVConfig())


def start_batch(engine: Any, batch: int, timed_steps: int, args: argparse.Namespace, gen: Any) -> None:
    """Queue ``batch`` greedy requests of random prompts, prefill them and take the warm-up steps."""
    import torch

    from confkv_engine.core.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=timed_steps + args.warmup + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(100, engine.vocab_size, (args.prompt,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{i}", prompt, greedy)
    while any(s.num_computed < s.prompt_len for s in engine._seqs.values()):  # prefill
        engine.step()
    for _ in range(args.warmup):
        engine.step()


def end_batch(engine: Any, batch: int) -> None:
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    engine.step()


def native_int8_ab(args: argparse.Namespace) -> dict[str, float]:
    """Two engines in one process, the int8 weights on ``q8n`` and off it (the switch is read when a
    model's kernel table is made), stepped alternately; medians as ``blocks_ab``."""
    import torch

    engines = {}
    for mode, value in (("q8n", None), ("off", "0")):
        if value is None:
            os.environ.pop("CONFKV_NATIVE_INT8", None)
        else:
            os.environ["CONFKV_NATIVE_INT8"] = value
        engines[mode] = make_engine(args)
    os.environ.pop("CONFKV_NATIVE_INT8", None)
    out: dict[str, float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for engine in engines.values():  # the same prompts in both
            start_batch(engine, batch, args.steps * args.rounds + 2 * args.rounds, args,
                        torch.Generator().manual_seed(batch))
        runs: dict[str, list[float]] = {"q8n": [], "off": []}
        for r in range(args.rounds):
            for mode in (("q8n", "off") if r % 2 == 0 else ("off", "q8n")):
                engines[mode].step()
                runs[mode].append(timed(engines[mode], args.steps))
        ratios = [n / b for n, b in zip(runs["q8n"], runs["off"], strict=True)]
        out.update({f"decode@{batch} q8n": statistics.median(runs["q8n"]),
                    f"decode@{batch} off": statistics.median(runs["off"]),
                    f"decode@{batch} q8n/off": statistics.median(ratios)})
        for engine in engines.values():
            end_batch(engine, batch)
    return out


def timed(engine: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def blocks_ab(engine: Any, batch: int, steps: int, rounds: int) -> dict[str, float]:
    """In one process: the layers' native row-wise blocks (``model.rowops``) against the PyTorch
    reference functions (set as the model's ``ops``, which every native call site defers to),
    alternating ``rounds`` times; medians of the rounds' medians and of the per-round ratios."""
    from confkv_engine.model import llama

    ops = engine.model.ops
    runs: dict[str, list[float]] = {"native": [], "reference": []}
    for r in range(rounds):
        for mode in (("native", "reference") if r % 2 == 0 else ("reference", "native")):
            native = mode == "native"
            ops.norm = None if native else llama.rms_norm
            ops.rope = None if native else llama.apply_rope
            ops.act = None if native else llama.silu_mul
            engine.step()
            runs[mode].append(timed(engine, steps))
    ops.norm = ops.rope = ops.act = None
    ratios = [n / r for n, r in zip(runs["native"], runs["reference"], strict=True)]
    return {f"decode@{batch} native": statistics.median(runs["native"]),
            f"decode@{batch} reference": statistics.median(runs["reference"]),
            f"decode@{batch} native/reference": statistics.median(ratios)}


def run_worker(tree: Path, argv: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(tree / d) for d in SOURCE_DIRS))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *argv], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interleaved(trees: dict[str, Path], argv: list[str], rounds: int) -> dict[str, list[dict[str, float]]]:
    """Every tree's worker once per round, the order reversed every other round."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(rounds):
        for name, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
            runs[name].append(run_worker(tree, argv))
            cells = ", ".join(f"{k} {v:.2f} ms" for k, v in runs[name][-1].items())
            print(f"round {r + 1} {name}: {cells}", flush=True)
    return runs


def report(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Medians over the rounds, and the median of the rounds' own ratios (each round's two workers ran
    back to back, so a ratio within a round is the least exposed to the machine's drift)."""
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    new, base = medians["new"], medians.get("base")
    for key in new:
        line = f"{key}: new {new[key]:.2f} ms"
        if base is not None:
            pairs = zip(runs["new"], runs["base"], strict=True)
            paired = statistics.median(n[key] / b[key] for n, b in pairs)
            medians.setdefault("paired_ratio", {})[key] = paired
            line += f", base {base[key]:.2f} ms, new/base {new[key] / base[key]:.3f} (per round {paired:.3f})"
        print(line)
    return medians


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--weights", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", type=Path, help="another checkout to time alternately (the base)")
    p.add_argument("--out", help="file name under bench/results/micro")
    p.add_argument("--blocks", action="store_true",
                   help="one process: native row-wise blocks against the PyTorch reference, alternating")
    p.add_argument("--native-int8", action="store_true",
                   help="one process: int8 weights on the native kernel against CONFKV_NATIVE_INT8=0")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.blocks or args.native_int8:
        results = worker(args)
        print("\n".join(f"{k}: {v:.3f}" for k, v in results.items()))
        if args.out:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            meta = {k: getattr(args, k) for k in ("model", "weights", "threads", "prompt", "steps", "rounds")}
            key = "native_int8" if args.native_int8 else "blocks"
            (OUT_DIR / args.out).write_text(json.dumps({**meta, key: results}, indent=2))
        return 0
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    forwarded = ("model", "weights", "threads", "batches", "prompt", "steps", "warmup")
    passed = [f"--{k}={getattr(args, k)}" for k in forwarded]
    trees = {"new": Path(__file__).resolve().parents[2]}
    if args.against:
        trees["base"] = args.against.resolve()
    runs = interleaved(trees, passed, args.rounds)
    medians = report(runs)
    if args.out:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        meta = {k: getattr(args, k) for k in ("model", "weights", "threads", "prompt", "steps", "rounds")}
        (OUT_DIR / args.out).write_text(json.dumps({**meta, "runs": runs, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
