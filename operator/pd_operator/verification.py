"""A verification round carried across a takeover (or a restart).

The KV path is verified every `verifyIntervalSeconds` and whenever the link set changes. A new
leader starts with an empty memory, so without this it re-probed every deployment at once and,
until its probes came back, wrote KVPathVerified Unknown and phase Linking over a fleet that was
Ready. The status records, beside the last good round, a digest of what it verified: every
decoder's link set and the boot ids on both ends of each link. A new leader that reads the same
digest from its own, fresh agent reports (every link up, the same incarnations) and a round
younger than the interval takes that round as its own and verifies again when it falls due; any
difference (a link, a restarted engine, an older round) and it verifies at once, as before."""
from __future__ import annotations

import hashlib
import json

from .state import Memory
from .switch import parse_iso


def link_digest(reported: dict[str, list[dict]], boot_ids: dict[str, str]) -> str:
    """What a round verifies: each decoder (and its boot id) with each linked peer's cluster id
    and boot id. The same set of links between the same engine processes gives the same digest."""
    rows = sorted([d, boot_ids.get(d, ""), link["cluster_id"], link.get("peer_boot_id") or ""]
                  for d, links in reported.items() for link in links)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]


def fresh(mem: Memory) -> bool:
    """No round of this process's own yet (a start or a takeover)."""
    return not mem.verify and mem.verified_at is None and not mem.verified_links


def carried_age(status: dict | None, digest: str, wall: float, interval: float) -> float | None:
    """Seconds since the recorded round, when it can stand for this process's own: it passed
    (KVPathVerified True), verified exactly `digest` and is younger than `interval`. Else None."""
    st = status or {}
    last = st.get("lastVerified") or {}
    ok = any(c.get("type") == "KVPathVerified" and c.get("status") == "True" for c in st.get("conditions") or [])
    at = parse_iso(last.get("at"))
    if not ok or at is None or last.get("links") != digest:
        return None
    age = wall - at
    return age if 0 <= age < interval else None


def carry(mem: Memory, status: dict | None, reported: dict[str, list[dict]], boot_ids: dict[str, str],
          link_set: frozenset, wall: float, now: float, interval: float) -> bool:
    """Take the recorded round as this memory's own if it still holds (see carried_age)."""
    digest = link_digest(reported, boot_ids)
    age = carried_age(status, digest, wall, interval)
    if age is None:
        return False
    mem.verified_links, mem.verify_digest, mem.verify_carried = link_set, digest, True
    mem.next_verify = now + interval - age
    mem.verified_at = (status or {}).get("lastVerified", {}).get("at")
    return True
