"""Fixtures of the weights tests: a tiny corpus for micro training runs."""

from __future__ import annotations

import numpy as np
import pytest

TEXT = (
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
    "Rough winds do shake the darling buds of May, And summer's lease hath all too short a date. "
) * 12
HELD = "Thou art more lovely than a summer's day, and the buds of May are darling. Zounds, quoth he."


@pytest.fixture(scope="session")
def streams(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) token streams, each starting with <|endoftext|> as weights.train's."""
    eos = tokenizer.eos_token_id
    return np.array([eos, *tokenizer.encode(TEXT)]), np.array([eos, *tokenizer.encode(HELD)])
