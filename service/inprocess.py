"""The engine core and the output processor in one process, stepped by the caller.

What the server splits across two processes (service/http/client.py), joined for tests, benchmarks
and scripts that want text without a server:

    engine = Engine(model, tokenizer, EngineConfig(max_slots=8))
    [result] = engine.generate([request])          # FinishedRequest, with text
    engine.submit([request]); output = engine.step()  # or step by step: events with text
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from model.gpt2 import GPT2
from service.engine.core import EngineConfig, EngineCore
from service.engine.grammar import Grammars
from service.engine.types import FinishedRequest, GenerationRequest, RequestFailed, StepStats, TokenEvent
from service.http.outputs import OutputProcessor
from weights.tokenizer import GPT2Tokenizer

__all__ = ["Engine", "EngineConfig", "StepOutput"]


@dataclass
class StepOutput:
    events: list[TokenEvent]  # by request, each request's in order
    finished: list[FinishedRequest]
    stats: StepStats
    failed: list[RequestFailed] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        model: GPT2,
        tokenizer: GPT2Tokenizer,
        config: EngineConfig = EngineConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        grammars = Grammars.for_tokenizer(tokenizer, model.config.vocab_size)
        self.core = EngineCore(model, tokenizer.eos_token_id, config, clock, grammars)
        self.outputs = OutputProcessor(tokenizer, clock)

    @property
    def cache(self):
        return self.core.cache

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def input_batch(self):
        return self.core.runner.batch

    def submit(self, requests: list[GenerationRequest]) -> None:
        """Queue requests to be prefilled together. Raises ValueError, QueueFull, EngineStopped."""
        self.core.submit(requests)
        self.outputs.add(requests)

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step, which reports the request finished as cancelled."""
        self.core.cancel(request_id)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> StepOutput:
        core_step = self.core.step()
        processed = self.outputs.process(core_step)
        for request_id in processed.abort:
            self.core.cancel(request_id)
        events = [event for mine in processed.events.values() for event in mine]
        return StepOutput(events, processed.finished, core_step.stats, processed.failed)

    def generate(self, requests: list[GenerationRequest]) -> list[FinishedRequest]:
        """Run steps until these requests finish."""
        self.submit(requests)
        results: dict[str, FinishedRequest] = {}
        while len(results) < len(requests):
            output = self.step()
            if output.failed:
                raise RuntimeError(output.failed[0].message)
            results.update((f.request_id, f) for f in output.finished)
        return [results[r.request_id] for r in requests]
