"""The mixed load of bench/host_core.py: which requests use which feature, what each feature's
request asks for, and what the outputs show each feature did (so the stand-in cannot drop one
silently).

A mix is `--mix grammar=1/16,beam=1/64,...`: the share of requests using each feature; `all` (the
issue's mix, FEATURES' shares) or a list of names takes the default shares. A request uses one
feature at most, spread evenly over the requests (each feature's credit grows by its share per
request and a request takes the first feature whose credit reached one; every credit starts at
one, so the first requests show every feature at once).

What a feature's request is, beside the plain one (greedy, ignore_eos, no speculation):
- grammar: a JSON schema (bench/grammar_schemas.py's PERSON), EOS allowed;
- beam: 4 beams;
- ngram: the core speculates (every draft it can make is verified: the pricing's weight-pass rows
  infinite), this request drafts (the others opt out), and its prompt ends in the stand-in's
  own period so its drafts find their loop at once;
- top_logprobs: 5 alternatives per token;
- stop_ids: one stop token id, which the stand-in draws a few tokens in;
- lora: an adapter of rank 8 (random), loaded in the core.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

FEATURES = {"grammar": Fraction(1, 16), "beam": Fraction(1, 64), "ngram": Fraction(1, 16),
            "top_logprobs": Fraction(1, 16), "stop_ids": Fraction(1, 16), "lora": Fraction(1, 16)}
BEAMS = 4
ALTERNATIVES = 5
ADAPTER = "a0"
ADAPTER_RANK = 8
# The goal (issue 45): host time per row-step at most this many times the plain batch's, overlap on.
GOAL_RATIO = 1.5


def parse_mix(text: str) -> dict[str, Fraction]:
    """`all`, `grammar,beam`, or `grammar=1/16,beam=0.02`: shares by feature (ValueError says
    what is wrong)."""
    if text.strip() == "all":
        return dict(FEATURES)
    mix: dict[str, Fraction] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, share = item.partition("=")
        if name not in FEATURES:
            raise ValueError(f"unknown feature {name!r} in --mix (known: {', '.join(FEATURES)}, or all)")
        try:
            mix[name] = Fraction(share).limit_denominator(10_000) if share else FEATURES[name]
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--mix {name}={share}: not a share (1/16, 0.0625)") from None
        if not 0 < mix[name] <= 1:
            raise ValueError(f"--mix {name}={share}: a share is above 0 and at most 1")
    if not mix:
        raise ValueError("--mix names no feature")
    if sum(mix.values()) > 1:
        raise ValueError(f"--mix shares add up to {float(sum(mix.values())):.3g}: a request uses one feature at most")
    return mix


def share_text(share: Fraction | None) -> str:
    return "-" if share is None else str(share)


class Assigner:
    """Each next request's feature (None: plain), spread evenly by each feature's share."""

    def __init__(self, mix: dict[str, Fraction]) -> None:
        # Credits in units of 1/denominator, as integers: Fraction arithmetic for every request
        # submitted cost the timed steps tens of microseconds (the core's time is what counts).
        self.denominator = math.lcm(*(share.denominator for share in mix.values())) if mix else 1
        self.mix = {name: int(share * self.denominator) for name, share in mix.items()}
        self.credit = {name: self.denominator for name in mix}

    def next(self) -> str | None:
        for name, share in self.mix.items():
            self.credit[name] += share
        for name in self.mix:
            if self.credit[name] >= self.denominator:
                self.credit[name] -= self.denominator
                return name
        return None


def small_tokenizer_json(tokenizer_json: str, vocabulary: int) -> str:
    """GPT-2's tokenizer cut to its first `vocabulary - 1` tokens (the 256 bytes and the first
    merges, whose ids follow the merges' order) and EOS as the last id: a consistent byte-level
    BPE that encodes any text, for grammars over a small vocabulary."""
    tokenizer = json.loads(tokenizer_json)
    model = tokenizer["model"]
    model["vocab"] = {text: index for text, index in model["vocab"].items() if index < vocabulary - 1}
    model["merges"] = model["merges"][: vocabulary - 1 - 256]
    (eos,) = tokenizer["added_tokens"]
    eos["id"] = vocabulary - 1
    return json.dumps(tokenizer)


def person_grammar() -> str:
    from bench.grammar_schemas import PERSON  # noqa: PLC0415 (the checkout's own)
    from service.http.grammar import json_schema_grammar  # noqa: PLC0415

    return json_schema_grammar(PERSON, "json_schema")


def write_adapter(model_dir: Path, out: Path) -> Path:
    from bench.bench_lora import random_adapters  # noqa: PLC0415

    (folder,) = random_adapters(model_dir, out, 1, ADAPTER_RANK)
    return folder


@dataclass
class Tracked:
    """A feature's request, as far as its outputs tell what the feature did."""

    feature: str
    prompt_length: int
    max_new_tokens: int
    stop_id: int | None = None
    tokens: list[int] = field(default_factory=list)
    alternatives: int = 0  # its tokens that came with alternatives
    reason: str | None = None  # the finish reason of its last token
    beams: int = 0  # beam search: the hypotheses it returned


@dataclass
class Evidence:
    """What the requests of each feature showed while recorded, and the step statistics."""

    requests: dict[str, Tracked] = field(default_factory=dict)  # by id, while running
    finished: list[Tracked] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # the failures' messages
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record(self, out) -> None:
        """One CoreStep: the tracked requests' tokens, finish reasons, alternatives and ends."""
        tracked = self.requests
        for request_id, index, token, _, reason, top in out.tokens:
            request = tracked.get(request_id)
            if request is None or index:
                continue
            request.tokens.append(token)
            request.alternatives += bool(top)
            request.reason = reason or request.reason
        for done in out.done:
            if (request := tracked.pop(done.request_id, None)) is not None:
                request.beams = len(done.beams or ())
                self.finished.append(request)
        self.failed += [failure.message for failure in out.failed]
        self.draft_tokens += out.stats.draft_tokens
        self.accepted_tokens += out.stats.accepted_tokens

    def summary(self, free_id, grammar_check, lora_forwards: int) -> dict[str, dict]:
        """Per feature, what its finished requests did and whether it was used (`used`).
        `free_id(counter)`: the stand-in's draw there without a mask; `grammar_check(tokens)`:
        whether the grammar accepts the tokens."""
        of = {name: [r for r in self.finished if r.feature == name] for name in FEATURES}
        result: dict[str, dict] = {}
        grammar = of["grammar"]
        steered = [r for r in grammar
                   if any(t != free_id(r.prompt_length + i) for i, t in enumerate(r.tokens))]
        invalid = [r for r in grammar if not grammar_check(r.tokens)]
        result["grammar"] = {"finished": len(grammar), "steered": len(steered), "invalid": len(invalid),
                             "used": bool(steered) and not invalid}
        beams = [r for r in of["beam"] if r.beams]
        result["beam"] = {"finished": len(of["beam"]), "with_hypotheses": len(beams),
                          "used": bool(beams) and len(beams) == len(of["beam"])}
        result["ngram"] = {"finished": len(of["ngram"]), "draft_tokens": self.draft_tokens,
                           "accepted_tokens": self.accepted_tokens, "used": self.accepted_tokens > 0}
        top = of["top_logprobs"]
        tokens = sum(len(r.tokens) for r in top)
        with_top = sum(r.alternatives for r in top)
        result["top_logprobs"] = {"finished": len(top), "tokens": tokens, "with_alternatives": with_top,
                                  "used": tokens > 0 and with_top == tokens}
        stopped = [r for r in of["stop_ids"]
                   if r.reason == "eos_token" and r.tokens and r.tokens[-1] == r.stop_id and len(r.tokens) < r.max_new_tokens]
        result["stop_ids"] = {"finished": len(of["stop_ids"]), "stopped_by_id": len(stopped),
                              "used": bool(stopped) and len(stopped) == len(of["stop_ids"])}
        result["lora"] = {"finished": len(of["lora"]), "forwards_with_adapter_rows": lora_forwards,
                          "used": bool(of["lora"]) and lora_forwards > 0}
        return result


def evidence_text(feature: str, facts: dict) -> str:
    """One line of what a feature's requests did, for the table."""
    texts = {
        "grammar": "{finished} finished, {steered} steered by the mask, {invalid} invalid",
        "beam": "{finished} finished, {with_hypotheses} with beam hypotheses",
        "ngram": "{draft_tokens} draft tokens, {accepted_tokens} stood",
        "top_logprobs": "{with_alternatives} of {tokens} tokens with alternatives",
        "stop_ids": "{stopped_by_id} of {finished} ended by their stop id",
        "lora": "{finished} finished, {forwards_with_adapter_rows} forwards with adapter rows",
    }
    return texts[feature].format(**facts) + ("" if facts["used"] else "  NOT USED")


def goal_met(ratio: float, overlap_share: float | None) -> bool:
    return ratio <= GOAL_RATIO and overlap_share is not None and math.isclose(overlap_share, 1.0)
