"""Schemathesis fuzzing of a real ``confkv serve`` through its own OpenAPI document.

Cases are generated from ``/openapi.json`` (fetched with the API key, which it needs) for every
operation, half valid per the schema and half deliberately invalid (schemathesis' negative mode),
and sent to the running server. Every answer must be below 500 and one of the status codes (and
content types) the document lists, with error bodies matching the documented ``ErrorResponse``, and
every invalid request must be refused (``negative_data_rejection``, schemathesis' ST201: a string,
boolean or float accepted for an integer field is one). Failures are counted per schemathesis code
and printed with an example, then asserted to be none. Meanwhile a prober times ``/health``, which
must never stall; afterwards the server is healthy and its greedy output is what it was before.

Random cases seldom hit one mistyped field alone, so the schemathesis command line's coverage phase
runs too: it derives cases systematically from each schema (every property given each wrong JSON
type, every bound crossed), which is how a lax integer field shows up as ST201.

The run is bounded (``CONFKV_FUZZ_EXAMPLES`` cases, default sized to fit about two minutes on two
cores) and deterministic (hypothesis derandomized, so CI sees the same cases every run); set the
variable higher for a longer local run. The server runs with a 64-token context so that a valid
case generates at most a few dozen tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from engine_server import EngineServer, running_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.timeout(900)

API_KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("CONFKV_FUZZ_EXAMPLES", "1200"))
HEALTH_BOUND_S = 1.0  # far inside the liveness probe's 5 s timeout
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


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
    document = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                      schema.as_strategy(GenerationMode.NEGATIVE))
    statuses: Counter[int] = Counter()
    failures: Counter[str] = Counter()
    examples: dict[str, str] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def send(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.url, headers=server.headers, timeout=120)
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=server.headers)
        except FailureGroup as group:  # counted, not raised: the run reports every kind it finds
            for failure in group.exceptions:
                failures[failure.code] += 1
                examples.setdefault(failure.code, f"{failure.title}: {case.method} {case.path} "
                                    f"body={str(case.body)[:300]} -> {response.status_code}")

    with HealthProber(server.url) as prober:
        send()
    print(f"fuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}, "
          f"failures {dict(sorted(failures.items()))} (ST201: {failures['ST201']}), "
          f"worst /health {prober.worst * 1000:.0f} ms")
    for code, example in sorted(examples.items()):
        print(f"  {code} e.g. {example}")
    assert not failures, (dict(failures), examples)
    assert not any(code >= 500 for code in statuses), statuses
    assert statuses[200] > 0 and sum(n for code, n in statuses.items() if 400 <= code < 500) > 0, statuses
    assert prober.failures == 0 and prober.worst < HEALTH_BOUND_S, (prober.failures, prober.worst)
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    assert greedy_text(server) == before
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def test_the_fuzzed_document_is_the_servers_own(server: EngineServer) -> None:
    """The cases above come from what the server publishes, not from a copy that could drift."""
    document = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30).json()
    operations = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/health")} <= operations
    assert json.dumps(document).count('"422"') == 0


def test_coverage_phase_finds_no_accepted_schema_violation(server: EngineServer, tmp_path: Path) -> None:
    """schemathesis' own runner, coverage phase, with the checks above (ST201 among them)."""
    document = tmp_path / "openapi.json"
    document.write_text(httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30).text)
    checks = ",".join(check.__name__ for check in CHECKS)
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", str(document), "--url", server.url,
               "-H", f"Authorization: Bearer {API_KEY}", "--phases", "coverage", "-c", checks,
               "--workers", "1", "--no-color", "--generation-deterministic"]
    with HealthProber(server.url) as prober:
        run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    found = dict(re.findall(r"(ST\d{3}) [^:\n]*: (\d+)", run.stdout))
    generated = re.search(r"(\d+) generated", run.stdout)
    print(f"coverage phase: {generated.group(1) if generated else '?'} cases, failures {found} "
          f"(ST201: {found.get('ST201', 0)}), worst /health {prober.worst * 1000:.0f} ms")
    assert run.returncode == 0 and not found, run.stdout[-6000:] + run.stderr[-2000:]
    assert generated is not None and int(generated.group(1)) > 100, run.stdout[-2000:]
    assert prober.failures == 0 and prober.worst < HEALTH_BOUND_S, (prober.failures, prober.worst)
