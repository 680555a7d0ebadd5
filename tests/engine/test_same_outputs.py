"""The comparison the batch-comparing engine tests use on CUDA (conftest.first_difference): tokens,
texts and reasons exact, floats within a tolerance, and the place of the first difference named."""

from __future__ import annotations

import math

from service.engine.types import FinishedSequence
from tests.engine.conftest import CUDA_FLOAT_TOLERANCE, first_difference


def test_floats_within_the_tolerance_agree_and_anything_else_is_named():
    out = {"r0": [([5, 7], " a b", [-10.25, -9.5], "length")]}
    nudged = {"r0": [([5, 7], " a b", [-10.25 + 1e-6, -9.5], "length")]}
    assert first_difference(nudged, out, CUDA_FLOAT_TOLERANCE) is None
    assert first_difference({"r0": [([5, 7], " a b", [-10.25, math.nan], "length")]},
                            {"r0": [([5, 7], " a b", [-10.25, math.nan], "length")]}, CUDA_FLOAT_TOLERANCE) is None
    for changed, where in [
        ({"r0": [([5, 8], " a b", [-10.25, -9.5], "length")]}, "['r0'][0][0][1]"),
        ({"r0": [([5, 7], " a c", [-10.25, -9.5], "length")]}, "['r0'][0][1]"),
        ({"r0": [([5, 7], " a b", [-10.25, -9.4], "length")]}, "['r0'][0][2][1]"),
        ({"r0": [([5, 7], " a b", [-10.25, -9.5], "eos_token")]}, "['r0'][0][3]"),
        ({"r0": [([5, 7, 1], " a b", [-10.25, -9.5], "length")]}, "['r0'][0][0]"),
        ({"r1": [([5, 7], " a b", [-10.25, -9.5], "length")]}, ""),
    ]:
        assert first_difference(changed, out, CUDA_FLOAT_TOLERANCE).startswith(f"at {where}:"), changed


def test_dataclasses_are_compared_field_by_field():
    sequence = FinishedSequence(token_ids=[3, 4], text="x", logprobs=[-1.5, -2.0], finish_reason="length")
    close = FinishedSequence(token_ids=[3, 4], text="x", logprobs=[-1.5, -2.0 + 1e-6], finish_reason="length")
    far = FinishedSequence(token_ids=[3, 4], text="x", logprobs=[-1.5, -2.5], finish_reason="length")
    assert first_difference(close, sequence, CUDA_FLOAT_TOLERANCE) is None
    assert first_difference(far, sequence, CUDA_FLOAT_TOLERANCE).startswith("at ['logprobs'][1]:")
