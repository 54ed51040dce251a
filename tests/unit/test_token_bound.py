"""The lower bound on a prompt's token count from its length (``model.token_bound``): it holds on the
embedded SmolLM2 vocabulary and on a SentencePiece one, it is tight on text made of the longest
token, and every tokenizer feature that could break it turns it off (each with a text that shows
the naive bound would be wrong). ``Tokenizer.encode_within`` counts exactly."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from confkv_engine.model import gguf_loader, loader
from confkv_engine.model.gguf_vocab import build_spm_bpe
from confkv_engine.model.token_bound import longest_token_chars, min_tokens
from confkv_engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    metadata = gguf_loader.open_gguf(loader.builtin_path("smollm2-135m")).metadata
    return Tokenizer.from_gguf_metadata(metadata)


def _texts(tok: Tokenizer) -> list[str]:
    rng = random.Random(7)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    pieces = ["hello world ", " ", "\n", "\t", "1234567890", "ünïcödé ", "日本語のテキスト", "🙂",
              "<|im_start|>", "def f(x):\n    return x\n", tok.backend.decode([vocab[longest]])]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 400))) for _ in range(60)]
    code_points = [c for c in range(32, 0x2FFFF) if not 0xD800 <= c < 0xE000]  # no lone surrogates
    texts += ["".join(chr(rng.choice(code_points)) for _ in range(500)) for _ in range(5)]
    return texts


def _assert_bound_holds(tok: Tokenizer, texts: list[str]) -> None:
    longest = tok.longest_token_chars
    assert longest is not None
    for text in texts:
        count = len(tok.encode(text))
        assert count >= min_tokens(len(text), longest), (text[:80], count, longest)


def test_the_smollm2_bound_is_its_longest_token_and_holds(smollm: Tokenizer) -> None:
    vocab = smollm.backend.get_vocab(with_added_tokens=True)
    assert smollm.longest_token_chars == max(len(token) for token in vocab)
    _assert_bound_holds(smollm, _texts(smollm))


def test_the_bound_is_tight_on_the_longest_token(smollm: Tokenizer) -> None:
    vocab = smollm.backend.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    text = smollm.backend.decode([vocab[longest]]) * 50
    assert len(text) == 50 * len(longest)  # one byte-level character per byte: all ASCII here
    assert len(smollm.encode(text)) == min_tokens(len(text), len(longest)) == 50


def test_a_sentencepiece_vocabulary_with_byte_fallback_is_bounded() -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["\u2581", "\u2581the", "\u2581cat", "he", "the", "\u2581c", "at", "t", "h", "e", "c", "a"]
    types = [2, 3, 3] + [6] * 256 + [1] * 12
    backend = build_spm_bpe(tokens, [0.0] * len(tokens), types)
    tok = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=None)
    assert tok.longest_token_chars == max(len(t) for t in tokens)
    _assert_bound_holds(tok, ["the cat", " the  the cat ", "zz", "日本", "the" * 30, " " * 40])


def _bpe(vocab: list[str], **options: object) -> HFTokenizer:
    return HFTokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, [], **options))


def _spec(backend: HFTokenizer) -> dict:
    return json.loads(backend.to_str())


LETTERS = ["a", "b", " "]  # one character per token: the naive bound is the length itself


def _whitespace_split() -> HFTokenizer:
    backend = _bpe(LETTERS)
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return backend


def _shrinking_replace() -> HFTokenizer:
    backend = _bpe(LETTERS)
    backend.normalizer = normalizers.Replace("  ", " ")
    return backend


def _composing_normalizer() -> HFTokenizer:
    backend = _bpe([*LETTERS, "\u00e9"])
    backend.normalizer = normalizers.NFC()
    return backend


def _removing_split() -> HFTokenizer:
    backend = _bpe(LETTERS)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(" +"), behavior="removed")
    return backend


def _fused_unknowns() -> HFTokenizer:
    return _bpe([*LETTERS, "<unk>"], unk_token="<unk>", fuse_unk=True)


def _stripping_added_token() -> HFTokenizer:
    backend = _bpe(LETTERS)
    backend.add_special_tokens([AddedToken("<m>", lstrip=True, rstrip=True)])
    return backend


@pytest.mark.parametrize(("build", "text"), [
    (_whitespace_split, "a" + " " * 30 + "b"),
    (_shrinking_replace, "a" + " " * 30 + "b"),
    (_composing_normalizer, "e\u0301" * 30),
    (_removing_split, "a" + " " * 30 + "b"),
    (_fused_unknowns, "z" * 30),
    (_stripping_added_token, "a" + " " * 30 + "<m>" + " " * 30 + "b"),
])
def test_a_tokenizer_that_could_break_the_bound_gets_none(build: Callable[[], HFTokenizer],
                                                          text: str) -> None:
    backend = build()
    naive = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    # The naive bound really is wrong for this tokenizer...
    assert len(backend.encode(text, add_special_tokens=False).ids) < min_tokens(len(text), naive)
    # ...so none is given.
    assert longest_token_chars(_spec(backend)) is None


def test_a_truncating_tokenizer_gets_none() -> None:
    backend = _bpe(LETTERS)
    assert longest_token_chars(_spec(backend)) == 1
    backend.enable_truncation(8)
    assert longest_token_chars(_spec(backend)) is None


def test_encode_within_counts_exactly_and_keeps_the_ids(smollm: Tokenizer) -> None:
    text = "The capital of France is Paris. " * 40
    ids = smollm.encode(text)
    assert smollm.encode_within(text, len(ids)) == (len(ids), ids)
    assert smollm.encode_within(text, len(ids) - 1) == (len(ids), None)
    assert 0 < smollm.fewest_tokens(text) <= len(ids)


def test_encode_gives_the_ids_of_the_offset_tracking_encoder(smollm: Tokenizer) -> None:
    for text in _texts(smollm):
        assert smollm.encode(text) == smollm.backend.encode_batch([text], add_special_tokens=False)[0].ids
