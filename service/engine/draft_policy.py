"""How many tokens each sequence drafts this step: as many as are worth their verification.

A drafted token costs a row in the step's forward (its products, its attention, its logits and
its draw) whether it stands or not; it saves a step of this sequence only if it and every draft
token before it stand. With `weight_pass_rows` (ρ) the rows a forward can add for the price of
one pass over the weights, a step of R rows costs about (ρ + R) rows' worth, so a token it makes
costs (ρ + R) / R rows, and the j-th draft token is worth its row while

    p^j · (ρ + R) / R  >=  1,    i.e.   p^j >= R / (ρ + R)

where p is the chance that a draft token of this sequence stands. One client on a CPU (R = 1,
ρ ≈ 16: the weight pass dominates) drafts while p^j >= 6%; sixteen (R = 16, the step is mostly
products over rows) only while p^j >= 50%; a GPU (ρ in the hundreds) keeps drafting at any batch
this server runs. transformers' `num_assistant_tokens_schedule="heuristic"` grows and shrinks k
by how a draft fared; this does the same from an estimate of p, and prices it by batch size.

p is estimated per sequence from its recent drafts: each step with a draft moves the estimate
30% of the way to the share of that draft's tested tokens that stood, so a sequence that falls
into a loop, or out of one, is followed within a few steps. A sequence whose drafts stopped
paying drafts nothing, and its estimate creeps back towards an even prior (0.5% of the way per
step): after a failing stretch it tries one token again some steps later (for one client on a
CPU, about every eight), and never at a batch where even p = 0.5 does not pay.

With the core's overlap (step n + 1 launched before step n is read), a draft costs more: it
follows the sequence's last token, which is in flight, so the sequence sits a step out to draft
(Scheduler.schedule). Where other rows run that step, two steps then make 1 + E tokens,
E = p + p^2 + ... + p^j for a draft of j, where decoding as a plain row, fed from the device,
makes two; where nothing else would run, the step it sits out is empty and costs only the wait
for the read. So while its token is in flight a sequence whose draft would pay its rows sits out
if its last look at its n-gram index found a draft and either E >= 1 or the step is otherwise
empty; otherwise it decodes, and looks again (sits a step out to draft) every LOOK_AGAIN_STEPS
steps, so that a sequence falling into a loop is found. Sampled text with no n-gram match then
loses one step in nine, not one in two. math.inf rows per weight pass (always draft k) sits out
to draft whenever it can, as without overlap it drafts at every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR = 0.5  # a new sequence's estimate: half its draft tokens stand
LEARNING_RATE = 0.3  # how far one step's draft moves the estimate towards what it showed
RECOVERY = 0.005  # how far one step without a draft moves it back towards the prior
LOOK_AGAIN_STEPS = 8  # with overlap: plain steps (tokens) before a sequence that stopped drafting looks again


@dataclass
class DraftAcceptance:
    """A sequence's estimate of the chance that its next draft token stands."""

    rate: float = PRIOR
    found: bool = True  # its last look at its n-gram index found a draft (a new sequence looks first)
    looked_at: int = 0  # the sequence's length at that look

    def looked(self, found: bool, length: int) -> None:
        self.found, self.looked_at = found, length

    def wants_to_look(self, threshold: float, most: int, alone: bool, length: int) -> bool:
        """With its last token in flight (`length`: the sequence's, that token counted): whether
        to sit a step out and draft (see the module's doc). `alone`: no other row would run in the
        step it sits out."""
        drafted = draft_length(self.rate, threshold, most)
        if drafted == 0:  # no draft would be made from it
            return False
        if threshold <= 0.0 or length - self.looked_at > LOOK_AGAIN_STEPS:
            return True
        return self.found and (alone or sum(self.rate**j for j in range(1, drafted + 1)) >= 1.0)

    def record(self, drafted: int, accepted: int) -> None:
        """One decode step of the sequence: it drafted `drafted` tokens (maybe 0), `accepted` stood."""
        if drafted == 0:
            self.rate += RECOVERY * (PRIOR - self.rate)
            return
        # Tested: the tokens that stood and the first that did not (all k when every one stood).
        tested = min(drafted, accepted + 1)
        self.rate += LEARNING_RATE * (accepted / tested - self.rate)


def acceptance_threshold(rows: int, weight_pass_rows: float) -> float:
    """The chance a draft token must have of standing to be worth its row in a step of `rows`."""
    return rows / (weight_pass_rows + rows)


def draft_length(rate: float, threshold: float, most: int) -> int:
    """The longest j <= most with rate^j >= threshold."""
    if most <= 0 or rate < threshold:
        return 0
    if rate >= 1.0 or threshold <= 0.0:
        return most
    # rate >= threshold: at least one; max() guards the rounding of an exact power.
    return min(most, max(1, int(math.log(threshold) / math.log(rate))))
