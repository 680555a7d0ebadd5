"""--api-servers N's bookkeeping: each step's outputs cut per HTTP process (service/engine/routing.py),
and the in-flight count every HTTP process admits against (service/http/core_link.py)."""

from __future__ import annotations

from service.engine.routing import Owners
from service.engine.types import CoreStep, RequestDone, RequestFailed, RequestStarted, StepStats, StepTokens
from service.http.core_link import RunDir, SharedInFlight

STATS = StepStats(3, 0, 3, 3, 0, 3, 8, 0.01)


def token(request_id: str, token_id: int, reason=None):
    return (request_id, 0, token_id, -1.0, reason, None)


def tokens(*rows) -> StepTokens:
    columns = StepTokens()
    for row in rows:
        columns.append(row)
    return columns


def test_each_process_gets_its_own_requests_and_every_process_the_stats():
    owners = Owners(3)
    owners.add(["a1", "a2"], 0)
    owners.add(["c1"], 2)
    step = CoreStep(
        tokens=tokens(token("a1", 10), token("c1", 11), token("a2", 12, "length")),
        started=[RequestStarted("c1", 0.1, 5)],
        done=[RequestDone("a2")],
        failed=[RequestFailed("c1", "boom")],
        stats=STATS,
    )
    parts = owners.split(step)
    assert [[t[0] for t in p.tokens] for p in parts] == [["a1", "a2"], [], ["c1"]]
    # Each part's columns stay aligned: a reason moves with its token.
    assert list(parts[0].tokens) == [token("a1", 10), token("a2", 12, "length")]
    assert [[s.request_id for s in p.started] for p in parts] == [[], [], ["c1"]]
    assert [[d.request_id for d in p.done] for p in parts] == [["a2"], [], []]
    assert [[f.request_id for f in p.failed] for p in parts] == [[], [], ["c1"]]
    assert all(p.stats is STATS for p in parts)
    # Ended requests are forgotten; the running one is still owned.
    assert owners.of_client(0) == ["a1"] and owners.of_client(2) == []


def test_the_in_flight_limit_is_the_whole_servers(tmp_path):
    run_dir = RunDir(tmp_path / "run", 2)
    run_dir.create()
    first, second = SharedInFlight(run_dir, 0), SharedInFlight(run_dir, 1)
    assert first.admit(3, limit=4) is None
    assert second.admit(2, limit=4) == 3  # refused: 3 + 2 > 4, and nothing added
    assert second.admit(1, limit=4) is None
    assert first.admit(1, limit=4) == 4
    first.publish(1)  # two of the first process's requests finished
    assert second.admit(2, limit=4) is None
    # A restarted process starts from nothing: its predecessor's requests were cancelled.
    SharedInFlight(run_dir, 1)
    assert first.admit(3, limit=4) is None
