"""The embedded SmolLM2 tokenizer rebuilt from GGUF metadata, checked token for token against an
independent pure-Python implementation of llama.cpp's ``smollm`` byte-level BPE."""

from __future__ import annotations

import pytest

from confkv_engine.model.gguf_reader import read_gguf
from confkv_engine.model.loader import builtin_path
from confkv_engine.model.tokenizer import ChatTemplateError, Tokenizer

regex = pytest.importorskip("regex")  # comes with transformers (test extra)

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: every digit alone first, then the GPT-2 regex.
DIGIT = r"\p{N}"
GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SAMPLES = [
    "Hello world",
    "12345 and 3.14159, 2024-11-30",
    "x    42 items\nTotal:\n    100\n",  # spaces before digits: where splitting digits first matters
    "  multiple   spaces\n\n\ttabs and trailing   ",
    "naïve café — 日本語 🙂 Ünïcödé",
    "def f(x):\n    return x**2  # it's squared\n",
    "<|im_start|>user\nWhat is 7*6?<|im_end|>\n",
    "I'm sure they'll say we've done it",
]


def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ReferenceBPE:
    def __init__(self, metadata: dict) -> None:
        tokens = metadata["tokenizer.ggml.tokens"]
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(metadata["tokenizer.ggml.merges"])}
        kinds = metadata["tokenizer.ggml.token_type"]
        self.specials = [t for t, k in zip(tokens, kinds, strict=True) if k == 3]
        self.byte_map = _bytes_to_unicode()

    def _bpe(self, word: str) -> list[int]:
        parts = [self.byte_map[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            pairs = [
                (self.ranks.get((a, b), 1 << 30), i)
                for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
            ]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return [self.vocab[p] for p in parts]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        special_re = "(" + "|".join(regex.escape(s) for s in self.specials) + ")"
        for part in regex.split(special_re, text):
            if part in self.specials:
                ids.append(self.vocab[part])
                continue
            for chunk in regex.split(f"({DIGIT})", part):
                for word in regex.findall(GPT2, chunk):
                    ids += self._bpe(word)
        return ids


@pytest.fixture(scope="module")
def metadata() -> dict:
    return read_gguf(builtin_path("smollm2-135m")).metadata


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.mark.parametrize("text", SAMPLES)
def test_matches_reference_bpe_token_for_token(tok, metadata, text):
    assert tok.encode(text) == ReferenceBPE(metadata).encode(text)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("year 2024")
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces[-4:] == ["2", "0", "2", "4"]
    assert all(len(tok.id_to_token(i)) == 1 for i in tok.encode("9876543210"))


def test_special_ids(tok):
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_ids == (2,) and tok.eos_token == "<|im_end|>"
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= tok.special_ids
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, *tok.encode("hi"), 2]) == "hi"  # specials skipped by default
    assert tok.encode("hi", add_bos=True)[0] == 1
    assert tok.add_bos_token is False


def test_id_to_token_is_the_text_alone(tok):
    ids = tok.encode(" Paris is")
    assert [tok.id_to_token(i) for i in ids] == [" Paris", " is"]
    assert tok.id_to_token(2) == "<|im_end|>"


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_gen = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not no_gen.endswith("<|im_start|>assistant\n")
    own_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "x"}]
    )
    assert own_system.startswith("<|im_start|>system\nBe terse.<|im_end|>")


def test_chat_template_errors_are_chat_template_errors(metadata):
    strict = {**metadata, "tokenizer.chat_template": "{{ raise_exception('roles must alternate') }}"}
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer.from_gguf_metadata(strict).apply_chat_template([{"role": "user", "content": "x"}])
    none = {k: v for k, v in metadata.items() if k != "tokenizer.chat_template"}
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_gguf_metadata(none).apply_chat_template([{"role": "user", "content": "x"}])
