"""The LoRA adapters an engine core serves: loaded at start-up or at run time, chosen by name per
request, unloaded once no request uses them.

The tensors and the batched products are model/lora.py's (`LoraSet`); this adds the serving
rules: a name being unloaded takes no new request, and its index (which a later adapter may
reuse) is given up only after every running and waiting request that uses it has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from model.gpt2 import GPT2
from model.lora import BASE, LoraRows, LoraSet


class UnknownAdapter(ValueError):
    """A request named an adapter not served (or being unloaded)."""


class ServedAdapters:
    def __init__(self, model: GPT2, adapters: tuple[tuple[str, str], ...] = ()) -> None:
        """`adapters`: (name, peft folder) pairs to load now; AdapterError names a bad one."""
        self.set = LoraSet(model)
        self.unloading: set[str] = set()
        for name, folder in adapters:
            self.set.load(name, folder)
        self.loaded = bool(self.set.names)  # read by every step: a flag, not a question

    @property
    def names(self) -> list[str]:
        """The adapters a request may name."""
        return [name for name in self.set.names if name not in self.unloading]

    def load(self, name: str, folder: str) -> None:
        """Make a peft folder's adapter servable. Raises AdapterError (a ValueError) naming what
        is wrong; then nothing changes."""
        if name in self.unloading:
            raise ValueError(f"adapter {name!r} is being unloaded (requests still use it)")
        self.set.load(name, folder)
        self.loaded = True

    def unload(self, name: str) -> None:
        """Refuse new requests for it from now on; `free_unused` frees it once none uses it."""
        self.index(name)  # raises for an unknown name
        self.unloading.add(name)

    def index(self, name: str | None) -> int:
        """A request's adapter index (BASE for none). ValueError for a name not served."""
        if name is None:
            return BASE
        if name not in self.set or name in self.unloading:
            raise UnknownAdapter(f"no LoRA adapter named {name!r} is loaded")
        return self.set.index(name)

    def rows(self, adapters: Iterable[int]) -> LoraRows | None:
        """A forward's per-row adapters (`adapters`: an array, as the input batch's column gives
        them to a decode, or any iterable of indices); None (the base forward, exactly as without
        adapters) when none is loaded (then `adapters` is never walked) or no row uses one."""
        if not self.loaded:
            return None
        return self.set.rows(adapters if isinstance(adapters, np.ndarray) else np.fromiter(adapters, dtype=np.int64))

    def free_unused(self, in_use: Callable[[int], bool]) -> list[int]:
        """Free the unloading adapters no request uses any more; their indices."""
        freed = {name: self.set.index(name) for name in self.unloading if not in_use(self.set.index(name))}
        for name in freed:
            self.set.remove(name)
            self.unloading.discard(name)
        self.loaded = bool(self.set.names)
        return list(freed.values())
