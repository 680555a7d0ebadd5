"""The engine core: one `step` = schedule → run → postprocess, as nano-vllm's LLMEngine.step.

- schedule: the Scheduler admits waiting requests into free KV-cache slots and says who decodes;
- run: one padded forward for the admitted prompts (prefill), one batched forward with one token
  per running sequence (decode), then one sampling call over every row outside beam search and
  one device→host copy (each beam-search request adds its own step and copy);
- postprocess: append token ids, check EOS and length, free finished slots, report one CoreStep.

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
from dataclasses import dataclass, field

import numpy as np
import torch

from model.gpt2 import GPT2
from model.kv_cache import KVCache, SlotBatch
from model.transfer import to_device
from service.engine.adapters import ServedAdapters
from service.engine.beams import advance_beams, beam_results, start_beam_search
from service.engine.forward import forward_from
from service.engine.grammar import Grammars
from service.engine.graphs import StaticDecode
from service.engine.prompt_scores import add_prompt_scores
from service.engine.scheduler import PrefillChunk, RequestState, Scheduler, Sequence, StepPlan
from service.engine.slot_rows import EOS, LAST, PROMPT_LENGTH, SlotRows
from service.engine.step_sampler import LaunchedStep, StepRows, StepSampler, alternatives
from service.engine.speculation import kept_length, new_drafter, propose
from service.engine.ngram_drafter import NgramSettings
from service.engine.types import (
    CoreStep,
    CoreToken,
    GenerationRequest,
    RequestDone,
    RequestFailed,
    RequestStarted,
    StepStats,
    StepTokens,
    TopLogprobs,
)

log = logging.getLogger(__name__)

# Spreads the seeds of a request's several sampled sequences (2^64 / golden ratio).
SEED_STRIDE = 0x9E3779B97F4A7C15
SEED_MODULUS = 2**63  # seeds are int64 tensors on the device
# From this many running requests a step is laid out and read as a batch (_layout_batch,
# _advance_batch): below it numpy's and torch's fixed cost per operation (a few µs, some dozen
# of them) exceeds Python's per row.
BATCHED_ROWS = 16


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


@dataclass
class StepResults:
    """What postprocessing collects during one step, before it becomes a CoreStep."""

    tokens: StepTokens = field(default_factory=StepTokens)
    started: list[RequestStarted] = field(default_factory=list)
    done: list[RequestDone] = field(default_factory=list)
    decode_output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


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
        self.sampler = StepSampler(config.max_slots, model.config.vocab_size, max_len, eos_token_id, self.device, grammars)
        self.slot_rows = SlotRows(config.max_slots)
        self.scheduler = Scheduler(
            self.cache, config.max_waiting, config.max_prefill_tokens, self._start, config.prefix_caching,
            self._grammar_ready,
        )
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
            plan = self.scheduler.schedule(started, in_flight=previous is not None)
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
            if self.adapters.unloading:
                self._free_unloaded_adapters()
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
            rows = self._layout(plan)
            logits = self._run(plan, rows)
            launched = self.sampler.launch(logits, rows, completing + plan.decode, completing, deferred)
            for state in launched.active:
                if state.beam is not None and advance_beams(state, logits, rows.row_of, self.cache):
                    for beam in state.sequences:  # finish() gives each hypothesis its reason
                        self.scheduler.release_sequence(beam, "length", state)
                    launched.ended.append(state)
        if deferred:
            for _, seq in rows.sampled:
                seq.pending += 1
        if not rows.drafted:  # a drafted step's lengths are known once its tokens are read
            self.slot_rows.drew(rows.facts)
        launched.releases = self.scheduler.releases
        return launched

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
        self._advance_all(launched, host, results)
        # Only requests a sequence of which ended here can be done: no pass over every row.
        finished = [state for state in {id(s): s for s in launched.ended}.values() if state.done and not state.reported]
        if finished:
            results.done += [self._finish(state) for state in finished]
            self.scheduler.leave(finished)

    def _free_unloaded_adapters(self) -> None:
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
        failed = [RequestFailed(state.request.request_id, errors[state.params.grammar]) for state in refused]
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
    def _layout(self, plan: StepPlan) -> StepRows:
        """Where every sequence's logits will be, decided before any forward is queued.

        Index tensors are built here: on CUDA a host→device copy waits for queued work, so
        making them after the forwards were launched would stall the host until they finish.
        """
        # The decoding sequences' rows first, in slot order (1 + k for one with a draft), then one
        # row per prompt chunk (a completed prompt's sequences share it; a chunk that leaves part
        # of its prompt for later samples nothing); the sampled rows in the same order. Once the
        # running sequences are packed into slots 0..D-1 and no prompt completes this step, or
        # those that do took the next free slots, sampled row b is logits row b and slot b for
        # every b: the read path without gathers. (A prompt admitted into a slot a finished
        # sequence left inside the batch, the usual case under heavy churn, still gathers.)
        if self.scheduler.host_paced_running or len(self.scheduler.running) < BATCHED_ROWS:
            return self._layout_each(plan)  # beams, drafts or grammars: some rows need their own
        return self._layout_batch(plan)

    def _layout_batch(self, plan: StepPlan) -> StepRows:
        """Every row draws one token from the sampler: who holds each slot and its length come from
        the slot table (a persistent batch), and the decode feeds the sampler's last tokens."""
        slot_rows = self.slot_rows
        slots = slot_rows.decoding(self.cache.in_use)  # plan.decode's sequences' slots
        decoding = list(map(slot_rows.seq.__getitem__, slots))
        sampled = list(zip(map(slot_rows.state.__getitem__, slots), decoding))
        row_of = dict(zip(slots, range(len(slots))))
        rows = len(slots)
        for index, chunk in enumerate(plan.prefill):
            if chunk.completes:
                row_of.update((seq.slot, rows + index) for seq in chunk.state.sequences)
        completing = [(state, seq) for state in plan.completing for seq in state.live]
        if completing:
            sampled += completing
            slots = slots + [seq.slot for _, seq in completing]
        logit_rows = list(range(rows)) + [row_of[seq.slot] for _, seq in completing]
        host = np.empty((3, len(slots)), dtype=np.int64)  # one host→device copy: [3, B]
        host[0], host[1], host[2] = logit_rows, slots, slot_rows.lengths(slots)
        return self._rows(decoding, row_of, sampled, host, slots, logit_rows, drafted=False, from_device=True)

    def _rows(self, decoding: list[Sequence], row_of: dict[int, int], sampled: list, host: np.ndarray, slots: list[int],
              logit_rows: list[int], drafted: bool, from_device: bool) -> StepRows:
        """`host`: [3, B] the sampled rows' logits rows, slots and counters."""
        sample_rows, sample_slots, sample_counters = to_device(torch.from_numpy(host), self.device)  # [B] each
        in_order = logit_rows == slots == list(range(len(slots)))
        facts = self.slot_rows.gather(slots, host[1], host[2], in_order)
        return StepRows(decoding, row_of, sampled, sample_rows, sample_slots, sample_counters, facts, in_order, drafted,
                        from_device)

    def _layout_each(self, plan: StepPlan) -> StepRows:
        """The layout row by row, from the sequences themselves."""
        by_slot = sorted([(seq.slot, state, seq) for state in plan.decode for seq in state.live])  # slots are unique
        decoding = [seq for _, _, seq in by_slot]
        sampled = [(state, seq) for _, state, seq in by_slot]
        if self.scheduler.host_paced_running:  # beams among them, perhaps: they choose their own tokens
            sampled = [(state, seq) for state, seq in sampled if state.beam is None]
        drafted = self.config.speculative is not None and any(seq.draft for seq in decoding)
        if not drafted:
            # Comprehensions, not a loop of appends: this runs over every row of every step.
            row_of = dict(zip([seq.slot for seq in decoding], range(len(decoding))))
            row = len(decoding)
        else:
            row_of, row = {}, 0
            for seq in decoding:
                row_of[seq.slot] = row
                row += 1 + len(seq.draft)
            # Row j of a sequence's 1 + k draws the token at its length + j (its seed's draw there).
            sampled = [(state, seq) for state, seq in sampled for _ in range(1 + len(seq.draft))]
        for index, chunk in enumerate(plan.prefill):
            if chunk.completes:
                row_of.update((seq.slot, row + index) for seq in chunk.state.sequences)
        sampled += [(state, seq) for state in plan.completing if state.beam is None for seq in state.live]
        if not drafted:
            slots = [seq.slot for _, seq in sampled]
            logit_rows = [row_of[slot] for slot in slots]
            counters = [len(seq.token_ids) + seq.pending for _, seq in sampled]
        else:
            logit_rows, slots, counters, previous, j = [], [], [], None, 0
            for _, seq in sampled:
                j = j + 1 if seq is previous else 0
                previous = seq
                logit_rows.append(row_of[seq.slot] + j)
                slots.append(seq.slot)
                counters.append(len(seq.token_ids) + j)
        host = np.array([logit_rows, slots, counters], dtype=np.int64).reshape(3, len(slots))
        return self._rows(decoding, row_of, sampled, host, slots, logit_rows, drafted, from_device=False)

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
        # Ascending and distinct (the slot table's mask): one span when they are consecutive.
        rows = SlotBatch(slot_ids, slice(first, last + 1) if last - first == count - 1 else None)
        last_tokens = self.sampler.last_tokens
        input_ids = last_tokens[rows.span] if rows.span is not None else last_tokens[slot_ids]
        positions = step_rows.sample_counters[:count, None] - 1
        # kv_length from the host's counters: no device sync to find the longest row.
        out = self.model(input_ids[:, None], positions, self.cache, rows, kv_length=int(counters.max()), lora=lora)
        return out.logits[:, -1]  # [B, V]

    # --- postprocess ------------------------------------------------------------------------------
    def _advance_all(self, launched: LaunchedStep, host: np.ndarray, results: StepResults) -> None:
        """Append each sequence's tokens (`host`: the sampler's rows, one per sampled row) and
        report them. The requests a sequence of which ended are added to `launched.ended`."""
        if launched.rows.facts.per_row or len(host) < BATCHED_ROWS:  # drafts, stop token ids, grammars, alternatives
            self._advance_each(launched, host.tolist(), results)
            if launched.rows.drafted:  # the slot table learns the lengths the drafts left
                for _, seq in launched.rows.sampled:
                    self.slot_rows.set_length(seq)
        else:
            self._advance_batch(launched, host, results)

    def _advance_batch(self, launched: LaunchedStep, host: np.ndarray, results: StepResults) -> None:
        """Every row one token with no per-row stop but EOS and length: the stops of the whole
        batch as array operations, Python per row only to append a token to its sequence (and for
        the rows that end)."""
        facts, sampled = launched.rows.facts, launched.rows.sampled
        tokens, logprobs, counters, table = host[:, 0].astype(np.int64), host[:, 1], facts.counters, facts.table
        request_ids, indexes = facts.request_ids, facts.indexes
        if launched.releases != self.scheduler.releases:  # a sequence ended since launch: one of these?
            alive = [seq.finish_reason is None for _, seq in sampled]
            if not all(alive):
                keep = np.flatnonzero(alive)
                tokens, logprobs, counters, table = tokens[keep], logprobs[keep], counters[keep], table[keep]
                picks = keep.tolist()
                sampled = [sampled[i] for i in picks]
                request_ids, indexes = [request_ids[i] for i in picks], [indexes[i] for i in picks]
        eos = tokens == table[:, EOS]
        ends = np.flatnonzero(eos | (counters >= table[:, LAST])).tolist()
        token_ids = tokens.tolist()
        for (_, seq), token in zip(sampled, token_ids):
            ids = seq.token_ids
            ids.append(token)
            seq.cached = len(ids) - 1  # the forward that chose it wrote every earlier token
        reasons = {}
        for i in ends:
            state, seq = sampled[i]
            reasons[i] = reason = "eos_token" if eos[i] else "length"
            self.scheduler.release_sequence(seq, reason, state)
            launched.ended.append(state)
        results.tokens.extend(request_ids, indexes, token_ids, logprobs.tolist(), reasons)
        results.decode_output_tokens += int(np.count_nonzero(counters > table[:, PROMPT_LENGTH]))  # not a prompt's first

    def _advance_each(self, launched: LaunchedStep, host: list[list[float]], results: StepResults) -> None:
        """Row by row: its draft's tokens that stand, then the model's own."""
        sampled, n, ended = launched.rows.sampled, launched.alternatives, launched.ended
        start = 0
        while start < len(sampled):
            state, seq = sampled[start]
            if seq.finish_reason is not None:  # ended (or cancelled) since its step was launched
                start += 1
                continue
            if not seq.draft and seq.drafter is None:  # one token, no draft to judge
                row = host[start]
                token = self._advance(state, seq, row, alternatives(row, n, state.params.top_logprobs) if n else None)
                results.tokens.append(token)
                if token[4] is not None:  # its finish reason
                    ended.append(state)
                results.decode_output_tokens += len(seq.token_ids) - 1 > seq.prompt_length
                start += 1
                continue
            end = start + 1 + len(seq.draft)
            draft, decoding = seq.draft, len(seq.token_ids) > seq.prompt_length
            keep = kept_length([int(row[0]) for row in host[start:end]], draft)
            emitted = 0
            for row in host[start : start + keep]:
                top = alternatives(row, n, state.params.top_logprobs) if n else None
                results.tokens.append(self._advance(state, seq, row, top))
                emitted += 1
                if seq.finish_reason is not None:
                    ended.append(state)
                    break
            if decoding:
                results.decode_output_tokens += emitted
                results.draft_tokens += len(draft)
                results.accepted_tokens += emitted - 1
                if seq.drafter is not None:
                    seq.acceptance.record(len(draft), keep - 1)
            seq.draft = []
            start = end

    def _advance(self, state: RequestState, seq: Sequence, row: list[float], top: TopLogprobs | None) -> CoreToken:
        """Append the token of a sampler's row (`row`: [token, log-prob, ...]) and check its stops."""
        token = int(row[0])
        seq.token_ids.append(token)
        seq.cached = len(seq.token_ids) - 1  # the forward that chose it wrote every earlier token
        params = state.request.params
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "eos_token"
        elif seq.matcher is not None and seq.matcher.is_stopped():
            reason = "eos_token"  # the grammar is complete and allows nothing more: EOS is all it could add
        elif len(seq.token_ids) - seq.prompt_length >= params.max_new_tokens:
            reason = "length"
        else:
            reason = None
        if reason is not None:
            self.scheduler.release_sequence(seq, reason, state)
        return (state.request.request_id, seq.index, token, row[1], reason, top)

    def _finish(self, state: RequestState) -> RequestDone:
        state.reported = True
        self.scheduler.forget(state.request.request_id)
        beams = beam_results(state) if state.beam is not None and state.beam.done else None
        return RequestDone(state.request.request_id, beams)
