"""The per-key worker runtime both controllers run on: passes requeue after the delay they ask for
or on a wake-up, failures follow the controller's error policy, leadership loss cancels a pass in
flight and the worker waits to lead again, and nothing a pass raises ends the worker."""
from __future__ import annotations

import asyncio

import pytest

from pd_operator.runtime import Runtime

KEY = ("ns", "a")


class Script:
    """run() answers from a list: a delay, or an exception to raise; on_error() from another."""

    def __init__(self, runs: list, errors: list | None = None):
        self.runs, self.errors = list(runs), list(errors or [])
        self.calls: list[str] = []
        self.ran = asyncio.Event()
        self.block: asyncio.Event | None = None

    async def run(self, key):
        self.calls.append("run")
        self.ran.set()
        if self.block is not None:
            await self.block.wait()
        out = self.runs.pop(0) if self.runs else None
        if isinstance(out, BaseException):
            raise out
        return out

    async def on_error(self, key, e):
        self.calls.append(f"error:{type(e).__name__}")
        out = self.errors.pop(0) if self.errors else None
        if isinstance(out, BaseException):
            raise out
        return out


async def until(cond, timeout: float = 10.0) -> None:
    """Yield to the loop until `cond()` holds (what the test observes, however slow the machine)."""
    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(wait(), timeout)


async def runs_of(s: Script, n: int, timeout: float = 5.0) -> None:
    async def until() -> None:
        while s.calls.count("run") < n:
            s.ran.clear()
            await s.ran.wait()
    await asyncio.wait_for(until(), timeout)


@pytest.fixture
def leading():
    ev = asyncio.Event()
    ev.set()
    return ev


async def test_a_pass_requeues_after_its_delay_and_a_poke_wakes_it_early(leading):
    s = Script([0.05, 3600, None])
    rt = Runtime("t", s.run, s.on_error, leading)
    rt.ensure(KEY)
    rt.ensure(KEY)                     # one worker per key
    await runs_of(s, 2)                # the first pass asked for 0.05 s
    assert len(rt.tasks) == 1
    rt.poke(KEY)                       # the second asked for an hour: a wake-up comes first
    await runs_of(s, 3)
    await rt.stop()


async def test_failures_follow_the_error_policy_and_a_failing_handler_does_not_end_the_worker(leading):
    s = Script([RuntimeError("api away"), ValueError("x"), None], errors=[0.01, KeyError("reporting failed")])
    rt = Runtime("t", s.run, s.on_error, leading)
    import pd_operator.runtime as runtime
    runtime.ERROR_FALLBACK_S, before = 0.01, runtime.ERROR_FALLBACK_S
    try:
        rt.ensure(KEY)
        await runs_of(s, 3)
    finally:
        runtime.ERROR_FALLBACK_S = before
    assert s.calls == ["run", "error:RuntimeError", "run", "error:ValueError", "run"]
    assert not rt.tasks[KEY].done()
    await rt.stop()


async def test_a_terminal_error_waits_for_a_wake_up(leading):
    s = Script([RuntimeError("rejected"), None], errors=[None])
    rt = Runtime("t", s.run, s.on_error, leading)
    rt.ensure(KEY)
    await runs_of(s, 1)
    await asyncio.sleep(0.2)
    assert s.calls.count("run") == 1   # no retry on its own
    rt.poke(KEY)
    await runs_of(s, 2)
    await rt.stop()


async def test_leadership_loss_cancels_the_pass_in_flight_and_the_worker_waits_to_lead(leading):
    s = Script([5.0, 5.0, None])
    s.block = asyncio.Event()          # the pass is in flight (waiting on the API)
    timings: list[float] = []
    rt = Runtime("t", s.run, s.on_error, leading, timed=timings.append)
    rt.ensure(KEY)
    await runs_of(s, 1)
    leading.clear()
    await rt.restart()                 # follow(): cancelled, not finished
    assert timings == [] and KEY in rt.tasks and not rt.tasks[KEY].done()
    s.block.set()
    await asyncio.sleep(0.1)
    assert s.calls.count("run") == 1   # a standby runs no pass
    leading.set()                      # lead(): from the start again
    rt.poke_all()
    await runs_of(s, 2)
    rt.forget(KEY)
    assert KEY not in rt.tasks and KEY not in rt.wake
    await rt.stop()
    rt.ensure(("ns", "b"))             # a stopped runtime starts no worker
    assert ("ns", "b") not in rt.tasks


async def _lost_leadership_in_a_pass(run, calls: list[str], leading: asyncio.Event) -> Runtime:
    """A runtime whose worker is in its first pass when leadership is lost (restart has returned)."""
    async def on_error(key, e):
        return None

    rt = Runtime("t", run, on_error, leading)
    rt.ensure(KEY)
    await until(lambda: calls == ["run"])
    leading.clear()
    await asyncio.wait_for(rt.restart(), 5.0)
    return rt


async def test_a_worker_that_swallows_its_cancellation_does_not_hold_up_leadership_loss(leading):
    """A cancellation lost on its way down (asyncio.wait_for before 3.12 can drop one) must not
    hang follow(): the leader election awaits it, and its other Leases are due for renewal."""
    swallowed = asyncio.Event()
    calls: list[str] = []

    async def run(key):
        calls.append("run")
        if swallowed.is_set():
            await asyncio.sleep(3600)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()            # lost once; the pass goes on as if nothing happened
        await asyncio.sleep(3600)

    rt = await _lost_leadership_in_a_pass(run, calls, leading)
    assert swallowed.is_set() and calls == ["run"], "cancelled again until it ended; no further pass"
    leading.set()
    rt.poke_all()
    await until(lambda: calls == ["run", "run"])
    await rt.stop()


async def test_a_worker_that_outlived_every_cancel_and_ended_later_is_started_again(leading):
    """restart leaves a worker that swallowed all its cancels; if it ends later, the key must not
    keep a dead task that ensure() takes for a running worker (the deployment would get no pass)."""
    release = asyncio.Event()
    calls: list[str] = []

    async def run(key):
        calls.append("run")
        if len(calls) == 1:
            while True:
                try:
                    await release.wait()
                    break
                except asyncio.CancelledError:
                    pass           # every cancel lost...
            raise asyncio.CancelledError   # ... and a late one ends it
        await asyncio.sleep(3600)

    rt = await _lost_leadership_in_a_pass(run, calls, leading)
    release.set()
    await until(lambda: rt.tasks[KEY].done())
    leading.set()
    rt.ensure(KEY)                 # what a watch event or a takeover does
    rt.poke_all()
    await until(lambda: calls == ["run", "run"])
    await rt.stop()


async def test_first_passes_run_a_few_at_a_time_and_later_passes_are_not_held(leading):
    from pd_operator.runtime import FIRST_PASSES
    running, most, gate = 0, 0, asyncio.Event()
    passes: dict = {}

    async def run(key):
        nonlocal running, most
        passes[key] = passes.get(key, 0) + 1
        running += 1
        most = max(most, running)
        try:
            if passes[key] == 1:
                await gate.wait()
            return 3600
        finally:
            running -= 1

    async def on_error(key, e):
        return None
    rt = Runtime("t", run, on_error, leading)
    keys = [("ns", f"d{i}") for i in range(3 * FIRST_PASSES)]
    for k in keys:
        rt.ensure(k)
    await until(lambda: running == FIRST_PASSES)
    for _ in range(10):          # more workers get their turn on the loop: none may start a pass
        await asyncio.sleep(0)
    assert most == FIRST_PASSES, "first passes bounded"
    gate.set()
    await until(lambda: len(passes) == len(keys) and running == 0)   # every deployment had its first pass
    assert not rt.fresh
    gate.clear()
    rt.poke_all()                # not a takeover: the next passes are not first passes
    await until(lambda: all(n >= 2 for n in passes.values()))
    assert all(n == 2 for n in passes.values())
    rt.poke_all(fresh=True)      # a takeover: every next pass is a first pass again
    assert rt.fresh == set(keys)
    await rt.stop()
