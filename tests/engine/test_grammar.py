"""Constrained decoding in the engine (service/engine/grammar.py): every finished output parses
and validates, constrained and free rows share a batch without touching the free ones' tokens,
seeded requests repeat, and what cannot be combined with a grammar is refused."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest

from service.engine.grammar import Grammars, bitmask_words
from service.http.grammar import JSON_DEFAULTS, MAX_OPTIONAL_PROPERTIES
from tests.engine.conftest import assert_same_outputs, make_request, random_prompt

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
    assert_same_outputs([s.logprobs for s in speculated], [s.logprobs for s in plain])
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
        assert_same_outputs(together[request_id].logprobs, solo.logprobs)
        assert_same_outputs(together[request_id].top_logprobs, solo.top_logprobs)


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
    assert engine.cache.slots_used == 0 and engine.scheduler.waiting.count == 0


def test_grammars_compile_off_the_step_loop(make_engine, monkeypatch):
    """A grammar compiling holds up only its own request: steps go on for the others meanwhile."""
    import threading

    engine = make_engine()
    release = threading.Event()
    free = make_request([4, 5, 6], max_new_tokens=6)
    constrained = make_request([1, 2, 3], max_new_tokens=40, grammar=schema_grammar(SCHEMAS[0]))
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *args, **kwargs: (release.wait(30), real(*args, **kwargs))[1])
    engine.submit([constrained, free])
    done = {}
    for _ in range(8):  # the compile is held: the free request (behind it in the queue) runs to its end
        done.update((f.request_id, f) for f in engine.step().finished)
    assert list(done) == [free.request_id]
    assert engine.scheduler.waiting.count == 1
    release.set()
    deadline = time.monotonic() + 60  # steps with nothing to run are quick: wait in time, not steps
    while engine.has_work() and time.monotonic() < deadline:
        done.update((f.request_id, f) for f in engine.step().finished)
    text = done[constrained.request_id].sequences[0].text
    assert done[constrained.request_id].sequences[0].finish_reason == "eos_token", text
    jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_a_grammar_dropped_from_the_cache_before_admission_compiles_again_off_the_step_loop(make_engine, monkeypatch):
    """More grammars than the cache holds arrive while a request waits for a slot: its compiled
    grammar is dropped before it is admitted. It is compiled again on the worker thread, not on
    the step loop (where a heavy grammar's compile, ~0.1 s, would stall every stream)."""
    import threading

    import service.engine.grammar as grammar_module

    monkeypatch.setattr(grammar_module, "CACHE_SIZE", 1)
    engine = make_engine(max_slots=1)
    built_on = []
    build = Grammars._build
    monkeypatch.setattr(Grammars, "_build", lambda self, grammar: (built_on.append(threading.current_thread()), build(self, grammar))[1])
    first, second = (make_request([1, 2, 3], f"g{i}", max_new_tokens=100, grammar=schema_grammar(schema))
                     for i, schema in enumerate(SCHEMAS[:2]))
    engine.submit([make_request([4, 5, 6], "free", max_new_tokens=8)])  # holds the one slot a while
    engine.step()
    engine.submit([first, second])
    done = {}
    deadline = time.monotonic() + 60
    while engine.has_work() and time.monotonic() < deadline:
        done.update((f.request_id, f) for f in engine.step().finished)
    assert set(done) == {"free", "g0", "g1"}
    for schema, request in zip(SCHEMAS, (first, second)):
        jsonschema.validate(json.loads(done[request.request_id].sequences[0].text), schema)
    assert len(built_on) > 2  # one compiled again: the cache held one grammar at a time
    assert threading.main_thread() not in built_on


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars.for_tokenizer(tokenizer, tokenizer.vocab_size)


def ref_loop(*names: str) -> dict:
    """A schema whose $defs refer to one another in a ring and to nothing else: no finite JSON."""
    defs = {name: {"$ref": f"#/$defs/{names[(i + 1) % len(names)]}"} for i, name in enumerate(names)}
    return {"$ref": f"#/$defs/{names[0]}", "$defs": defs}


def optional_properties(count: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(count)}}


# Grammars that compile in milliseconds and then fail on their first mask or the one after their
# first token (issue 43's reproducers), each with the reason its refusal names.
FAILING_GRAMMARS = {
    "repeated repetition": (llguidance.grammar_from("regex", "(a{1000}){1000}"), "too many expressions"),
    "empty class": (llguidance.grammar_from("regex", r"[^\s\S]"), "matches no text"),
    "$ref a→a": (schema_grammar(ref_loop("a")), "matches no text"),
    "$ref a→b→a": (schema_grammar(ref_loop("a", "b")), "matches no text"),
    "array of itself": (schema_grammar({"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"},
                                                                                "minItems": 1}}}), "Too many items"),
    "2,000 optional properties": (schema_grammar(optional_properties(2000)), "Current row has 8007 items"),
    "Lark repeated repetition": (llguidance.grammar_from("grammar", "start: /(a{1000}){1000}/"), "too many expressions"),
    "only the empty text": (llguidance.grammar_from("regex", "(a){0}"), "only the empty text"),
}


def test_grammars_failing_their_first_masks_are_refused_in_the_core_alone(make_engine):
    """Compiled on the core's worker thread with their first masks (Grammars.prepare/collect):
    each fails alone before it holds a slot, naming why; the request running beside them does
    not notice, and a valid grammar submitted with them still runs."""
    engine = make_engine(max_slots=8)
    running = make_request([4, 5, 6], max_new_tokens=12)
    engine.submit([running])
    engine.step()
    requests = [(make_request([1, 2, 3], max_new_tokens=16, grammar=grammar), reason) for grammar, reason in FAILING_GRAMMARS.values()]
    engine.submit([request for request, _ in requests])
    hostile = {request.request_id: reason for request, reason in requests}
    valid = make_request([7, 8], max_new_tokens=40, grammar=schema_grammar(SCHEMAS[0]))
    engine.submit([valid])
    failed, finished = {}, {}
    deadline = time.monotonic() + 120  # the compiles run off the step loop: wait in time, not steps
    while engine.has_work() and time.monotonic() < deadline:
        output = engine.step()
        failed.update((f.request_id, f.message) for f in output.failed)
        finished.update((f.request_id, f.sequences[0]) for f in output.finished)
    assert set(failed) == set(hostile), failed
    for request_id, reason in hostile.items():
        assert reason in failed[request_id], (reason, failed[request_id])
    assert finished[running.request_id].finish_reason == "length"
    assert finished[running.request_id].token_ids == make_engine().generate([running])[0].sequences[0].token_ids
    assert finished[valid.request_id].finish_reason == "eos_token"
    jsonschema.validate(json.loads(finished[valid.request_id].text), SCHEMAS[0])
    assert engine.cache.slots_used == 0 and engine.scheduler.waiting.count == 0


@pytest.mark.parametrize("name", list(FAILING_GRAMMARS))
def test_compile_refuses_what_fails_its_first_masks(grammars, name):
    grammar, reason = FAILING_GRAMMARS[name]
    with pytest.raises(ValueError, match=re.escape(reason)):
        grammars.compile(grammar)
    assert not grammars.cached(grammar)


def test_the_row_limit_ends_an_ambiguous_grammar_instead_of_slowing_every_mask(grammars, tokenizer):
    """An ambiguous grammar's Earley rows grow with its text, and a mask's work with their square:
    under llguidance's default row limit (2,000) its masks reach seconds before any limit, under
    ours (LIMITS) the matcher fails within a few hundred tokens, which fails its request alone."""
    matcher = grammars.matcher(llguidance.grammar_from("grammar", 'start: s\ns: s s | "a"'))
    bitmask = np.empty(bitmask_words(grammars.vocab_size), dtype=np.int32)
    [a] = tokenizer.encode("a")
    for consumed in range(400):
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        if matcher.is_error() or not matcher.consume_token(a):
            break
    assert matcher.is_error() and "max is 500" in matcher.get_error(), consumed


def test_an_object_of_optional_properties_runs_up_to_the_row_limit(grammars):
    grammars.compile(schema_grammar(optional_properties(MAX_OPTIONAL_PROPERTIES)))
    with pytest.raises(ValueError, match="Current row has"):
        grammars.compile(schema_grammar(optional_properties(MAX_OPTIONAL_PROPERTIES + 1)))
