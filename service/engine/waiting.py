"""The requests submitted and not admitted yet, and the ids of every request not finished: the one
part of the scheduler another thread touches (`add`, `cancel`, `forget`, `close`: tests drive both
from one thread, the engine core process from its own), so everything here is behind one lock.
What runs, and when, is the scheduler's to decide (service/engine/scheduler.py); this keeps the
arrival order and answers who is waiting, who was cancelled and which ids are taken.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from service.engine.requests import RequestState
from service.engine.types import EngineStopped, QueueFull


class WaitingQueue:
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._submissions: deque[list[RequestState]] = deque()  # in arrival order: one HTTP call's prompts together
        self.count = 0  # written under the lock; the stepping thread reads it as it is
        self.cancelled: set[str] = set()  # taken by `take_cancelled`; read as it is to skip the lock when empty
        self._active: set[str] = set()  # submitted and not yet finished
        self._closed = False

    def add(self, states: list[RequestState]) -> None:
        """Queue one submission's requests behind the others. EngineStopped once closed, ValueError
        for an id that is taken (or twice in it), QueueFull beyond max_waiting."""
        ids = [state.request.request_id for state in states]
        with self._lock:
            if self._closed:
                raise EngineStopped("the engine is shutting down")
            if len(set(ids)) < len(ids) or self._active.intersection(ids):
                raise ValueError(f"request ids must be unique among active requests: {ids}")
            if self.count + len(states) > self.max_waiting:
                raise QueueFull(f"{self.count} requests are already waiting")
            self._submissions.append(states)
            self.count += len(states)
            self._active.update(ids)

    def push_front(self, state: RequestState) -> None:
        """A running request back in the queue, first (preempted)."""
        with self._lock:
            self._submissions.appendleft([state])
            self.count += 1

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._active:
                self.cancelled.add(request_id)

    def cancel_all(self) -> None:
        with self._lock:
            self.cancelled.update(self._active)

    def take_cancelled(self) -> set[str]:
        """The ids cancelled since the last call (a cancel arriving meanwhile is taken next time)."""
        with self._lock:
            cancelled, self.cancelled = self.cancelled, set()
        return cancelled

    def forget(self, request_id: str) -> None:
        """The request has finished: its id may be used again."""
        with self._lock:
            self._active.discard(request_id)
            self.cancelled.discard(request_id)

    def close(self) -> None:
        """Refuse new submissions from now on (draining)."""
        with self._lock:
            self._closed = True

    def states(self) -> list[RequestState]:
        """The waiting requests, in arrival order (a snapshot)."""
        with self._lock:
            return [state for submission in self._submissions for state in submission]

    def drop(self, dropping: Callable[[RequestState], bool]) -> list[RequestState]:
        """Take the waiting requests `dropping` says leave the queue (their ids stay taken)."""
        dropped = []
        with self._lock:
            for submission in self._submissions:
                for state in [s for s in submission if dropping(s)]:
                    submission.remove(state)
                    dropped.append(state)
            self._submissions = deque(s for s in self._submissions if s)
            self.count -= len(dropped)
        return dropped

    @contextmanager
    def admitting(self) -> Iterator[tuple[list[RequestState], list[RequestState]]]:
        """(the waiting requests in arrival order, a list for the caller to put those it admits
        in), under the lock: no submission lands in the middle of an admission. The admitted leave
        the queue on exit, also when admitting one of them raised."""
        admitted: list[RequestState] = []
        with self._lock:
            try:
                yield [state for submission in self._submissions for state in submission], admitted
            finally:
                gone = {id(state) for state in admitted}
                self._submissions = deque(kept for submission in self._submissions
                                          if (kept := [state for state in submission if id(state) not in gone]))
                self.count -= len(admitted)
