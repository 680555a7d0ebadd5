"""bench/host_mix.py: the mix's spec and how it spreads features over requests (the runs
themselves are test_smoke.py's)."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
import torch
from tokenizers import Tokenizer

from bench.host_mix import FEATURES, Assigner, parse_mix, small_tokenizer_json
from service.engine.grammar import Grammars
from service.http.grammar import regex_grammar
from weights.tokenizer import GPT2Tokenizer


def test_parse_mix_takes_all_names_and_shares():
    assert parse_mix("all") == FEATURES
    assert parse_mix("grammar,beam") == {"grammar": Fraction(1, 16), "beam": Fraction(1, 64)}
    assert parse_mix("grammar=1/8, lora=0.25") == {"grammar": Fraction(1, 8), "lora": Fraction(1, 4)}


@pytest.mark.parametrize("spec, message", [
    ("beams=1/16", "unknown feature 'beams'"),
    ("grammar=x", "not a share"),
    ("grammar=0", "above 0"),
    ("grammar=3/4,beam=1/2", "add up to 1.25"),
    ("", "names no feature"),
])
def test_parse_mix_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mix(spec)


def test_assigner_gives_each_feature_its_share_one_feature_per_request():
    assigner = Assigner(dict(FEATURES))
    counts = Counter(assigner.next() for _ in range(64 * 16))
    # Within one of its share (the credit each feature starts with).
    assert all(abs(counts[name] - share * 64 * 16) <= 1 for name, share in FEATURES.items()), counts
    assert counts[None] == 64 * 16 - sum(counts[name] for name in FEATURES)
    # Every credit starts full: the first requests show every feature at once.
    first = Assigner(dict(FEATURES))
    assert [first.next() for _ in FEATURES] == list(FEATURES)


def test_small_tokenizer_encodes_any_text_below_its_eos(tokenizer):
    text = small_tokenizer_json(tokenizer.to_json(), 300)
    small = GPT2Tokenizer(Tokenizer.from_str(text))
    assert small.eos_token_id == 299 and small.vocab_size == 300
    ids = small.encode('{"name": "Zoë", "age": 36}')
    assert ids and max(ids) < 299 and small.decode(ids) == '{"name": "Zoë", "age": 36}'
    # llguidance builds its tokenizer from it; a grammar's mask covers the 300 ids and allows
    # exactly the tokens that start its text.
    grammars = Grammars(lambda: text, 300, 299)
    rows, banned, errors = grammars.banned([grammars.matcher(regex_grammar("ab", "regex"))], torch.device("cpu"))
    assert rows == [0]
    allowed = (~banned[0]).nonzero()[:, 0].tolist()
    assert banned.shape == (1, 300) and not errors
    assert allowed and all(small.decode([token]) in ("a", "ab") for token in allowed), [small.decode([t]) for t in allowed]
