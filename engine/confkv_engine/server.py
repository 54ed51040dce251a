"""The engine server's composition root: model, engine, HTTP app and control plane wired together.

The model loads in a background thread after the server starts, so ``/health`` (liveness) answers
during a long load while ``/ready`` (readiness) stays 503 until the engine runs. The gRPC control
plane (``control.servicer``) starts with the server and attaches to the engine once it runs.

**Drain.** On SIGTERM (or a first Ctrl-C) the server keeps listening: ``/ready`` answers 503,
new generation requests get 503 in OpenAI's format, and the requests that arrived before the signal
run to completion (``http.drain``). When none is left, or after ``drain_timeout`` seconds (the
engine then ends the stragglers' streams with an error), uvicorn closes the listener, the engine
stops and the process exits 0. A second signal ends the drain early: the listener closes and
uvicorn's own shutdown waits for the requests in flight (a second Ctrl-C forces the exit). In a pod,
``terminationGracePeriodSeconds`` must exceed a preStop sleep plus ``drain_timeout`` plus a few
seconds to stop (README).

HTTP/1.1 is served by uvicorn with the h11 protocol of ``http.connection`` (strict framing,
OpenAI-format errors from the parser, a header-read deadline).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from confkv_api.config import ConfKVConfig
from confkv_engine.core.async_engine import AsyncEngine
from confkv_engine.core.control_api import EngineControlTarget
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.http.app import APIError, create_app
from confkv_engine.http.connection import DEFAULT_HEADER_TIMEOUT_S, MAX_HEAD_BYTES, protocol_class
from confkv_engine.http.drain import RequestTracker
from confkv_engine.http.metrics import EngineMetrics
from confkv_engine.http.serving import OpenAIServing

if TYPE_CHECKING:
    from confkv_engine.core.engine import LLMEngine
    from confkv_engine.parallel.topology import Topology

log = logging.getLogger("confkv.server")

WARMUP_TIMEOUT = 600.0  # seconds a warm-up may take before the caller gets an error
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # fits the operator's 60 s grace period with room to stop


async def _prefill_all(engine: AsyncEngine, prompts: list[list[int]]) -> None:
    """Run each prompt for one greedy token, so its full blocks land in the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=1)

    async def one(ids: list[int]) -> None:
        async for _ in engine.generate(f"warmup-{uuid.uuid4().hex}", ids, params):
            pass

    await asyncio.gather(*(one(ids) for ids in prompts))


def _in_own_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], None],
                   name: str) -> asyncio.Future[None]:
    """Run ``fn`` on a new thread that ends with it; the future resolves on ``loop`` when it returns."""
    done: asyncio.Future[None] = loop.create_future()

    def run() -> None:
        try:
            fn()
        finally:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


class ServerState:
    """The server's state (``http.app.ServedState``); the engine parts are filled in by the loader thread."""

    def __init__(self, config: ConfKVConfig, on_load_failed: Callable[[], None] | None = None,
                 topology: Topology | None = None) -> None:
        self.config = config
        self.topology = topology  # the tensor-parallel group's nodes (None: every rank on this machine)
        self.metrics = EngineMetrics()
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.model_name: str | None = config.model.served_name
        self.max_model_len = 0
        self.load_error: str | None = None
        self.draining = False
        self.requests = RequestTracker(lambda: self.draining)
        self.created = int(time.time())
        self.on_load_failed = on_load_failed
        self.loaded_event = threading.Event()
        self.drain_timeout: float | None = None
        self._loader: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core: LLMEngine | None = None
        self._async: AsyncEngine | None = None
        self._tokenizer: Any = None
        from confkv_engine.control.servicer import ControlPlane  # grpc: imported only by a serving process

        self.control = ControlPlane(config)

    def load(self) -> None:
        """Load the model and start the engine thread (runs in a worker thread)."""
        try:
            from confkv_engine.core.engine import LLMEngine
            from confkv_engine.model.loader import load_model, resolve_device, resolve_dtype

            cfg = self.config
            if cfg.engine.tensor_parallel > 1:  # rank 0 of a group it spawns (parallel.launch)
                from confkv_engine.parallel.launch import start_leader
                loaded, core = start_leader(cfg, self.metrics.registry, self.topology)
            else:
                device = resolve_device(cfg.engine.device)
                loaded = load_model(cfg.model.source, resolve_dtype(cfg.model.dtype, device), device,
                                    weights=cfg.model.weights)
                core = LLMEngine(loaded, cfg)
            engine = AsyncEngine(core,
                                 on_finished=self.metrics.observe_finished,
                                 on_aborted=self.metrics.observe_aborted)
            self.model_name = self.model_name or loaded.name
            self.max_model_len = loaded.max_model_len
            vocab = getattr(loaded.args, "vocab_size", 1 << 31)
            self.metrics.attach_engine(engine.stats, str(loaded.device))
            engine.start()
            core.start_compression()  # the background worker for cold cached blocks (when enabled)
            self._core, self._async, self._tokenizer = core, engine, loaded.tokenizer
            if cfg.confkv.warmup.prompts:  # before readiness: the first users already hit the cache
                ran, cached = self.warm(list(cfg.confkv.warmup.prompts), 0)
                log.info("warm-up: %d prompt(s) prefilled, %d blocks cached", ran, cached)
            self._attach_control(core, engine, str(loaded.device))
            self.serving = OpenAIServing(engine, loaded.tokenizer, self.model_name,
                                         loaded.max_model_len, vocab, cfg.model.served_aliases,
                                         default_max_tokens=cfg.engine.max_tokens_default)
            self.engine = engine
            log.info("model %s loaded (%s, %s); max_model_len=%d", self.model_name, loaded.device,
                     loaded.dtype, loaded.max_model_len)
            _freeze_startup_objects()
        except Exception as err:
            log.exception("model load failed")
            self.load_error = f"{type(err).__name__}: {err}"
            if self.on_load_failed is not None:
                self.on_load_failed()
        finally:
            self.loaded_event.set()

    def _attach_control(self, core: EngineControlTarget, engine: AsyncEngine, device: str) -> None:
        try:
            self.control.attach(core, engine.stats, self.metrics.registry, device, self.model_name,
                                warmup=self.warm)
        except Exception:  # the HTTP API keeps serving without the control plane
            log.exception("gRPC control plane could not attach to the engine")

    def warm(self, prompts: list[str], top_k: int) -> tuple[int, int]:
        """Prefill ``prompts`` (none: the top-k hot prefixes the disk store remembers) into the prefix
        cache through the running engine and wait for them; returns (prompts run, blocks cached).
        Called from the control plane's threads and from the loader (start-up warm-up)."""
        core, engine, tokenizer = self._core, self._async, self._tokenizer
        if core is None or engine is None or tokenizer is None or self._loop is None:
            raise ValueError("the engine is not running yet")
        ids = [tokenizer.encode(p) for p in prompts if p] if prompts else core.hot_prefixes(top_k)
        ids = [i[: core.max_model_len - 1] for i in ids if i]
        if ids:
            asyncio.run_coroutine_threadsafe(_prefill_all(engine, ids), self._loop).result(WARMUP_TIMEOUT)
        return len(ids), core.cache.num_cached_blocks // 2

    async def startup(self) -> None:
        """gRPC on the shared Unix socket (started by ``run_server`` before the port opens; a no-op then;
        UNAVAILABLE until the engine attaches), then the model load."""
        self.control.start()
        self._loop = asyncio.get_running_loop()
        # Not the default executor: its threads live on, and one that ran torch ops keeps an OpenMP
        # thread pool. libgomp counts every pool's workers, and once they outnumber the cores it
        # stops spin-waiting between parallel regions, which made every op of the engine thread
        # 2-3x slower on a 2-core machine. A thread of its own exits after the load and frees its pool.
        self._loader = _in_own_thread(self._loop, self.load, "confkv-loader")

    async def shutdown(self) -> None:
        self.begin_drain()
        log.info("shutting down: draining the engine")
        if self._loader is not None:
            await self._loader  # a load still running finishes first, so the engine thread stops cleanly
        await self.stop_engine(self.drain_timeout)
        if self._core is not None:
            self._core.close()
        self.control.stop()
        log.info("engine stopped")

    async def stop_engine(self, timeout: float | None) -> None:
        """Let the engine finish its requests (at most ``timeout`` s; the rest end with an error),
        then stop it."""
        if self.engine is not None:
            await self.engine.drain_and_stop(timeout)

    def healthy(self) -> bool:
        return self.load_error is None and (self.engine is None or self.engine.alive or self.draining)

    def begin_drain(self) -> None:
        self.draining = True
        if self.engine is not None:
            self.engine.begin_drain()

    def readiness(self) -> tuple[bool, str]:
        if self.load_error:
            return False, "failed"
        if self.draining:
            return False, "draining"
        if self.engine is None:
            return False, "loading"
        return (True, "ready") if self.engine.alive else (False, "engine stopped")

    def require_serving(self, model: str | None) -> OpenAIServing:
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="draining")
        if self.serving is None:
            raise APIError(503, "the model is still loading", "service_unavailable", code="not_ready")
        if model is not None and model not in (*self.serving.served_names, self.config.model.source):
            raise APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
        return self.serving


class DrainingServer(uvicorn.Server):
    """uvicorn that drains while still listening (module docstring) and exits 0 after a drained SIGTERM."""

    def __init__(self, config: uvicorn.Config, state: ServerState,
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout = drain_timeout
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is None and not self.should_exit:
            # The first signal: drain, listening on (checked once per tick by on_tick).
            self._drain_deadline = time.monotonic() + self._drain_timeout
            self._state.begin_drain()
            log.info("signal %d: draining (%d request(s) in progress, at most %.0f s); /ready answers 503",
                     sig, self._state.requests.admitted, self._drain_timeout)
            return
        super().handle_exit(sig, frame)  # a second signal: uvicorn's shutdown from here
        # uvicorn re-raises a captured signal after shutting down; a drained SIGTERM is a clean exit.
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
            captured.remove(sig)

    async def on_tick(self, counter: int) -> bool:
        deadline = self._drain_deadline
        if deadline is not None and not self.should_exit:
            left = self._state.requests.admitted
            if left and time.monotonic() >= deadline:
                log.warning("drain timeout: ending %d request(s) still in progress", left)
                await self._state.stop_engine(timeout=0.0)
                left = 0
            self.should_exit = left == 0
        return await super().on_tick(counter)


def run_server(config: ConfKVConfig, log_level: str = "info",
               on_loaded: Callable[[str], None] | None = None,
               drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
               header_timeout: float = DEFAULT_HEADER_TIMEOUT_S, topology: Topology | None = None) -> int:
    """Serve until SIGTERM/SIGINT and the drain; returns the process exit status (1 when the model
    failed to load or the control plane cannot start). ``topology``: rank 0 of a group across nodes."""
    holder: dict[str, DrainingServer] = {}

    def stop() -> None:
        holder["server"].should_exit = True

    state = ServerState(config, on_load_failed=stop, topology=topology)
    from confkv_engine.control.servicer import ControlPlaneError

    try:
        state.control.start()  # before the port opens: no engine serves without its control plane
    except ControlPlaneError as err:
        log.error("exiting: gRPC control plane not started: %s", err)
        return 1
    app = create_app(state)
    uv_config = uvicorn.Config(app, host=config.engine.host, port=config.engine.port, log_level=log_level,
                               access_log=log_level == "debug", lifespan="on",
                               http=protocol_class(header_timeout),
                               h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    server = holder["server"] = DrainingServer(uv_config, state, drain_timeout)
    if on_loaded is not None:
        def announce() -> None:
            state.loaded_event.wait()
            if state.serving is not None:
                on_loaded(state.serving.model_name)
        threading.Thread(target=announce, daemon=True).start()
    server.run()
    log.info("server stopped")
    if state.load_error:
        log.error("exiting: %s", state.load_error)
        return 1
    return 0


def _freeze_startup_objects() -> None:
    """Keep the ~200K objects of start-up (torch, pydantic, FastAPI, the model) out of the garbage
    collector's full passes: each pass walks every tracked object with the GIL held (50-90 ms
    here), and /health waits for it. What requests allocate later is collected as before."""
    gc.collect()
    gc.freeze()
