"""Constrained decoding in the engine (service/engine/grammar.py): every finished output parses
and validates, constrained and free rows share a batch without touching the free ones' tokens,
seeded requests repeat, and what cannot be combined with a grammar is refused."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from service.http.grammar import JSON_DEFAULTS
from tests.engine.conftest import make_request, random_prompt, run_until_idle

import llguidance

# Every value bounded (enums, bounded integers and strings, short arrays), so that even an
# untrained model finishes each one within max_new_tokens: a test of validity, not of length.
SCHEMAS = [
    {"type": "object", "properties": {"label": {"enum": ["yes", "no", "maybe"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["label", "score"], "additionalProperties": False},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "kind": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"}]},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"], "additionalProperties": False},
    }, "required": ["name", "tags", "active", "kind", "inner"], "additionalProperties": False},
]
REGEX = r"(cat|dog)-[0-9]{2}"
SAMPLED = dict(do_sample=True, temperature=1.3)


def schema_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_output_parses_and_validates(make_engine, schema):
    engine = make_engine(max_slots=8)
    requests = [make_request(random_prompt(3 + i % 7, seed=i), max_new_tokens=100, grammar=schema_grammar(schema),
                             seed=i, **(SAMPLED if i % 4 else {})) for i in range(16)]
    for finished in engine.generate(requests):
        sequence = finished.sequences[0]
        assert sequence.finish_reason == "eos_token", sequence.text
        jsonschema.validate(json.loads(sequence.text), schema)


def test_regex_outputs_match_whole(make_engine):
    requests = [make_request(random_prompt(4, seed=i), max_new_tokens=20, grammar=llguidance.grammar_from("regex", REGEX),
                             seed=i, **SAMPLED) for i in range(8)]
    texts = [f.sequences[0].text for f in make_engine().generate(requests)]
    assert all(re.fullmatch(REGEX, text) for text in texts), texts
    assert len(set(texts)) > 1  # sampled within the grammar, not one forced string


def test_speculation_drafts_within_the_grammar_and_keeps_the_tokens(make_engine, tokenizer):
    """Drafts of a constrained row are cut where the grammar refuses a token, and each verified
    position is masked as the grammar stands after the draft tokens before it: the tokens are the
    ones decoding without speculation gives, and drafts did stand."""
    from service.engine.ngram_drafter import NgramSettings

    regex = r"(cat|dog)( (cat|dog)){8,30}\."
    prompt = tokenizer.encode(" cat dog cat dog cat dog cat dog cat dog")
    requests = lambda: [make_request(prompt, max_new_tokens=40, grammar=llguidance.grammar_from("regex", regex), seed=i,
                                     **(SAMPLED if i % 2 else {})) for i in range(6)]
    plain = [f.sequences[0] for f in make_engine(max_slots=8).generate(requests())]
    engine = make_engine(max_slots=8, speculative=NgramSettings(min_n=1, max_n=3, tokens=4, weight_pass_rows=float("inf")))
    engine.submit(batch := requests())
    drafted = accepted = 0
    done = {}
    while engine.has_work():
        output = engine.step()
        drafted, accepted = drafted + output.stats.draft_tokens, accepted + output.stats.accepted_tokens
        done.update((f.request_id, f.sequences[0]) for f in output.finished)
    speculated = [done[r.request_id] for r in batch]
    assert [s.token_ids for s in speculated] == [s.token_ids for s in plain]
    assert [s.logprobs for s in speculated] == [s.logprobs for s in plain]
    assert all(re.fullmatch(regex, s.text) for s in speculated if s.finish_reason == "eos_token"), [s.text for s in speculated]
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_free_rows_beside_constrained_ones_keep_their_tokens(make_engine):
    free = [make_request(random_prompt(6, seed=50 + i), max_new_tokens=15, seed=i, top_logprobs=2,
                         **(SAMPLED if i % 2 else {})) for i in range(3)]
    alone = {r.request_id: make_engine().generate([r])[0].sequences[0] for r in free}
    constrained = [make_request(random_prompt(5, seed=70 + i), max_new_tokens=60, grammar=schema_grammar(SCHEMAS[i % 2]),
                                seed=i, **SAMPLED) for i in range(3)]
    mixed = make_engine(max_slots=8).generate([r for pair in zip(free, constrained) for r in pair])
    together = {f.request_id: f.sequences[0] for f in mixed}
    for request_id, solo in alone.items():
        assert together[request_id].token_ids == solo.token_ids
        assert together[request_id].logprobs == solo.logprobs
        assert together[request_id].top_logprobs == solo.top_logprobs


def test_seeded_constrained_requests_repeat_and_logprobs_are_the_constrained_ones(make_engine):
    grammar = schema_grammar(SCHEMAS[1])
    first, again = (make_engine().generate([make_request(random_prompt(5, seed=1), max_new_tokens=80, grammar=grammar,
                                                         seed=99, top_logprobs=3, **SAMPLED)])[0].sequences[0]
                    for _ in range(2))
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    # The alternatives come from the masked distribution: all of them are tokens the grammar
    # allowed there, so after `{"` (forced) every alternative continues a property name.
    assert all(lp <= 0.0 for lp in first.logprobs)
    # Where the grammar allows one token (`{"`, a property's name), the constrained distribution
    # gives it probability 1: log-prob 0, which the raw model's logits never give.
    assert 0.0 in first.logprobs
    assert all(alt[0][1] >= alt[-1][1] for alt in first.top_logprobs)


def test_max_new_tokens_ends_a_row_mid_structure(make_engine):
    [finished] = make_engine().generate([make_request(random_prompt(4, seed=3), max_new_tokens=3,
                                                      grammar=schema_grammar(SCHEMAS[1]))])
    assert finished.sequences[0].finish_reason == "length"
    assert finished.sequences[0].text.startswith('{"')


@pytest.mark.parametrize("extra, named", [
    (dict(num_beams=2), "beam search"),
    (dict(ignore_eos=True), "ignore_eos"),
    (dict(min_new_tokens=3), "min_new_tokens"),
    (dict(bad_words_ids=((5,),)), "bad_words_ids"),
])
def test_what_a_grammar_cannot_be_combined_with_is_refused(make_engine, extra, named):
    request = make_request([1, 2, 3], max_new_tokens=5, grammar=schema_grammar(SCHEMAS[0]), **extra)
    with pytest.raises(ValueError, match=named):
        make_engine().submit([request])


def test_a_grammar_that_does_not_compile_is_refused_alone(make_engine):
    engine = make_engine()
    running = make_request([4, 5, 6], max_new_tokens=4)
    engine.submit([running])
    engine.step()
    bad = make_request([1, 2, 3], max_new_tokens=5, grammar=llguidance.grammar_from("regex", "(unclosed"))
    engine.submit([bad])
    failed, finished = [], []
    while engine.has_work():
        output = engine.step()
        failed += output.failed
        finished += output.finished
    assert [f.request_id for f in failed] == [bad.request_id] and "does not compile" in failed[0].message
    # The request already running is not disturbed, and nothing is left holding a slot.
    assert [f.request_id for f in finished] == [running.request_id] and finished[0].sequences[0].finish_reason == "length"
    assert engine.cache.slots_used == 0 and engine.scheduler.waiting_count == 0


def test_grammars_compile_off_the_step_loop(make_engine, monkeypatch):
    """A grammar compiling holds up only its own request: steps go on for the others meanwhile."""
    import threading

    engine = make_engine()
    release = threading.Event()
    free = make_request([4, 5, 6], max_new_tokens=6)
    constrained = make_request([1, 2, 3], max_new_tokens=40, grammar=schema_grammar(SCHEMAS[0]))
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *args: (release.wait(30), real(*args))[1])
    engine.submit([constrained, free])
    done = {}
    for _ in range(8):  # the compile is held: the free request (behind it in the queue) runs to its end
        done.update((f.request_id, f) for f in engine.step().finished)
    assert list(done) == [free.request_id]
    assert engine.scheduler.waiting_count == 1
    release.set()
    deadline = time.monotonic() + 60  # steps with nothing to run are quick: wait in time, not steps
    while engine.has_work() and time.monotonic() < deadline:
        done.update((f.request_id, f) for f in engine.step().finished)
    text = done[constrained.request_id].sequences[0].text
    assert done[constrained.request_id].sequences[0].finish_reason == "eos_token", text
    jsonschema.validate(json.loads(text), SCHEMAS[0])
