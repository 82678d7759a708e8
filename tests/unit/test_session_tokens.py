"""Token continuity keeps a session's exact tokens when its history is unchanged."""

from __future__ import annotations

from orchestrator.kv.session_tokens import SessionTokens


def chars(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character."""
    return [ord(c) for c in text]


def test_continues_the_generated_tokens_when_the_text_extends_the_last_turn() -> None:
    st = SessionTokens(ttl_s=100)
    # Turn 1: "ab" tokenized from scratch; the model answered with two tokens 900, 901
    # whose text is "XY" (as a real tokenizer would not spell it).
    first = st.encode("s", "ab", full=chars, suffix=chars, now_s=0)
    assert first == [97, 98]
    st.remember("s", "ab" + "XY", [*first, 900, 901], now_s=1)
    # Turn 2 extends the text: the model's own tokens are kept, the suffix is tokenized.
    assert st.encode("s", "abXYcd", full=chars, suffix=chars, now_s=2) == [
        97,
        98,
        900,
        901,
        99,
        100,
    ]


def test_rewritten_history_stale_entries_and_other_sessions_tokenize_from_scratch() -> None:
    st = SessionTokens(ttl_s=100)
    st.remember("s", "abXY", [1, 2, 900, 901], now_s=0)
    assert st.encode("s", "aXXYcd", full=chars, suffix=chars, now_s=1) == chars("aXXYcd")
    assert st.encode("s", "abXY", full=chars, suffix=chars, now_s=1) == chars("abXY")  # no suffix
    assert st.encode("t", "abXYcd", full=chars, suffix=chars, now_s=1) == chars("abXYcd")
    assert st.encode(None, "abXYcd", full=chars, suffix=chars, now_s=1) == chars("abXYcd")
    assert st.encode("s", "abXYcd", full=chars, suffix=chars, now_s=101) == chars("abXYcd")


def test_bounded_oldest_first() -> None:
    st = SessionTokens(max_sessions=2)
    for i, sid in enumerate("abc"):
        st.remember(sid, "x", [i], now_s=i)
    assert len(st) == 2
    assert st.encode("a", "xy", full=chars, suffix=chars, now_s=3) == chars("xy")  # dropped
    assert st.encode("c", "xy", full=chars, suffix=chars, now_s=3) == [2, ord("y")]
    st.forget("c")
    assert st.encode("c", "xy", full=chars, suffix=chars, now_s=3) == chars("xy")


def test_token_id_turns_are_remembered_for_draining_but_never_continued_as_text() -> None:
    st = SessionTokens()
    st.remember("s", None, [5, 6, 7], now_s=0)
    assert list(st.token_ids("s") or []) == [5, 6, 7]
    assert st.encode("s", "anything", full=chars, suffix=chars, now_s=1) == chars("anything")
