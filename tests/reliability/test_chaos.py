"""Chaos beside plain streams: while a few greedy streams run, a live server is sent malformed
and NaN adapters, requests whose logits turn non-finite mid-generation (injected in the engine
core: GPT2_INJECT_NONFINITE), grammars llguidance cannot follow, and an adapter unloaded while
idle. Every plain stream must get exactly its solo tokens, the engine core must keep its pid,
/health must answer 200 throughout, and each hostile request must get its own clear 4xx (never a
5xx). RELIABILITY_SOAK=1 runs it on the default 124M model with more rounds (make reliability)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from service.engine.faults import INJECT_ENV
from tests.model.test_lora import PEFT_CONFIGS, peft_adapter
from tests.reliability.results import record
from tests.service.live import live_server

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

SOAK = os.environ.get("RELIABILITY_SOAK") == "1"
STREAMS, ROUNDS = (4, 3) if SOAK else (3, 1)
HOSTILE_SEED = 909090
KEY = {"Authorization": "Bearer chaos"}
PLAIN_PROMPTS = ["The quick brown fox", "Once upon a time there", "In the beginning the", "A long way from home"]
NEW_TOKENS = 48

# adapter_config.json variants that once ended the engine core (re.error, TypeError, RecursionError).
MALFORMED_CONFIGS = {
    "target_modules_bad_regex": {"target_modules": "("},
    "layers_to_transform_text": {"layers_to_transform": "abc"},
    "target_modules_number": {"target_modules": 5},
    "rank_pattern_bad_regex": {"rank_pattern": {"(": 4}},
    "alpha_pattern_text": {"alpha_pattern": {"c_attn": "x"}},
}
DEEP_JSON = 100_000
GRAMMARS = {
    "regex_blowup": {"type": "regex", "value": "(a{1000}){1000}"},
    "regex_empty_only": {"type": "regex", "value": r"[^\s\S]"},
    "ref_loop": {"type": "json", "value": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
    "ref_cycle": {"type": "json", "value": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
    "array_of_itself": {"type": "json", "value": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
    "wide_object": {"type": "json", "value": {"type": "object", "required": [f"p{i}" for i in range(2000)],
                                             "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}},
}


def stream_tokens(client: httpx.Client, prompt: str) -> tuple[list[int], list[float], str | None]:
    """A greedy TGI stream: its token ids, their arrival times, and an error event's text if any."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    ids, times, error = [], [], None
    with client.stream("POST", "/generate_stream", json=body, headers=KEY) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    error = event["error"]
                else:
                    ids.append(event["token"]["id"])
                    times.append(time.monotonic())
    return ids, times, error


def adapter_folder(base: Path, tiny_model_dir: Path, name: str) -> Path:
    return peft_adapter(base / name, tiny_model_dir, seed=3, **PEFT_CONFIGS["attention-only"])


def hostile_adapters(good: Path, root: Path) -> dict[str, Path]:
    """Copies of a good peft folder, each broken in one way."""
    config = json.loads((good / "adapter_config.json").read_text())
    folders = {}
    for name, change in MALFORMED_CONFIGS.items():
        folder = root / name
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
        folders[name] = folder
    deep = root / "deep_json"
    deep.mkdir()
    (deep / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    (deep / "adapter_config.json").write_text(json.dumps(config)[:-1] + ', "deep": ' + "[" * DEEP_JSON + "]" * DEEP_JSON + "}")
    folders["deep_json"] = deep
    nan = root / "nan_weights"
    nan.mkdir()
    (nan / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(good / "adapter_model.safetensors"))
    save_file({k: v * float("nan") if "lora_B" in k else v for k, v in tensors.items()}, str(nan / "adapter_model.safetensors"))
    folders["nan_weights"] = nan
    return folders


class Chaos:
    """The hostile requests, one after another, each answer kept by name."""

    def __init__(self, client: httpx.Client, good_adapter: Path, broken: dict[str, Path]) -> None:
        self.client, self.good, self.broken = client, good_adapter, broken
        self.answers: dict[str, tuple[int, str]] = {}

    def post(self, name: str, path: str, body: dict) -> None:
        response = self.client.post(path, json=body, headers=KEY)
        self.answers[name] = (response.status_code, response.text)

    def run(self, round_: int) -> None:
        for name, folder in self.broken.items():
            self.post(f"adapter:{name}", "/v1/load_lora_adapter", {"lora_name": f"{name}-{round_}", "lora_path": str(folder)})
        prompt = "Tell me something"
        injected = {"max_new_tokens": 16, "do_sample": True, "seed": HOSTILE_SEED}
        self.post("nonfinite:whole", "/generate", {"inputs": prompt, "parameters": injected})
        with self.client.stream("POST", "/generate_stream", json={"inputs": prompt, "parameters": injected}, headers=KEY) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        errors = [e["error"] for e in events if "error" in e]
        self.answers["nonfinite:stream"] = (r.status_code if errors else 500, errors[0] if errors else json.dumps(events[-1:]))
        for name, grammar in GRAMMARS.items():
            self.post(f"grammar:{name}", "/generate",
                      {"inputs": "Answer:", "parameters": {"max_new_tokens": 16, "details": True, "grammar": grammar}})
        # Unloaded while idle, then loaded again under the same name: free at once, not "being unloaded".
        name = f"idle-{round_}"
        self.post("adapter:load", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(self.good)})
        self.post("adapter:use", "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 4, "adapter_id": name}})
        self.post("adapter:unload", "/v1/unload_lora_adapter", {"lora_name": name})
        self.post("adapter:reload", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(self.good)})
        self.post("adapter:unload-again", "/v1/unload_lora_adapter", {"lora_name": name})


def gaps(times_by_stream: list[list[float]]) -> list[float]:
    return [after - before for times in times_by_stream for before, after in zip(times, times[1:])]


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else 0.0


def plain_load(url: str, prompts, rounds: int) -> list[list[float]]:
    """Each prompt streamed `rounds` times, all prompts at once: their tokens' arrival times."""
    times: list[list[float]] = []

    def stream(prompt: str) -> None:
        with httpx.Client(base_url=url, timeout=120) as own:
            times.extend(stream_tokens(own, prompt)[1] for _ in range(rounds))

    threads = [threading.Thread(target=stream, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return times


def test_hostile_requests_fail_alone_beside_plain_streams(tiny_model_dir, default_model_dir, tmp_path):
    model_dir = default_model_dir if SOAK else tiny_model_dir
    good = adapter_folder(tmp_path, model_dir, "good")
    broken = hostile_adapters(good, tmp_path)
    env = {INJECT_ENV: f"seed={HOSTILE_SEED},after=3"}
    with live_server(model_dir, env=env, api_key="chaos", max_batch_size=8) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        solo = {prompt: stream_tokens(client, prompt)[0] for prompt in PLAIN_PROMPTS[:STREAMS]}
        baseline = plain_load(server.url, solo, rounds=2)  # the same streams, together, with no chaos
        core_pid = server.engine_core_pid()
        health, stop = [], threading.Event()

        def poll_health() -> None:
            while not stop.is_set():
                health.append(server.get("/health").status_code)
                time.sleep(0.05)

        plain: dict[str, list] = {prompt: [] for prompt in solo}
        chaos_done = threading.Event()

        def keep_streaming(prompt: str) -> None:
            with httpx.Client(base_url=server.url, timeout=120) as own:
                while not chaos_done.is_set() or not plain[prompt]:
                    plain[prompt].append(stream_tokens(own, prompt))

        threads = [threading.Thread(target=poll_health)] + [threading.Thread(target=keep_streaming, args=(p,)) for p in solo]
        for thread in threads:
            thread.start()
        chaos = Chaos(client, good, broken)
        started = time.monotonic()
        try:
            for round_ in range(ROUNDS):
                chaos.run(round_)
        finally:
            chaos_done.set()
            for thread in threads[1:]:
                thread.join(300)
            stop.set()
            threads[0].join(10)
        chaos_seconds = time.monotonic() - started

        # Every plain stream, every time, exactly its solo tokens, no error event.
        runs = [(prompt, ids, error) for prompt, got in plain.items() for ids, _, error in got]
        assert all(error is None for _, _, error in runs), [e for *_, e in runs if e]
        assert all(ids == solo[prompt] for prompt, ids, _ in runs)
        assert server.engine_core_pid() == core_pid
        assert health and set(health) == {200}
        # Each hostile request: its own 4xx with a message saying what was wrong.
        answers = chaos.answers
        for name in [*MALFORMED_CONFIGS, "deep_json", "nan_weights"]:
            status, text = answers[f"adapter:{name}"]
            assert 400 <= status < 500 and json.loads(text)["error"], (name, status, text)
        assert "finite" in answers["adapter:nan_weights"][1]
        assert answers["nonfinite:whole"][0] == 424 and "not finite" in answers["nonfinite:whole"][1]
        assert answers["nonfinite:stream"][0] == 200 and "not finite" in answers["nonfinite:stream"][1]
        for name in GRAMMARS:
            status, text = answers[f"grammar:{name}"]
            assert status == 422 and json.loads(text)["error_type"] == "validation", (name, status, text)
        for step in ("load", "use", "unload", "reload", "unload-again"):
            assert answers[f"adapter:{step}"][0] == 200, (step, answers[f"adapter:{step}"])
        assert server.metric("gpt2_request_failures_total", cause="nonfinite_logits") >= 2 * ROUNDS
        during = gaps([times for got in plain.values() for _, times, _ in got])
        alone = gaps(baseline)
        record("chaos_soak" if SOAK else "chaos", {
            "model": model_dir.name, "streams": len(solo), "plain_runs": len(runs), "rounds": ROUNDS,
            "hostile_requests": len(answers) * ROUNDS, "chaos_seconds": round(chaos_seconds, 1),
            "statuses": sorted({status for status, _ in answers.values()}), "health_checks": len(health),
            "gap_p50_alone_ms": round(1000 * statistics.median(alone), 2), "gap_p99_alone_ms": round(1000 * percentile(alone, 99), 2),
            "gap_p50_during_ms": round(1000 * statistics.median(during), 2),
            "gap_p99_during_ms": round(1000 * percentile(during, 99), 2),
        })
