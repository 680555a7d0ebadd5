"""Several HTTP processes in front of one core (--api-servers N): which process owns which
request, and each step's output cut into one message per process.

Every process gets every step's stats (its /info and gauges stay current) and only its own
requests' tokens and results.
"""

from __future__ import annotations

from service.engine.types import CoreStep, StepTokens


class Owners:
    def __init__(self, clients: int) -> None:
        self.clients = clients
        self._owner: dict[str, int] = {}

    def add(self, request_ids: list[str], client: int) -> None:
        self._owner.update((r, client) for r in request_ids)

    def of_client(self, client: int) -> list[str]:
        return [r for r, c in self._owner.items() if c == client]

    def split(self, step: CoreStep) -> list[CoreStep]:
        """One CoreStep per client, then forget the requests that ended in this step."""
        owner = self._owner
        parts = [CoreStep(StepTokens(), [], [], [], step.stats) for _ in range(self.clients)]
        for token in step.tokens:
            parts[owner.get(token[0], 0)].tokens.append(token)
        for started in step.started:
            parts[owner.get(started.request_id, 0)].started.append(started)
        for done in step.done:
            parts[owner.pop(done.request_id, 0)].done.append(done)
        for failed in step.failed:
            parts[owner.pop(failed.request_id, 0)].failed.append(failed)
        return parts
