"""Link planning (pure): desired links from current roles and topology, compared with
what each decoder's agent reports, gives what to unlink and what to link."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

MAX_PER_CALL = 16  # link_clusters takes at most 16 clusters per call


@dataclass(frozen=True)
class Engine:
    pod: str
    group: str
    role: str            # current role label: prefill | decoder | switching
    cluster_id: int
    ip: str | None
    port: int
    ready: bool = False
    agent_ok: bool = False   # reachable, authorised and initialised
    agent_url: str | None = None

    @property
    def linkable(self) -> bool:
        return self.ready and self.agent_ok and bool(self.ip)


@dataclass
class DecoderPlan:
    decoder: Engine
    unlink: list[dict] = field(default_factory=list)       # agent link states to drop
    force_unlink: list[dict] = field(default_factory=list)  # broken ones: local end only
    link: list[Engine] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.unlink or self.force_unlink or self.link)

    def link_batches(self) -> list[list[Engine]]:
        return batches(self.link)


def batches(items: list, size: int = MAX_PER_CALL) -> list[list]:
    """link_clusters/unlink_clusters take at most 16 clusters per call."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def prefills_of(engines: list[Engine]) -> list[Engine]:
    return sorted((e for e in engines if e.role == "prefill" and e.linkable), key=lambda e: e.cluster_id)


def decoders_of(engines: list[Engine]) -> list[Engine]:
    return sorted((e for e in engines if e.role == "decoder" and e.linkable), key=lambda e: e.cluster_id)


def desired(engines: list[Engine], topology: str = "FullMesh") -> dict[str, list[Engine]]:
    """FullMesh: every decoder links every prefill."""
    if topology != "FullMesh":
        raise ValueError(f"unknown topology {topology!r}")
    prefills = prefills_of(engines)
    return {d.pod: prefills for d in decoders_of(engines)}


def plan(engines: list[Engine], reported: dict[str, list[dict]], topology: str = "FullMesh",
         due: Callable[[str, int], bool] = lambda d, c: True) -> list[DecoderPlan]:
    """`reported[decoder] = [{name, cluster_id, ip, port, code}, ...]` from each agent's status."""
    want = desired(engines, topology)
    by_pod = {e.pod: e for e in engines}
    plans = []
    for dpod, peers in want.items():
        p = DecoderPlan(by_pod[dpod])
        have = {l["cluster_id"]: l for l in reported.get(dpod, [])}
        wanted = {e.cluster_id: e for e in peers}
        for cid, link in have.items():
            target = wanted.get(cid)
            if target is None:
                (p.unlink if link["code"] == "LLM_SUCCESS" else p.force_unlink).append(link)
            elif link["code"] != "LLM_SUCCESS" or link.get("ip") != target.ip or link.get("port") != target.port:
                p.force_unlink.append(link)  # broken, or the peer moved: re-make it
                if due(dpod, cid):
                    p.link.append(target)
        for cid, target in wanted.items():
            if cid not in have and due(dpod, cid):
                p.link.append(target)
        if not p.empty:
            plans.append(p)
    # decoders that are not linkable (switching, not ready) keep their links until the
    # switcher or a restart handles them; prefills never dial.
    return plans


def counts(engines: list[Engine], reported: dict[str, list[dict]], topology: str = "FullMesh") -> tuple[int, int]:
    """(expected, up) over desired links."""
    want = desired(engines, topology)
    expected = sum(len(v) for v in want.values())
    up = 0
    for dpod, peers in want.items():
        have = {l["cluster_id"]: l for l in reported.get(dpod, [])}
        for e in peers:
            l = have.get(e.cluster_id)
            if l and l["code"] == "LLM_SUCCESS" and l.get("ip") == e.ip and l.get("port") == e.port:
                up += 1
    return expected, up


def verify_pairs(engines: list[Engine], round_no: int) -> list[tuple[Engine, Engine]]:
    """Each decoder probes one prefill per round, rotating, so every P-D path is covered
    over max(P) rounds."""
    prefills = prefills_of(engines)
    if not prefills:
        return []
    return [(d, prefills[(round_no + i) % len(prefills)]) for i, d in enumerate(decoders_of(engines))]
