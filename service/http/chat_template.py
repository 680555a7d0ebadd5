"""Chat templates: a conversation rendered to a prompt text as transformers' apply_chat_template
renders it (a jinja2 template, from the model folder or --chat-template).

The environment is transformers' own: jinja2's ImmutableSandboxedEnvironment with trim_blocks
and lstrip_blocks, loop controls, the `raise_exception` and `strftime_now` globals, a `tojson`
filter that does not escape HTML, a `dict` and a `namespace` that refuse underscore names; the
template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
(`bos_token`, `eos_token`, ...) and the request's `chat_template_kwargs`.

A template is code someone else wrote, run on every request. The sandbox keeps it from Python's
internals (attributes beginning with `_`, unsafe callables, mutation of what it is given); on
top of that, every rendering is bounded: the compiled template ticks a clock at every block
(each loop iteration, each branch, each macro call), so a loop that runs too long is stopped
within `MAX_RENDER_SECONDS`, and the operations that can make a large string in one step
(`*`, `**`, `%`, `~`, the padding filters and methods) are refused past `MAX_RENDER_CHARS`, as is
output beyond it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.filters import do_replace
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_SECONDS = 0.25
MAX_RENDER_CHARS = 2_000_000  # the rendered prompt, and any one string made while rendering
MAX_TEMPLATE_CHARS = 200_000  # a chat template's source
# transformers marks the final message this way for continue_final_message; so do we.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# A number in a format string wider than this is refused ('%999999999d' would allocate it).
_WIDE_FORMAT = re.compile(r"\d{7,}")


class TemplateError(ValueError):
    """The template cannot render this conversation: its own raise_exception, a jinja2 error, a
    sandbox refusal or a bound reached. The message says which."""


class _Budget(threading.local):
    deadline = float("inf")


_budget = _Budget()


def _tick() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateError(f"the chat template ran longer than {MAX_RENDER_SECONDS} s")


def _bounded(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, bytes)) and len(value) > MAX_RENDER_CHARS:
        raise TemplateError(f"the chat template made a value of more than {MAX_RENDER_CHARS} characters or items")
    return value


def _check_size(size: int) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateError(f"the chat template would make a value of {size} characters or items;"
                            f" at most {MAX_RENDER_CHARS}")


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with a clock tick at the start of every block and every `~`
    concatenation's result checked for size."""

    def blockvisit(self, nodes, frame) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(nodes, frame)

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded(")
        super().visit_Concat(node, frame)
        self.write(")")


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    tick = staticmethod(_tick)
    bounded = staticmethod(_bounded)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    _check_size(len(seq) * max(count, 0))
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                _check_size(right * abs(left).bit_length() // 4)  # ~ its decimal digits
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        return _bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        _tick()
        if isinstance(getattr(__obj, "__self__", None), str):
            _check_str_method(__obj.__self__, __obj.__name__, args, kwargs)
        return _bounded(super().call(__context, __obj, *args, **kwargs))


def _check_format(text: str) -> None:
    if _WIDE_FORMAT.search(text):
        raise TemplateError("the chat template's format string asks for a width or precision too large")


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> None:
    """The str methods that can make a long string from short arguments."""
    numbers = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs") and numbers:
        widest = max(numbers)
        _check_size(widest * (len(text) if name == "expandtabs" else 1))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        occurrences = text.count(args[0]) if args[0] else len(text) + 1
        _check_size(len(text) + occurrences * max(len(args[1]) - len(args[0]), 0))
    elif name in ("format", "format_map"):
        _check_format(text)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    if indent is not None and (not isinstance(indent, int) or indent > 64):
        raise TemplateError("tojson: indent is at most 64")
    return _bounded(json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys))


def _strftime_now(format: str) -> str:
    _check_format(format)
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates, without a class to climb from (as transformers gives it)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (Python's internals) and values too large."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja2's Namespace takes self this way)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _TemplateNamespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not begin with '_': {name!r}")
        _bounded(value)


def _bounded_filter(original: Callable, check: Callable[..., None]) -> Callable:
    """`original`, with `check` of its arguments first and its result's size after."""
    def filtered(*args, **kwargs):
        check(*args, **kwargs)
        return _bounded(original(*args, **kwargs))
    return filtered


@jinja2.pass_eval_context
def _bounded_replace(eval_ctx, text, old, new, count=None):
    """jinja2's replace filter (it takes the eval context first), refused past the size bound."""
    _check_str_method(str(text), "replace", (str(old), str(new)), {})
    return _bounded(do_replace(eval_ctx, text, old, new, count))


def _environment() -> _ChatEnvironment:
    env = _ChatEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    filters = env.filters
    filters["tojson"] = _tojson
    filters["format"] = _bounded_filter(filters["format"], lambda text, *a, **k: _check_format(str(text)))
    filters["center"] = _bounded_filter(filters["center"], lambda text, width=80: _check_size(int(width)))
    filters["indent"] = _bounded_filter(
        filters["indent"],
        lambda text, width=4, *a, **k: _check_size(len(str(text)) * (width if isinstance(width, int) else len(str(width)))),
    )
    filters["replace"] = _bounded_replace
    # lipsum(n) writes n paragraphs in pure Python, with no block to tick (minutes for a million).
    del env.globals["lipsum"]
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


_ENV = _environment()


@lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


class ChatTemplate:
    """One chat template, compiled once; `special_tokens` are the names it may read (bos_token, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"{origin}: the chat template has {len(source)} characters; at most {MAX_TEMPLATE_CHARS}")
        try:
            self.template = _compiled(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"{origin}: the chat template does not parse: {exc} (line {exc.lineno})") from None
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.origin = origin

    def render(
        self, messages: list[dict], *, add_generation_prompt: bool = True, continue_final_message: bool = False,
        tools: list[dict] | None = None, documents: list[dict] | None = None, kwargs: dict | None = None,
    ) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False) gives it.
        TemplateError if the template raises, is refused by the sandbox or passes a bound."""
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt cannot both be set")
        messages = [dict(m) for m in messages]
        final = None
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise TemplateError("continue_final_message needs a final message with text content")
            final = messages[-1]["content"]
            messages[-1]["content"] = final + CONTINUE_TAG
        variables = {**self.special_tokens, **(kwargs or {})}
        text = self._render_bounded(dict(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables))
        if final is not None:
            tag = CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise TemplateError("continue_final_message: the template does not show the final message as given")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text

    def _render_bounded(self, variables: dict) -> str:
        _budget.deadline = time.monotonic() + MAX_RENDER_SECONDS
        pieces, size = [], 0
        try:
            for piece in self.template.generate(**variables):
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise TemplateError(f"the chat template's output passed {MAX_RENDER_CHARS} characters")
                pieces.append(piece)
        except TemplateError:
            raise
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, SecurityError, UndefinedError, ...
            raise TemplateError(f"the chat template failed: {exc}") from None
        except (RecursionError, MemoryError, ArithmeticError, TypeError, ValueError, LookupError, AttributeError) as exc:
            raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _budget.deadline = float("inf")
        return "".join(pieces)


# --- where a template comes from --------------------------------------------------------------

# GPT-2's tokenizer calls all three the same token; tokenizer_config.json may say otherwise.
DEFAULT_SPECIAL_TOKENS = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def special_tokens(model_dir: Path) -> dict[str, str]:
    """The special tokens a template may name, as transformers' special_tokens_map gives them."""
    tokens = dict(DEFAULT_SPECIAL_TOKENS)
    config = _tokenizer_config(model_dir)
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken, serialised
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def folder_template_source(model_dir: Path) -> tuple[str, str] | None:
    """(source, where) of the model folder's chat template: chat_template.jinja, else
    tokenizer_config.json's `chat_template` (a string, or transformers' list of named templates,
    of which the one named "default")."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    value = _tokenizer_config(model_dir).get("chat_template")
    where = f"{model_dir / 'tokenizer_config.json'} (chat_template)"
    if isinstance(value, str):
        return value, where
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"], where
    return None


def load_chat_template(model_dir: Path, option: str | None) -> ChatTemplate | None:
    """The template served: --chat-template (a file's path, or the template itself), else the
    model folder's; None when neither has one. ValueError (start-up stops) when unreadable."""
    tokens = special_tokens(model_dir)
    if option is not None:
        path = Path(option)
        is_file = "{" not in option and "\n" not in option and len(option) < 4096 and path.is_file()
        if is_file:
            return ChatTemplate(path.read_text(encoding="utf-8"), tokens, str(path))
        if "{" not in option:
            raise ValueError(f"--chat-template {option!r}: no such file, and not a template (no jinja2 markup)")
        return ChatTemplate(option, tokens, "--chat-template")
    found = folder_template_source(model_dir)
    return None if found is None else ChatTemplate(found[0], tokens, found[1])
