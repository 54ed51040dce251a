"""SentencePiece ('llama') GGUF vocabularies: our rebuild against transformers' own GGUF conversion on
a synthetic vocabulary, plus llama.cpp's space prefix after special tokens and byte fallback."""

from __future__ import annotations

import numpy as np
import pytest

from confkv_engine.model.tokenizer import Tokenizer

PIECES = [
    "▁", "▁t", "he", "▁the", "in", "▁in", "ing", "▁a", "th", "▁th", "er", "▁b", "at", "▁bat", "▁bath",
    "ath", "▁thing", "hi", "ng", "▁there", "re", "ere", "ll", "▁he", "llo", "▁hello", "▁▁", "▁two",
    "tw", "wo", "▁s", "pa", "ce", "▁spa", "▁space",
]  # fmt: skip
SAMPLES = ["the thing in a bath", "hello there", "Zebra! at 9", "naïve 日本", "  two  spaces", "a\nb"]


@pytest.fixture(scope="module")
def metadata() -> dict:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + letters + PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * (len(letters) + len(PIECES))
    rng = np.random.default_rng(0)
    scores = [0.0] * 259 + [float(s) for s in -rng.permutation(len(letters) + len(PIECES)) * 1.5]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def reference(metadata):
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    tokenizer_dict = {
        "tokenizer_type": "llama",
        "tokens": metadata["tokenizer.ggml.tokens"],
        "scores": metadata["tokenizer.ggml.scores"],
        "token_type": metadata["tokenizer.ggml.token_type"],
    }
    backend, _ = mapping.convert_gguf_tokenizer("llama", tokenizer_dict)
    return backend


@pytest.mark.parametrize("text", SAMPLES)
def test_matches_transformers_gguf_conversion(tok, reference, text):
    ours = tok.encode(text)
    # llama.cpp (like sentencepiece) always prefixes one space; transformers' Metaspace skips it when
    # the text already starts with one, so give the reference the prefixed text.
    assert ours == reference.encode(" " + text, add_special_tokens=False).ids
    assert tok.decode(ours) == text


def test_byte_fallback_and_specials(tok):
    ids = tok.encode("Z")  # not in the vocabulary: "▁" then the byte token
    assert [tok.backend.id_to_token(i) for i in ids] == ["▁", "<0x5A>"]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.add_bos_token is True
    assert tok.encode("hi", add_bos=True)[0] == 1
    # llama.cpp prefixes a space to every run of text, also right after a special token
    the = tok.backend.token_to_id("▁the")
    assert tok.encode("<s>the") == [1, the]
    assert tok.encode("the</s>the") == [the, 2, the]
    assert tok.decode([1, the, 2]) == "the"
    assert [tok.id_to_token(i) for i in tok.encode("the thing")] == [" the", " thing"]
