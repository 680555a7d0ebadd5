"""A step's grammar masks (Grammars.banned) on every device: the CPU unpacks the bitmask with
numpy, any other device unpacks the packed words itself (service/engine/grammar.py). Both must
take any number of constrained rows, none included: with overlap, a constrained sequence that
ended while its step's draw waited for the read of the step before leaves that draw with no
constrained row (StepSampler.launch). The meta device runs the device path's shapes on a CPU."""

from __future__ import annotations

import pytest
import torch

from service.engine.grammar import Grammars

REGEX = '%llguidance {}\nstart: /[a-z]{2,6}( [a-z]{2,6}){0,3}/'


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars.for_tokenizer(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize("constrained", [0, 1, 3])
def test_masks_are_the_cpus_on_every_device(grammars, device, constrained):
    # Constrained rows between free ones (None: no grammar), or free rows alone.
    matchers = [None] + [row for _ in range(constrained) for row in (grammars.matcher(REGEX), None)]
    rows, on_cpu, errors = grammars.banned(matchers, torch.device("cpu"))
    assert rows == list(range(1, 2 * constrained, 2)) and not errors
    assert on_cpu.shape == (constrained, grammars.vocab_size)
    if constrained:
        assert 0 < int((~on_cpu).sum()) < grammars.vocab_size  # some tokens allowed, not all
    for other in {torch.device("meta"), device} - {torch.device("cpu")}:
        rows_there, banned, errors = grammars.banned(matchers, other)
        assert rows_there == rows and not errors
        assert banned.shape == on_cpu.shape and banned.dtype == torch.bool and banned.device.type == other.type
        if other.type != "meta":
            assert torch.equal(banned.cpu(), on_cpu)
