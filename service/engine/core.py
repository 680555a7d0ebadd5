"""The engine core: one `step` = schedule → execute → update, as nano-vllm's LLMEngine.step and
vLLM v1's EngineCore.step:

- schedule: the Scheduler (scheduler.py) admits waiting requests into free KV-cache slots, says
  who decodes and which prompt chunks run: one StepPlan down;
- execute: the ModelRunner (runner.py) applies the plan to its input batch and cache, runs the
  forwards (prefill, decode), samples every row, computes the beam searches' candidates and
  queues one device→host copy: one LaunchedStep;
- update: the scheduler reads the launched step's tokens (step_reader.py: append, EOS, stops,
  length), finishes and fails requests: one StepResults up, sent as one CoreStep.

With overlap (CUDA) step n + 1 is executed before step n's tokens are read, whatever runs: a
request that needs its last token on the host to plan its step (a draft, a beam) sits out the
steps launched before that token was read; a grammar's rows do not: their step's forwards are
queued, step n is read, and then their masks are computed and the step's draw queued. The scheduler and the
runner never call each other: this loop passes the plan down and the tokens up. A beam search's
candidates come up with the tokens; its bookkeeping runs in update (service/engine/beams.py).

Token ids only: text, stop strings and response assembly belong to the HTTP side
(service/http/outputs.py). No HTTP, no asyncio, no IPC here: service/engine/process.py runs it in
its own process, and a test drives `step()` directly (or through service/inprocess.py, with text).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.gpt2 import GPT2
from model.block_tables import BLOCK_SIZE, blocks_for
from model.kv_cache import KVCache, bytes_per_token
from service.engine.adapters import ServedAdapters
from service.engine.grammar import Grammars
from service.engine.ngram_drafter import NgramSettings
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.engine.step_data import LaunchedStep
from service.engine.step_reader import StepResults
from service.engine.types import CoreStep, GenerationRequest, RequestFailed, StepStats

log = logging.getLogger(__name__)


# The service's default KV budget, in full-context sequences: the bytes its default of 16 fixed
# slots took before the cache was paged (--kv-cache-bytes sets it).
DEFAULT_KV_CACHE_SEQUENCES = 16


@dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8  # sequences decoded together; KV-cache rows
    max_len: int | None = None  # tokens per sequence (prompt + new); default: the model's context
    # The KV cache's memory budget: its block pool holds this many bytes of keys and values;
    # None: kv_cache_sequences sequences of max_len tokens (default max_slots of them, what a
    # cache of fixed slots took). max_slots bounds the sequences running, the budget their tokens.
    kv_cache_bytes: int | None = None
    # Else, on a GPU: this fraction of the device's memory free once the weights are loaded (as
    # vLLM's --gpu-memory-utilization), at most max_slots full-length sequences' (more is idle).
    kv_cache_fraction: float | None = None
    kv_cache_sequences: int | None = None
    max_waiting: int = 64  # requests queued beyond the running ones; more raise QueueFull
    # Prompt tokens one step prefills; a longer prompt is prefilled
    # in chunks of at most this many, between the decode steps of the running sequences.
    max_prefill_tokens: int = 512
    # Keep computed blocks findable by their content; a prompt shares its longest cached prefix.
    prefix_caching: bool = True
    # Decode with static shapes (graphs.py): captured as CUDA graphs on a GPU, run eagerly
    # elsewhere (tests prove the static path's tokens on the CPU).
    static_decode: bool = False
    # How a CUDA decode step's attention reads the cache's blocks (model/paged_attention.py).
    decode_attention: str = "gather"
    # Speculative decoding from n-gram drafts (speculation.py); None: off.
    speculative: NgramSettings | None = None
    # LoRA adapters loaded at start-up: (name, peft folder) pairs (model/lora.py).
    adapters: tuple[tuple[str, str], ...] = ()
    # Launch step n + 1 before reading step n's tokens, so the host's scheduling and
    # bookkeeping run while the device computes (SGLang's overlap scheduler, vLLM's async
    # scheduling). Tokens then reach the caller one step() later. None: on where the device runs
    # asynchronously (CUDA); on a CPU every op runs in the caller's thread, so there is nothing
    # to hide and the delay would only add a step to every token's latency.
    overlap: bool | None = None


def kv_blocks(engine: EngineConfig, max_len: int, config, dtype: torch.dtype, free_bytes: int | None = None) -> int | None:
    """Blocks the engine's KV budget holds (None: the cache's default, max_slots full rows).
    `free_bytes`: the device's free memory, where kv_cache_fraction applies (a GPU)."""
    per_block = bytes_per_token(config, dtype) * BLOCK_SIZE
    if engine.kv_cache_bytes is not None:
        budget = engine.kv_cache_bytes
    elif engine.kv_cache_fraction is not None and free_bytes is not None:
        budget = min(int(engine.kv_cache_fraction * free_bytes), engine.max_slots * blocks_for(max_len) * per_block)
    elif engine.kv_cache_sequences is not None:
        budget = engine.kv_cache_sequences * blocks_for(max_len) * per_block
    else:
        return None
    if budget < per_block:
        raise ValueError(f"a KV cache of {budget} bytes holds no block of {BLOCK_SIZE} positions ({per_block} bytes)")
    return budget // per_block


def device_free_bytes(device: torch.device) -> int | None:
    """The GPU's free memory, which a fraction budget takes its share of; None elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


class EngineCore:
    def __init__(
        self,
        model: GPT2,
        eos_token_id: int,
        config: EngineConfig = EngineConfig(),
        clock: Callable[[], float] = time.monotonic,
        grammars: Grammars | None = None,
    ) -> None:
        """`grammars`: the grammar engine over the model's tokenizer; None refuses constrained
        requests."""
        self.model = model.eval()
        self.grammars = grammars
        self.eos_token_id = eos_token_id
        self.config = config
        self.device = model.device
        self.clock = clock
        max_len = config.max_len or model.config.n_positions
        free = device_free_bytes(self.device)
        self.cache = KVCache(model.config, config.max_slots, max_len, self.device, model.dtype,
                             num_blocks=kv_blocks(config, max_len, model.config, model.dtype, free),
                             decode_attention=config.decode_attention)
        self.scheduler = Scheduler(self.cache, config.max_waiting, config.max_prefill_tokens, eos_token_id,
                                   config.prefix_caching, grammars, config.speculative)
        self.runner = ModelRunner(self.model, self.cache, eos_token_id, grammars, config.speculative,
                                  config.static_decode, config.adapters)
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self._launched: LaunchedStep | None = None  # the step launched, tokens not yet read
        self._counted = (0, 0)  # preemptions and prefix evictions the steps' stats have reported

    @property
    def adapters(self) -> ServedAdapters:
        return self.runner.adapters

    # --- entry points -------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest]) -> None:
        """Queue requests to be prefilled together. Raises ValueError, QueueFull, EngineStopped."""
        grammars = {r.params.grammar for r in requests} - {None}
        if grammars and self.grammars is None:
            raise ValueError("this engine has no grammar engine: constrained decoding is off")
        self.scheduler.submit(requests, [self.adapters.index(r.adapter) for r in requests])
        for grammar in grammars:
            self.grammars.prepare(grammar)  # compiled off the step loop; admitted once it is

    def cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None

    @property
    def running_ahead(self) -> bool:
        """The last step left its tokens in flight (overlap): they are read after the next launch."""
        return self._launched is not None

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> CoreStep:
        started = self.clock()
        results = StepResults()
        failed: list[RequestFailed] = []
        prefill_tokens = cached_tokens = decode_tokens = batch_size = prefix_hits = 0
        scheduler, runner = self.scheduler, self.runner
        try:
            # Overlap: this step is launched before the previous one's tokens are read. A request
            # that needs its last token on the host to build its next step (a draft, a beam)
            # sits out the steps launched before that token is read (Scheduler.schedule).
            previous, self._launched = self._launched, None
            if self.grammars is not None and scheduler.waiting.count:
                failed += scheduler.refuse_uncompiled()
            # With a step in flight, some sequences may have drawn their last token already.
            plan = scheduler.schedule(started, runner.exhausted() if previous is not None else [], previous is not None)
            results.done += [scheduler.finish(state) for state in plan.cancelled]
            failed += plan.failed
            prefill_tokens, cached_tokens = plan.prefill_tokens, plan.cached_tokens
            prefix_hits = cached_tokens // self.cache.block_size  # blocks: reuse is whole blocks
            runner.prepare(plan)
            deferred = self.overlap
            launched = None
            if plan.prefill or plan.decode:
                launched = runner.execute(plan, deferred)
                if deferred:
                    scheduler.in_flight(launched)
                launched.releases = scheduler.releases
                batch_size, decode_tokens = len(launched.rows.row_of), len(launched.rows.decoding)
                if launched.rows.beams:  # one output token a step each decoding beam (not a prompt's first)
                    results.decode_output_tokens += sum(len(group.rows) for group in launched.rows.beams
                                                        if not group.state.beam.first_step)
            # One step's tokens read: the one before (overlap), else this one.
            read = previous if deferred else launched
            if read is not None:
                scheduler.update_from_output(read, runner.read(read), results)
                if read.rows.drafted:  # its sequences' lengths and last tokens, known now
                    runner.after_read(read)
            if launched is not None and launched.awaiting is not None:  # a grammar's masks needed those tokens
                runner.draw(launched)
            if deferred:
                self._launched = launched
            failed += results.failed
            if self.runner.adapters.unloading:
                self.free_unloaded_adapters()
        except Exception as exc:  # e.g. out of device memory: fail these requests, keep serving
            log.exception("engine step failed")
            self._launched = None
            failed += [
                RequestFailed(state.request.request_id, f"engine step failed: {exc}")
                for state in scheduler.abort_running()
            ]
        stats = StepStats(
            batch_size=batch_size,
            prefill_tokens=prefill_tokens,
            cached_prompt_tokens=cached_tokens,
            decode_tokens=decode_tokens,
            running=len(scheduler.active.states),
            waiting=scheduler.waiting.count,
            kv_slots_used=self.cache.slots_used,
            kv_slots_total=self.cache.max_slots,
            step_seconds=self.clock() - started,
            finished=len(results.done),
            decode_output_tokens=results.decode_output_tokens,
            draft_tokens=results.draft_tokens,
            accepted_tokens=results.accepted_tokens,
            prefix_hits=prefix_hits,
            **self._kv_stats(),
        )
        return CoreStep(results.tokens, results.started, results.done, failed, stats)

    def _kv_stats(self) -> dict[str, int]:
        """The block pool's use and the preemptions and evictions since the last step's stats."""
        cache, scheduler = self.cache, self.scheduler
        counts = (scheduler.preemptions, cache.pool.evictions)
        (preemptions, evictions), self._counted = [now - before for now, before in zip(counts, self._counted)], counts
        return {"kv_blocks_used": cache.num_blocks - cache.blocks_free, "kv_blocks_total": cache.num_blocks,
                "preemptions": preemptions, "prefix_evictions": evictions}

    def free_unloaded_adapters(self) -> None:
        """Free the adapters being unloaded that no request uses any more: after each step, and
        by the core's loop when an unload arrives while no step runs."""
        # A launched step's kernels are already queued with the tensors they read (freed memory
        # is reused in stream order), so only the requests that will still run count.
        for index in self.adapters.free_unused(self.scheduler.adapter_in_use):
            self.scheduler.prefix.forget_adapter(index)  # its index may go to another adapter
