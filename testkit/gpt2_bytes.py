"""GPT-2's byte <-> printable character table (byte-level BPE vocabularies spell bytes with it): the
sampling tests build byte tokenizers from it, and the structured-output benchmark maps a vocabulary
back to bytes with it."""

from __future__ import annotations


def gpt2_byte_map() -> dict[int, str]:
    """Byte value -> the character GPT-2's byte-level BPE writes it as."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}
