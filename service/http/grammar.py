"""Structured output requests, as TGI and vLLM's OpenAI server take them, turned into one
llguidance grammar text (what SamplingParams.grammar carries to the engine core).

- TGI: `parameters.grammar = {"type": "json", "value": <schema>}`, `{"type": "json_schema",
  "value": {"name": ..., "schema": <schema>}}` (TGI 3) or `{"type": "regex", ...}`;
- OpenAI /v1/completions: `response_format` `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}`, and vLLM's `structured_outputs` with one of
  `json` (a schema), `regex`, `choice` (strings) or `grammar` (Lark, or GBNF as llama.cpp's).

Checked here, before anything reaches the core (a 422 naming what is wrong): the size of what was
sent, a schema's nesting depth and an object's optional properties (refused, not compiled, beyond
the bounds), then whether llguidance compiles it with our tokenizer and computes its first masks,
under llguidance's own limits (service/engine/grammar.py): a grammar that fails there, or matches
no text, is refused before any token. The compile runs on a worker thread of its own, never on
the event loop that streams every other request's tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from service.common.errors import validation_error
from service.common.metrics import Metrics
from service.engine.grammar import LIMITS, Grammars
from service.http.schemas_openai import CompletionRequest
from service.http.schemas_tgi import TGIParameters

MAX_GRAMMAR_CHARS = 64_000  # a schema's JSON, a regex, a grammar or the choices, as sent
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays in a schema
MAX_CHOICES = 256
# An object's optional properties take 4 Earley items each in one row of llguidance's parser,
# which holds at most LIMITS["max_items_in_row"]: more would fail on the object's first token, after
# a compile that grows with their square (0.5 s for 2,000): refused before it.
MAX_OPTIONAL_PROPERTIES = (LIMITS["max_items_in_row"] - 8) // 4
# JSON as json.dumps writes it (", " and ": "), no other whitespace: a model cannot wander in
# blank space for ever (an untrained one would). A schema's "x-guidance" can say otherwise.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "regex", "choice", "grammar")  # what /info lists


@dataclass(frozen=True)
class GrammarRequest:
    """A request's grammar as llguidance's text, built but not yet compiled, with the field that
    gave it (named in a 422) and its kind (counted in metrics)."""

    text: str
    field: str
    kind: str


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
    if (optional := optional_properties(parsed)) > MAX_OPTIONAL_PROPERTIES:
        raise validation_error(f"{field}: an object with {optional} optional properties; at most {MAX_OPTIONAL_PROPERTIES} "
                               "(list more of them in `required`, or nest them in objects of their own)")
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


def optional_properties(schema: object) -> int:
    """The most optional properties (in `properties`, not in `required`) any one object of the
    schema has, wherever it is nested (the schema's depth is bounded before this walks it)."""
    most = 0
    if isinstance(schema, dict):
        properties, required = schema.get("properties"), schema.get("required")
        if isinstance(properties, dict):
            named = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
            most = len(properties.keys() - named)
        values = list(schema.values())
    elif isinstance(schema, list):
        values = schema
    else:
        return 0
    return max([most, *(optional_properties(v) for v in values)])


class GrammarChecker:
    """Compiles a request's grammar with the served tokenizer and computes its first masks
    (service/engine/grammar.py's Grammars: the engine core's own compiler and cache), to refuse
    what the core could not run (llguidance's reason, as a 422). A grammar compiled before is a
    cache hit. Compiles run on one thread of their own: a hostile grammar takes ~0.1-0.3 s of
    llguidance's work within its limits, which the event loop must not wait for, and several at
    once queue there rather than take every core."""

    def __init__(self, grammars: Grammars, metrics: Metrics) -> None:
        self.grammars, self.metrics = grammars, metrics
        # The compile cache is written on this thread only (read on the event loop).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")

    async def check(self, grammar: GrammarRequest | None) -> None:
        """Refuse `grammar` (a 422 naming its field and llguidance's reason) unless it compiles
        and its first masks can be computed."""
        if grammar is None:
            return
        self.metrics.constrained_requests.labels(kind=grammar.kind).inc()
        if self.grammars.cached(grammar.text):
            self.metrics.grammar_cache_hits.inc()
            return
        start = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.grammars.compile, grammar.text)
        except ValueError as exc:
            raise validation_error(f"{grammar.field}: {exc}") from None
        finally:
            self.metrics.grammar_check_seconds.observe(time.perf_counter() - start)


def tgi_grammar(parameters: TGIParameters) -> GrammarRequest | None:
    grammar = parameters.grammar
    if grammar is None:
        return None
    if grammar.type == "json":
        return GrammarRequest(json_schema_grammar(grammar.value, "grammar.value"), "grammar", "json")
    if grammar.type == "json_schema":  # TGI 3's: the value was read as {"name": ..., "schema": {...}}
        schema = grammar.value.schema_
        text = json_schema_grammar(schema if schema is not None else {"type": "object"}, "grammar.value.schema")
        return GrammarRequest(text, "grammar", "json")
    if not isinstance(grammar.value, str):
        raise validation_error("grammar.value: a regex grammar's value is a string")
    return GrammarRequest(regex_grammar(grammar.value, "grammar.value"), "grammar", "regex")


def openai_grammar(request: CompletionRequest) -> GrammarRequest | None:
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
        return GrammarRequest(text, "structured_outputs", kind)
    if response_format is None or response_format.type == "text":
        return None
    schema = response_format.json_schema.schema_ if response_format.json_schema is not None else None
    text = json_schema_grammar(schema if schema is not None else {"type": "object"}, "response_format")
    return GrammarRequest(text, "response_format", "json")
