"""Each KV-cache slot's decoding parameters as device tensors, written once at admission.

A step gathers its rows' parameters by slot with one index per table, so a batch mixing
greedy, sampled and penalised sequences costs no per-step Python work beyond the row list.
"""

from __future__ import annotations

import torch

from model.sampling import SamplingTensors
from model.transfer import to_device
from service.engine.row_features import RowFeatures
from service.engine.types import SamplingParams

# Columns of the float table.
TEMPERATURE, TOP_P, PENALTY, DO_SAMPLE = range(4)


class SlotParams:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._floats = torch.ones(max_slots, 4, device=device)  # [slots, 4]
        self._top_k = torch.full((max_slots,), vocab_size, dtype=torch.long, device=device)
        self._seed = torch.zeros(max_slots, dtype=torch.long, device=device)
        # Tokens of the prompt and output so far, for the repetition penalty. Kept up to date
        # only while the slot's sequence has a penalty (the flag in SamplingTensors).
        self._seen = torch.zeros(max_slots, vocab_size, dtype=torch.bool, device=device)
        # Per slot: its rows hold greedy decoding's values, known once written (then the admissions
        # that decode greedily without a penalty, the most common, write nothing).
        self._greedy = [False] * max_slots

    def write(self, slot: int, params: SamplingParams, prompt_ids: list[int], seed: int = 0) -> None:
        """`seed`: the sequence's own sampling seed, in [0, 2^63)."""
        greedy = not params.do_sample and params.repetition_penalty == 1.0
        if greedy and self._greedy[slot]:
            return
        self._greedy[slot] = greedy
        sampling = params.do_sample
        row = [params.temperature if sampling else 1.0, params.top_p if sampling else 1.0,
               params.repetition_penalty, float(sampling)]
        self._floats[slot] = to_device(row, self.device, torch.float32)
        top_k = params.top_k if sampling and params.top_k > 0 else self.vocab_size
        self._top_k[slot] = min(top_k, self.vocab_size)
        self._seed[slot] = seed
        if params.repetition_penalty != 1.0:
            self._seen[slot] = False
            self._seen[slot, to_device(prompt_ids, self.device)] = True

    def move(self, src: int, dst: int) -> None:
        self._floats[dst] = self._floats[src]
        self._top_k[dst] = self._top_k[src]
        self._seed[dst] = self._seed[src]
        self._seen[dst] = self._seen[src]
        self._greedy[dst] = self._greedy[src]

    def gather(self, slots: torch.Tensor | slice, features: RowFeatures) -> SamplingTensors:
        """The parameters of rows using `slots` [B] (or slots 0..B-1 as a slice: views, no copy);
        `features`: which optional stages those rows use."""
        floats = self._floats[slots]  # [B, 4]
        return SamplingTensors(
            temperature=floats[:, TEMPERATURE],
            top_k=self._top_k[slots],
            top_p=floats[:, TOP_P],
            repetition_penalty=floats[:, PENALTY],
            do_sample=floats[:, DO_SAMPLE] > 0,
            seed=self._seed[slots],
            any_sample=features.sample,
            any_top_k_top_p=features.top_k_top_p,
            any_penalty=features.penalty,
        )

    def seen(self, slots: torch.Tensor | slice) -> torch.Tensor:
        return self._seen[slots]  # [B, V]

    def mark_seen(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self._seen[slots, tokens] = True
