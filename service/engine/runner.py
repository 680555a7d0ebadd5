"""The model runner: one StepPlan in, one launched step out (vLLM v1's GPUModelRunner, nano-vllm's
ModelRunner). It owns what the device holds for the running sequences: the KV cache's tensors, the
persistent input batch (every per-slot value), the layout of a step's rows, the forwards (prefill,
decode: static shapes and CUDA graphs where asked) and the sampler.

- `prepare(plan)`: beam searches' slots and tokens, packing moves in the input batch (the
  scheduler moved the cache's block tables), and the plan's admitted sequences written into
  the input batch;
- `execute(plan)`: rows laid out, the forwards and the sampling queued, and the one device→host
  copy of what was drawn (read later with `read`: the core's overlap); where a grammar's mask
  waits for the step before to be read, the sampling is queued by `draw` once it is;
- `after_read(launched)`: what only the read tokens tell the batch (drafted sequences' lengths).

The runner never calls the scheduler; it writes only what its forwards computed onto the plan's
requests (a prefill's prompt scores).
"""

from __future__ import annotations

import numpy as np
import torch

from model.gpt2 import GPT2
from model.kv_cache import KVCache, SlotBatch
from model.lora import LoraRows
from model.transfer import to_device
from service.engine.adapters import ServedAdapters
from service.engine.beams import apply_beam_moves
from service.engine.faults import NonfiniteInjection
from service.engine.forward import forward_from
from service.engine.grammar import Grammars
from service.engine.graphs import StaticDecode
from service.engine.input_batch import InputBatch
from service.engine.layout import StepLayout
from service.engine.ngram_drafter import NgramSettings
from service.engine.prompt_scores import add_prompt_scores
from service.engine.requests import PrefillChunk, RequestState, Sequence, StepPlan
from service.engine.step_data import LaunchedStep, StepRows
from service.engine.step_sampler import StepSampler


class ModelRunner:
    def __init__(
        self,
        model: GPT2,
        cache: KVCache,
        eos_token_id: int,
        grammars: Grammars | None,
        speculative: NgramSettings | None,
        static_decode: bool,
        adapters: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        config = model.config
        self.batch = InputBatch(cache.max_slots, config.vocab_size, cache.max_len, eos_token_id, self.device)
        self.layout = StepLayout(self.batch, cache, speculative is not None)
        self.sampler = StepSampler(self.batch, grammars, NonfiniteInjection.from_env())
        self.static_decode = StaticDecode(model, cache) if static_decode else None
        if self.static_decode is not None and self.device.type == "cuda":
            self.static_decode.capture()  # on failure it says why and decodes eagerly
        self.adapters = ServedAdapters(model, adapters)

    def prepare(self, plan: StepPlan) -> None:
        """The plan's changes to the cache and the batch, even in a step with nothing to run: with
        overlap, a sequence whose last token is still in flight is packed but not stepped."""
        with torch.inference_mode():
            if plan.beam_moves:  # as the searches left the slots, before packing or copies read them
                apply_beam_moves(self.batch, plan.beam_moves)
            for src, dst in plan.moves:  # the scheduler moved the cache's block tables already
                self.batch.move(src, dst)
        for state in plan.admitted:
            for seq in state.sequences:
                self.batch.add(state, seq)
            if state.resumed:  # preempted, back on a new slot: its last token there, as after a read
                self.batch.set_drafted(state.sequences)

    def execute(self, plan: StepPlan, deferred: bool) -> LaunchedStep:
        """Queue the step's model work and sampling (and its beam searches' candidates).
        `deferred`: its tokens are read after the next step is launched."""
        completing = plan.completing
        with torch.inference_mode():
            rows = self.layout.layout(plan)
            logits = self._run(plan, rows)
            return self.sampler.launch(logits, rows, completing + plan.decode, completing, deferred)

    def draw(self, launched: LaunchedStep) -> None:
        """Queue a launched step's draw that waited for the step before it to be read (a
        constrained row's mask needs its last token: StepSampler.launch)."""
        with torch.inference_mode():
            self.sampler.draw(launched)

    def read(self, launched: LaunchedStep) -> np.ndarray:
        """The launched step's sampler rows on the host, once the device has them."""
        return self.sampler.read(launched)

    def after_read(self, launched: LaunchedStep) -> None:
        """What a drafted step's read tokens tell the batch: each sequence's length and last token
        (the drafts that stood)."""
        self.batch.set_drafted(launched.rows.drafted)

    def exhausted(self) -> list[RequestState]:
        """The requests a sequence of which drew its last token in a step not read yet."""
        return self.batch.exhausted(self.cache.in_use)

    # --- the forwards -------------------------------------------------------------------------------
    def _run(self, plan: StepPlan, rows: StepRows) -> torch.Tensor:
        """Logits [rows, V] in the layout of `rows`: decode rows, then prefill rows."""
        # The two forwards touch disjoint cache entries (padded rows write only positions no
        # sequence caches), so their order is free.
        if rows.from_device and rows.drafted:  # its parts joined once, with the prompts' below
            parts = self._decode_drafted(rows)
        else:
            parts = [self._decode(rows)] if rows.decoding else []
        if plan.prefill:
            parts.append(self._prefill(plan.prefill))
        if not parts:  # every sequence of the plan ended when the step before it was read (drafts)
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Each chunk's prompt tokens from its offset, over the keys its slot already holds (a
        reused prefix, earlier chunks). Logits [B, V] at each chunk's last token."""
        out = forward_from(
            self.model,
            self.cache,
            [chunk.state.sequences[0].slot for chunk in chunks],
            [chunk.start for chunk in chunks],
            [chunk.tokens for chunk in chunks],
            hidden_states=any(chunk.state.params.prompt_logprobs for chunk in chunks),
            lora=self.adapters.rows(chunk.state.adapter for chunk in chunks),
        )
        for row, chunk in enumerate(chunks):
            if chunk.state.params.prompt_logprobs:
                add_prompt_scores(self.model, chunk.state, chunk, out.hidden[row])
        # Several sampled sequences of one prompt: the prompt ran once, into the first slot, whose
        # blocks the others share (the scheduler forked them).
        return out.logits  # [B, V]

    def _decode(self, step_rows: StepRows) -> torch.Tensor:
        """Logits [B + drafted tokens, V]: one row per sequence (in slot order), 1 + k for one with
        a draft."""
        seqs, loaded = step_rows.decoding, self.adapters.loaded  # (no call on the path without adapters)
        if step_rows.from_device:
            return self._decode_batch(step_rows, self._lora(step_rows.facts.slots[: len(seqs)]) if loaded else None)
        slots = [s.slot for s in seqs]
        lora = self._lora(slots) if loaded else None
        if step_rows.drafted:  # row by row, every sequence verifying its draft (or none)
            return self._verify(seqs, lora)
        lengths = [len(s.token_ids) + s.pending for s in seqs]
        # A sequence whose last token the host has not read yet (overlap) feeds the one its
        # slot's last sampling left on the device; the host's token_ids[-1] is then stale.
        ahead = [s.pending > 0 for s in seqs]
        tokens = [s.token_ids[-1] for s in seqs]
        last_tokens = self.batch.last_tokens
        if self.static_decode is not None and lora is None:  # a graph holds no adapter: eager with one
            return self.static_decode.run(slots, tokens, [n - 1 for n in lengths], ahead, last_tokens)
        host = to_device([slots, tokens, [n - 1 for n in lengths], ahead], self.device)  # [4, B]: one copy
        slot_ids, input_ids, positions, from_device = host
        if any(ahead):
            input_ids = torch.where(from_device.bool(), last_tokens[slot_ids], input_ids)
        # kv_length from Python ints: no device sync to find the longest row.
        rows = self.cache.batch(slots, slot_ids)
        out = self.model(input_ids[:, None], positions[:, None], self.cache, rows, kv_length=max(lengths), lora=lora)
        return out.logits[:, -1]  # [B, V]

    def _decode_drafted(self, step_rows: StepRows) -> list[torch.Tensor]:
        """A batch's decode with sequences verifying drafts: the undrafted rows' logits [U, V] as a
        step without drafts computes them, then the drafted sequences' [sum of 1 + k, V]."""
        seqs, drafted = step_rows.decoding, step_rows.drafted
        undrafted = seqs[: len(seqs) - len(drafted)]
        loaded, parts = self.adapters.loaded, []
        if undrafted:  # the first rows sampled (layout.py)
            parts.append(self._decode_batch(step_rows, self._lora(step_rows.facts.slots[: len(undrafted)]) if loaded else None))
        parts.append(self._verify(drafted, self._lora([s.slot for s in drafted]) if loaded else None))
        return parts

    def _lora(self, slots: list[int] | np.ndarray) -> LoraRows | None:
        """The adapters of the rows on `slots`, from the input batch's column (no Python per row)."""
        return self.adapters.rows(self.batch.adapter[slots])

    def _verify(self, seqs: list[Sequence], lora: LoraRows | None) -> torch.Tensor:
        """Logits [sum of 1 + k, V]: each sequence's last token and draft (k tokens, maybe none),
        at every position."""
        # A row whose last token is still in flight (overlap; never one with a draft: a drafter
        # sits such steps out) feeds the one its slot's last sampling left.
        starts = [len(s.token_ids) + s.pending - 1 for s in seqs]
        pieces = [[s.token_ids[-1]] + s.draft for s in seqs]
        # Each position as decoding computes it, so a draft's length (which the batch prices) and
        # the rows beside it never change a token's bits.
        return forward_from(self.model, self.cache, [s.slot for s in seqs], starts, pieces, every_position=True,
                            one_query_per_call=True, lora=lora, ahead=[s.pending > 0 for s in seqs],
                            last_tokens=self.batch.last_tokens).logits

    def _decode_batch(self, step_rows: StepRows, lora: LoraRows | None) -> torch.Tensor:
        """Every decoding row feeds its slot's last sampled token, left on the device by the sampler
        (`last_tokens`), at the position before its counter: the layout's index vectors, already
        on the device, say which (no Python per row, no other copy). The sequences verifying a
        draft, after them, are not these rows."""
        count = len(step_rows.decoding) - len(step_rows.drafted)  # the first rows sampled
        slots, counters = step_rows.facts.slots[:count], step_rows.facts.counters[:count]
        last_tokens = self.batch.last_tokens
        if self.static_decode is not None and lora is None:  # a graph holds no adapter: eager with one
            return self.static_decode.run(slots, np.zeros(count, dtype=np.int64), counters - 1,
                                          np.ones(count, dtype=bool), last_tokens)
        slot_ids = step_rows.sample_slots[:count]
        first, last = int(slots[0]), int(slots[-1])
        # Ascending and distinct (either layout sorts them): one span when they are consecutive.
        rows = SlotBatch(slot_ids, slice(first, last + 1) if last - first == count - 1 else None)
        input_ids = last_tokens[rows.span] if rows.span is not None else last_tokens[slot_ids]
        positions = step_rows.sample_counters[:count, None] - 1
        # kv_length from the host's counters: no device sync to find the longest row.
        out = self.model(input_ids[:, None], positions, self.cache, rows, kv_length=int(counters.max()), lora=lora)
        return out.logits[:, -1]  # [B, V]
