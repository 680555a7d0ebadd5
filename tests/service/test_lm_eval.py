"""lm-evaluation-harness against a live server: its `local-completions` model (OpenAI
completions with echo + logprobs, and its remote tokenizer over /tokenizer_info, /tokenize,
/detokenize) gives per-item loglikelihoods equal to the harness's own HF backend (transformers)
reading the same folder.

No data set can be downloaded: the tasks are a handful of items written here, one
loglikelihood task (lambada-style: context → continuation) and one multiple-choice task
(hellaswag-style), in the harness's own task YAML.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import TINY
from tests.model.hf_reference import load_reference
from tests.service.conftest import LOGPROB_TOLERANCE
from tests.service.live import live_server

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.slow

CONTINUATIONS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "One, two, three,", "continuation": " four"},
    {"context": "She opened the door and", "continuation": " walked into the room."},
    {"context": "ü∂ unicode → text", "continuation": " ✓ done"},
]
CHOICES = [
    {"query": "He poured the water into the", "choices": [" glass.", " sky.", " idea."], "label": 0},
    {"query": "To bake bread you need", "choices": [" flour", " a hammer", " rain"], "label": 0},
]


@torch.no_grad()
def greedy_item(model_dir: Path) -> dict:
    """An item whose continuation is transformers' greedy choice: its is_greedy must be True."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_reference(model_dir, TINY)
    ids = tokenizer("Greedy decoding picks")["input_ids"]
    for _ in range(2):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    context = tokenizer.decode(ids[:-2])
    return {"context": context, "continuation": tokenizer.decode(ids[-2:])}


def write_tasks(folder: Path, greedy: dict) -> None:
    """Two task YAMLs over local jsonl files (the harness reads them with `datasets`' json loader)."""
    for name, items in (("continuations", CONTINUATIONS + [greedy]), ("choices", CHOICES)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / "tiny_loglikelihood.yaml").write_text(
        f"""task: tiny_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'continuations.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )
    (folder / "tiny_choice.yaml").write_text(
        f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'choices.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )


def per_item(results: dict, task: str) -> list[tuple[float, bool]]:
    """Each request's (loglikelihood, is_greedy), in the harness's order."""
    return [tuple(resp[0]) for sample in results["samples"][task] for resp in sample["resps"]]


def evaluate(model: str, model_args: dict, tasks: Path) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tiny_loglikelihood", "tiny_choice"],
        # Only these tasks: indexing the harness's thousands of built-in ones takes seconds.
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )


def test_local_completions_equals_the_harness_hf_backend(tiny_model_dir, tmp_path, monkeypatch):
    # The json loader must never look for a hub copy; the server is on loopback.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    greedy = greedy_item(tiny_model_dir)
    write_tasks(tmp_path, greedy)
    reference = evaluate("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"}, tmp_path)
    with live_server(tiny_model_dir) as server:
        served = evaluate(
            "local-completions",
            # tokenizer_backend=remote: the harness tokenizes through the server's own endpoints.
            {"base_url": f"{server.url}/v1/completions", "model": "gpt2", "tokenizer_backend": "remote",
             "num_concurrent": 1, "max_retries": 1, "batch_size": 2},
            tmp_path,
        )
    for task, count in (("tiny_loglikelihood", len(CONTINUATIONS) + 1), ("tiny_choice", 6)):
        expected, actual = per_item(reference, task), per_item(served, task)
        assert len(actual) == len(expected) == count
        # A loglikelihood sums a few tokens' log-probabilities, each within LOGPROB_TOLERANCE.
        assert [ll for ll, _ in actual] == pytest.approx([ll for ll, _ in expected], abs=4 * LOGPROB_TOLERANCE)
        assert [greedy for _, greedy in actual] == [greedy for _, greedy in expected]
        assert served["results"][task]["acc,none"] == reference["results"][task]["acc,none"]
    # The greedy item (written last) is greedy by both, so the alternatives were read right.
    assert per_item(served, "tiny_loglikelihood")[-1][1] is True
