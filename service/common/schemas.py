"""The request fields both sides read: every text a request carries (prompts, stop strings, texts
to analyse) is a `Text`; token ids sent to the analysis process are `TokenId`s."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field


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
# Checked against the vocabulary where the model is (the analysis process); bounded here so what
# crosses the process boundary fits its 64-bit integers (a larger one failed the encoding: 500).
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
