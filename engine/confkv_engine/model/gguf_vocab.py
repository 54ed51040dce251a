"""``tokenizers`` backends equivalent to llama.cpp's tokenizers, built from GGUF vocabulary metadata.

- ``gpt2``: byte-level BPE; the vocabulary is already in GPT-2's byte alphabet and merges are "a b"
  strings. The pre-tokenizer follows ``tokenizer.ggml.pre`` (SmolLM2's ``smollm`` splits every digit
  on its own before the GPT-2 regex).
- ``llama``: SentencePiece BPE (Llama 2, Mistral, TinyLlama files): no merges, a score per token; a
  pair merges in order of the merged token's score, unknown bytes fall back to ``<0xNN>`` tokens, and
  a space is prefixed to every run of text (at the start and after each special token), as llama.cpp
  does, with spaces written as U+2581.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from confkv_engine.model.weights import ModelLoadError

log = logging.getLogger(__name__)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp sets ignore_merges for these (a whole-word vocabulary hit wins over the merge order).
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"


def _token_kinds(tokens: Sequence[str], token_types: Sequence[int]) -> list[int]:
    kinds = list(token_types) or [_NORMAL] * len(tokens)  # all normal when the file has no token types
    if len(kinds) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer has {len(tokens)} tokens but {len(kinds)} token types")
    return kinds


def _add_special_tokens(backend: HFTokenizer, tokens: Sequence[str], kinds: Sequence[int]) -> None:
    """Control tokens (and the unknown token) become special; user-defined ones are matched whole."""
    pairs = list(zip(tokens, kinds, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k in (_CONTROL, _UNKNOWN)]
    )
    backend.add_tokens([AddedToken(t, normalized=False) for t, k in pairs if k == _USER_DEFINED])


def build_byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str
) -> HFTokenizer:
    """A ``tokenizers`` byte-level BPE equivalent to llama.cpp's for this vocabulary and ``pre`` type."""
    kinds = _token_kinds(tokens, token_types)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(
        vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES
    )
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, [k if k != _UNKNOWN else _NORMAL for k in kinds])
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in ("default", "gpt2", "gpt-2"):
        log.warning(
            "GGUF pre-tokenizer %r not known; using the GPT-2 regex (tokens may differ slightly)", pre
        )
    return byte_level_regex


def spm_merges(tokens: Sequence[str], scores: Sequence[float], kinds: Sequence[int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a normal token into two vocabulary
    pieces, best-scoring merged token first (ties: shorter left piece, then vocabulary order)."""
    vocab = {t: i for i, t in enumerate(tokens) if kinds[i] in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], len(left), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    *,
    add_space_prefix: bool = True,
) -> HFTokenizer:
    kinds = _token_kinds(tokens, token_types)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = next((t for t, k in zip(tokens, kinds, strict=True) if k == _UNKNOWN), None)
    bpe = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, kinds),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = HFTokenizer(bpe)
    steps = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    _add_special_tokens(backend, tokens, kinds)
    return backend
