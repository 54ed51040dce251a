"""Load test of the OpenAI API with locust (``pip install -e '.[bench]'``; not a test dependency).

    confkv serve --model builtin:smollm2-135m --port 8000 &
    locust -f bench/serving/locustfile.py --headless --users 100 --spawn-rate 10 --run-time 2m \\
        --host http://127.0.0.1:8000

Each simulated user alternates streamed chat completions and plain completions with prompts cut
from the standard library's ``pydoc_data.topics`` text. Streamed responses are read to the end and
reported with their time to first token as a separate entry, so locust's table shows both TTFT and
full-response latency. 429 (queue full) counts as a failure: it is what an overloaded server does.
Environment: CONFKV_MODEL (default: the server's first model), CONFKV_MAX_TOKENS (default 64),
CONFKV_API_KEY (bearer token, when the server requires one).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

MAX_TOKENS = int(os.environ.get("CONFKV_MAX_TOKENS", "64"))


def _passages() -> list[str]:
    from pydoc_data.topics import topics

    words = "\n\n".join(topics[k] for k in sorted(topics)).split()
    rng = random.Random(0)
    out = []
    for _ in range(200):
        length = rng.randint(20, 300)  # words, roughly 30-450 tokens
        start = rng.randrange(len(words) - length)
        out.append(" ".join(words[start:start + length]))
    return out


PASSAGES = _passages()


class OpenAIUser(HttpUser):
    wait_time = between(0.5, 2.0)
    model: str | None = os.environ.get("CONFKV_MODEL")

    def on_start(self) -> None:
        key = os.environ.get("CONFKV_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"
        if OpenAIUser.model is None:
            resp = self.client.get("/v1/models", name="/v1/models")
            OpenAIUser.model = resp.json()["data"][0]["id"]

    @task(3)
    def chat_stream(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Summarise this:\n" + random.choice(PASSAGES)}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
        }
        start = time.perf_counter()
        first = None
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="/v1/chat/completions stream") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                delta = json.loads(line[5:])["choices"]
                if first is None and delta and delta[0].get("delta", {}).get("content"):
                    first = time.perf_counter()
            # locust times a streamed request to its headers; report the whole stream instead.
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            resp.success()
        if first is not None:
            events.request.fire(request_type="TTFT", name="chat first token", response_length=0,
                                response_time=(first - start) * 1000, exception=None, context={})

    @task(1)
    def completion(self) -> None:
        body = {"model": self.model, "prompt": random.choice(PASSAGES), "max_tokens": MAX_TOKENS,
                "temperature": 0.7, "seed": random.randrange(1 << 30)}
        with self.client.post("/v1/completions", json=body, catch_response=True,
                              name="/v1/completions") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
            elif not resp.json().get("choices"):
                resp.failure("no choices in the response")
