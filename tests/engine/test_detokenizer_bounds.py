"""The incremental detokenizer's work per token stays bounded however long the output: a run of
tokens that never completes a UTF-8 character goes out as U+FFFD after a few tokens instead of
being decoded again, growing, at every token; stop strings are found across token boundaries."""

from __future__ import annotations

from compiled_engine.tokenization import MAX_WAIT_TOKENS, IncrementalDetokenizer


class ByteTokens:
    """Token 0 is a lone UTF-8 continuation byte (U+FFFD when decoded); others are letters."""

    def __init__(self) -> None:
        self.decoded: list[int] = []  # the length of each decode call's input

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.decoded.append(len(ids))
        return "".join("\ufffd" if t == 0 else chr(ord("a") + t % 26) for t in ids)


def test_invalid_bytes_go_out_after_a_few_tokens_and_each_decode_is_bounded() -> None:
    tok = ByteTokens()
    detok = IncrementalDetokenizer(tok, [5, 6])
    out = "".join(detok.add(0) for _ in range(5000)) + detok.flush()
    assert out == "\ufffd" * 5000 and detok.text == out
    assert max(tok.decoded) <= 2 * MAX_WAIT_TOKENS + 4  # the window, never the whole output


def test_stop_strings_across_tokens_and_valid_text_unchanged() -> None:
    tok = ByteTokens()
    detok = IncrementalDetokenizer(tok, [], stop=("cde",))
    got = [detok.add(t) for t in (0 + 26, 1, 2, 3, 4, 5)]  # a b c d e f
    assert "".join(got) == "ab" and detok.stopped and detok.text == "ab"
