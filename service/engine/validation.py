"""Whether a request can ever run on this engine: checked on both sides of the IPC."""

from __future__ import annotations

import math

from service.engine.types import GenerationRequest, SamplingParams


def slots_needed(params: SamplingParams) -> int:
    """KV-cache slots a request holds while it runs: one per beam or returned sequence."""
    return max(params.num_beams, params.num_return_sequences)


def validate_request(request: GenerationRequest, max_len: int, max_slots: int) -> None:
    """Refuse what can never run, saying why (the HTTP side turns this into a 422).

    The HTTP side calls it before sending a request to the core, and the core again on receipt.
    """
    p, prompt_length = request.params, len(request.prompt_ids)
    if prompt_length == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    if p.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {p.max_new_tokens}")
    if prompt_length + p.max_new_tokens > max_len:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds "
            f"the maximum sequence length {max_len}"
        )
    if p.num_beams < 1 or p.num_return_sequences < 1:
        raise ValueError("num_beams and num_return_sequences must be at least 1")
    if p.num_beams > 1 and p.do_sample:
        raise ValueError("beam search with sampling is not supported: set do_sample=false")
    if p.num_beams > 1 and p.num_return_sequences > p.num_beams:
        raise ValueError(
            f"num_return_sequences ({p.num_return_sequences}) must not exceed num_beams ({p.num_beams})"
        )
    if p.num_beams == 1 and p.num_return_sequences > 1 and not p.do_sample:
        raise ValueError("several return sequences need do_sample=true or num_beams > 1")
    if p.do_sample and p.temperature <= 0:
        raise ValueError(f"temperature must be positive when sampling, got {p.temperature}")
    if not 0 < p.top_p <= 1 or p.top_k < 0 or p.repetition_penalty <= 0:
        raise ValueError("top_p must be in (0, 1], top_k >= 0, repetition_penalty > 0")
    if any(not s for s in p.stop):
        raise ValueError("stop strings must not be empty")
    if p.num_beams > 1 and p.stop:
        raise ValueError("stop strings are not supported with beam search")
    if not math.isfinite(p.length_penalty) or p.early_stopping not in (True, False, "never"):
        raise ValueError("length_penalty must be finite; early_stopping true, false or 'never'")
    if p.grammar is not None:
        check_grammar_combination(p)
    if slots_needed(p) > max_slots:
        raise ValueError(
            f"the request needs {slots_needed(p)} sequences at once; the engine has "
            f"{max_slots} slots"
        )


def check_grammar_combination(p: SamplingParams) -> None:
    """What a grammar cannot be combined with: beam search (its candidates are not masked), and
    the controls that ban tokens by themselves, which could ban every token the grammar allows
    at a step (min_new_tokens bans the EOS that may be the only one) or end the text where the
    grammar does not (ignore_eos, stop_token_ids)."""
    if p.num_beams > 1:
        raise ValueError("a grammar cannot be combined with beam search (num_beams > 1): use greedy or sampling")
    clashing = [name for name, used in (
        ("ignore_eos", p.ignore_eos), ("min_new_tokens", p.min_new_tokens > 0), ("stop_token_ids", bool(p.stop_token_ids)),
        ("no_repeat_ngram_size", p.no_repeat_ngram_size > 0), ("bad_words_ids", bool(p.bad_words_ids)),
    ) if used]
    if clashing:
        raise ValueError(f"a grammar cannot be combined with {', '.join(clashing)}: the grammar decides which tokens"
                         " may come and where the text ends")
