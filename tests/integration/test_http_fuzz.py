"""Schemathesis fuzzing of a real ``confkv serve`` through its own OpenAPI document.

Cases are generated from ``/openapi.json`` for every operation, half valid per the schema and half
deliberately invalid (schemathesis' negative mode), and sent to the running server. Every answer
must be below 500 and one of the status codes (and content types) the document lists, with error
bodies matching the documented ``ErrorResponse``. Meanwhile a prober times ``/health``, which must
never stall; afterwards the server is healthy and its greedy output is what it was before.

The run is bounded (``CONFKV_FUZZ_EXAMPLES`` cases, default sized to fit about two minutes on two
cores) and deterministic (hypothesis derandomized, so CI sees the same cases every run); set the
variable higher for a longer local run. The server runs with a 64-token context so that a valid
case generates at most a few dozen tokens.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from engine_server import EngineServer, running_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.timeout(900)

API_KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("CONFKV_FUZZ_EXAMPLES", "1200"))
HEALTH_BOUND_S = 1.0  # far inside the liveness probe's 5 s timeout
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    workdir = tmp_path_factory.mktemp("fuzz")
    with running_server(workdir, "--max-model-len", "64", "--grpc-socket", str(workdir / "control.sock"),
                        api_key=API_KEY) as srv:
        yield srv


def greedy_text(server: EngineServer) -> str:
    resp = httpx.post(f"{server.url}/v1/completions", json=GREEDY, headers=server.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


class HealthProber:
    """Times GET /health every 50 ms on its own thread until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.failures = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.wait(0.05):
                start = time.monotonic()
                ok = client.get(f"{self.url}/health").status_code == 200
                self.worst = max(self.worst, time.monotonic() - start)
                self.failures += not ok

    def __enter__(self) -> HealthProber:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_fuzzed_requests_never_get_a_server_error(server: EngineServer) -> None:
    before = greedy_text(server)
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                      schema.as_strategy(GenerationMode.NEGATIVE))
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def send(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.url, headers=server.headers, timeout=120)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS, headers=server.headers)

    with HealthProber(server.url) as prober:
        send()
    print(f"fuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}, "
          f"worst /health {prober.worst * 1000:.0f} ms")
    assert not any(code >= 500 for code in statuses), statuses
    assert statuses[200] > 0 and sum(n for code, n in statuses.items() if 400 <= code < 500) > 0, statuses
    assert prober.failures == 0 and prober.worst < HEALTH_BOUND_S, (prober.failures, prober.worst)
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    assert greedy_text(server) == before
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def test_the_fuzzed_document_is_the_servers_own(server: EngineServer) -> None:
    """The cases above come from what the server publishes, not from a copy that could drift."""
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    operations = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/health")} <= operations
    assert json.dumps(document).count('"422"') == 0
