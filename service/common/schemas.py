"""The request field both sides read: every text a request carries (prompts, stop strings, texts
to analyse) is a `Text`."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def _valid_unicode(text: str) -> str:
    """JSON may carry a lone surrogate ("\ud800"): a str to Python, not text to the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text is not valid Unicode: lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
