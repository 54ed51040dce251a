"""FastAPI app of the engine: OpenAI routes, probes, metrics, errors, auth and lifecycle.

The model loads in a background thread after the server starts, so ``/health`` (liveness) answers
during a long load while ``/ready`` (readiness) stays 503 until the engine runs. On SIGTERM
readiness goes false at once, uvicorn stops accepting connections and waits for in-flight
responses, then the engine drains and the process exits 0. The gRPC control plane
(``control.py``) starts with the server and attaches to the engine once it runs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from confkv_api.config import ConfKVConfig
from confkv_engine.core.async_engine import AsyncEngine, EngineUnavailable, QueueFull
from confkv_engine.core.sampling_params import InvalidRequest
from confkv_engine.http.metrics import EngineMetrics
from confkv_engine.http.protocol import ChatCompletionRequest, CompletionRequest, error_body
from confkv_engine.http.serving import GenerationFailed, OpenAIServing

log = logging.getLogger("confkv.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class ServerState:
    """What the routes need; filled in by the loader thread."""

    def __init__(self, config: ConfKVConfig, on_load_failed: Callable[[], None] | None = None) -> None:
        self.config = config
        self.metrics = EngineMetrics()
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.model_name: str | None = config.model.served_name
        self.max_model_len = 0
        self.load_error: str | None = None
        self.draining = False
        self.created = int(time.time())
        self.on_load_failed = on_load_failed
        self.loaded_event = threading.Event()
        from confkv_engine.control.servicer import ControlPlane  # grpc: imported only by a serving process

        self.control = ControlPlane(config)

    def load(self) -> None:
        """Load the model and start the engine thread (runs in a worker thread)."""
        try:
            from confkv_engine.core.engine import LLMEngine
            from confkv_engine.model.loader import load_model, resolve_device, resolve_dtype

            cfg = self.config
            loaded = load_model(cfg.model.source, resolve_dtype(cfg.model.dtype),
                                resolve_device(cfg.engine.device), weights=cfg.model.weights)
            core = LLMEngine(loaded, cfg)
            engine = AsyncEngine(core,
                                 on_finished=self.metrics.observe_finished,
                                 on_aborted=self.metrics.observe_aborted)
            self.model_name = self.model_name or loaded.name
            self.max_model_len = loaded.max_model_len
            vocab = getattr(loaded.args, "vocab_size", 1 << 31)
            self.metrics.attach_engine(engine.stats, str(loaded.device))
            engine.start()
            self._attach_control(core, engine, str(loaded.device))
            self.serving = OpenAIServing(engine, loaded.tokenizer, self.model_name,
                                         loaded.max_model_len, vocab)
            self.engine = engine
            log.info("model %s loaded (%s, %s); max_model_len=%d", self.model_name, loaded.device,
                     loaded.dtype, loaded.max_model_len)
        except Exception as err:
            log.exception("model load failed")
            self.load_error = f"{type(err).__name__}: {err}"
            if self.on_load_failed is not None:
                self.on_load_failed()
        finally:
            self.loaded_event.set()

    def _attach_control(self, core: object, engine: AsyncEngine, device: str) -> None:
        try:
            self.control.attach(core, engine.stats, self.metrics.registry, device, self.model_name)
        except Exception:  # the HTTP API keeps serving without the control plane
            log.exception("gRPC control plane could not attach to the engine")

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
        if model is not None and model not in (self.model_name, self.config.model.source):
            raise APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
        return self.serving


def _auth_dependency(api_key: str | None) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
    return check


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return _error(err.status, str(err), err.type, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error(400, "We could not parse the JSON body of your request.", "invalid_request_error",
                          code="invalid_json")
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":
            msg, code = f"Unrecognized request argument supplied: {param}", "unknown_parameter"
        else:
            msg, code = f"{param or 'body'}: {first.get('msg', 'invalid value')}", "invalid_value"
        return _error(400, msg, "invalid_request_error", param, code)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, err: InvalidRequest) -> JSONResponse:
        return _error(400, str(err), "invalid_request_error", err.param, err.code)

    @app.exception_handler(QueueFull)
    async def _full(_: Request, err: QueueFull) -> JSONResponse:
        return _error(429, str(err), "rate_limit_error", code="queue_full")

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, err: EngineUnavailable) -> JSONResponse:
        return _error(503, str(err), "service_unavailable", code="unavailable")

    @app.exception_handler(GenerationFailed)
    async def _failed(_: Request, err: GenerationFailed) -> JSONResponse:
        return _error(500, str(err), "server_error", code="generation_failed")


def _openai_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth_dependency(state.config.engine.api_key))])

    @router.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await state.require_serving(req.model).completions(req, request)

    @router.post("/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await state.require_serving(req.model).chat(req, request)

    @router.get("/models")
    async def models() -> dict[str, Any]:
        serving = state.require_serving(None)
        return {"object": "list", "data": [_model_card(state, serving)]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return _model_card(state, state.require_serving(model_id))

    return router


def _model_card(state: ServerState, serving: OpenAIServing) -> dict[str, Any]:
    return {"id": serving.model_name, "object": "model", "created": state.created, "owned_by": "confkv",
            "max_model_len": serving.max_model_len}


def create_app(state: ServerState, drain_timeout: float | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.control.start()  # gRPC on the shared Unix socket; UNAVAILABLE until the engine attaches
        loader = asyncio.get_running_loop().run_in_executor(None, state.load)
        yield
        state.begin_drain()
        log.info("shutting down: draining the engine")
        await loader  # a load still running finishes first, so the engine thread is stopped cleanly
        if state.engine is not None:
            await state.engine.drain_and_stop(drain_timeout)
        state.control.stop()
        log.info("engine stopped")

    app = FastAPI(title="CONF-KV engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    app.include_router(_openai_router(state))

    @app.get("/health")
    async def health() -> Response:
        healthy = state.load_error is None and (state.engine is None or state.engine.alive or state.draining)
        return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=200 if healthy else 503)

    @app.get("/ready")
    async def ready() -> Response:
        ok, status = state.readiness()
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn with readiness dropped at the signal and a clean exit status after the drain."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.begin_drain()
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal after shutting down; a drained SIGTERM is a clean exit.
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
            captured.remove(sig)


def run_server(config: ConfKVConfig, log_level: str = "info",
               on_loaded: Callable[[str], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit status (1 when the model failed to load)."""
    holder: dict[str, DrainingServer] = {}

    def stop() -> None:
        holder["server"].should_exit = True

    state = ServerState(config, on_load_failed=stop)
    app = create_app(state)
    uv_config = uvicorn.Config(app, host=config.engine.host, port=config.engine.port, log_level=log_level,
                               access_log=log_level == "debug", lifespan="on")
    server = holder["server"] = DrainingServer(uv_config, state)
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
