"""The analysis of one or several models, as the JSON the route returns and the CLI writes.

A `Subject` is a model with its name and tokenizer. With several (GPT-2 beside a Post-LN GPT-1,
the document's §2.3 comparison), the body is the first model's report with the others' under
"compare", each with its own "model"; every model tokenizes the texts with its own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model.analysis import AnalysedModel, analyze, check_layers, check_sequences
from model.lora import AppliedAdapter
from model.post_ln import PostLNGPT
from weights.post_ln import load_analysis_model
from weights.tokenizer import GPT2Tokenizer


@dataclass
class Subject:
    name: str
    model: AnalysedModel
    tokenizer: object  # anything with encode_batch(texts) -> list[list[int]]
    adapter: AppliedAdapter | None = None  # a LoRA adapter applied to the whole model

    def describe(self) -> dict:
        config = self.model.config
        return {
            "name": self.name, "adapter": None if self.adapter is None else self.adapter.name, "architecture": "post-ln" if isinstance(self.model, PostLNGPT) else "pre-ln",
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }


class PlainTokenizer:
    """A tokenizer.json without GPT-2's <|endoftext|> (GPT-1's): the analysis only encodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def load_subject(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32, name: str | None = None) -> Subject:
    """A GPT-2 or Post-LN model folder with its tokenizer (CheckpointError, ValueError, OSError)."""
    model = load_analysis_model(model_dir, device=device, dtype=dtype)
    try:
        tokenizer = GPT2Tokenizer.from_dir(model_dir)
    except ValueError as exc:  # a tokenizer without <|endoftext|>: GPT-1's, if it has a tokenizer.json
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(f"{model_dir}: {exc}") from exc
        tokenizer = PlainTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    return Subject(name or model_dir.resolve().name, model, tokenizer)


def encode(subjects: list[Subject], texts: list[str] | None, token_ids: list[list[int]] | None) -> list[list[list[int]]]:
    """Each subject's token ids: its own tokenization of the texts, or the given ids."""
    if texts is None:
        return [token_ids for _ in subjects]
    by_tokenizer: dict[int, list[list[int]]] = {}
    for subject in subjects:
        if id(subject.tokenizer) not in by_tokenizer:
            by_tokenizer[id(subject.tokenizer)] = subject.tokenizer.encode_batch(texts)
    return [by_tokenizer[id(s.tokenizer)] for s in subjects]


def check_request(
    subjects: list[Subject],
    token_ids: list[list[list[int]]],
    layers: list[int] | None,
    max_tokens: int | None = None,
    what: str = "text",
) -> None:
    """ValueError naming the item (and the model, when there are several) that cannot be analysed."""
    for subject, ids in zip(subjects, token_ids):
        try:
            check_layers(subject.model.config, layers)
            check_sequences(subject.model.config, ids, max_tokens, what)
        except ValueError as exc:
            raise ValueError(f"model {subject.name!r}: {exc}" if len(subjects) > 1 else str(exc)) from None


def report_dict(subject: Subject, token_ids: list[list[int]], method: str, layers: list[int] | None) -> dict:
    """One model's body: its identity, then the report."""
    return {"model": subject.describe()} | analyze(subject.model, token_ids, method, layers, subject.adapter).to_dict()


def reports(subjects: list[Subject], token_ids: list[list[list[int]]], method: str, layers: list[int] | None) -> list[dict]:
    return [report_dict(s, ids, method, layers) for s, ids in zip(subjects, token_ids)]


def combined(all_reports: list[dict]) -> dict:
    """The first report, with the others under "compare" when there are others."""
    first, *others = all_reports
    return first | {"compare": others} if others else first
