"""The GPT-2 byte-level BPE tokenizer, through Hugging Face `tokenizers`.

A model folder holds `tokenizer.json`, or `vocab.json` + `merges.txt` (GPT-2's original pair).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_TEXT = "<|endoftext|>"


class GPT2Tokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        eos = tokenizer.token_to_id(EOS_TEXT)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS_TEXT} token")
        self.eos_token_id = eos
        self.special_ids = frozenset({eos})  # GPT-2's one special token
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what llguidance reads, service/engine/grammar.py)."""
        return self._tok.to_str()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "GPT2Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if path.exists():
            try:
                tokenizer = Tokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises a bare Exception for any unreadable file
                raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from None
            return cls(tokenizer)
        vocab, merges = model_dir / "vocab.json", model_dir / "merges.txt"
        if vocab.exists() and merges.exists():
            return cls(build_tokenizer(vocab, merges))
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json, nor vocab.json with merges.txt")

    # Through encode_batch even for one text: `tokenizers` releases the GIL there and not in
    # encode, which holds it for the whole text (~0.9 s for 1 MB), freezing every other thread
    # (the server's event loop included) however the call is scheduled.

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in `text`."""
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self) -> Callable[[int], str | None]:
        """A function fed one token id at a time, returning the text it completes, or None while
        the text so far ends inside a UTF-8 character (or the token adds no text, as a special
        token). The tokenizer's own incremental decoder, in Rust: one call per token."""
        return partial(decoders.DecodeStream(skip_special_tokens=True).step, self._tok)

    def token_str(self, token_id: int) -> str:
        """The token as the vocabulary spells it (byte-level: "Ġthe" for " the")."""
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids


def build_tokenizer(vocab_file: Path, merges_file: Path) -> Tokenizer:
    """GPT-2's tokenizer from its two original files, as transformers builds it."""
    # Not GPT2TokenizerFast(vocab_file=..., merges_file=...): transformers 5 silently builds an
    # empty tokenizer from those arguments.
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab_file), str(merges_file)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TEXT])
    return tokenizer
