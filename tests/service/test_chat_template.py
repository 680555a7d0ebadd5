"""Chat templates rendered as transformers' apply_chat_template renders them, token for token,
and hostile templates refused quickly (service/http/chat_template.py)."""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from service.http.chat_template import (
    MAX_RENDER_CHARS,
    ChatTemplate,
    TemplateError,
    load_chat_template,
    special_tokens,
)
from tests.conftest import DEFAULT_MODEL_DIR

TEMPLATES = Path(__file__).parent / "chat_templates"
DIALOGPT_CONFIG = TEMPLATES / "dialogpt_tokenizer_config.json"


def template_source(name: str) -> str:
    if name == "dialogpt":
        return json.loads(DIALOGPT_CONFIG.read_text())["chat_template"]
    return (TEMPLATES / f"{name}.jinja").read_text()


CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello there!"}],
    "system and turns": [
        {"role": "system", "content": "You speak in verse."},
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": " Grey skies, and rain upon the plain. "},
        {"role": "user", "content": "And tomorrow?\nTell me  more."},
    ],
    "unicode": [{"role": "user", "content": "Grüße, 世界 🎭 <b>&amp;</b>"}],
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The default folder's tokenizer files, and DialoGPT's tokenizer_config.json (its template)."""
    folder = tmp_path_factory.mktemp("dialogpt-like")
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    shutil.copy(DIALOGPT_CONFIG, folder / "tokenizer_config.json")
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def reference_ids(reference, source: str, messages, **kwargs) -> list[int]:
    reference.chat_template = source
    out = reference.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", ["dialogpt", "chatml", "zephyr", "llama2", "chatml_tools"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_ids_equal_transformers(name, conversation, add_generation_prompt, model_dir, reference, tokenizer):
    source, messages = template_source(name), CONVERSATIONS[conversation]
    ours = ChatTemplate(source, special_tokens(model_dir), name).render(messages, add_generation_prompt=add_generation_prompt)
    expected = reference_ids(reference, source, messages, add_generation_prompt=add_generation_prompt)
    assert tokenizer.encode(ours) == expected
    assert expected  # something was rendered


def test_tools_and_tool_calls_render_as_transformers(model_dir, reference, tokenizer):
    source = template_source("chatml_tools")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "grey"}'},
    ]
    ours = ChatTemplate(source, special_tokens(model_dir), "tools").render(messages, tools=[WEATHER_TOOL])
    assert '"name": "get_weather"' in ours  # tojson of the tool, unescaped
    assert tokenizer.encode(ours) == reference_ids(reference, source, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)


@pytest.mark.parametrize("name", ["chatml", "zephyr", "llama2"])
def test_continue_final_message_as_transformers(name, model_dir, reference, tokenizer):
    source = template_source(name)
    messages = [{"role": "user", "content": "Finish this line:"}, {"role": "assistant", "content": "Shall I compare thee"}]
    ours = ChatTemplate(source, special_tokens(model_dir), name).render(
        messages, add_generation_prompt=False, continue_final_message=True)
    assert ours.endswith("Shall I compare thee")
    assert tokenizer.encode(ours) == reference_ids(reference, source, messages, continue_final_message=True)


def test_raise_exception_gives_the_templates_message(model_dir):
    template = ChatTemplate(template_source("llama2"), special_tokens(model_dir), "llama2")
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        template.render([{"role": "assistant", "content": "I speak first"}])


def test_chat_template_kwargs_and_strftime_reach_the_template(model_dir):
    source = "{{ strftime_now('%Y') }}|{{ greeting }}|{{ bos_token }}"
    text = ChatTemplate(source, special_tokens(model_dir), "x").render([], kwargs={"greeting": "hail"})
    assert text == f"{time.strftime('%Y')}|hail|<|endoftext|>"


def test_template_sources_in_order_of_precedence(model_dir, tmp_path):
    # tokenizer_config.json's template (DialoGPT's)
    assert load_chat_template(model_dir, None).source == template_source("dialogpt")
    # chat_template.jinja beside it wins, and --chat-template wins over both (a file, or the text)
    (tmp_path / "chat_template.jinja").write_text("folder")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    assert load_chat_template(tmp_path, None).source == "folder"
    assert load_chat_template(tmp_path, str(TEMPLATES / "chatml.jinja")).source == template_source("chatml")
    assert load_chat_template(tmp_path, "{{ messages }}").source == "{{ messages }}"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(tmp_path, "missing.jinja")
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template(tmp_path, "{% for %}")
    # none at all
    assert load_chat_template(DEFAULT_MODEL_DIR, None) is None


HOSTILE = {
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals of a function": "{{ raise_exception.__globals__['os'].environ }}",
    "the environment": "{{ cycler.__init__.__globals__.os.environ }}",
    "reading a file": "{{ namespace.__init__.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "namespace internals": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "mutating what it is given": "{{ messages.append(1) }}",
    "dict internals": "{{ dict.__call__.__globals__ }}",
    "a loop that never ends": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "three loops over one range": "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% for k in r %}"
                                  "{% endfor %}{% endfor %}{% endfor %}",
    "huge output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "one huge string": "{{ 'a' * 100000000 }}",
    "doubling by concatenation": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}"
                                 "{% endfor %}{{ ns.x|length }}",
    "a wide format": "{{ '%099999999d' % 1 }}",
    "a wide format filter": "{{ '%099999999d'|format(1) }}",
    "a wide padding": "{{ 'a'.ljust(100000000) }}",
    "a wide centre": "{{ 'a'|center(100000000) }}",
    "a growing replace": "{% set ns = namespace(x='a' * 1000) %}{% for i in range(30) %}"
                         "{% set ns.x = ns.x|replace('a', 'aaaa') %}{% endfor %}",
    "endless recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "lorem ipsum": "{{ lipsum(1000000) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_are_refused_quickly(name):
    # Each would run for minutes, fill the memory or reach Python's internals without its bound.
    template = ChatTemplate(HOSTILE[name], {}, name)
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError):
            template.render([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Refused before the large string is made, not after (100 MB each, without the checks).
    assert peak < 8 * MAX_RENDER_CHARS, peak


def test_a_large_but_bounded_rendering_is_served():
    text = ChatTemplate("{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}", {}, "x").render([])
    assert len(text) == 1_000_000 < MAX_RENDER_CHARS


def test_output_past_the_bound_is_refused():
    # Quick to make (3,000 blocks), but more than the prompt may be.
    with pytest.raises(TemplateError, match="output passed"):
        ChatTemplate("{% for i in range(3000) %}{{ 'x' * 1000 }}{% endfor %}", {}, "x").render([])
