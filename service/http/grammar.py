"""Structured output requests, as TGI and vLLM's OpenAI server take them, turned into one
llguidance grammar text (what SamplingParams.grammar carries to the engine core).

- TGI: `parameters.grammar = {"type": "json", "value": <schema>}` or `{"type": "regex", ...}`;
- OpenAI /v1/completions: `response_format` `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}`, and vLLM's `structured_outputs` with one of
  `json` (a schema), `regex`, `choice` (strings) or `grammar` (Lark, or GBNF as llama.cpp's).

Checked here, before anything reaches the core (a 422 naming what is wrong): the size of what was
sent and a schema's nesting depth (refused, not compiled, beyond the bounds), then whether
llguidance compiles it with our tokenizer, under llguidance's own limits on grammar size and
lexer work (a grammar that would take too long is refused by them, not run).
"""

from __future__ import annotations

import json
import time

import llguidance

from service.common.errors import validation_error
from service.common.metrics import Metrics
from service.engine.grammar import Grammars
from service.http.schemas import CompletionRequest, TGIParameters

MAX_GRAMMAR_CHARS = 64_000  # a schema's JSON, a regex, a grammar or the choices, as sent
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays in a schema
MAX_CHOICES = 256
# JSON as json.dumps writes it (", " and ": "), no other whitespace: a model cannot wander in
# blank space for ever (an untrained one would). A schema's "x-guidance" can say otherwise.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "regex", "choice", "grammar")  # what /info lists


def json_schema_grammar(schema: dict | str | bool, field: str) -> str:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    check_size(field, text)
    try:
        parsed = json.loads(text) if isinstance(schema, str) else schema
    except json.JSONDecodeError as exc:
        raise validation_error(f"{field}: not JSON ({exc})") from None
    if not isinstance(parsed, (dict, bool)):
        raise validation_error(f"{field}: a JSON schema is an object (or true/false)")
    if depth(parsed) > MAX_SCHEMA_DEPTH:
        raise validation_error(f"{field}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    except ValueError as exc:
        raise validation_error(f"{field}: {exc}") from None


def regex_grammar(regex: str, field: str) -> str:
    check_size(field, regex)
    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: list[str], field: str) -> str:
    if not choices or len(choices) > MAX_CHOICES or any(not isinstance(c, str) or not c for c in choices):
        raise validation_error(f"{field}: 1 to {MAX_CHOICES} non-empty strings")
    check_size(field, json.dumps(choices))
    return llguidance.grammar_from("choice", json.dumps(choices))


def lark_grammar(grammar: str, field: str) -> str:
    """A Lark grammar (llguidance's syntax), or a GBNF one (llama.cpp's), converted."""
    check_size(field, grammar)
    try:
        return llguidance.grammar_from("grammar", grammar)
    except ValueError as exc:
        raise validation_error(f"{field}: {exc}") from None


def check_size(field: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise validation_error(f"{field}: {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")


def depth(value: object, level: int = 0) -> int:
    """How deep JSON nests (iteratively bounded: stops counting past the limit)."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((depth(v, level + 1) for v in value), default=level + 1)
    return level


class GrammarChecker:
    """Compiles a request's grammar with the served tokenizer (service/engine/grammar.py's
    Grammars: the engine core's own compiler and cache), to refuse what the core could not run
    (llguidance's error message, as a 422). A grammar compiled before is a cache hit."""

    def __init__(self, grammars: Grammars, metrics: Metrics) -> None:
        self.grammars, self.metrics = grammars, metrics

    def check(self, grammar: str, field: str, kind: str) -> str:
        self.metrics.constrained_requests.labels(kind=kind).inc()
        if self.grammars.cached(grammar):
            self.metrics.grammar_cache_hits.inc()
            return grammar
        start = time.perf_counter()
        try:
            self.grammars.compile(grammar)
        except ValueError as exc:
            raise validation_error(f"{field}: {exc}") from None
        finally:
            self.metrics.grammar_check_seconds.observe(time.perf_counter() - start)
        return grammar


def tgi_grammar(parameters: TGIParameters, checker: GrammarChecker) -> str | None:
    grammar = parameters.grammar
    if grammar is None:
        return None
    if grammar.type == "json":
        return checker.check(json_schema_grammar(grammar.value, "grammar.value"), "grammar", "json")
    if not isinstance(grammar.value, str):
        raise validation_error("grammar.value: a regex grammar's value is a string")
    return checker.check(regex_grammar(grammar.value, "grammar.value"), "grammar", "regex")


def openai_grammar(request: CompletionRequest, checker: GrammarChecker) -> str | None:
    outputs, response_format = request.structured_outputs, request.response_format
    if outputs is not None:
        if outputs.json_ is not None:
            kind, text = "json", json_schema_grammar(outputs.json_, "structured_outputs.json")
        elif outputs.regex is not None:
            kind, text = "regex", regex_grammar(outputs.regex, "structured_outputs.regex")
        elif outputs.choice is not None:
            kind, text = "choice", choice_grammar(outputs.choice, "structured_outputs.choice")
        else:
            kind, text = "grammar", lark_grammar(outputs.grammar, "structured_outputs.grammar")
        return checker.check(text, "structured_outputs", kind)
    if response_format is None or response_format.type == "text":
        return None
    schema = response_format.json_schema.schema_ if response_format.json_schema is not None else None
    text = json_schema_grammar(schema if schema is not None else {"type": "object"}, "response_format")
    return checker.check(text, "response_format", "json")
