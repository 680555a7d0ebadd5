"""Only the request at fault fails: non-finite logits, a grammar that fails, an adapter that
misbehaves or a beam search that raises end that request alone, with its own error, while every
other request of the same steps gets exactly the tokens it gets without it."""

from __future__ import annotations

import itertools
import math

import llguidance
import pytest
import torch

from model.linear import Conv1D
from service.engine import faults
from service.engine import scheduler as scheduler_module
from service.engine.faults import NonfiniteInjection
from service.engine.ngram_drafter import NgramSettings
from tests.engine.conftest import assert_same_outputs, make_request, random_prompt
from tests.model.test_lora import PEFT_CONFIGS, peft_adapter

HOSTILE_SEED = 424242
REGEX = '%llguidance {}\nstart: /[a-z]{2,6}( [a-z]{2,6}){0,3}/'


def bystanders() -> list:
    """Plain neighbours of every kind: greedy, sampled with warpers, several sequences,
    alternatives, beams, a grammar, a penalty."""
    specs = [
        dict(max_new_tokens=12),
        dict(max_new_tokens=10, do_sample=True, seed=3, top_k=40, top_p=0.9),
        dict(max_new_tokens=8, do_sample=True, seed=4, num_return_sequences=2),
        dict(max_new_tokens=9, top_logprobs=3),
        dict(max_new_tokens=6, num_beams=3, num_return_sequences=2),
        dict(max_new_tokens=10, grammar=REGEX, do_sample=True, seed=6),
        dict(max_new_tokens=11, repetition_penalty=1.3, do_sample=True, seed=7, typical_p=0.9),
    ]
    return [make_request(random_prompt(4 + 3 * i, seed=i), f"bystander-{i}", **params) for i, params in enumerate(specs)]


def outcome(finished) -> list:
    return [(s.token_ids, s.logprobs, s.finish_reason, s.score) for s in finished.sequences]


def run(engine, requests, limit: int = 500, texts: dict | None = None) -> tuple[dict, dict]:
    """Every finished and failed request, by id, once the engine is idle; `texts`: each finished
    request's sequences' texts go there too."""
    engine.submit(requests)
    finished, failed = {}, {}
    for _ in range(limit):
        if not engine.has_work():
            return finished, failed
        out = engine.step()
        finished.update((f.request_id, outcome(f)) for f in out.finished)
        if texts is not None:
            texts.update((f.request_id, [s.text for s in f.sequences]) for f in out.finished)
        failed.update((f.request_id, f) for f in out.failed)
    raise AssertionError("engine still busy")


@pytest.fixture
def alone(make_engine):
    """The bystanders' outcomes without any hostile request beside them."""
    finished, failed = run(make_engine(), bystanders())
    assert not failed
    return finished


@pytest.mark.parametrize("value, after", [("nan", 0), ("inf", 3), ("-inf", 2)])
@pytest.mark.parametrize("overlap", [False, True])
def test_nonfinite_logits_fail_their_request_alone(make_engine, monkeypatch, alone, value, after, overlap):
    monkeypatch.setenv(faults.INJECT_ENV, f"seed={HOSTILE_SEED},after={after},value={value}")
    engine = make_engine(overlap=overlap)
    hostile = [make_request(random_prompt(7, seed=99), "hostile", max_new_tokens=12, do_sample=True, seed=HOSTILE_SEED,
                            num_return_sequences=2),
               make_request(random_prompt(5, seed=98), "hostile-greedy", max_new_tokens=12, seed=HOSTILE_SEED)]
    finished, failed = run(engine, bystanders() + hostile)
    assert sorted(failed) == ["hostile", "hostile-greedy"]
    for failure in failed.values():
        assert (failure.status, failure.error_type, failure.cause) == (424, "generation", "nonfinite_logits")
        assert f"not finite (NaN or inf) at generated token {after + 1}" in failure.message
    assert_same_outputs(finished, alone)  # every neighbour's tokens, log-probs and finish reasons as without them
    assert not engine.scheduler.running and engine.cache.slots_used == 0
    assert torch.isfinite(engine.cache.kv).all()  # nothing non-finite left for the next occupant
    # The same prompt again (no injection for this seed): computed afresh, as alone.
    again = make_request(random_prompt(7, seed=99), "again", max_new_tokens=6, do_sample=True, seed=1)
    finished_again, failed_again = run(engine, [again])
    fresh, _ = run(make_engine(), [make_request(random_prompt(7, seed=99), "again", max_new_tokens=6, do_sample=True, seed=1)])
    assert not failed_again and finished_again == fresh


@pytest.mark.parametrize("when", ["before it starts", "while it decodes", "as it verifies a draft"])
def test_an_adapter_that_turns_non_finite_at_run_time_fails_only_its_requests(make_engine, tiny_model_dir, tmp_path,
                                                                          alone, monkeypatch, when):
    """Its requests' prompts fail, or their decode steps, or (with n-gram speculation: their prompts
    repeat themselves) a step in which one verifies a draft, its rows read on their own. The
    bystanders' tokens stay the ones they get alone, without speculation (its promise)."""
    folder = peft_adapter(tmp_path / "poisoned", tiny_model_dir, seed=0, **PEFT_CONFIGS["all-modules"])
    speculative = NgramSettings(min_n=1, max_n=3, tokens=4, weight_pass_rows=float("inf")) if "draft" in when else None
    engine = make_engine(speculative=speculative)
    engine.core.adapters.load("poisoned", str(folder))
    lora = engine.core.adapters.set
    index = lora.index("poisoned")
    poisoned = []

    def poison() -> None:  # loaded as valid, its resident weights broken afterwards
        for module in engine.core.model.modules():
            delta = lora.delta(index, module) if isinstance(module, Conv1D) else None
            if delta is not None:
                delta.b_t.fill_(math.nan)
        poisoned.append(True)

    if when == "before it starts":
        poison()
    elif when == "while it decodes":  # before the fourth step: its prompts and two tokens each done
        step, calls = engine.step, itertools.count()

        def stepping():
            if next(calls) == 3:
                poison()
            return step()
        monkeypatch.setattr(engine, "step", stepping)
    else:  # in the plan that gives one of its sequences a draft, before that step's forwards
        propose = scheduler_module.propose

        def proposing(*args, **kwargs):
            drafted = propose(*args, **kwargs)
            if not poisoned and any(seq.adapter == index for seq in drafted):
                poison()
            return drafted
        monkeypatch.setattr(scheduler_module, "propose", proposing)
    hostile = [make_request(random_prompt(3, seed=50) * 4, "greedy-on-it", max_new_tokens=24),
               make_request(random_prompt(3, seed=51) * 4, "sampled-on-it", max_new_tokens=24, do_sample=True, seed=2)]
    for request in hostile:
        request.adapter = "poisoned"
    finished, failed = run(engine, hostile + bystanders())  # admitted first: they run from the first step
    assert poisoned
    assert sorted(failed) == ["greedy-on-it", "sampled-on-it"]
    assert all(f.cause == "nonfinite_logits" and f.status == 424 for f in failed.values())
    assert_same_outputs(finished, alone)
    assert torch.isfinite(engine.cache.kv).all()  # its NaN keys and values scrubbed from the slots it held


class BreakingMatcher:
    """A real llguidance matcher that enters an error state at its n-th mask or n-th token, as
    llguidance does when a grammar exceeds its limits mid-generation."""

    def __init__(self, inner: llguidance.LLMatcher, mask_at: int | None = None, token_at: int | None = None,
                 raises: bool = False) -> None:
        """`raises`: at its n-th token it raises instead (llguidance raises only when misused)."""
        self.inner, self.mask_at, self.token_at, self.raises = inner, mask_at, token_at, raises
        self.masks = self.tokens = 0
        self.error = ""

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        self.masks += 1
        if self.masks == self.mask_at:
            self.error = "injected: too many items in a row"
        self.inner.unsafe_compute_mask_ptr(pointer, size)

    def consume_token(self, token: int) -> bool:
        self.tokens += 1
        if self.tokens == self.token_at:
            if self.raises:
                raise RuntimeError("injected: the matcher raised")
            self.error = "injected: token not accepted"
            return False
        return self.inner.consume_token(token)

    def is_error(self) -> bool:
        return bool(self.error) or self.inner.is_error()

    def is_stopped(self) -> bool:  # llguidance's stopped includes its error state
        return self.is_error() or self.inner.is_stopped()

    def get_error(self) -> str:
        return self.error or self.inner.get_error()


@pytest.mark.parametrize("where", [dict(mask_at=1), dict(mask_at=4), dict(token_at=3), dict(token_at=3, raises=True)])
def test_a_grammar_failing_mid_generation_is_an_error_not_an_ending(make_engine, monkeypatch, alone, where):
    engine = make_engine()
    hostile_grammar = '%llguidance {}\nstart: /[a-z]{3,9}( [a-z]{2,6}){0,5}/'
    real = engine.core.grammars.matcher
    monkeypatch.setattr(engine.core.grammars, "matcher",
                        lambda grammar: BreakingMatcher(real(grammar), **where) if grammar == hostile_grammar else real(grammar))
    hostile = make_request(random_prompt(5, seed=70), "hostile", max_new_tokens=12, grammar=hostile_grammar)
    finished, failed = run(engine, bystanders() + [hostile])
    assert list(failed) == ["hostile"]
    failure = failed["hostile"]
    assert (failure.status, failure.error_type, failure.cause) == (422, "validation", "grammar")
    assert failure.message.startswith("the grammar failed during generation: ") and "injected" in failure.message
    assert_same_outputs(finished, alone)


def test_a_grammar_llguidance_cannot_mask_fails_alone(make_engine, alone):
    """Compiles (as the HTTP side's check sees it), then fails on its first mask: refused at
    admission or failed at its first step, either way an error of its own."""
    hostile = make_request(random_prompt(5, seed=71), "hostile", max_new_tokens=8,
                           grammar=llguidance.grammar_from("regex", "(a{1000}){1000}"))
    finished, failed = run(make_engine(), bystanders() + [hostile])
    assert list(failed) == ["hostile"] and failed["hostile"].cause == "grammar" and failed["hostile"].status == 422
    assert_same_outputs(finished, alone)


def test_a_grammar_whose_compile_raises_fails_only_its_requests(make_engine, monkeypatch, alone):
    """The compile on the worker thread raises something other than llguidance's refusal (a
    ValueError): only the requests of that grammar are refused."""
    engine = make_engine()
    hostile_grammar = REGEX.replace("2,6", "3,7")
    build = engine.core.grammars._build

    def building(grammar):
        if grammar == hostile_grammar:
            raise RuntimeError("injected compile failure")
        return build(grammar)
    monkeypatch.setattr(engine.core.grammars, "_build", building)
    hostile = [make_request(random_prompt(5, seed=72 + i), f"hostile-{i}", max_new_tokens=8, grammar=hostile_grammar)
               for i in range(2)]
    finished, failed = run(engine, bystanders() + hostile)
    assert sorted(failed) == ["hostile-0", "hostile-1"]
    assert all(f.cause == "grammar" and "injected compile failure" in f.message for f in failed.values())
    assert_same_outputs(finished, alone)


def test_a_beam_search_that_raises_fails_alone(make_engine, monkeypatch, alone):
    from model.beam import BeamSearch

    advance = BeamSearch.advance

    def breaking(self, *candidates):
        if self.params.num_beams == 4:  # the hostile request's width; the bystander's is 3
            raise RuntimeError("injected beam failure")
        return advance(self, *candidates)

    monkeypatch.setattr(BeamSearch, "advance", breaking)
    hostile = make_request(random_prompt(6, seed=80), "hostile", max_new_tokens=6, num_beams=4)
    finished, failed = run(make_engine(), bystanders() + [hostile])
    assert list(failed) == ["hostile"] and failed["hostile"].cause == "beam_search"
    assert "injected beam failure" in failed["hostile"].message
    assert_same_outputs(finished, alone)


@pytest.mark.parametrize("part", ["beam search", "grammar matcher", "blocks"])
def test_a_request_that_fails_to_start_fails_alone(make_engine, monkeypatch, alone, part):
    """Starting an admitted request (its beam search, its grammar's matcher, its prompt's blocks)
    raises: that request fails with an error of its own, nothing of it stays behind (rows,
    blocks, its id), and the requests beside it run as they do without it."""
    import service.engine.admission as admission_module

    engine = make_engine()
    scheduler = engine.core.scheduler
    hostile = make_request(random_prompt(6, seed=83), "hostile", max_new_tokens=6,
                           **{"beam search": dict(num_beams=4), "grammar matcher": dict(grammar=REGEX.replace("2,6", "1,5"))}.get(part, {}))

    def breaking(real, hostile_when):
        def call(*args, **kwargs):
            if hostile_when(*args):
                raise RuntimeError(f"injected {part} failure")
            return real(*args, **kwargs)
        return call

    if part == "beam search":
        monkeypatch.setattr(admission_module, "start_beam_search",
                            breaking(admission_module.start_beam_search, lambda params, *_: params.num_beams == 4))
    elif part == "grammar matcher":
        monkeypatch.setattr(engine.core.grammars, "matcher",
                            breaking(engine.core.grammars.matcher, lambda grammar: grammar == hostile.params.grammar))
    else:
        monkeypatch.setattr(scheduler.room, "place",
                            breaking(scheduler.room.place, lambda state, *_: state.request is hostile))
    free_blocks = engine.cache.blocks_free
    finished, failed = run(engine, bystanders() + [hostile])
    assert list(failed) == ["hostile"]
    failure = failed["hostile"]
    assert (failure.status, failure.error_type, failure.cause) == (500, "generation", "start")
    assert f"injected {part} failure" in failure.message
    assert_same_outputs(finished, alone)
    assert engine.cache.slots_used == 0 and engine.cache.blocks_free == free_blocks
    assert scheduler.running == [] and scheduler.host_paced == [] and scheduler.beams_running == 0
    again = make_request(random_prompt(6, seed=83), "hostile", max_new_tokens=3)  # its id is free again
    finished, failed = run(engine, [again])
    assert not failed and len(finished["hostile"][0][0]) == 3


def test_non_finite_beam_logits_fail_the_beam_request_alone(make_engine, monkeypatch, alone):
    """Non-finite logits that only the search reads (its rows' draws, unused, see finite ones)."""
    import service.engine.step_sampler as sampler_module

    launch = sampler_module.launch_candidates

    def poisoned(step_logits, groups, out):
        rows = [row for group in groups if group.state.params.num_beams == 4 for row in group.rows]
        step_logits = step_logits.clone()
        step_logits[rows] = math.nan
        return launch(step_logits, groups, out)

    monkeypatch.setattr(sampler_module, "launch_candidates", poisoned)
    hostile = make_request(random_prompt(6, seed=81), "hostile", max_new_tokens=6, num_beams=4)
    finished, failed = run(make_engine(), bystanders() + [hostile])
    assert list(failed) == ["hostile"] and failed["hostile"].cause == "nonfinite_logits"
    assert_same_outputs(finished, alone)


def test_half_precision_logits_summing_past_fp16s_range_fail_no_search(make_engine, monkeypatch):
    """An fp16 model's logits (GPT-2's are near -100 over 50,257 tokens) summed in fp16 overflow
    to -inf: the check that fails a search on non-finite logits must not read that as a fault."""
    import service.engine.step_sampler as sampler_module

    launch = sampler_module.launch_candidates
    monkeypatch.setattr(sampler_module, "launch_candidates",
                        lambda step_logits, groups, out: launch(step_logits.half() - 100.0, groups, out))
    request = make_request(random_prompt(6, seed=82), "beams", max_new_tokens=6, num_beams=4)
    finished, failed = run(make_engine(), [request])
    assert not failed and len(finished["beams"]) == 1 and len(finished["beams"][0][0]) == 6


def test_injection_is_off_unless_configured(monkeypatch):
    monkeypatch.delenv(faults.INJECT_ENV, raising=False)
    assert NonfiniteInjection.from_env() is None
    monkeypatch.setenv(faults.INJECT_ENV, "seed=5,after=2")
    injection = NonfiniteInjection.from_env()
    logits = torch.zeros(3, 4)
    out = injection.apply(logits, [(5, 2), (5, 1), (None, 9)])
    assert out[0].isnan().all() and torch.isfinite(out[1:]).all()


@pytest.mark.parametrize("part", ["drafter", "grammar's check of a draft"])
def test_drafting_that_raises_leaves_its_request_to_decode_without_drafts(make_engine, monkeypatch, alone, part):
    """A draft only saves forwards, so the sequence whose drafting raises (its n-gram index, or
    its grammar's check of the draft) goes on undrafted: no request fails, and every one gets the
    tokens it gets alone without speculation (the bystanders' and its own)."""
    from service.engine.ngram_drafter import NgramIndex

    prompt = random_prompt(3, seed=90) * 4  # repeats itself: it drafts from its first decode step
    options = dict(grammar=REGEX.replace("2,6", "1,4")) if part != "drafter" else {}
    hostile = make_request(prompt, "hostile", max_new_tokens=16, **options)
    reference, failed = run(compiled(make_engine(), options), [make_request(prompt, "hostile", max_new_tokens=16, **options)])
    assert not failed
    engine = make_engine(speculative=NgramSettings(min_n=1, max_n=3, tokens=4, weight_pass_rows=float("inf")))
    raised = []
    if part == "drafter":
        draft, calls = NgramIndex.draft, itertools.count()

        def drafting(self, tokens, limit):
            if tokens[: len(prompt)] == prompt and next(calls) == 2:  # its third draft
                raised.append(True)
                raise RuntimeError("injected drafter failure")
            return draft(self, tokens, limit)
        monkeypatch.setattr(NgramIndex, "draft", drafting)
    else:
        real = engine.core.grammars.matcher

        class RaisingCheck:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def validate_tokens(self, tokens):
                raised.append(True)
                raise RuntimeError("injected check failure")
        monkeypatch.setattr(engine.core.grammars, "matcher",
                            lambda grammar: RaisingCheck(real(grammar)) if grammar == hostile.params.grammar else real(grammar))
    finished, failed = run(engine, [hostile] + bystanders())
    assert raised and not failed
    assert finished.pop("hostile") == reference["hostile"]
    assert_same_outputs(finished, alone)


def compiled(engine, options: dict):
    """The engine with the grammar of `options` (if any) compiled and cached: a request alone
    steps nothing while its grammar compiles on the worker, and could use up `run`'s steps."""
    if "grammar" in options:
        engine.core.grammars.compile(options["grammar"])
    return engine


def test_a_request_whose_text_fails_fails_alone(make_engine, monkeypatch, alone):
    """The HTTP side's text of one request raises (its tokenizer's decoder, a stop string's
    check): that request fails with an internal error and is stopped in the core; every other
    request of the same steps gets all of its tokens and text."""
    from service.http.outputs import TextStream

    add = TextStream.add

    def adding(self, token_id):
        if "<boom>" in self._stop and len(self._pieces) >= 2:
            raise RuntimeError("injected decoder failure")
        return add(self, token_id)
    monkeypatch.setattr(TextStream, "add", adding)
    engine = make_engine()
    hostile = make_request(random_prompt(5, seed=91), "hostile", max_new_tokens=40, stop=("<boom>",))
    texts = {}
    finished, failed = run(engine, [hostile] + bystanders(), texts=texts)
    assert engine.core.scheduler.running == []
    assert list(failed) == ["hostile"]
    assert (failed["hostile"].status, failed["hostile"].cause) == (500, "output")
    assert "injected decoder failure" in failed["hostile"].message
    assert_same_outputs(finished, alone)
    assert all(all(texts[request_id]) for request_id in finished), texts  # every text made, beams' too
