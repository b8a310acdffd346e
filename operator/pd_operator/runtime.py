"""The per-key worker runtime both controllers run on (PDDeployment: reconcile.Controller, PDGateway:
gatewaycontroller.GatewayController): one worker task per object, woken by its watch events or
after the delay its last pass asked for, running only while this process leads, cancelled when
leadership is lost (what a pass recorded is in status for the next leader) and restarted to wait
for it again, with the error policy the controller gives it. The clock is injected, so tests drive
time without sleeping."""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

log = logging.getLogger("pd_operator.runtime")
Key = tuple[str, str]
COALESCE_S = 0.02   # after a wake-up: let a burst of watch events land before the pass
ERROR_FALLBACK_S = 5.0
RESTART_CANCELS, RESTART_WAIT_S = 5, 0.2   # leadership lost: a worker is cancelled this often, this long apart
FIRST_PASSES = 12    # first passes run at once, at most (a start or a takeover of many deployments)


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


SYSTEM_CLOCK = SystemClock()


def spread(key: Key) -> float:
    """A fraction in [0, 1) fixed per key: periods stretched by it keep deployments that settled
    together (a start, a takeover) from resyncing or relisting together forever after."""
    return (zlib.crc32(f"{key[0]}/{key[1]}".encode()) % 1000) / 1000


class Limiters:
    """Agent calls in flight, bounded per key: one deployment with many slow agents cannot take
    every connection (a runtime object, kept out of the memory decide forks)."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self._sems: dict[Key, asyncio.Semaphore] = {}

    def __call__(self, key: Key) -> asyncio.Semaphore:
        sem = self._sems.get(key)
        if sem is None:
            sem = self._sems[key] = asyncio.Semaphore(self.per_key)
        return sem

    def forget(self, key: Key) -> None:
        self._sems.pop(key, None)


class Runtime:
    """`run(key)` is one pass: it returns the seconds until the next (None: only on a wake-up).
    `on_error(key, error)` decides the delay after a pass that raised (None: only on a wake-up, e.g.
    a terminal error waits for a spec change). `timed(seconds)` sees every pass's duration."""

    def __init__(self, name: str, run: Callable[[Key], Awaitable[float | None]],
                 on_error: Callable[[Key, Exception], Awaitable[float | None]],
                 leading: asyncio.Event | Callable[[Key], asyncio.Event],
                 timed: Callable[[float], None] | None = None, clock: Clock = SYSTEM_CLOCK, workers: bool = True):
        self.name, self.run, self.on_error, self.timed = name, run, on_error, timed
        # a key's worker runs while its leadership is held: one Event, or one per shard
        self.leading_for = leading if callable(leading) else (lambda key: leading)
        # workers=False: no worker tasks; whoever holds the runtime runs the passes with once()
        self.clock, self.workers = clock, workers
        self.wake: dict[Key, asyncio.Event] = {}
        self.tasks: dict[Key, asyncio.Task] = {}
        self.stopping = False
        # first passes (after a start or a takeover) ask every agent and re-verify: a few at a
        # time, so a fleet's takeover is a queue that moves, not every pass slow at once
        self.fresh: set[Key] = set()
        self.first_passes = asyncio.Semaphore(FIRST_PASSES)

    def ensure(self, key: Key) -> None:
        """A worker for `key`, if it has none running (and the runtime is not stopping). A worker
        that outlived restart's cancels and ended later counts as none."""
        task = self.tasks.get(key)
        if (task is None or task.done()) and not self.stopping and self.workers:
            self.fresh.add(key)
            self.wake[key] = asyncio.Event()
            self.tasks[key] = asyncio.create_task(self._worker(key), name=f"{self.name}/{key[0]}/{key[1]}")

    def forget(self, key: Key) -> None:
        self.fresh.discard(key)
        task = self.tasks.pop(key, None)
        if task:
            task.cancel()
        self.wake.pop(key, None)

    def poke(self, key: Key) -> None:
        ev = self.wake.get(key)
        if ev:
            ev.set()

    def woken(self, key: Key) -> bool:
        """Whether `key` has a wake-up its worker has not taken yet."""
        ev = self.wake.get(key)
        return ev is not None and ev.is_set()

    def poke_all(self, fresh: bool = False, keys: Iterable[Key] | None = None) -> None:
        """Wake every worker (of `keys`); `fresh`: their next pass is a first pass (a takeover)."""
        chosen = None if keys is None else set(keys)
        woken = [k for k in self.wake if chosen is None or k in chosen]
        if fresh:
            self.fresh.update(woken)
        for key in woken:
            self.poke(key)

    async def restart(self, keys: Iterable[Key] | None = None) -> None:
        """Leadership lost (of `keys`, or of all): cancel their passes in flight now and start
        their workers again, to wait until this process leads them."""
        chosen = None if keys is None else set(keys)
        tasks = [(k, t) for k, t in self.tasks.items() if chosen is None or k in chosen]
        # bounded: a cancellation can be swallowed on its way down (asyncio.wait_for before 3.12,
        # a library's cancel scope), and the caller is the leader election, whose other Leases
        # must go on being renewed. A worker that lived through it is asked again; one that still
        # runs waits at its leadership check before any further pass, so it is left to that.
        pending = {t for _, t in tasks}
        for _ in range(RESTART_CANCELS):
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=RESTART_WAIT_S) if pending else (set(), set())
            if not pending:
                break
        if pending:
            log.warning("%s: %d workers did not end when cancelled; they wait to lead again", self.name, len(pending))
        for key, _ in tasks:
            if self.tasks.get(key) is not None and self.tasks[key].done():
                del self.tasks[key]
                self.ensure(key)

    async def stop(self) -> None:
        self.stopping = True
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def once(self, key: Key) -> float | None:
        """One pass as a worker runs it: the wake-ups so far taken, the error policy's delay if it raised."""
        if key in self.wake:
            self.wake[key].clear()
        if key in self.fresh:
            async with self.first_passes:
                self.fresh.discard(key)
                return await self._once(key)
        return await self._once(key)

    async def _once(self, key: Key) -> float | None:
        t0 = self.clock.monotonic()
        delay: float | None
        try:
            delay = await self.run(key)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never let one object stop the operator
            try:
                delay = await self.on_error(key, e)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - reporting the error failed too (the API away)
                log.exception("%s %s/%s: handling a failed pass", self.name, *key)
                delay = ERROR_FALLBACK_S
        if self.timed is not None:
            self.timed(self.clock.monotonic() - t0)
        return delay

    async def _worker(self, key: Key) -> None:
        while not self.stopping:
            await self.leading_for(key).wait()
            wake = self.wake[key]
            delay = await self.once(key)
            try:
                await asyncio.wait_for(wake.wait(), delay)
                await asyncio.sleep(COALESCE_S)
            except asyncio.TimeoutError:
                pass
