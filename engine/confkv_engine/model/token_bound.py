"""A lower bound on a text's token count from its length alone, so that a prompt that cannot fit
the context is refused before it is tokenized (a 10 MB prompt costs seconds of tokenizer time).

The bound: if no token of the vocabulary stands for more than ``L`` characters of the input text,
a text of ``n`` characters needs at least ``ceil(n / L)`` tokens. ``L`` is the length of the longest
token string (added tokens included), which is an upper bound on what one token covers when

- the normalizer never shortens text: none, ``Prepend``, ``NFD``/``NFKD`` (decomposition only
  lengthens), ``Lowercase`` (one character to one or more), ``Replace`` of a literal by a text at
  least as long, or a ``Sequence`` of these (``NFC``/``NFKC`` compose, ``Strip`` and the BERT and
  SentencePiece normalizers delete characters: one token could then stand for more than ``L``);
- the pre-tokenizer drops no character: ``ByteLevel`` (one token character per input byte, and a
  character is at least one byte), ``Metaspace`` (a space becomes one '▁'), ``Digits``,
  ``UnicodeScripts``, ``Split``/``Punctuation`` unless their behaviour is ``removed``, or a
  ``Sequence`` of these (``Whitespace`` and BERT's pre-tokenizer drop the spaces between words);
- the model is BPE whose unknown characters cannot fuse into one ``<unk>`` (a fused ``<unk>``
  stands for any run of them; byte fallback with all 256 ``<0xNN>`` tokens never reaches it;
  WordPiece, WordLevel and Unigram map whole words or runs to one unknown token);
- no added token strips the whitespace around it (``lstrip``/``rstrip`` let one token swallow any
  run of spaces), and the tokenizer does not truncate.

A tokenizer outside these rules gets no bound (``None``): its prompts are tokenized and counted
exactly, which is always correct, only slower to refuse. Byte-fallback tokens (``<0x41>``) and
continuing-subword prefixes only make ``L`` larger than what a token covers, so the bound stays a
bound, merely a looser one.
"""

from __future__ import annotations

from typing import Any

_KEEPING_NORMALIZERS = frozenset({"Prepend", "NFD", "NFKD", "Lowercase"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})
_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})


def min_tokens(chars: int, longest_token_chars: int) -> int:
    """The fewest tokens a text of ``chars`` characters can have (``ceil(chars / L)``)."""
    return -(-chars // longest_token_chars)


def longest_token_chars(spec: dict[str, Any]) -> int | None:
    """``L`` for a ``tokenizers`` JSON spec (``Tokenizer.to_str()``), or None when the rules in the
    module docstring do not hold for it."""
    if not (_keeps_length(spec.get("normalizer")) and _drops_nothing(spec.get("pre_tokenizer"))):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not _unknowns_stay_apart(model, vocab):
        return None
    added = spec.get("added_tokens") or []
    if spec.get("truncation") or any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    lengths = [len(token) for token in vocab] + [len(token.get("content", "")) for token in added]
    longest = max(lengths, default=0)
    return longest if longest > 0 else None


def _unknowns_stay_apart(model: dict[str, Any], vocab: dict[str, int]) -> bool:
    if not model.get("fuse_unk") or model.get("unk_token") is None:
        return True
    return bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))


def _keeps_length(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_length(step) for step in normalizer.get("normalizers") or [])
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        literal = pattern.get("String")
        return isinstance(literal, str) and len(normalizer.get("content") or "") >= len(literal)
    return kind in _KEEPING_NORMALIZERS


def _drops_nothing(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_drops_nothing(step) for step in pre_tokenizer.get("pretokenizers") or [])
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return str(pre_tokenizer.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS
