"""service/http/outputs.py TextStream: released text against the tokenizer's own decode of all tokens.

Reference: decode(all tokens), cut where the stop string starts. The stream releases text in
pieces; their concatenation must equal the reference, and no piece may hold text that the
reference does not (that is what "never emit a partial stop string" means for a client).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from service.http.outputs import TextStream


def run(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream, int]:
    """Feed ids until the stream stops; return the released pieces and how many ids were used."""
    stream = TextStream(tokenizer, stop)
    pieces = []
    used = 0
    for token in ids:
        pieces.append(stream.add(token))
        used += 1
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream, used


def released_prefixes(pieces: list[str]) -> list[str]:
    out, text = [], ""
    for piece in pieces:
        text += piece
        out.append(text)
    return out


def test_without_stop_strings_pieces_concatenate_to_decode(tokenizer):
    text = "Hello world! Ünïcödé — 東京 and emoji 😀🎉 end."
    ids = tokenizer.encode(text)
    pieces, stream, _ = run(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text == stream.text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_a_character_split_over_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    stream = TextStream(tokenizer)
    assert [stream.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.add(ids[-1]) == "😀"


def test_incomplete_bytes_at_the_end_are_released_as_decode_shows_them(tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]
    pieces, _, _ = run(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)


@pytest.mark.parametrize(
    "text, stop",
    [
        ("The cat sat on the mat. The dog", " on the"),  # spans whole tokens
        ("The cat sat on the mat. The dog", "at on t"),  # starts and ends inside tokens
        ("The cat sat on the mat. The dog", "mat."),
        ("The cat sat on the mat. The dog", "The"),  # at the very start
        ("Hello 😀 world", "😀 w"),  # inside a multi-token character
        ("aaaaab", "aab"),  # overlapping partial matches
    ],
)
def test_stop_string_cuts_text_and_is_never_released_in_part(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    expected = full[: full.index(stop)]
    pieces, stream, used = run(tokenizer, ids, (stop,))
    assert stream.stopped
    assert "".join(pieces) == expected
    for released in released_prefixes(pieces):
        assert expected.startswith(released)
    # It stopped on the token that completed the stop string, not later.
    assert stop in tokenizer.decode(ids[:used]) and stop not in tokenizer.decode(ids[: used - 1])


def test_held_back_text_is_released_when_the_stop_string_does_not_complete(tokenizer):
    ids = tokenizer.encode("we want wax")
    stream = TextStream(tokenizer, ("wanted",))
    pieces = [stream.add(t) for t in ids]
    assert "want" not in "".join(pieces[:2])  # " want" could become " wanted": held
    assert "".join(pieces) + stream.finish() == "we want wax"
    assert not stream.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three four")
    pieces, stream, _ = run(tokenizer, ids, ("four", "two"))
    assert "".join(pieces) == "one "


def test_random_token_streams_with_a_stop_string_from_their_text(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size - 1) for _ in range(rng.randint(2, 12))]
        full = tokenizer.decode(ids)
        if len(full) < 3:
            continue
        start = rng.randrange(len(full) - 1)
        stop = full[start : start + rng.randint(1, 6)]
        expected = full[: full.index(stop)]
        pieces, stream, _ = run(tokenizer, ids, (stop,))
        assert "".join(pieces) == expected, (ids, stop)
        for released in released_prefixes(pieces):
            assert expected.startswith(released), (ids, stop)


def byte_tokens(default_model_dir, text: str) -> list[int]:
    """text as GPT-2's single-byte tokens: every multi-byte character split across tokens."""
    vocab = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [vocab.token_to_id(char) for piece, _ in byte_level.pre_tokenize_str(text) for char in piece]


TRICKY = "Ünïcödé — 東京 😀🎉 é"


def test_characters_split_into_single_bytes_come_out_whole(tokenizer, default_model_dir):
    ids = byte_tokens(default_model_dir, TRICKY)
    assert len(ids) == len(TRICKY.encode())
    pieces, stream, _ = run(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == TRICKY == stream.text
    released = [p for p in pieces if p]
    assert len(released) == len(TRICKY)  # one character per completing byte, never half of one
    assert all("\ufffd" not in p for p in pieces)


def test_random_byte_tokens_match_a_full_decode_at_every_step(tokenizer):
    """Invalid and truncated UTF-8 included: what is released after each token is a prefix of
    the full decode of the tokens so far, and everything adds up to the full decode."""
    rng = random.Random(1)  # GPT-2's first 256 ids are its single-byte tokens
    for _ in range(300):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 10))]
        full = tokenizer.decode(ids)
        stream = TextStream(tokenizer)
        released = ""
        for used, token in enumerate(ids, 1):
            released += stream.add(token)
            assert full.startswith(released), ids
            assert tokenizer.decode(ids[:used]).startswith(released), ids
        assert released + stream.finish() == full, ids


@pytest.mark.parametrize("stop", ["京 😀", "😀🎉", "é —", "\U0001f389 é"])
def test_stop_strings_over_split_characters(tokenizer, default_model_dir, stop):
    ids = byte_tokens(default_model_dir, TRICKY)
    expected = TRICKY[: TRICKY.index(stop)]
    pieces, stream, used = run(tokenizer, ids, (stop,))
    assert stream.stopped and "".join(pieces) == expected == stream.text
    for released in released_prefixes(pieces):
        assert expected.startswith(released)
    assert stop in tokenizer.decode(ids[:used]) and stop not in tokenizer.decode(ids[: used - 1])


def test_special_tokens_add_no_text(tokenizer):
    ids = tokenizer.encode("one two")
    pieces, stream, _ = run(tokenizer, [ids[0], tokenizer.eos_token_id, *ids[1:], tokenizer.eos_token_id])
    assert "".join(pieces) == "one two" == stream.text


def test_empty_stop_string_is_refused(tokenizer):
    with pytest.raises(ValueError, match="empty"):
        TextStream(tokenizer, ("",))
