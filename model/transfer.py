"""Host → device copies that never make the host wait for the device's queued work.

The engine core overlaps the host's work for step n + 1 with the device's for step n
(service/engine/core.py). On CUDA, `torch.tensor(values, device="cuda")` copies from pageable
memory synchronously: the host waits until every kernel already queued has run, which would undo
the overlap at each admission or step. A copy from pinned memory with `non_blocking=True` is
queued like a kernel instead (torch's pinned-memory cache keeps the buffer until it is done).
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a list, nested lists, or a host tensor) as a tensor on `device`, copied without a sync."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
