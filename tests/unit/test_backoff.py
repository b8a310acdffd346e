"""Exponential backoff with jitter, per key."""
from pd_operator.backoff import Backoff


def test_doubles_with_jitter_and_caps():
    b = Backoff(base=0.5, cap=4, rng=lambda: 1.0)
    assert [b.fail("k", 0) for _ in range(6)] == [0.5, 1, 2, 4, 4, 4]
    low = Backoff(base=0.5, cap=4, rng=lambda: 0.0)
    assert [low.fail("k", 0) for _ in range(3)] == [0.25, 0.5, 1.0]


def test_due_and_reset_per_key():
    b = Backoff(base=1, cap=10, rng=lambda: 1.0)
    b.fail("a", now=100)
    assert not b.due("a", 100.5) and b.due("a", 101) and b.due("b", 100)
    assert b.next_in(100.25) == 0.75
    b.succeed("a")
    assert b.due("a", 100) and b.failures("a") == 0 and b.next_in(0) is None
