"""What each API key may do (pure): the models it may use, requests per minute, tokens per UTC
day, when it expires, and whether it may read everyone's usage. A refusal says which limit
and, for a quota, when it resets; the caller turns it into the API's error object."""
from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from typing import Any

DAY_S = 86400
log = logging.getLogger("pd_gateway.policy")


@dataclass(frozen=True)
class KeyPolicy:
    models: tuple[str, ...] | None = None    # None: every model the gateway serves
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    expires: dt.datetime | None = None
    admin: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KeyPolicy:
        expires = d.get("expires")
        when = None
        if expires:
            try:
                when = dt.datetime.fromisoformat(str(expires).replace("Z", "+00:00"))
            except ValueError:   # a date Python cannot hold (year 0): the key is refused, not the gateway down
                log.warning("a key's expires %r does not parse: the key is treated as expired", expires)
                when = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
            if when.tzinfo is None:
                when = when.replace(tzinfo=dt.timezone.utc)
        models = d.get("models")
        return cls(models=tuple(models) if models is not None else None,
                   requests_per_minute=d.get("requestsPerMinute") or None,
                   tokens_per_day=d.get("tokensPerDay") or None, expires=when, admin=bool(d.get("admin")))


def parse(text: str | None) -> dict[str, KeyPolicy]:
    """PD_GATEWAY_KEY_POLICY: JSON {key name: {models, requestsPerMinute, tokensPerDay, expires, admin}}."""
    raw = json.loads(text) if text else {}
    if not isinstance(raw, dict):
        raise ValueError("the key policy must be a JSON object {key name: policy}")
    return {name: KeyPolicy.from_dict(p or {}) for name, p in raw.items()}


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str
    etype: str
    retry_after: int | None = None


def day_of(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y-%m-%d")


def minute_of(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M")


def _until_midnight(now: float) -> int:
    return max(1, int(DAY_S - now % DAY_S))


def expired(name: str, p: KeyPolicy, now: float) -> Refusal | None:
    if p.expires is not None and (p.expires.year < 1970 or now >= p.expires.timestamp()):
        return Refusal(401, "expired_api_key", f"API key {name!r} expired at {p.expires.isoformat()}; ask for a "
                       f"new key or a later `expires` in the gateway's keys", "authentication_error")
    return None


def model_allowed(name: str, p: KeyPolicy, asked: str, same: tuple[str, ...] = ()) -> Refusal | None:
    """`same`: the model's id and aliases; listing any of them allows them all."""
    if p.models is not None and asked not in p.models and not set(same) & set(p.models):
        return Refusal(403, "model_not_allowed", f"model not allowed for this key: {name!r} may use "
                       f"{', '.join(p.models) or 'no model'}, not {asked!r}", "permission_error")
    return None


def quota(name: str, p: KeyPolicy, now: float, requests_this_minute: int, tokens_today: int) -> Refusal | None:
    """Limits counted over every replica of the gateway (as of their last sync, a few seconds)."""
    if p.requests_per_minute is not None and requests_this_minute >= p.requests_per_minute:
        wait = max(1, 60 - int(now % 60))
        return Refusal(429, "rate_limit_exceeded", f"rate limit for key {name!r} reached: requestsPerMinute "
                       f"{p.requests_per_minute}; the minute resets in {wait}s", "rate_limit_error", wait)
    if p.tokens_per_day is not None and tokens_today >= p.tokens_per_day:
        wait = _until_midnight(now)
        reset = dt.datetime.fromtimestamp(now + wait, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return Refusal(429, "token_quota_exceeded", f"token quota for key {name!r} reached: tokensPerDay "
                       f"{p.tokens_per_day} ({tokens_today} used today, UTC); it resets at {reset}",
                       "rate_limit_error", wait)
    return None


def tokens_fit(name: str, p: KeyPolicy, now: float, tokens_today: int, need: int) -> Refusal | None:
    """A request's prompt and max_tokens against what is left of its key's tokensPerDay (used and
    reserved by requests in flight), before any engine works on it."""
    if p.tokens_per_day is None or tokens_today + need <= p.tokens_per_day:
        return None
    wait = _until_midnight(now)
    left = max(0, p.tokens_per_day - tokens_today)
    reset = dt.datetime.fromtimestamp(now + wait, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Refusal(429, "token_quota_exceeded", f"token quota for key {name!r}: this request may use {need} tokens "
                   f"(its prompt and max_tokens) and {left} of tokensPerDay {p.tokens_per_day} are left today "
                   f"(UTC, requests in flight included); ask for fewer max_tokens, or retry when it resets at "
                   f"{reset}", "rate_limit_error", wait)
