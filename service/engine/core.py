"""The engine core: one `step` = schedule → run → postprocess, as nano-vllm's LLMEngine.step.

- schedule: the Scheduler admits waiting requests into free KV-cache slots and says who decodes;
- run: one padded forward for the admitted prompts (prefill), one batched forward with one token
  per running sequence (decode), then one sampling call over every row outside beam search and
  one device→host copy (each beam-search request adds its own step and copy);
- postprocess: append token ids, check EOS and length, free finished slots, report one CoreStep.

Where the rows go (layout.py), the sampling (step_sampler.py) and the reading of a step's tokens
(step_reader.py) are modules of their own; the per-slot table they share (slot_rows.py) is the
persistent batch.

Token ids only: text, stop strings and response assembly belong to the HTTP side
(service/http/outputs.py), so the core's per-step Python work is a few list operations per row.
No HTTP, no asyncio, no IPC here: service/engine/process.py runs it in its own process, and a
test drives `step()` directly (or through service/inprocess.py, with text).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model.gpt2 import GPT2
from model.kv_cache import KVCache, SlotBatch
from model.transfer import to_device
from service.engine.adapters import ServedAdapters
from service.engine.beams import advance_beams, beam_results, start_beam_search
from service.engine.faults import NONFINITE, NonfiniteInjection, RowFault, RowFaultError, beam_failed
from service.engine.forward import forward_from
from service.engine.grammar import Grammars
from service.engine.graphs import StaticDecode
from service.engine.prompt_scores import add_prompt_scores
from service.engine.scheduler import PrefillChunk, RequestState, Scheduler, Sequence, StepPlan
from service.engine.layout import StepLayout
from service.engine.slot_rows import SlotRows
from service.engine.speculation import new_drafter, propose
from service.engine.step_reader import StepReader, StepResults
from service.engine.step_sampler import LaunchedStep, StepRows, StepSampler
from service.engine.ngram_drafter import NgramSettings
from service.engine.types import (
    CoreStep,
    GenerationRequest,
    RequestDone,
    RequestFailed,
    RequestStarted,
    StepStats,
)

log = logging.getLogger(__name__)

# Spreads the seeds of a request's several sampled sequences (2^64 / golden ratio).
SEED_STRIDE = 0x9E3779B97F4A7C15
SEED_MODULUS = 2**63  # seeds are int64 tensors on the device


@dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8  # sequences decoded together; KV-cache rows
    max_len: int | None = None  # tokens per sequence (prompt + new); default: the model's context
    max_waiting: int = 64  # requests queued beyond the running ones; more raise QueueFull
    # Prompt tokens one step prefills; a longer prompt is prefilled
    # in chunks of at most this many, between the decode steps of the running sequences.
    max_prefill_tokens: int = 512
    # Keep what finished sequences cached; a prompt reuses its longest cached prefix.
    prefix_caching: bool = True
    # Decode with static shapes (graphs.py): captured as CUDA graphs on a GPU, run eagerly
    # elsewhere (tests prove the static path's tokens on the CPU).
    static_decode: bool = False
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
        self.cache = KVCache(model.config, config.max_slots, max_len, self.device, model.dtype)
        self.sampler = StepSampler(config.max_slots, model.config.vocab_size, max_len, eos_token_id, self.device, grammars,
                                   NonfiniteInjection.from_env())
        self.slot_rows = SlotRows(config.max_slots)
        self.scheduler = Scheduler(
            self.cache, config.max_waiting, config.max_prefill_tokens, self._start, config.prefix_caching,
            self._grammar_ready,
        )
        self.layout = StepLayout(self.scheduler, self.slot_rows, self.cache, config.speculative is not None)
        self.reader = StepReader(self.scheduler, eos_token_id)
        self.static_decode = StaticDecode(self.model, self.cache) if config.static_decode else None
        if self.static_decode is not None and self.device.type == "cuda":
            self.static_decode.capture()  # on failure it says why and decodes eagerly
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self.adapters = ServedAdapters(self.model, config.adapters)
        self._launched: LaunchedStep | None = None  # the step launched, tokens not yet read

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

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> CoreStep:
        started = self.clock()
        results = StepResults()
        failed: list[RequestFailed] = []
        prefill_tokens = cached_tokens = decode_tokens = batch_size = 0
        try:
            # Overlap: this step is launched before the previous one's tokens are read, unless a
            # running request needs every token on the host before its next step can be built.
            overlap = self.overlap and not self.scheduler.host_paced_running
            previous, self._launched = self._launched, None
            if previous is not None and not overlap:
                self._postprocess(previous, results)
                previous = None
            failed += self._refuse_uncompiled()
            # With a step in flight (only when no host-paced request runs: the slot table is exact
            # for every running sequence) some may have drawn their last token already.
            exhausted = self.slot_rows.exhausted(self.cache.in_use) if previous is not None else []
            plan = self.scheduler.schedule(started, exhausted)
            results.done += [self._finish(state) for state in plan.cancelled]
            prefill_tokens = plan.prefill_tokens
            cached_tokens = plan.cached_tokens
            if self.scheduler.host_paced_running:  # beams among them: one output token per step each
                results.decode_output_tokens += sum(len(s.live) for s in plan.decode if s.beam is not None)
            self._rearrange(plan)
            launched = self._launch(plan, overlap) if plan.prefill or plan.decode else None
            if launched is not None:
                batch_size = len(launched.rows.row_of)
                decode_tokens = len(launched.rows.decoding)
            if previous is not None:
                self._postprocess(previous, results)
            if overlap:
                self._launched = launched
            elif launched is not None:
                self._postprocess(launched, results)
            failed += results.failed
            if self.adapters.unloading:
                self.free_unloaded_adapters()
        except Exception as exc:  # e.g. out of device memory: fail these requests, keep serving
            log.exception("engine step failed")
            self._launched = None
            failed += [
                RequestFailed(state.request.request_id, f"engine step failed: {exc}")
                for state in self.scheduler.abort_running()
            ]
        stats = StepStats(
            batch_size=batch_size,
            prefill_tokens=prefill_tokens,
            cached_prompt_tokens=cached_tokens,
            decode_tokens=decode_tokens,
            running=len(self.scheduler.running),
            waiting=self.scheduler.waiting_count,
            kv_slots_used=self.cache.slots_used,
            kv_slots_total=self.cache.max_slots,
            step_seconds=self.clock() - started,
            finished=len(results.done),
            decode_output_tokens=results.decode_output_tokens,
            draft_tokens=results.draft_tokens,
            accepted_tokens=results.accepted_tokens,
        )
        return CoreStep(results.tokens, results.started, results.done, failed, stats)

    def _launch(self, plan: StepPlan, deferred: bool) -> LaunchedStep:
        """Queue the step's model work and sampling; with beams or drafts, it also waits for it.
        `deferred`: its tokens are read after the next step is launched."""
        completing = plan.completing
        with torch.inference_mode():
            if self.config.speculative is not None:
                propose(plan.decode, self.config.speculative, plan.prefill_tokens)
            rows = self.layout.layout(plan)
            logits = self._run(plan, rows)
            launched = self.sampler.launch(logits, rows, completing + plan.decode, completing, deferred)
            for state in launched.active if self.scheduler.host_paced_running else ():  # beams among them?
                if state.beam is not None and self._advance_beams(state, logits, rows, launched):
                    for beam in state.sequences:  # finish() gives each hypothesis its reason
                        self.scheduler.release_sequence(beam, "length", state)
                    launched.ended.append(state)
        if deferred:
            for _, seq in rows.sampled:
                seq.pending += 1
        if not rows.drafted:  # a drafted step's lengths are known once its tokens are read
            self.slot_rows.drew(rows.facts.slots, rows.in_slot_order)
        launched.releases = self.scheduler.releases
        return launched

    def _advance_beams(self, state: RequestState, logits: torch.Tensor, rows: StepRows, launched: LaunchedStep) -> bool:
        """One beam-search step; a search that fails (its logits not finite, or raising) ends
        that request alone, when the step is read."""
        try:
            return advance_beams(state, logits, rows.row_of, self.cache)
        except Exception as exc:
            fault = exc.fault if isinstance(exc, RowFaultError) else beam_failed(exc)
            self.scheduler.end_failed(state, scrub=fault.cause == NONFINITE)
            launched.failed.append((state, fault))
            return False

    def _fail(self, failures: list[tuple[RequestState, RowFault]]) -> list[RequestFailed]:
        """Requests whose own rows failed leave (their sequences already ended) and are answered
        with their fault; every other request of the step went on."""
        answers, leaving = [], []
        for state, fault in {id(state): (state, fault) for state, fault in failures}.values():
            if state.reported:
                continue
            leaving.append(state)
            log.warning("request %s failed alone (%s): %s", state.request.request_id, fault.cause, fault.message)
            state.reported = True
            self.scheduler.forget(state.request.request_id)
            answers.append(RequestFailed(state.request.request_id, fault.message, fault.status, fault.error_type,
                                         fault.cause))
        self.scheduler.leave(leaving)
        return answers

    def _rearrange(self, plan: StepPlan) -> None:
        """The plan's packing moves and prefix copies, even in a step with nothing to run: with
        overlap, a sequence whose last token is still in flight is packed but not stepped."""
        with torch.inference_mode():
            for src, dst, length, swap in plan.moves:
                self._move(src, dst, length, swap)
            for src, dst, length in plan.copies:
                self.cache.copy_slots([src], [dst], length)

    def _postprocess(self, launched: LaunchedStep, results: StepResults) -> None:
        """Read a launched step's tokens and append them; report who started and who finished.
        Requests cancelled, or finished by an earlier step, since it was launched get nothing."""
        host = self.sampler.read(launched)
        if launched.deferred:
            for _, seq in launched.rows.sampled:
                seq.pending -= 1
        results.started += [
            RequestStarted(s.request.request_id, s.scheduled_time - s.request.arrival_time, s.seed, s.prompt_scores)
            for s in launched.completing
            if not s.reported
        ]
        self.reader.read(launched, host, results)
        if launched.rows.drafted:  # what the drafts left: each sequence's length and last token
            drafted = list({id(seq): seq for _, seq in launched.rows.sampled}.values())
            for seq in drafted:
                self.slot_rows.set_length(seq)
            self.sampler.set_last_tokens([seq.slot for seq in drafted], [seq.token_ids[-1] for seq in drafted])
        # Only requests a sequence of which ended here can be done: no pass over every row.
        if launched.failed:  # before the finished: a failed request is never also done
            results.failed += self._fail(launched.failed)
        finished = [state for state in {id(s): s for s in launched.ended}.values() if state.done and not state.reported]
        if finished:
            results.done += [self._finish(state) for state in finished]
            self.scheduler.leave(finished)

    def free_unloaded_adapters(self) -> None:
        """Free the adapters being unloaded that no request uses any more: after each step, and
        by the core's loop when an unload arrives while no step runs."""
        # A launched step's kernels are already queued with the tensors they read (freed memory
        # is reused in stream order), so only the requests that will still run count.
        for index in self.adapters.free_unused(self.scheduler.adapter_in_use):
            self.scheduler.prefix.forget_adapter(index)  # its index may go to another adapter

    # --- admission ------------------------------------------------------------------------------
    def _grammar_ready(self, state: RequestState) -> bool:
        grammar = state.params.grammar
        return grammar is None or (self.grammars.ready(grammar) and grammar not in self.grammars.errors)

    def _refuse_uncompiled(self) -> list[RequestFailed]:
        """Take the grammars compiled since the last step. Waiting requests whose grammar failed to
        compile (the HTTP side checked it, so this is rare) each fail alone, before holding a slot."""
        if self.grammars is None:
            return []
        self.grammars.collect()
        errors = self.grammars.errors
        if not errors:
            return []
        refused = self.scheduler.refuse_waiting(lambda state: state.params.grammar in errors)
        failed = [RequestFailed(state.request.request_id, errors[state.params.grammar], 422, "validation", "grammar")
                  for state in refused]
        errors.clear()  # every waiting request of those grammars is refused; a later one compiles again
        return failed

    def _start(self, state: RequestState, slots: list[int]) -> list[Sequence]:
        """Turn an admitted request's parameters into per-slot tensors and generators, once."""
        params, prompt = state.params, state.request.prompt_ids
        if params.do_sample:
            state.seed = params.seed if params.seed is not None else secrets.randbits(63)
        if params.num_beams > 1:
            state.beam = start_beam_search(params, prompt, self.eos_token_id)
        sequences = []
        for index, slot in enumerate(slots):
            if state.beam is None:
                seed = (state.seed + index * SEED_STRIDE) % SEED_MODULUS if params.do_sample else 0
                self.sampler.write(slot, params, prompt, seed)
            drafter = new_drafter(self.config.speculative, params)
            # A copy of the grammar compiled off the step loop before admission (Grammars.prepare).
            matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
            sequences.append(Sequence(index, slot, list(prompt), len(prompt), drafter=drafter, matcher=matcher,
                                      adapter=state.adapter))
            self.slot_rows.write(state, sequences[-1], self.eos_token_id)
        state.host_paced = state.beam is not None or any(s.drafter is not None or s.matcher is not None for s in sequences)
        return sequences

    def _move(self, src: int, dst: int, length: int, swap: bool) -> None:
        if swap:
            self.cache.swap_slots(src, dst, length)
        elif length:
            self.cache.copy_slots([src], [dst], length)
        self.sampler.move(src, dst)
        self.slot_rows.move(src, dst)

    # --- run: forwards and sampling -------------------------------------------------------------
    def _run(self, plan: StepPlan, rows: StepRows) -> torch.Tensor:
        """Logits [rows, V] in the layout of `rows`: decode rows, then prefill rows."""
        # The two forwards touch disjoint cache entries (padded rows write only positions no
        # sequence caches), so their order is free.
        decoded = self._decode(rows) if rows.decoding else None
        prefilled = self._prefill(plan.prefill) if plan.prefill else None
        parts = [part for part in (decoded, prefilled) if part is not None]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Each chunk's prompt tokens from its offset, over the keys its slot already holds (a
        reused prefix, earlier chunks). Logits [B, V] at each chunk's last token."""
        out = forward_from(
            self.model,
            self.cache,
            [chunk.state.sequences[0].slot for chunk in chunks],
            [chunk.start for chunk in chunks],
            [chunk.state.request.prompt_ids[chunk.start : chunk.end] for chunk in chunks],
            hidden_states=any(chunk.state.params.prompt_logprobs for chunk in chunks),
            lora=self.adapters.rows(chunk.state.adapter for chunk in chunks),
        )
        for row, chunk in enumerate(chunks):
            state = chunk.state
            state.prefilled = state.sequences[0].cached = chunk.end
            if state.params.prompt_logprobs:
                add_prompt_scores(self.model, state, chunk, out.hidden[row])
        # Several sampled sequences of one prompt: the prompt ran once, into the first slot.
        copies = [
            (chunk.state.sequences[0].slot, seq)
            for chunk in chunks
            if chunk.completes and chunk.state.beam is None
            for seq in chunk.state.sequences[1:]
        ]
        if copies:
            longest = max(len(seq.token_ids) for _, seq in copies)
            self.cache.copy_slots([s for s, _ in copies], [seq.slot for _, seq in copies], longest)
            for _, seq in copies:
                seq.cached = len(seq.token_ids)
        return out.logits  # [B, V]

    def _decode(self, step_rows: StepRows) -> torch.Tensor:
        """Logits [B + drafted tokens, V]: one row per sequence (in slot order), 1 + k for one with
        a draft."""
        seqs = step_rows.decoding
        lora = self.adapters.rows(s.adapter for s in seqs)
        if step_rows.from_device:
            return self._decode_batch(step_rows, lora)
        slots = [s.slot for s in seqs]
        if step_rows.drafted:  # verification: 1 + k positions per row, eagerly
            starts = [len(s.token_ids) - 1 for s in seqs]
            pieces = [[s.token_ids[-1]] + s.draft for s in seqs]
            # Each position as decoding computes it, so a draft's length (which the batch
            # prices) never changes a token's bits.
            return forward_from(self.model, self.cache, slots, starts, pieces, every_position=True, one_query_per_call=True,
                                lora=lora).logits
        lengths = [len(s.token_ids) + s.pending for s in seqs]
        # A sequence whose last token the host has not read yet (overlap) feeds the one its
        # slot's last sampling left on the device; the host's token_ids[-1] is then stale.
        ahead = [s.pending > 0 for s in seqs]
        tokens = [s.token_ids[-1] for s in seqs]
        if self.static_decode is not None and lora is None:  # a graph holds no adapter: eager with one
            return self.static_decode.run(slots, tokens, [n - 1 for n in lengths], ahead, self.sampler.last_tokens)
        host = to_device([slots, tokens, [n - 1 for n in lengths], ahead], self.device)  # [4, B]: one copy
        slot_ids, input_ids, positions, from_device = host
        if any(ahead):
            input_ids = torch.where(from_device.bool(), self.sampler.last_tokens[slot_ids], input_ids)
        # kv_length from Python ints: no device sync to find the longest row.
        rows = self.cache.batch(slots, slot_ids)
        out = self.model(input_ids[:, None], positions[:, None], self.cache, rows, kv_length=max(lengths), lora=lora)
        return out.logits[:, -1]  # [B, V]

    def _decode_batch(self, step_rows: StepRows, lora) -> torch.Tensor:
        """Every decoding row feeds its slot's last sampled token, left on the device by the sampler
        (`last_tokens`), at the position before its counter: the layout's index vectors, already
        on the device, say which (no Python per row, no other copy)."""
        count = len(step_rows.decoding)  # the first rows sampled
        slots, counters = step_rows.facts.slots[:count], step_rows.facts.counters[:count]
        if self.static_decode is not None and lora is None:  # a graph holds no adapter: eager with one
            return self.static_decode.run(slots, np.zeros(count, dtype=np.int64), counters - 1,
                                          np.ones(count, dtype=bool), self.sampler.last_tokens)
        slot_ids = step_rows.sample_slots[:count]
        first, last = int(slots[0]), int(slots[-1])
        # Ascending and distinct (either layout sorts them): one span when they are consecutive.
        rows = SlotBatch(slot_ids, slice(first, last + 1) if last - first == count - 1 else None)
        last_tokens = self.sampler.last_tokens
        input_ids = last_tokens[rows.span] if rows.span is not None else last_tokens[slot_ids]
        positions = step_rows.sample_counters[:count, None] - 1
        # kv_length from the host's counters: no device sync to find the longest row.
        out = self.model(input_ids[:, None], positions, self.cache, rows, kv_length=int(counters.max()), lora=lora)
        return out.logits[:, -1]  # [B, V]

    def _finish(self, state: RequestState) -> RequestDone:
        state.reported = True
        self.scheduler.forget(state.request.request_id)
        beams = beam_results(state) if state.beam is not None and state.beam.done else None
        return RequestDone(state.request.request_id, beams)
