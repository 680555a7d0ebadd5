"""Repeated log lines are rate-limited, so no attack can fill the disk through the log.

An attacker who holds thousands of connections or sends malformed requests makes uvicorn and
asyncio log the same line (often with a traceback) once per connection: ~750k tracebacks (305 MB)
in 40 s were seen. This filter lets through the first `burst` records of each message template
per window and drops the rest; the first one let through after a drop says how many were dropped.
"""

from __future__ import annotations

import logging
import threading
import time

# Loggers that log once per connection or per malformed request.
FLOOD_LOGGERS = ("asyncio", "uvicorn.error")
MAX_KEYS = 1000  # templates are code constants; the bound only guards against one that is not


class RepeatLimitFilter(logging.Filter):
    def __init__(self, burst: int = 10, window_s: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._seen: dict[tuple, list] = {}  # key → [window start, let through, dropped]
        self._lock = threading.Lock()  # worker threads (tokenization, analysis) log too

    def filter(self, record: logging.LogRecord) -> bool:
        # The unformatted template: per-connection details (addresses, ports) do not make a line new.
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            if len(self._seen) > MAX_KEYS:
                self._seen.clear()
            entry = self._seen.setdefault(key, [now, 0, 0])
            if now - entry[0] >= self.window_s:
                dropped = entry[2]
                entry[:] = [now, 0, 0]
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar lines dropped in the last {self.window_s:g} s]"
            if entry[1] < self.burst:
                entry[1] += 1
                return True
            entry[2] += 1
            return False


def limit_repeated_lines(burst: int = 10, window_s: float = 60.0) -> RepeatLimitFilter:
    log_filter = RepeatLimitFilter(burst, window_s)
    for name in FLOOD_LOGGERS:
        logging.getLogger(name).addFilter(log_filter)
    return log_filter
