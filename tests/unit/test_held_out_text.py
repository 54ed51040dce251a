"""The held-out text builder of the HTTP quality check (``testkit.held_out``): exact, deterministic."""

from __future__ import annotations

import pytest

from testkit import held_out


def test_repeating_window_copies_head_passages_after_fresh_spans() -> None:
    fresh = list(range(1000, 1400))
    w = held_out.repeating_window(fresh, size=256, head=128, span=32)
    assert len(w) == 256 and w[:128] == fresh[:128]
    # head of 4 passages -> copies in order 2, 1, 0, 3, each after 32 fresh tokens
    assert w[128:160] == fresh[128:160] and w[160:192] == fresh[64:96]
    assert w[192:224] == fresh[160:192] and w[224:256] == fresh[32:64]
    assert held_out.unique_tokens(256, 128, 32) == 192


def test_repeating_windows_are_deterministic_disjoint_and_reach_far_back() -> None:
    tokens = list(range(5000))
    a = held_out.repeating_windows(tokens, 3, 1024, 100, 384, 64)
    assert a == held_out.repeating_windows(tokens, 3, 1024, 100, 384, 64)
    assert [len(w) for w in a] == [1024] * 3
    assert not set(a[0]) & set(a[1]) and not set(a[1]) & set(a[2])
    # every copied passage sits at least 190 tokens after its first occurrence; the last copy ~960
    first = {t: i for i, t in reversed(list(enumerate(a[0])))}
    reaches = [i - first[t] for i, t in enumerate(a[0]) if first[t] != i]
    assert min(reaches) >= 190 and max(reaches) >= 900
    assert held_out.passage_order(6) == [4, 3, 2, 1, 0, 5]


def test_bad_shapes_and_short_texts_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of span"):
        held_out.repeating_window(list(range(500)), 256, 100, 32)
    with pytest.raises(ValueError, match="needs"):
        held_out.repeating_window(list(range(50)), 256, 128, 32)
    with pytest.raises(ValueError, match="need 3072 tokens"):
        held_out.prose_windows(list(range(3000)), 2, 1024)
    with pytest.raises(held_out.HeldOutTextMissing, match="not found"):
        held_out.prose_text(held_out.PROSE_PATH.with_name("no-such-licence"))


@pytest.mark.skipif(not held_out.PROSE_PATH.is_file(), reason="Debian's base-files licence text is absent")
def test_prose_is_the_system_licence_text() -> None:
    text = held_out.prose_text()
    assert "GNU GENERAL PUBLIC LICENSE" in text and "Version 3" in text
    assert held_out.text_digest(text) == held_out.text_digest(held_out.prose_text())
