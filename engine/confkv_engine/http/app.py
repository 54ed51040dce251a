"""FastAPI app of the engine: OpenAI routes, probes, metrics, errors and auth.

The app knows the server only through ``ServedState`` (what the routes read, and the start-up /
shutdown hooks its lifespan calls); the composition root ``confkv_engine.server`` implements it,
loading the model and wiring the control plane, so this room never imports ``control``.

Every error a client can cause is a 4xx in OpenAI's error body, whatever raised it: FastAPI's own
body-parse failures (not UTF-8, nested too deep for the JSON parser, an integer too long to
convert), unknown routes and methods, and the body limit (``limits``). Error bodies are ASCII JSON,
so quoting a client's invalid text back (a model name with a lone surrogate) cannot fail. The
OpenAPI document lists the codes the routes really answer: 400 for validation (never FastAPI's
default 422), 401, 404, 413, 429 and 503.

No redirects: a path with a trailing slash (``/v1/completions/``) is an unknown path (404 in the
OpenAI format), never a 307 built from the client's ``Host`` header. With an API key set, only the
probes and the scrape (``/health``, ``/ready``, ``/metrics``) are open; ``/openapi.json`` needs the
key like the API it describes (there is no ``/docs`` page).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from confkv_api.config import ConfKVConfig
from confkv_engine.core.async_engine import EngineUnavailable, QueueFull
from confkv_engine.core.sampling_params import InvalidRequest
from confkv_engine.http import tokenization
from confkv_engine.http.body import LargeBodyOffLoopRoute, render_json
from confkv_engine.http.drain import DrainMiddleware, RequestTracker
from confkv_engine.http.limits import RequestBodyLimit
from confkv_engine.http.metrics import EngineMetrics
from confkv_engine.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    error_body,
)
from confkv_engine.http.serving import GenerationFailed, OpenAIServing

log = logging.getLogger("confkv.server")


class ServedState(Protocol):
    """What the routes and the lifespan need from the server."""

    config: ConfKVConfig
    metrics: EngineMetrics
    created: int
    requests: RequestTracker

    async def startup(self) -> None: ...
    async def shutdown(self) -> None: ...
    def healthy(self) -> bool: ...
    def readiness(self) -> tuple[bool, str]: ...
    def require_serving(self, model: str | None) -> OpenAIServing: ...


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


class _ErrorJSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return _ErrorJSON(error_body(message, type_, param, code), status_code=status, headers=headers)


def _unparsable_body(cause: BaseException) -> str:
    """Why FastAPI's JSON parser gave up on a body (it raises a bare 400 from the cause)."""
    if isinstance(cause, UnicodeDecodeError):
        return "The request body is not valid UTF-8, so it is not JSON."
    if isinstance(cause, RecursionError):
        return "The JSON body is nested too deeply to parse."
    if "integer string conversion" in str(cause):  # CPython's digit limit (4300 digits)
        return "The JSON body holds an integer literal too long to parse."
    return "We could not parse the JSON body of your request."


_WHEN = {
    400: "Invalid request: malformed JSON, a bad or unsupported value, an unknown field, or a "
         "prompt over the context (OpenAI error body; `code` says which)",
    401: "engine.apiKey is set and the bearer token is missing or wrong",
    404: "Unknown model",
    413: "The request body is larger than engine.maxRequestBytes",
    429: "The waiting queue (engine.maxWaiting) is full",
    500: "The engine failed the request",
    503: "The model is still loading, or the server is shutting down",
}


def _documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": _WHEN[code]} for code in codes}


# With ``stream: true`` the 200 is server-sent events. The schema describes one event (SSE
# validators check each event against it): ``data`` is a JSON chunk, or ``[DONE]`` last.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_STREAMABLE: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion, or with stream=true its server-sent events",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


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
    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 400 and err.__cause__ is not None:  # FastAPI could not parse the body
            return _error(400, _unparsable_body(err.__cause__), "invalid_request_error", code="invalid_json")
        type_ = "invalid_request_error" if err.status_code < 500 else "server_error"
        return _error(err.status_code, f"{err.detail} ({request.method} {request.url.path})", type_,
                      headers=err.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        # Starlette re-raises after this answer, so the traceback is still logged.
        return _error(500, "The server had an error while processing your request.", "server_error",
                      code="internal_error")

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
        elif first.get("type") == "finite_number":  # NaN/Infinity: not "less than or equal to 2"
            msg, code = f"{param or 'body'}: must be a finite number", "invalid_value"
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


def _openai_router(state: ServedState) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth_dependency(state.config.engine.api_key))],
                       responses=_documented(400, 401, 404, 413, 429, 500, 503),
                       route_class=LargeBodyOffLoopRoute)

    @router.post("/completions", responses=_STREAMABLE)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await state.require_serving(req.model).completions(req, request)

    @router.post("/chat/completions", responses=_STREAMABLE)
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await state.require_serving(req.model).chat(req, request)

    @router.get("/models")
    async def models() -> dict[str, Any]:
        serving = state.require_serving(None)
        cards = [_model_card(state, serving, name) for name in serving.served_names]
        return {"object": "list", "data": cards}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return _model_card(state, state.require_serving(model_id), model_id)

    return router


def _tokenizer_router(state: ServedState) -> APIRouter:
    """vLLM's tokenizer endpoints (outside /v1, as vLLM serves them; behind the same API key)."""
    router = APIRouter(dependencies=[Depends(_auth_dependency(state.config.engine.api_key))],
                       responses=_documented(400, 401, 404, 413, 500, 503), route_class=LargeBodyOffLoopRoute)

    @router.post("/tokenize", response_model=dict[str, Any])  # the same schema as before, rendered here
    async def tokenize(body: dict[str, Any] = Body(...)) -> Response:  # noqa: B008 - FastAPI's idiom
        req = tokenization.tokenize_request(body)
        serving = state.require_serving(req.model)
        # Off the event loop, as the generation routes tokenize: a megabyte prompt takes seconds,
        # and its answer is megabytes of ids (vLLM returns them whatever their count).
        return await run_in_threadpool(lambda: render_json(tokenization.tokenize(serving, req)))

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await run_in_threadpool(tokenization.detokenize, state.require_serving(req.model), req)

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenization.tokenizer_info(state.require_serving(None))

    return router


def _model_card(state: ServedState, serving: OpenAIServing, name: str) -> dict[str, Any]:
    """One model card per served name, as vLLM lists its --served-model-name aliases."""
    return {"id": name, "object": "model", "created": state.created, "owned_by": "confkv",
            "root": state.config.model.source, "parent": None, "max_model_len": serving.max_model_len}


def create_app(state: ServedState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.startup()
        yield
        await state.shutdown()

    app = FastAPI(title="CONF-KV engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    _install_error_handlers(app)
    app.add_middleware(RequestBodyLimit, max_bytes=state.config.engine.max_request_bytes)
    app.add_middleware(DrainMiddleware, tracker=state.requests)  # outermost: counts every request
    app.include_router(_openai_router(state))
    app.include_router(_tokenizer_router(state))
    app.openapi = lambda: _openapi_document(app)  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False,
             dependencies=[Depends(_auth_dependency(state.config.engine.api_key))])
    async def openapi() -> Response:
        return JSONResponse(app.openapi())

    @app.get("/health", responses={503: {"description": "The engine thread has stopped"}})
    async def health() -> Response:
        healthy = state.healthy()
        return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=200 if healthy else 503)

    @app.get("/ready", responses={503: {"description": _WHEN[503]}})
    async def ready() -> Response:
        ok, status = state.readiness()
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)  # documented as text, as it is
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without its default 422: validation errors here are 400s."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = doc
    return app.openapi_schema
