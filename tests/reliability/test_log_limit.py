"""Repeated log lines are rate-limited per message template; the count of dropped lines is told."""

from __future__ import annotations

import logging

from service.http.log_limit import RepeatLimitFilter


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, args, None)


def test_a_flood_of_one_line_is_cut_to_the_burst_and_the_drop_is_reported():
    now = [0.0]
    limit = RepeatLimitFilter(burst=3, window_s=60, clock=lambda: now[0])
    # Per-connection details are arguments, not the template: still the same line.
    passed = [limit.filter(record("connection from %s failed", f"10.0.0.{i}")) for i in range(1000)]
    assert sum(passed) == 3 and passed[:3] == [True] * 3
    assert limit.filter(record("another line")), "other lines are not affected"
    now[0] = 61.0
    later = record("connection from %s failed", "10.0.0.1")
    assert limit.filter(later)
    assert "997 similar lines dropped" in later.getMessage()
