"""The running requests, kept up to date as they come and go (admission, leaving), so that neither
a step nor an admission asks every running request: in admission order, those among them that need
the host's tokens before each step (RequestState.host_paced), how many are beam searches, and them
by their prompt's first token (only those can share a prefix with a new prompt).
"""

from __future__ import annotations

from service.engine.requests import RequestState


class RunningRequests:
    def __init__(self) -> None:
        self.states: list[RequestState] = []
        self.host_paced: list[RequestState] = []
        self.beams = 0
        self._by_first_token: dict[int, list[RequestState]] = {}

    def add(self, state: RequestState) -> None:
        """An admitted request starts running (after its sequences were made)."""
        self.states.append(state)
        if state.host_paced:
            self.host_paced.append(state)
        self.beams += state.beam is not None
        self._by_first_token.setdefault(state.request.prompt_ids[0], []).append(state)

    def remove(self, states: list[RequestState]) -> None:
        """Running requests leave (finished, cancelled, failed or preempted)."""
        if not states:
            return
        gone = {id(state) for state in states}
        self.states = [s for s in self.states if id(s) not in gone]
        if self.host_paced:
            self.host_paced = [s for s in self.host_paced if id(s) not in gone]
        self.beams -= sum(state.beam is not None for state in states)
        for first_token in {state.request.prompt_ids[0] for state in states}:
            kept = [s for s in self._by_first_token.get(first_token, ()) if id(s) not in gone]
            if kept:
                self._by_first_token[first_token] = kept
            else:
                self._by_first_token.pop(first_token, None)

    def clear(self) -> list[RequestState]:
        """Every running request leaves at once (after a failed step); they are returned."""
        states, self.states = self.states, []
        self.host_paced, self.beams = [], 0
        self._by_first_token.clear()
        return states

    def sharing_first_token(self, token: int) -> list[RequestState]:
        """The running requests whose prompt starts with `token`."""
        return self._by_first_token.get(token, [])
