"""One sequence's output text, released piece by piece as tokens arrive, cut at stop strings.

Two things make the text of a token unsafe to show at once:
- a byte-level BPE token can end inside a UTF-8 character (decoding it alone gives U+FFFD), so
  its text waits for the token that completes the character: the tokenizer's incremental
  decoder (`tokenizers.decoders.DecodeStream`, weights/tokenizer.py) does that, one Rust call
  per token;
- the text may be the start of a stop string that the next tokens complete; it is held back
  until it cannot be, so a stop string (even one split across tokens) is never shown in part.
"""

from __future__ import annotations

from weights.tokenizer import GPT2Tokenizer


class TextStream:
    def __init__(self, tokenizer: GPT2Tokenizer, stop: tuple[str, ...] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._step = tokenizer.stream_decoder()
        self._stop = stop
        self._unreleased: list[int] = []  # ids the decoder has taken without releasing their text
        self._held = ""
        self._pieces: list[str] = []  # everything released so far
        self.stopped = False  # a stop string was found; nothing more is released

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Take the next token; return the text it makes safe to show (often '' or one word)."""
        if self.stopped:
            return ""
        piece = self._step(token_id)
        if piece is None:
            self._unreleased.append(token_id)  # an incomplete character: wait for its bytes
            return ""
        self._unreleased.clear()
        return self._release(piece, final=False)

    def finish(self) -> str:
        """The sequence ended: release what was held (and any incomplete bytes, as U+FFFD)."""
        if self.stopped:
            return ""
        # The released text ends on a whole character, so the rest decodes on its own as it
        # would at the end of decoding every token.
        rest = self._tokenizer.decode(self._unreleased, skip_special_tokens=True)
        self._unreleased.clear()
        return self._release(rest, final=True)

    def _release(self, piece: str, final: bool) -> str:
        if not self._stop:
            self._pieces.append(piece)
            return piece
        held = self._held + piece
        cut = self._first_stop(held)
        if cut is not None:
            self.stopped = True
            out, self._held = held[:cut], ""
        else:
            keep = 0 if final else self._partial_stop_suffix(held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self._pieces.append(out)
        return out

    def _first_stop(self, text: str) -> int | None:
        """Index where the earliest stop string starts in text, or None."""
        found = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest end of text that some stop string starts with."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
