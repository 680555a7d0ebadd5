"""One sequence's output text, released piece by piece as tokens arrive, cut at stop strings.

Two things make the text of a token unsafe to show at once:
- a byte-level BPE token can end inside a UTF-8 character (decoding it alone gives U+FFFD), so
  its text waits for the token that completes the character;
- the text may be the start of a stop string that the next tokens complete; it is held back
  until it cannot be, so a stop string (even one split across tokens) is never shown in part.
"""

from __future__ import annotations

from weights.tokenizer import GPT2Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: GPT2Tokenizer, stop: tuple[str, ...] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        # Text is decoded from `_prefix_offset`; ids before `_read_offset` are already shown.
        self._prefix_offset = 0
        self._read_offset = 0
        self._held = ""
        self.text = ""  # everything released so far
        self.stopped = False  # a stop string was found; nothing more is released

    def add(self, token_id: int) -> str:
        """Take the next token; return the text it makes safe to show (often '' or one word)."""
        self._ids.append(token_id)
        if self.stopped:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character: wait for the bytes that complete it
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(new_text[len(prefix_text) :], final=False)

    def finish(self) -> str:
        """The sequence ended: release what was held (and any incomplete bytes, as U+FFFD)."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        rest = self._decode(self._prefix_offset, len(self._ids))[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(rest, final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True)

    def _release(self, piece: str, final: bool) -> str:
        held = self._held + piece
        cut = self._first_stop(held)
        if cut is not None:
            self.stopped = True
            out, self._held = held[:cut], ""
        else:
            keep = 0 if final else self._partial_stop_suffix(held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += out
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
