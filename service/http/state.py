"""What every route reads: `request.app.state.service`, one ServiceState per app."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from model.gpt2 import GPT2
from service.http.admission import Limits
from service.http.client import EngineClient
from service.http.generation import Generations
from service.http.metrics import Metrics
from service.settings import Settings
from weights.tokenizer import GPT2Tokenizer


@dataclass
class ServiceState:
    settings: Settings
    model: GPT2
    tokenizer: GPT2Tokenizer
    origin: dict
    metrics: Metrics = field(default_factory=Metrics)
    limits: Limits | None = None
    client: EngineClient | None = None  # the engine core's process; started by the app's lifespan
    generations: Generations | None = None  # the HTTP side of a generation
    started_at: float = field(default_factory=time.time)
    serving: bool = False  # the lifespan has started the engine core

    def __post_init__(self) -> None:
        if self.limits is None:
            config = self.model.config
            self.limits = Limits.from_settings(self.settings, config.n_positions, config.vocab_size)


def service_state(request: Request) -> ServiceState:
    return request.app.state.service
