"""bench/bench_decide.py at a tiny size: the passes it times are settled ones (it asserts so), so
the benchmark keeps measuring what it says as decide changes."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_decide  # noqa: E402


def test_the_timed_passes_are_settled_and_the_failing_status_is_measured():
    r = bench_decide.run(prefill=2, decoder=2, tp=2, passes=3)
    assert r["passes"] == 3 and 0 < r["median_ms"] <= r["max_ms"]
    assert 0 < r["failing_status_bytes"] <= bench_decide.STATUS_LIMIT


def test_a_pass_with_a_link_down_is_not_taken_for_settled():
    f = bench_decide.fleet(2, 2, 2)
    mem, now, wall = bench_decide.settle(f)
    d = next(s for s in f.statuses.values() if s.role == "decoder")
    f.statuses[d.pod] = d.model_copy(update={"links": d.links[:1]})
    plan = bench_decide.decide(bench_decide.snapshot(f, mem, now, wall))
    assert not bench_decide.settled(plan) and [p.decoder.pod for p in plan.links] == [d.pod]
