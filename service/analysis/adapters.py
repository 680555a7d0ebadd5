"""The LoRA adapters the analysis process can apply to its own copy of the served model.

The same folders as the engine core's (`--lora`, then loaded and unloaded at run time through
service/analysis/remote.py), the same LoraSet and the same rules (service/engine/adapters.py):
a name being unloaded takes no new analysis, and its tensors (whose index a later adapter may
reuse) are freed only once no running analysis uses it. Analyses run on worker threads while
load and unload come from the main one, hence the lock around the bookkeeping.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from model.gpt2 import GPT2
from model.lora import AppliedAdapter
from service.engine.adapters import ServedAdapters


class UnknownAdapter(LookupError):
    """A request named an adapter that is not loaded (404); the message names it."""


class AnalysedAdapters:
    def __init__(self, model: GPT2, adapters: tuple[tuple[str, str], ...] = ()) -> None:
        """`adapters`: (name, peft folder) pairs to load now; AdapterError names a bad one."""
        self._served = ServedAdapters(model, adapters)
        self._applied = {name: self._served.set.applied(name) for name in self._served.names}
        self._in_use: Counter[int] = Counter()
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        with self._lock:
            return self._served.names

    def load(self, name: str, folder: str) -> None:
        """ValueError (one line: the folder's fault, or the name's) when refused; then nothing changes."""
        with self._lock:
            self._served.load(name, folder)
            self._applied[name] = self._served.set.applied(name)

    def unload(self, name: str) -> None:
        """UnknownAdapter for a name not loaded (or already being unloaded)."""
        with self._lock:
            try:
                self._served.unload(name)
            except ValueError as exc:
                raise UnknownAdapter(str(exc)) from None
            self._free_unused()

    @contextmanager
    def using(self, name: str | None) -> Iterator[AppliedAdapter | None]:
        """The adapter, held for one analysis (None: the base model)."""
        if name is None:
            yield None
            return
        with self._lock:
            try:
                self._served.index(name)
            except ValueError as exc:
                raise UnknownAdapter(str(exc)) from None
            applied = self._applied[name]
            self._in_use[applied.index] += 1
        try:
            yield applied
        finally:
            with self._lock:
                self._in_use[applied.index] -= 1
                self._free_unused()

    def _free_unused(self) -> None:
        self._served.free_unused(lambda index: self._in_use[index] > 0)
        self._applied = {name: a for name, a in self._applied.items() if name in self._served.set}
