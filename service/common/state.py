"""What every route reads, whichever side it is on: `request.app.state.service`, one per app.

The HTTP side extends it with the engine client and admission limits (service/http/state.py);
the analysis reads only this part: the settings, the model's config and tokenizer, the metrics.
No weights: an HTTP process holds none (the engine core and the analysis process do).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from model.config import GPT2Config
from service.common.metrics import Metrics
from service.settings import Settings
from weights.tokenizer import GPT2Tokenizer


@dataclass
class SharedState:
    settings: Settings
    config: GPT2Config  # config.json's: what requests are checked against
    tokenizer: GPT2Tokenizer
    origin: dict
    metrics: Metrics = field(default_factory=Metrics)
    started_at: float = field(default_factory=time.time)


def shared_state(request: Request) -> SharedState:
    return request.app.state.service
