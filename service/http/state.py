"""What the HTTP routes read: the shared state (service/common/state.py) plus the engine client,
the generations and the admission limits."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from service.common.errors import ApiError
from service.common.state import SharedState
from service.http.admission import Limits
from service.http.chat_template import ChatTemplate
from service.engine.grammar import Grammars
from service.http.client import EngineClient
from service.http.generation import Generations
from service.http.grammar import GrammarChecker


# The names TGI's clients give for "the model this server serves": huggingface_hub's
# InferenceClient(base_url=...) sends "dummy", TGI's own docs "tgi" (TGI ignores the name).
TGI_MODEL_NAMES = ("tgi", "dummy")


@dataclass
class ServiceState(SharedState):
    limits: Limits | None = None
    client: EngineClient | None = None  # the engine core's process; started by the app's lifespan
    generations: Generations | None = None  # the HTTP side of a generation
    serving: bool = False  # the lifespan has started the engine core
    parameters: int = 0  # the served model's, counted from its config (/info)
    grammars: GrammarChecker | None = None  # compiles a request's grammar once, to refuse bad ones
    chat_template: ChatTemplate | None = None  # renders /v1/chat/completions' conversations (None: no template)

    def __post_init__(self) -> None:
        config = self.config
        if self.limits is None:
            self.limits = Limits.from_settings(self.settings, config.n_positions, config.vocab_size)
        if self.grammars is None:
            self.grammars = GrammarChecker(Grammars.for_tokenizer(self.tokenizer, config.vocab_size), self.metrics)


    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters a request may name (the engine core's list)."""
        return self.client.adapters if self.client is not None else []

    def served_adapter(self, name: str | None, error_type: str = "model_not_found") -> str | None:
        """A request's model or adapter name → its adapter (None: the base model). ApiError 404
        naming it when nothing by that name is served (`error_type`: OpenAI's code for it; TGI's
        clients know only their own kinds, and take "validation")."""
        if name is None or name == self.settings.model_name or (name in TGI_MODEL_NAMES and name not in self.adapters):
            return None
        if name in self.adapters:
            return name
        served = ", ".join(repr(n) for n in [self.settings.model_name, *self.adapters])
        raise ApiError(404, error_type, f"model {name!r} is not served here; this server serves {served}")


def service_state(request: Request) -> ServiceState:
    return request.app.state.service
