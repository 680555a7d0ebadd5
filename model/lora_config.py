"""adapter_config.json read as data: bounded, typed by a schema, its patterns compiled under a guard.

The file comes from whoever may load adapters (`--lora` at start-up, an admin at run time), so
nothing in it may raise anything but `AdapterError` or stall the reader:
- the file's size and its JSON nesting are bounded before it is parsed (a deeply nested array
  would otherwise overflow the parser's recursion);
- every option the reader applies is checked for its type and size by a pydantic schema before
  anything is built;
- each regular expression must compile with `re`, as peft compiles it, and is matched by `regex`
  with a time budget: `re` has none, and some patterns take it hours on a module name (`(.*)*x`
  already takes half a minute); the two syntaxes `regex` reads otherwise are refused;
- then the meaning of each option is checked against peft's (model/lora_format.py): what would
  compute something else than peft is refused.
Every refusal is one line naming the file and the option.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Union

import numpy as np
import regex
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CONFIG_FILE = "adapter_config.json"
# peft writes about one kilobyte; the bounds leave room for any real config and no more.
MAX_CONFIG_BYTES = 1 << 20
MAX_NESTING = 32
MAX_PATTERN_CHARS = 512
MAX_NAME_CHARS = 256
MAX_ITEMS = 1024
MAX_RANK = 1 << 16
MAX_LAYER = 1 << 16
# All the pattern matching of one adapter's read together, in seconds.
PATTERN_BUDGET_S = 1.0
_SHOWN_CHARS = 80

# Options read here, each checked or applied below.
APPLIED = {
    "peft_type", "r", "lora_alpha", "use_rslora", "fan_in_fan_out", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "use_dora", "bias",
    "init_lora_weights",
}
# Options that only shape training or bookkeeping: the trained tensors mean the same without them.
NO_EFFECT_ON_INFERENCE = {
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "lora_dropout", "auto_mapping",
    "peft_version", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_config",
    "megatron_core", "qalora_group_size", "ensure_weight_tying",
}
# init_lora_weights values under which peft also rewrites the base weights: the adapter then
# only means something on that rewritten base, which we do not have.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


class AdapterError(ValueError):
    """An adapter folder this model cannot serve; the message is one line saying why."""


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
PatternText = Annotated[str, Field(max_length=MAX_PATTERN_CHARS)]
Names = Annotated[list[Name], Field(max_length=MAX_ITEMS)]
Rank = Annotated[int, Field(gt=0, le=MAX_RANK)]
Number = Annotated[float, Field(allow_inf_nan=False)]  # strict floats take JSON's integers too
Layer = Annotated[int, Field(ge=0, le=MAX_LAYER)]


class _Schema(BaseModel):
    """The types and sizes of the options the reader applies; others are judged by name below."""

    model_config = ConfigDict(strict=True, extra="allow")

    r: Rank
    lora_alpha: Number
    use_rslora: Union[bool, None] = False
    fan_in_fan_out: Union[bool, None] = False
    target_modules: Union[PatternText, Names, None] = None
    exclude_modules: Union[PatternText, Names, None] = None
    layers_to_transform: Union[Layer, Annotated[list[Layer], Field(max_length=MAX_ITEMS)], None] = None
    layers_pattern: Union[Name, Names, None] = None
    rank_pattern: Union[Annotated[dict[PatternText, Rank], Field(max_length=MAX_ITEMS)], None] = None
    alpha_pattern: Union[Annotated[dict[PatternText, Number], Field(max_length=MAX_ITEMS)], None] = None
    use_dora: Union[bool, None] = False
    bias: Union[Name, None] = "none"
    init_lora_weights: Union[bool, Name, None] = True


_PATTERN = f"a regular expression of at most {MAX_PATTERN_CHARS} characters"
_NAMES = f"a list of at most {MAX_ITEMS} module names of at most {MAX_NAME_CHARS} characters"
_EXPECTED = {
    "r": f"a positive integer of at most {MAX_RANK}",
    "lora_alpha": "a finite number",
    "use_rslora": "true or false",
    "fan_in_fan_out": "true or false",
    "target_modules": f"{_PATTERN}, or {_NAMES}",
    "exclude_modules": f"{_PATTERN}, or {_NAMES}",
    "layers_to_transform": f"a layer index (0 to {MAX_LAYER}) or a list of at most {MAX_ITEMS} of them",
    "layers_pattern": f"a name or {_NAMES}",
    "rank_pattern": f"an object of at most {MAX_ITEMS} entries, {_PATTERN} to a positive integer of at most {MAX_RANK}",
    "alpha_pattern": f"an object of at most {MAX_ITEMS} entries, {_PATTERN} to a finite number",
    "use_dora": "true or false",
    "bias": "a string",
    "init_lora_weights": "true, false or a method's name",
}


def shown(value) -> str:
    """A value of the file as JSON, cut short: a message stays one short line whatever the file holds."""
    text = json.dumps(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _described(value) -> str:
    """A refused value, with its size where the size is what is wrong."""
    if isinstance(value, (list, dict)) and len(value) > MAX_ITEMS:
        return f"{len(value)} entries: {shown(value)}"
    if isinstance(value, str) and len(value) > MAX_PATTERN_CHARS:
        return f"a string of {len(value)} characters: {shown(value)}"
    return shown(value)


def one_line(name: object) -> str:
    """A path or a tensor's name for a message: as it is, unless a newline or its length would
    break the message's one line."""
    text = str(name)
    return text if text.isprintable() and len(text) <= 4 * _SHOWN_CHARS else shown(text)


@dataclass
class _Budget:
    """The matching time left to one read (reading the tensors between matches does not count)."""

    spent: float = 0.0

    def left(self) -> float:
        return max(PATTERN_BUDGET_S - self.spent, 1e-3)


# Syntax `regex` reads otherwise than `re`, which takes it for literal characters that no module
# name holds: a POSIX class in a set, braces that are no repeat count (`regex`'s fuzzy matching).
_READ_OTHERWISE = re.compile(r"\[:\^?\w+:\]|\{(?!\d*,?\d*\})")


@dataclass
class GuardedPattern:
    """A pattern of an option: valid for `re` as peft compiles it, matched by `regex` within the budget."""

    where: str  # the file, for messages
    option: str
    source: str  # as the file wrote it, for messages
    compiled: regex.Pattern
    budget: _Budget

    @classmethod
    def compile(cls, where: str, option: str, source: str, wrapped: str, budget: _Budget) -> GuardedPattern:
        try:
            re.compile(wrapped)
            compiled = regex.compile(wrapped, flags=regex.VERSION0)
        except (re.error, regex.error, RecursionError, OverflowError) as exc:
            raise AdapterError(f"{where}: option {option}: {shown(source)} is not a valid regular expression ({exc})") from None
        if _READ_OTHERWISE.search(re.sub(r"\\.", "", source)):
            raise AdapterError(f"{where}: option {option}: {shown(source)} holds a [:class:] or braces that are no repeat "
                               "count, which this reader would not match as peft does")
        return cls(where, option, source, compiled, budget)

    def matches(self, module: str, whole: bool) -> bool:
        start = time.perf_counter()
        try:
            if whole:
                return self.compiled.fullmatch(module, timeout=self.budget.left()) is not None
            return self.compiled.match(module, timeout=self.budget.left()) is not None
        except TimeoutError:
            raise AdapterError(f"{self.where}: option {self.option}: the regular expression {shown(self.source)} takes over "
                               f"{PATTERN_BUDGET_S:g} s to match the module names; simplify it") from None
        finally:
            self.budget.spent += time.perf_counter() - start


@dataclass
class LoraOptions:
    """adapter_config.json checked: the options as peft applies them."""

    raw: dict  # the file as read
    r: int
    lora_alpha: float
    use_rslora: bool
    targets: GuardedPattern | list[str]
    excluded: GuardedPattern | list[str]
    layers: set[int] | None  # None: every layer
    rank_pattern: list[tuple[GuardedPattern, int]] = field(default_factory=list)
    alpha_pattern: list[tuple[GuardedPattern, float]] = field(default_factory=list)

    def targeted(self, module: str, layer: int) -> bool:
        """Whether peft would have put a LoRA layer on `module` (its full name), as peft decides."""
        if _named(self.excluded, module):
            return False
        if isinstance(self.targets, GuardedPattern):
            return self.targets.matches(module, whole=True)
        if not _named(self.targets, module):
            return False
        return self.layers is None or layer in self.layers

    def rank(self, module: str) -> int:
        return _pattern_value(self.rank_pattern, module, self.r)

    def scaling(self, module: str) -> float:
        rank = self.rank(module)
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _named(names: GuardedPattern | list[str], module: str) -> bool:
    if isinstance(names, GuardedPattern):
        return names.matches(module, whole=True)
    return any(module == name or module.endswith(f".{name}") for name in names)


def _pattern_value(patterns: list[tuple[GuardedPattern, float]], module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key matching the module name's end."""
    for pattern, value in patterns:
        if pattern.matches(module, whole=False):
            return value
    return default


def read_config(folder: Path) -> LoraOptions:
    path = folder / CONFIG_FILE
    if not _is_file(path):
        raise AdapterError(f"{one_line(folder)}: no {CONFIG_FILE} (not a peft adapter folder)")
    where = one_line(path)
    config = _parse(path, where)
    # First, so that another method's folder (which may have no r) is named as such.
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{where}: peft_type {shown(kind)} is not supported; only LORA adapters are")
    try:
        options = _Schema.model_validate(config)
    except ValidationError as exc:
        option = str(exc.errors()[0]["loc"][0])
        got = f"got {_described(config[option])}" if option in config else "missing"
        raise AdapterError(f"{where}: option {option}: expected {_EXPECTED[option]}, {got}") from None
    _check_meaning(config, options, where)
    return _compiled(config, options, where)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError) as exc:  # a name too long, a NUL in it
        raise AdapterError(f"{one_line(path)}: cannot be read ({exc})") from None


def _parse(path: Path, where: str) -> dict:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise AdapterError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes (peft writes about one kilobyte)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AdapterError(f"{where}: not valid JSON (not UTF-8: {exc.reason} at byte {exc.start})") from None
    depth = nesting_depth(text)
    if depth > MAX_NESTING:
        raise AdapterError(f"{where}: JSON nested {depth} levels deep, more than {MAX_NESTING}")
    try:
        config = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
        raise AdapterError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: expected a JSON object")
    return config


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def nesting_depth(text: str) -> int:
    """How deep the JSON text's arrays and objects nest (brackets inside strings do not count),
    without recursion and without Python per character: a run-time load is read in the engine
    core's loop, where a megabyte scanned character by character would stall every stream for
    ~0.1 s. Invalid JSON gives some number, then fails to parse."""
    codes = np.frombuffer(_STRING.sub("", text).encode(), dtype=np.uint8)
    steps = np.isin(codes, _OPENING).astype(np.int32) - np.isin(codes, _CLOSING)
    return int(np.cumsum(steps).max(initial=0))


_OPENING = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSING = np.frombuffer(b"]}", dtype=np.uint8)


def _check_meaning(config: dict, options: _Schema, path: str) -> None:
    """What would make our forward compute something else than peft's."""
    if options.use_dora:
        raise AdapterError(f"{path}: use_dora=true (DoRA) is not supported; only plain LoRA adapters are")
    if options.bias != "none":
        raise AdapterError(f"{path}: bias={shown(options.bias)} is not supported (the adapter would change the base's biases); only \"none\"")
    init = options.init_lora_weights
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(f"{path}: init_lora_weights={shown(init)} rewrites the base weights, which this model does not have")
    for key, value in sorted(config.items()):
        if key not in APPLIED and key not in NO_EFFECT_ON_INFERENCE and value not in (None, False, "", [], {}, "none"):
            raise AdapterError(f"{path}: option {shown(key)}={shown(value)} is not supported")
    pattern = options.layers_pattern
    if pattern not in (None, "", [], "h", ["h"]):
        raise AdapterError(f"{path}: layers_pattern={shown(pattern)} names no GPT-2 layer list (GPT-2's is \"h\")")


def _compiled(config: dict, options: _Schema, path: str) -> LoraOptions:
    budget = _Budget()

    def names_or_pattern(option: str, value: str | list[str] | None) -> GuardedPattern | list[str]:
        if isinstance(value, str):
            return GuardedPattern.compile(path, option, value, value, budget)
        return list(value or ())

    def keyed(option: str, patterns: dict | None) -> list:
        # peft's get_pattern_key: the key matched against the module name's end.
        return [(GuardedPattern.compile(path, f"{option}[{shown(key)}]", key, rf"(.*\.)?({key})$", budget), value)
                for key, value in (patterns or {}).items()]

    layers = options.layers_to_transform
    return LoraOptions(
        raw=config, r=options.r, lora_alpha=float(options.lora_alpha), use_rslora=bool(options.use_rslora),
        targets=names_or_pattern("target_modules", options.target_modules),
        excluded=names_or_pattern("exclude_modules", options.exclude_modules),
        layers=None if layers is None or layers == [] else set([layers] if isinstance(layers, int) else layers),
        rank_pattern=keyed("rank_pattern", options.rank_pattern), alpha_pattern=keyed("alpha_pattern", options.alpha_pattern),
    )
