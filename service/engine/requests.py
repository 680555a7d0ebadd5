"""The engine's request data: a request from submission to its answer (RequestState), each of
its generated continuations (Sequence), and what one step runs (StepPlan, of PrefillChunks).

The scheduler creates and updates them; the model runner reads a plan and writes only what its
forwards computed (a prefill's prompt scores, a beam step's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.lora import BASE
from service.engine.draft_policy import DraftAcceptance
from service.engine.ngram_drafter import NgramIndex
from service.engine.types import FinishReason, GenerationRequest, PromptScores, SamplingParams
from service.engine.validation import slots_needed


@dataclass
class Sequence:
    """One generated continuation, owning one KV-cache slot while it runs."""

    index: int  # sequence_index within its request
    slot: int
    token_ids: list[int]  # prompt + generated
    prompt_length: int
    finish_reason: FinishReason | None = None
    # Leading token_ids whose keys and values the slot holds, written by completed forwards:
    # what the prefix cache may register. All but the last once decoding.
    cached: int = 0
    # The prefix cache's keys of its leading full blocks, as far as it registered them.
    block_keys: list[bytes] = field(default_factory=list)
    drafter: NgramIndex | None = None  # speculative decoding's n-gram index of token_ids
    draft: list[int] = field(default_factory=list)  # this step's drafted tokens
    acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)  # how its drafts fared
    matcher: object | None = None  # its grammar's llguidance.LLMatcher, when constrained
    adapter: int = BASE  # its LoRA adapter's index in the model's LoraSet (BASE: none)
    seed: int = 0  # its sampling seed (sampled requests), in [0, 2^63)
    # Tokens sampled on the device that the host has not read yet (the core's overlap: step
    # n + 1 is launched before step n's tokens are read). Its slot holds keys and values for
    # `cached + pending` positions; its next token is drawn at `len(token_ids) + pending`.
    pending: int = 0

    @property
    def written(self) -> int:
        """Positions its slot holds (or will once the queued forwards have run)."""
        return self.cached + self.pending

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_length :]


@dataclass
class RequestState:
    """A request from submission to its FinishedRequest."""

    request: GenerationRequest
    sequences: list[Sequence] = field(default_factory=list)  # filled at admission
    seed: int | None = None
    beam: object | None = None  # model.beam.BeamSearch for num_beams > 1
    scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_scores: PromptScores | None = None
    # Prompt tokens in the first sequence's slot: reused from the prefix cache at admission, then
    # grown chunk by chunk; the request decodes once it reaches the prompt's length.
    prefilled: int = 0
    reused: int = 0  # of which taken from the prefix cache
    # Each step's plan needs the host's view of its last tokens (beams, drafts): it sits out a step
    # launched before its last token was read (the core's overlap).
    host_paced: bool = False
    reported: bool = False  # its RequestDone was sent: nothing more is said about it
    # Preempted after it generated tokens (scheduler._preempt): its `prompt_length` is then the
    # tokens to prefill again (prompt and generated, but the last), and that prefill samples nothing.
    resumed: bool = False
    adapter: int = BASE  # its LoRA adapter's index (set at submission, from the request's name)

    def __post_init__(self) -> None:
        self.prompt_length = len(self.request.prompt_ids)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def slots_needed(self) -> int:
        return slots_needed(self.params)

    @property
    def live(self) -> list[Sequence]:
        sequences = self.sequences
        if len(sequences) == 1:  # most requests, read several times per row per step: no new list
            return sequences if sequences[0].finish_reason is None else []
        return [s for s in sequences if s.finish_reason is None]

    @property
    def done(self) -> bool:
        return bool(self.sequences) and all(s.finish_reason is not None for s in self.sequences)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_length

    @property
    def score_alternatives(self) -> int | None:
        """None when the request does not score its prompt, else the alternatives it wants."""
        return self.params.top_logprobs if self.params.prompt_logprobs else None


@dataclass
class PrefillChunk:
    """Prompt tokens [start, end) of one request, run this step into its first slot."""

    state: RequestState
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == self.state.prompt_length and not self.state.resumed

    @property
    def tokens(self) -> list[int]:
        """The chunk's tokens: the prompt's, or a resumed sequence's own."""
        return self.state.sequences[0].token_ids[self.start : self.end]


@dataclass
class StepPlan:
    prefill: list[PrefillChunk]  # prompt chunks run this step; the last one of a prompt samples
    decode: list[RequestState]  # prefilled and running: one token per live sequence
    cancelled: list[RequestState]  # leave now; their slots (if any) are already free
    # Done before the forwards: (from slot, to slot) packing moves (block-table moves already
    # made by the scheduler: the input batch's rows follow).
    moves: list[tuple[int, int]]
    completing: list[RequestState]  # the requests whose prompt's last chunk runs: they sample
    prefill_tokens: int  # prompt tokens this step prefills
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache by this step's admissions
    # Requests admitted by this plan: the runner writes their sequences into its input batch, on
    # their slots after the moves.
    admitted: list[RequestState] = field(default_factory=list)
    drafted: list[Sequence] = field(default_factory=list)  # the decoding sequences verifying a draft (speculation.py)
    running: int = 0  # requests running after admission
    # Of which some need each token on the host before their next step (beams, drafts).
    host_paced: int = 0
    beams: int = 0  # of which beam searches
    sitting_out: list[int] = field(default_factory=list)  # slots of host-paced sequences not stepped
    # What the beam searches read since the last plan ask of the cache and the batch, before
    # anything else (service/engine/beams.py's BeamMove).
    beam_moves: list = field(default_factory=list)
    # Admitted requests that failed to start (faults.start_failed), each alone: answered now.
    failed: list = field(default_factory=list)
