"""Which agent token Secrets the operator made, and so may use.

The token Secrets have fixed names, so anyone who may create Secrets in the namespace can make
one first, and an ownerReference proves nothing (the deployment's uid is readable by everyone
who can read the deployment). What proves a Secret is the operator's: the sha256 of each token
it generates is written to `status.tokenDigests` before the Secret is created, and only the
operator may write status. A Secret whose token has another digest was made by someone else
(before the operator, or in the moment between its status write and its create) and is never
used. The digest reveals nothing of the token (256 random bits).

Deployments reconciled before digests were recorded (status has an observedGeneration but no
tokenDigests) adopt the Secrets they own once: the operator already used those."""
from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Callable

from .builders import peer_token_secret_name, token_secret_name
from .gateway import data_token_secret_name

# status.tokenDigests key -> the Secret's name for a deployment
SECRETS: dict[str, Callable[[str], str]] = {
    "control": token_secret_name, "data": data_token_secret_name, "peer": peer_token_secret_name}


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """Hex, so a token never starts with '-', which a command line (`--token $TOKEN`) would take
    for an option."""
    return secrets.token_hex(32)


def token_of(secret: dict) -> str | None:
    raw = (secret.get("data") or {}).get("token")
    if not raw:
        return None
    try:
        return base64.b64decode(raw).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def owned_by(obj: dict, uid: str) -> bool:
    return bool(uid) and any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


@dataclass
class Verdict:
    token: str | None                          # the control token the operator may use
    digests: dict[str, str]                    # what status.tokenDigests records after this pass
    create: dict[str, str] = field(default_factory=dict)   # role -> token to create (after the record)
    foreign: list[str] = field(default_factory=list)       # Secret names refused
    problem: str | None = None


def judge(name: str, namespace: str, uid: str, found: dict[str, dict | None], status: dict | None,
          pending: dict[str, str], make: Callable[[], str] = new_token) -> Verdict:
    """found: role -> the Secret read now (None: absent). status: the deployment's status as the
    operator last wrote or read it. pending: tokens generated (and recorded) but not yet created."""
    status = status or {}
    recorded = status.get("tokenDigests")
    legacy = recorded is None and status.get("observedGeneration") is not None
    recorded = dict(recorded or {})
    digests: dict[str, str] = {}
    create: dict[str, str] = {}
    foreign: list[str] = []
    tokens: dict[str, str] = {}
    for role, secret_name in SECRETS.items():
        sec = found.get(role)
        if sec is None:
            tok = pending.get(role)
            if tok is None or recorded.get(role) not in (None, digest(tok)):
                tok = make()
            create[role], digests[role] = tok, digest(tok)
            continue
        tok = token_of(sec)
        d = digest(tok) if tok is not None else None
        if d is not None and (recorded.get(role) == d or (legacy and owned_by(sec, uid))):
            digests[role], tokens[role] = d, tok   # type: ignore[assignment]
        else:
            foreign.append(secret_name(name))
            if role in recorded:
                digests[role] = recorded[role]     # keep the record: the operator's token is that one
    problem = None
    if foreign:
        problem = (f"Secret {', '.join(foreign)} in {namespace} holds a token the operator did not make (its sha256 "
                   f"is not the one in status.tokenDigests), so it is never used; delete it and the operator "
                   f"creates its own")
    # a control token is used once its Secret exists and is proven (one created this pass, next pass)
    return Verdict(token=tokens.get("control"), digests=digests, create=create,
                   foreign=foreign, problem=problem)


def made_by_operator(deployment: dict, data_secret: dict | None) -> bool:
    """The deployment's data token Secret exists and is the one its operator recorded (or, for a
    deployment reconciled before digests were recorded, it exists)."""
    if data_secret is None:
        return False
    status = deployment.get("status") or {}
    if status.get("tokenDigests") is None:
        return status.get("observedGeneration") is not None
    recorded = status["tokenDigests"].get("data")
    tok = token_of(data_secret)
    return tok is not None and digest(tok) == recorded
