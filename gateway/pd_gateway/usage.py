"""Usage per key and model (requests, input and output tokens per UTC day) and requests per key
per minute, shared by every replica of a gateway through one object in the Kubernetes API.

Why the API and not a Redis: the gateway already talks to it, it survives restarts of every
gateway pod, and the chart needs nothing more to run. Each replica keeps what it counted since
its last sync and adds it to the shared document every few seconds with an optimistic write
(the object's resourceVersion; a conflict re-reads and adds again), so a quota holds across
replicas to within a sync interval. Counts survive a failed or interrupted write and a graceful
shutdown; a write the API server applied but whose answer never arrived is added again (usage
can be over-counted then, never lost). The document keeps DAYS_KEPT days and the last two
minutes: 100 keys x 4 models x 8 days is about 200 KB, below an object's 1 MiB.

Whoever may edit the ConfigMap (not only this gateway) can write anything there, so nothing in
it is trusted:
- every load is checked (check(): the schema, counts integers in 0..MAX_COUNT, bounded size); a
  document that fails is ignored: the replica keeps its last good copy (`remote`), counts the
  rejection (on_reject: a metric), says why (`rejected`: /healthz, admin keys' /v1/usage) and
  writes that copy back over the bad document;
- counts never go down from outside: a loaded counter is merged as max(last good copy, loaded)
  before this replica adds its own pending counts. A replica's copy is a document that was in
  the store, and honest replicas only add, so between them max() is the loaded value (nothing
  is added twice); a lowered count (a reset to `{}`) is put back and reported as `lowered`;
- a repair (of a rejected or lowered document) is written alone, this replica's pending counts at
  its next sync: added to its own copy, which may be older than another replica's, they would
  vanish in that replica's max(). (They still can if that replica's next sync is more than an
  interval late: per-replica counters would close that, at the cost of the document's size.)
- a counter that grew since the last good copy by more than the gateway could serve in that time
  (TOKENS_PER_S, REQUESTS_PER_S, over at least GROWTH_FLOOR_S) is a forged increase: rejected.
  An honest flush that big (a replica that could not write for minutes) is only delayed: the
  allowance grows with the time since the last good copy;
- the one way counts go down is an admin's reset of a key's day (reset()): a marker in the
  document, signed with a secret a ConfigMap editor does not have (the gateway derives it from
  its admin keys), newer than the one a replica knows, makes that (day, key) take the loaded
  counts as they are. A marker that does not verify is ignored, and dropped at the next write;
- the whole document is signed (`mac`) with a secret derived from every API key, which a
  ConfigMap editor who cannot read the keys Secret does not have: a document whose signature
  verifies under neither the current keys' secret nor the one before them (a key rotation, while
  replicas reload the keys at different times) is rejected, so no count, reservation or reset
  can be forged, not even within the growth bound. A document the replicas signed with keys
  since rotated out is signed again by the first replica to read it with the new keys. At a
  replica's first load any document is taken, as before signing (a new ConfigMap, one an older
  gateway wrote, one signed with keys this replica never held).

Reservations are shared too: each replica writes the tokens its requests in flight may still use
(`reserved`, per replica, with the time it last wrote them) and counts every other replica's
fresh reservations against a key's tokensPerDay, so replicas do not each admit the whole budget
for requests longer than a sync interval. A replica that stopped writing (gone) is forgotten
after RESERVATION_TTL_S."""
from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import json
import logging
import re
import threading
import uuid
from typing import Any, Callable, Protocol

from .policy import DAY_S, day_of, minute_of

log = logging.getLogger("pd_gateway.usage")
DAYS_KEPT = 8
SYNC_S = 3.0
DATA_KEY = "usage.json"
Doc = dict[str, Any]
COUNTERS = frozenset(("requests", "input", "output"))
# bounds of a document this gateway writes (a larger one was written by someone else): below a
# ConfigMap's 1 MiB; an entry (day, key, model) is at least ~40 bytes of JSON, so MAX_ENTRIES
# of them fit in MAX_BYTES; JavaScript's safe integers, so every JSON reader reads them the same
MAX_BYTES = 900 << 10
MAX_ENTRIES = 20000
MAX_DAYS = DAYS_KEPT + 2
MAX_MINUTES = 4
MAX_NAME = 253   # a Secret's data key (an API key's name) is at most this long
MAX_COUNT = 2**53
DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
MINUTE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}")
MAC = re.compile(r"[0-9a-f]{64}")
# the most one counter (a key's input or output tokens on one model, its requests) may grow per
# second of the time since a replica's last good copy: ten times what a large P-D fleet serves
# one key (some 100 pairs at 10k prompt tokens/s); over GROWTH_FLOOR_S at least, which covers
# another replica's counts kept through twenty failed writes (an API server restarting)
TOKENS_PER_S = 1_000_000
REQUESTS_PER_S = 10_000
GROWTH_FLOOR_S = 60.0
REJECTED_SHOWN_S = 600.0   # how long /healthz lists a rejected document
RESERVATION_TTL_S = 30.0   # another replica's reservations count while it wrote them this recently
RESERVATION_REFRESH_S = 10.0   # a replica holding reservations writes them again this often
MAX_REPLICAS = 64


class Conflict(Exception):
    """The shared document changed since it was read."""


class Invalid(ValueError):
    """The shared document is not one this gateway wrote. `reason` is one of a few words (a
    metric's label); `version` is the document's, so a repair writes over it and nothing newer."""

    def __init__(self, reason: str, detail: str, version: str | None = None):
        super().__init__(detail)
        self.reason, self.version = reason, version


class Store(Protocol):
    def load(self) -> tuple[Any, str | None]: ...
    def save(self, doc: Doc, version: str | None) -> None: ...


def empty() -> Doc:
    return {"days": {}, "minutes": {}, "resets": {}, "reserved": {}}


# ---- the schema ---------------------------------------------------------------------------------

def _where(*path: Any) -> str:
    return "".join(f"[{str(p)[:40]!r}]" for p in path)


def _obj(v: Any, *path: Any) -> dict:
    if not isinstance(v, dict):
        raise Invalid("bad_shape", f"{_where(*path) or 'the document'} is a {type(v).__name__}, not an object")
    return v


def _name(v: Any, pattern: re.Pattern | None, *path: Any) -> None:
    ok = isinstance(v, str) and 0 < len(v) <= MAX_NAME and (pattern is None or pattern.fullmatch(v))
    if not ok:
        raise Invalid("bad_shape", f"{_where(*path, v)}: not a {pattern.pattern if pattern else 'name'}")


def _count(v: Any, *path: Any) -> None:
    if type(v) is not int or not 0 <= v <= MAX_COUNT:   # type(): a bool is not a count
        raise Invalid("bad_count", f"{_where(*path)} is {str(v)[:40]!r}, not an integer in 0..2**53")


class _Budget:
    """Entries seen so far: a document with more was not written by this gateway."""

    def __init__(self) -> None:
        self.n = 0

    def take(self) -> None:
        self.n += 1
        if self.n > MAX_ENTRIES:
            raise Invalid("too_large", f"more than {MAX_ENTRIES} entries")


def _days(days: Any, budget: _Budget) -> None:
    if len(_obj(days, "days")) > MAX_DAYS:
        raise Invalid("too_large", f"{len(days)} days, more than {MAX_DAYS}")
    for day, keys in days.items():
        _name(day, DAY, "days")
        for key, models in _obj(keys, "days", day).items():
            _name(key, None, "days", day)
            for model, counts in _obj(models, "days", day, key).items():
                _name(model, None, "days", day, key)
                budget.take()
                if set(_obj(counts, "days", day, key, model)) != COUNTERS:
                    raise Invalid("bad_shape", f"{_where('days', day, key, model)} has "
                                               f"{sorted(map(str, counts))[:4]}, not {sorted(COUNTERS)}")
                for k, v in counts.items():
                    _count(v, "days", day, key, model, k)


def _minutes(minutes: Any, budget: _Budget) -> None:
    if len(_obj(minutes, "minutes")) > MAX_MINUTES:
        raise Invalid("too_large", f"{len(minutes)} minutes, more than {MAX_MINUTES}")
    for minute, keys in minutes.items():
        _name(minute, MINUTE, "minutes")
        for key, n in _obj(keys, "minutes", minute).items():
            _name(key, None, "minutes", minute)
            budget.take()
            _count(n, "minutes", minute, key)


def _resets(resets: Any, budget: _Budget) -> None:
    if len(_obj(resets, "resets")) > MAX_DAYS:
        raise Invalid("too_large", f"resets on {len(resets)} days, more than {MAX_DAYS}")
    for day, keys in resets.items():
        _name(day, DAY, "resets")
        for key, marker in _obj(keys, "resets", day).items():
            _name(key, None, "resets", day)
            budget.take()
            if set(_obj(marker, "resets", day, key)) != {"at", "mac"}:
                raise Invalid("bad_shape", f"{_where('resets', day, key)} is not {{at, mac}}")
            _count(marker["at"], "resets", day, key, "at")
            _name(marker["mac"], MAC, "resets", day, key)


def _reserved(reserved: Any, budget: _Budget) -> None:
    if len(_obj(reserved, "reserved")) > MAX_REPLICAS:
        raise Invalid("too_large", f"more than {MAX_REPLICAS} replicas hold reservations")
    for replica, held in reserved.items():
        _name(replica, None, "reserved")
        if set(_obj(held, "reserved", replica)) != {"at", "keys"}:
            raise Invalid("bad_shape", f"{_where('reserved', replica)} is not {{at, keys}}")
        _count(held["at"], "reserved", replica, "at")
        for key, n in _obj(held["keys"], "reserved", replica, "keys").items():
            budget.take()
            _name(key, None, "reserved", replica, "keys")
            _count(n, "reserved", replica, "keys", key)


def check(doc: Any) -> Doc:
    """The document if it is one this gateway could have written, else Invalid saying what is
    not (missing sections are empty: a new ConfigMap, an older gateway's document). Its
    signature is left out: verified() checks it."""
    unknown = set(_obj(doc)) - {"days", "minutes", "resets", "reserved", "mac"}
    if unknown:
        raise Invalid("bad_shape", f"unknown field {str(sorted(map(str, unknown))[0])[:40]!r}")
    out = {part: doc.get(part, {}) for part in empty()}
    budget = _Budget()
    _days(out["days"], budget)
    _minutes(out["minutes"], budget)
    _resets(out["resets"], budget)
    _reserved(out["reserved"], budget)
    if "mac" in doc:
        _name(doc["mac"], MAC, "mac")
    return out


def doc_mac(secret: bytes, doc: Doc) -> str:
    """The document's signature: over its canonical JSON, its own `mac` left out."""
    body = {part: doc.get(part, {}) for part in empty()}
    return hmac.new(secret, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(),
                    hashlib.sha256).hexdigest()


def verified(raw: Doc, doc: Doc, secrets: list[bytes], first: bool, macs: list[str] | None = None) -> Invalid | None:
    """Why a loaded document is not one the gateway's replicas signed (None if it is): signed
    under one of `secrets`, or holding nothing at all. At a replica's first load (`first`) any
    document is taken, as before signing: a replica that just started knows no earlier keys, and
    one signed with keys rotated out while it was down is honest (its replicas re-sign it)."""
    if not secrets or first:
        return None
    mac = raw.get("mac")
    if mac is None:
        holds = any(doc[part] for part in empty())
        return Invalid("unsigned", "the document is not signed by the gateway") if holds else None
    # `macs`: the document's signatures under `secrets`, if already computed
    if any(hmac.compare_digest(mac, m) for m in (macs if macs is not None else [doc_mac(x, doc) for x in secrets])):
        return None
    return Invalid("bad_signature", "the document's signature does not verify: it was written by someone "
                                    "without the gateway's keys")


# ---- merging ---------------------------------------------------------------------------------------

def sign(secret: bytes, day: str, key: str, at: int) -> str:
    return hmac.new(secret, json.dumps([day, key, at]).encode(), hashlib.sha256).hexdigest()


def reset_at(doc: Doc, day: str, key: str, secret: bytes | None) -> int:
    """When an admin last reset the key's day, if the document's marker says so and is signed
    with `secret` (-1: no reset, or a marker anyone could have written)."""
    m = doc.get("resets", {}).get(day, {}).get(key)
    if m is None or secret is None or not hmac.compare_digest(m["mac"], sign(secret, day, key, m["at"])):
        return -1
    return m["at"]


def _max_models(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for model, counts in b.items():
        into = out.setdefault(model, {k: 0 for k in COUNTERS})
        for k, v in counts.items():
            into[k] = max(into.get(k, 0), v)
    return out


def _pick(mine: Doc, theirs: Doc, day: str, key: str, secret: bytes | None) -> tuple[dict, dict | None]:
    """A (day, key)'s counts and reset marker: those of the side whose verified marker is newer,
    as they are; with the same marker (or none), the larger of each counter."""
    at_mine, at_theirs = reset_at(mine, day, key, secret), reset_at(theirs, day, key, secret)
    newer = theirs if at_theirs > at_mine else mine
    marker = dict(newer["resets"][day][key]) if max(at_mine, at_theirs) >= 0 else None
    if at_mine != at_theirs:
        return copy.deepcopy(newer["days"].get(day, {}).get(key, {})), marker
    return _max_models(mine["days"].get(day, {}).get(key, {}), theirs["days"].get(day, {}).get(key, {})), marker


def merge(mine: Doc, theirs: Doc, secret: bytes | None) -> Doc:
    """Per counter the larger of the two, so counts never go down from outside; but a (day, key)
    whose verified reset marker is newer on one side takes that side's counts as they are."""
    out = empty()
    for minute in mine["minutes"].keys() | theirs["minutes"].keys():
        a, b = mine["minutes"].get(minute, {}), theirs["minutes"].get(minute, {})
        out["minutes"][minute] = {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}
    for day in mine["days"].keys() | theirs["days"].keys() | mine["resets"].keys() | theirs["resets"].keys():
        for key in set().union(*(d[part].get(day, {}) for d in (mine, theirs) for part in ("days", "resets"))):
            models, marker = _pick(mine, theirs, day, key, secret)
            if models:
                out["days"].setdefault(day, {})[key] = models
            if marker is not None:
                out["resets"].setdefault(day, {})[key] = marker
    # reservations are each replica's own: the loaded document's say what the others hold now
    out["reserved"] = copy.deepcopy(theirs["reserved"] if "reserved" in theirs else mine.get("reserved", {}))
    return out


def too_fast(before: Doc, after: Doc, seconds: float, secret: bytes | None) -> str | None:
    """The first counter that grew from `before` to `after` by more than the gateway could serve
    in `seconds` (counted from zero after a reset), or None."""
    for day, keys in after["days"].items():
        for key, models in keys.items():
            fresh = reset_at(after, day, key, secret) != reset_at(before, day, key, secret)
            was = {} if fresh else before["days"].get(day, {}).get(key, {})
            for model, counts in models.items():
                for k, n in counts.items():
                    grew = n - was.get(model, {}).get(k, 0)
                    if grew > (REQUESTS_PER_S if k == "requests" else TOKENS_PER_S) * seconds:
                        return f"{_where('days', day, key, model, k)} grew by {grew} in {seconds:.0f}s"
    for minute, keys in after["minutes"].items():
        for key, n in keys.items():
            grew = n - before["minutes"].get(minute, {}).get(key, 0)
            if grew > REQUESTS_PER_S * seconds:
                return f"{_where('minutes', minute, key)} grew by {grew} in {seconds:.0f}s"
    return None


def lowered(before: Doc, after: Doc, since: str, secret: bytes | None) -> str | None:
    """The first counter of a day from `since` on that is lower in `after` than in `before` with
    no newer reset to say why (honest replicas only add), or None. Minutes are left out: another
    replica's clock a second off prunes a minute this one still keeps."""
    for day, keys in before["days"].items():
        if day < since:
            continue   # older days end the window at different times on different clocks
        for key, models in keys.items():
            if reset_at(after, day, key, secret) > reset_at(before, day, key, secret):
                continue
            now_models = after["days"].get(day, {}).get(key, {})
            for model, counts in models.items():
                for k, n in counts.items():
                    m = now_models.get(model, {}).get(k, 0)
                    if m < n:
                        return f"{_where('days', day, key, model, k)} went from {n} to {m}"
    return None


def add(a: Doc, b: Doc) -> Doc:
    """a + b, counter by counter (neither is changed; a's reset markers are kept)."""
    out = copy.deepcopy(a)
    for part in empty():
        out.setdefault(part, {})
    for day, keys in b.get("days", {}).items():
        for key, models in keys.items():
            for model, counts in models.items():
                into = out["days"].setdefault(day, {}).setdefault(key, {}).setdefault(
                    model, {"requests": 0, "input": 0, "output": 0})
                for k, v in counts.items():
                    into[k] = into.get(k, 0) + v
    for minute, keys in b.get("minutes", {}).items():
        for key, n in keys.items():
            out["minutes"].setdefault(minute, {})[key] = out["minutes"].get(minute, {}).get(key, 0) + n
    return out


def prune(doc: Doc, now: float) -> Doc:
    """The DAYS_KEPT days up to today (and tomorrow: another replica's clock may be past midnight)
    and the last two minutes. By date, not the newest present: days a writer put in the future
    must not push today out."""
    first, last = day_of(now - (DAYS_KEPT - 1) * DAY_S), day_of(now + DAY_S)
    keep = {minute_of(now), minute_of(now - 60)}
    fresh = int((now - RESERVATION_TTL_S) * 1000)
    return {"days": {d: v for d, v in doc.get("days", {}).items() if first <= d <= last},
            "minutes": {m: v for m, v in doc.get("minutes", {}).items() if m in keep},
            "resets": {d: v for d, v in doc.get("resets", {}).items() if first <= d <= last},
            "reserved": {r: v for r, v in doc.get("reserved", {}).items() if v["at"] >= fresh}}


def _lasting(doc: Doc) -> tuple:
    """What a repair must write back if it differs (a minute's counts end with it)."""
    return doc.get("days", {}), doc.get("resets", {})


class Usage:
    def __init__(self, store: Store | None = None, secret: Callable[[], bytes | None] | None = None,
                 doc_secret: Callable[[], bytes | None] | None = None, replica: str | None = None):
        self.store = store
        self.secret = secret            # signs and verifies reset markers (None: set by the gateway)
        self.doc_secret = doc_secret    # signs and verifies the document (None: set by the gateway)
        self.secrets: list[bytes] = []  # the document's secret now, and the one before it (a key rotation)
        self.replica = replica or uuid.uuid4().hex[:12]
        self.remote: Doc = empty()      # the shared document as of the last sync: the last good copy
        self.pending: Doc = empty()     # counted here since
        self.syncing: Doc = empty()     # being added to the shared document right now
        self.synced_at: float | None = None
        self.trusted_at: float | None = None   # when a loaded document was last accepted
        self.error = ""
        self.rejected: dict | None = None      # the last document ignored: {reason, detail, at}
        self.on_reject: Callable[[str], None] = lambda reason: None
        self.reserved: dict[str, int] = {}   # key -> tokens its requests in flight here may still use
        self._busy = False

    def _both(self) -> list[Doc]:
        return [self.remote, self.syncing, self.pending]

    def _secret(self) -> bytes | None:
        return self.secret() if self.secret is not None else None

    def reserve(self, key: str, tokens: int) -> None:
        """At admission: what a request may use (its prompt and max_tokens) counts against its key's
        quota until it is settled, so concurrent requests cannot all pass the same check."""
        self.reserved[key] = self.reserved.get(key, 0) + tokens

    def settle(self, key: str, tokens: int) -> None:
        """The request ended: its reservation goes (record() counts what it used)."""
        left = self.reserved.get(key, 0) - tokens
        if left > 0:
            self.reserved[key] = left
        else:
            self.reserved.pop(key, None)

    def admitted(self, key: str, now: float) -> None:
        m = self.pending["minutes"].setdefault(minute_of(now), {})
        m[key] = m.get(key, 0) + 1

    def record(self, key: str, model: str, input_tokens: int, output_tokens: int, now: float) -> None:
        c = self.pending["days"].setdefault(day_of(now), {}).setdefault(key, {}).setdefault(
            model, {"requests": 0, "input": 0, "output": 0})
        c["requests"] += 1
        c["input"] += input_tokens
        c["output"] += output_tokens

    def requests_this_minute(self, key: str, now: float) -> int:
        m = minute_of(now)
        return sum(d["minutes"].get(m, {}).get(key, 0) for d in self._both())

    def tokens_today(self, key: str, now: float) -> int:
        """Used today (every replica, as of the last sync) and reserved by requests in flight: here,
        and on the other replicas as they last wrote it (if recently)."""
        day = day_of(now)
        fresh = int((now - RESERVATION_TTL_S) * 1000)
        others = sum(held["keys"].get(key, 0) for replica, held in self.remote["reserved"].items()
                     if replica != self.replica and held["at"] >= fresh)
        return self.reserved.get(key, 0) + others + sum(c["input"] + c["output"] for d in self._both()
                                                        for c in d["days"].get(day, {}).get(key, {}).values())

    def report(self, key: str | None = None) -> dict:
        """{key: {day: {model: {requests, input, output}}}}, one key's or everyone's."""
        docs = self._both()
        if key is not None:   # one key's share only, before any copying
            docs = [{"days": {day: {key: keys[key]} for day, keys in d["days"].items() if key in keys}} for d in docs]
        total = add(add(docs[0], docs[1]), docs[2])
        out: dict = {}
        for day, keys in sorted(total["days"].items()):
            for k, models in keys.items():
                if key is None or k == key:
                    out.setdefault(k, {})[day] = models
        return out

    def reset(self, key: str, day: str, now: float) -> None:
        """An admin forgives a key's usage of a day: gone here at once; the other replicas drop
        their copies of it when they read the marker this replica's next sync writes."""
        for doc in self._both():   # counts a sync is writing right now: the marker drops them at the next
            doc["days"].get(day, {}).pop(key, None)
        secret = self._secret()
        if secret is not None:
            at = max(int(now * 1000), reset_at(self.remote, day, key, secret) + 1)
            self.remote["resets"].setdefault(day, {})[key] = {"at": at, "mac": sign(secret, day, key, at)}

    def problems(self, now: float) -> list[str]:
        """For /healthz: why the last sync failed, a document ignored recently."""
        out = [self.error] if self.error else []
        r = self.rejected
        if r is not None and now - r["at"] < REJECTED_SHOWN_S:
            out.append(f"usage document rejected {now - r['at']:.0f}s ago ({r['reason']}: {r['detail']}); "
                       f"the last good copy is kept and written back")
        return out

    async def sync(self, now: float) -> bool:
        """Add what was counted here to the shared document; on failure keep it for the next sync.
        True if this call read and, if need be, wrote the document."""
        if self.store is None or self._busy:
            return False   # a sync is in flight (the final one at shutdown overlapping the loop's)
        self._busy = True
        self.syncing, self.pending = self.pending, empty()
        try:
            for _ in range(5):
                if await self._attempt(now):
                    return True
            raise Conflict("the usage document kept changing under five writes in a row")
        except Exception as e:
            if str(e) != self.error:
                log.warning("usage not synced (kept for the next try): %s", e)
            self.error = str(e)
            return False
        finally:   # cancelled too: what was not written (or was held back) is kept for the next sync
            self.pending = add(self.syncing, self.pending)
            self.syncing = empty()
            self._busy = False

    async def _attempt(self, now: float) -> bool:
        """Read, check, merge and, if the shared document must change, write: False if another
        replica wrote in between."""
        raw, doc, version, bad = await asyncio.to_thread(self._read)
        secrets = self._doc_secrets()
        macs = await asyncio.to_thread(lambda: [doc_mac(x, doc) for x in secrets]) if secrets else []   # off the loop
        bad = bad or verified(raw, doc, secrets, first=self.trusted_at is None, macs=macs)
        secret = self._secret()
        base, tampered = self._judge(doc, bad, now, secret)
        taken = tampered is None or tampered.reason == "lowered"   # its counts are in `base`
        mine = self._reservations(now)
        if tampered is not None:
            self._reject(tampered, now)
        elif self.syncing == empty() and _lasting(base) == _lasting(doc) and self._held_as_written(doc, mine, now) \
                and (not secrets or raw.get("mac") == macs[0]):   # nothing to write (signed as now)
            self._synced(base, now, secret, trusted=True)
            return True
        # a repair goes alone: counts added to this replica's copy could vanish in another replica's
        # max() with its own newer copy; they are added at the next sync, onto the repaired document
        adding = empty() if tampered else self.syncing
        merged = prune(add(base, adding), now)
        if mine is None:
            merged["reserved"].pop(self.replica, None)
        else:
            merged["reserved"][self.replica] = mine
        if secrets:
            merged = {**merged, "mac": doc_mac(secrets[0], merged)}
        try:
            check(merged)   # never write what the other replicas would reject
        except Invalid as e:
            raise ValueError(f"the usage document would be out of bounds ({e}): not written") from None
        store = self.store
        assert store is not None   # sync() makes no attempt without one
        try:
            await asyncio.to_thread(store.save, merged, version)
        except Conflict:
            return False   # another replica wrote first: read again, add again
        if not tampered:
            self.syncing = empty()
        self._synced(merged, now, secret, trusted=taken)
        return True

    def _judge(self, doc: Doc, bad: Invalid | None, now: float, secret: bytes | None) -> tuple[Doc, Invalid | None]:
        """What to build on (the merge, or the last good copy if the document is ignored) and what
        is wrong with the document, if anything."""
        if bad is not None:
            return prune(self.remote, now), bad
        base = prune(merge(self.remote, doc, secret), now)
        if self.trusted_at is not None:
            grew = too_fast(self.remote, base, max(now - self.trusted_at, GROWTH_FLOOR_S), secret)
            if grew:
                return prune(self.remote, now), Invalid("implausible_growth", grew)
        low = lowered(self.remote, doc, day_of(now - DAY_S), secret)
        return base, Invalid("lowered", low) if low else None

    def _read(self) -> tuple[Doc, Doc, str | None, Invalid | None]:
        """The shared document as loaded and as checked (in a worker thread: it may be large), or why not."""
        assert self.store is not None
        try:
            raw, version = self.store.load()
        except Invalid as e:
            return {}, empty(), e.version, e
        try:
            return raw, check(raw), version, None
        except Invalid as e:
            return {}, empty(), version, e

    def _doc_secrets(self) -> list[bytes]:
        """The secrets a document may be signed with: the current keys', then the previous keys'."""
        now = self.doc_secret() if self.doc_secret is not None else None
        if now is not None and (not self.secrets or self.secrets[0] != now):
            self.secrets = [now, *self.secrets[:1]]
        return self.secrets

    def _reservations(self, now: float) -> dict | None:
        """This replica's entry of `reserved`: the tokens its requests in flight may still use."""
        held = {k: n for k, n in self.reserved.items() if n > 0}
        return {"at": int(now * 1000), "keys": held} if held else None

    def _held_as_written(self, doc: Doc, mine: dict | None, now: float) -> bool:
        """The document holds this replica's reservations as they are, written recently enough."""
        there = doc["reserved"].get(self.replica)
        if mine is None or there is None:
            return mine is None and there is None
        return there["keys"] == mine["keys"] and now * 1000 - there["at"] < RESERVATION_REFRESH_S * 1000

    def _synced(self, doc: Doc, now: float, secret: bytes | None, trusted: bool) -> None:
        # merged into the copy, not put in its place: a reset made meanwhile stays
        self.remote = prune(merge(self.remote, doc, secret), now)
        self.synced_at, self.error = now, ""
        if trusted:
            self.trusted_at = now

    def _reject(self, bad: Invalid, now: float) -> None:
        if self.rejected is None or self.rejected["detail"] != str(bad):
            log.warning("usage document rejected (%s: %s): the last good copy is kept and written back",
                        bad.reason, bad)
        self.rejected = {"reason": bad.reason, "detail": str(bad), "at": now}
        self.on_reject(bad.reason)


class MemoryStore:
    """One document in memory, with versions: replicas in one process (tests)."""

    def __init__(self) -> None:
        self.doc: Doc = empty()
        self.version = 0
        self.lock = threading.Lock()

    def load(self) -> tuple[Doc, str | None]:
        with self.lock:
            return copy.deepcopy(self.doc), str(self.version)

    def save(self, doc: Doc, version: str | None) -> None:
        with self.lock:
            if version != str(self.version):
                raise Conflict("changed since read")
            self.doc, self.version = copy.deepcopy(doc), self.version + 1


class ConfigMapStore:
    """The document in a ConfigMap the operator created for this gateway (the gateway may get and
    update that one object, nothing else)."""

    def __init__(self, namespace: str, name: str):
        from kubernetes import client, config
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.api, self.client = client.CoreV1Api(), client
        self.namespace, self.name = namespace, name

    def load(self) -> tuple[Any, str | None]:
        """The document as parsed (Usage checks it), or Invalid if it is not JSON within bounds."""
        cm = self.api.read_namespaced_config_map(self.name, self.namespace, _request_timeout=5)
        raw, version = (cm.data or {}).get(DATA_KEY), cm.metadata.resource_version if cm.metadata else None
        if not raw:
            return empty(), version
        size = len(raw.encode("utf-8", "surrogatepass"))
        if size > MAX_BYTES:
            raise Invalid("too_large", f"{size} bytes, over {MAX_BYTES}", version)
        try:
            return json.loads(raw), version
        except (ValueError, RecursionError) as e:
            raise Invalid("not_json", f"not JSON: {str(e)[:80] or type(e).__name__}", version) from None

    def save(self, doc: Doc, version: str | None) -> None:
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        if len(raw) > MAX_BYTES:
            raise ValueError(f"the usage document would be {len(raw)} bytes, over {MAX_BYTES}: not written")
        body = {"metadata": {"name": self.name, "resourceVersion": version}, "data": {DATA_KEY: raw}}
        try:
            self.api.patch_namespaced_config_map(self.name, self.namespace, body, _request_timeout=5)
        except self.client.ApiException as e:
            if e.status == 409:
                raise Conflict("changed since read") from None
            raise
