"""Request bodies, so that one key cannot stall the gateway for the others.

- Bytes are charged to the body budget as they arrive, against the gateway's total and a key's
  share of it: a connection that sends headers and nothing else holds no budget, and one key
  holding its whole share leaves the rest to the others.
- A body's size in JSON values (array items and object members) is bounded before it is parsed:
  parsing and validating run on the event loop, in time that grows with the values, not the bytes.
- A key's heavy steps (reading a large body's JSON, laying out and tokenizing a long prompt) run
  in the key's lane, one at a time: a key's huge requests queue behind each other, not in front
  of every other key's."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable, TypeVar

from aiohttp import web

T = TypeVar("T")
# the JSON values a body may hold: a chat of thousands of messages and parts fits; parsing and
# validating this many takes about 50 ms of the event loop
MAX_JSON_VALUES = 65536
# a body this large (bytes) is read, parsed and tokenized in its key's lane
HEAVY_BYTES = 64 << 10


class Refused(Exception):
    """A body refused as it was read: the status, the message and the API error's type and code."""

    def __init__(self, status: int, message: str, etype: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.etype, self.code = status, message, etype, code


class BodyBytes:
    """Body bytes held by the requests in flight, in total and per key: past either bound a
    request is refused at once, as past the streams' bounds."""

    def __init__(self, total: int, per_key: int):
        self.total, self.per_key, self.used = total, per_key, 0
        self.by_key: dict[str, int] = {}

    def refusal(self, key: str, n: int) -> str | None:
        """Which bound n more bytes would cross: "key", "total" or None."""
        if self.by_key.get(key, 0) + n > self.per_key:
            return "key"
        if self.used + n > self.total:
            return "total"
        return None

    def take(self, key: str, n: int) -> str | None:
        """None if taken (give it back), else which bound refused it."""
        why = self.refusal(key, n)
        if why is None:
            self.used += n
            self.by_key[key] = self.by_key.get(key, 0) + n
        return why

    def give(self, key: str, n: int) -> None:
        if not n:
            return
        self.used -= n
        left = self.by_key[key] - n
        if left:
            self.by_key[key] = left
        else:
            del self.by_key[key]


class Lanes:
    """A lock per key, held while the key has heavy steps waiting or running (FIFO within a key)."""

    def __init__(self) -> None:
        self.locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def lane(self, key: str) -> AsyncIterator[None]:
        lock, users = self.locks.get(key) or (asyncio.Lock(), 0)
        self.locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self.locks[key]
            if users == 1:
                del self.locks[key]
            else:
                self.locks[key] = (lock, users - 1)


class Held:
    """The body bytes one request holds, given back when it ends."""

    def __init__(self, key: str):
        self.key, self.n = key, 0


def overloaded(budget: BodyBytes, key: str, why: str) -> Refused:
    if why == "key":
        return Refused(429, f"key {key!r} holds {budget.by_key.get(key, 0)} bytes of request bodies in flight, "
                            f"its share of the gateway's; retry when a request ends", "rate_limit_error",
                       "concurrency_limit_exceeded")
    return Refused(503, f"the gateway holds {budget.used} bytes of request bodies in flight, the most it takes; "
                        f"retry shortly", "overloaded_error", "overloaded")


async def read(request: web.Request, budget: BodyBytes, held: Held, limit: int, timeout_s: float) -> bytes:
    """The body, at most `limit` bytes within `timeout_s`, each chunk charged to the budget as it
    arrives (and kept in `held`). A declared length that cannot fit is refused before a byte is read."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise Refused(413, f"the body is over {limit} bytes", "invalid_request_error", "request_too_large")
    if declared:
        why = budget.refusal(held.key, declared)
        if why:
            raise overloaded(budget, held.key, why)
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                if held.n + len(chunk) > limit:
                    raise Refused(413, f"the body is over {limit} bytes", "invalid_request_error",
                                  "request_too_large")
                why = budget.take(held.key, len(chunk))
                if why:
                    raise overloaded(budget, held.key, why)
                held.n += len(chunk)
                chunks.append(chunk)
    except TimeoutError:
        raise Refused(408, f"the body was not received within {timeout_s:g}s", "invalid_request_error",
                      "request_timeout") from None
    return b"".join(chunks)


def values_at_most(raw: bytes) -> int:
    """An upper bound on the JSON values in raw (the marks inside strings counted too): cheap."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{")


def values(raw: bytes, bound: int) -> int:
    """The JSON values in raw (array items and object members; what is inside strings skipped),
    counted up to just past `bound`. One pass of C-speed finds and counts between the strings, a
    Python step per string: in a worker thread the event loop keeps running. Raw that cannot be
    JSON (more strings than its values could hold) ends the count early: the parse refuses it."""
    n = strings = i = 0
    size = len(raw)
    while i < size:
        q = raw.find(b'"', i)
        end = size if q < 0 else q
        n += raw.count(b",", i, end) + raw.count(b"[", i, end) + raw.count(b"{", i, end)
        strings += 1
        if n > bound or q < 0 or strings > 2 * n + 4:   # JSON has at most a name and a string per value
            return n
        j = q + 1
        while True:   # the string's end: the next quote not escaped by an odd run of backslashes
            j = raw.find(b'"', j)
            if j < 0:
                return n   # not closed: the rest is inside it
            k = j - 1
            while k > q and raw[k] == 0x5C:
                k -= 1
            if (j - 1 - k) % 2 == 0:
                break
            j += 1
        i = j + 1
    return n


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a worker thread. If the request is cancelled meanwhile (its client left), this
    still waits for the thread to end before it lets the cancellation through: the key's turn and
    its bounds are held as long as its work runs (a thread cannot be stopped)."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


async def check_values(raw: bytes, bound: int) -> None:
    """Refuses a body of more than `bound` JSON values before it is parsed."""
    if values_at_most(raw) <= bound:
        return
    if await in_thread(values, raw, bound) > bound:
        raise Refused(400, f"the body holds more than {bound} JSON values (array items and object members: "
                           f"messages, content parts and every other list count)", "invalid_request_error",
                      "request_too_large")
