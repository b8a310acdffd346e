"""Link planning (pure): desired links from current roles and topology, compared with
what each decoder's agent reports, gives what to unlink and what to link.

A link is broken only when the engine says so (LLM_NOT_YET_LINK, LLM_LINK_FAILED, a pull's
LLM_WAIT_PROCESS_TIMEOUT), when the prefill's agent restarted since the link was made
(boot id), or when its ip/port moved; a busy link is a link at work. A prefill that is
leaving (terminating, or draining) gets no new links but keeps the ones it has until its agent
refuses new work and no KV cache on it waits to be pulled; then it is unlinked normally, from
the decoder's side."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pd_contract.names import BROKEN_CODES
from pd_contract.revisions import pairable

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
    boot_id: str | None = None      # the agent's, as last observed
    terminating: bool = False       # the pod has a deletionTimestamp
    draining: bool = False          # the agent refuses new work
    busy: bool | None = None        # in-flight requests or un-pulled KV caches; None: not known
    cache_desc: str | None = None   # canonical JSON of the CacheDesc the engine runs with
    starting: bool = False          # first container start, not Ready yet: its agent is coming up
    uid: str = ""
    label: str = ""                 # the pdoperator.io/role label (role may differ for a switching pod)
    llmd_ok: bool = True            # its llm-d labels (llm-d.ai/role, inferenceServing) follow that label
    assigned: str | None = None     # pdoperator.io/assigned-role: the role its engine starts in
    engine_role: str | None = None  # prefill | decoder, as its agent reports the engine
    switchable: bool | None = None  # initialised with llm.EnableSwitchRole
    in_flight: int = 0
    pending_kv: int = 0
    links_in: int = 0               # prompt side: decoders linked to it, as its agent reports
    tp: int = 1                     # tensor-parallel ranks: one engine each, linked rank to rank
    ranks: tuple[tuple[int, str, int], ...] = ()   # (cluster_id, ip, port) per rank, as its agent reports
    unfit: bool = False             # its network preflight failed (or its TLS differs): linked to nothing
    superpod: str = ""              # its node's A3 superpod, as its agent reports it ("" unknown)
    revision: str = ""              # its images' digest (pd_contract.revisions): never linked across one
    followers: tuple[str, ...] = ()  # an instance of several pods: its other pods (this one leads)

    @property
    def linkable(self) -> bool:
        # The agent's own word that its engine is initialised is enough: the readiness probe
        # asks the same thing, only up to a probe period later.
        return self.agent_ok and bool(self.ip)

    @property
    def leaving(self) -> bool:
        return self.terminating or self.draining

    @property
    def serving(self) -> bool:
        return self.linkable and not self.leaving

    @property
    def holding(self) -> bool:
        """A leaving prefill whose links must stay: caches wait on it, it cannot say, or its
        agent has not said it refuses new work. A pod being deleted takes requests until its
        agent gets SIGTERM and drains; unlinked before that, a request prefilled there in the
        meantime could not be pulled (LLM_NOT_YET_LINK)."""
        return self.leaving and bool(self.ip) and (self.busy is not False or not self.draining)


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
    return sorted((e for e in engines if e.role == "prefill" and e.serving and not e.unfit),
                  key=lambda e: e.cluster_id)


def decoders_of(engines: list[Engine]) -> list[Engine]:
    return sorted((e for e in engines if e.role == "decoder" and e.serving), key=lambda e: e.cluster_id)


def held_prefills(engines: list[Engine]) -> dict[int, Engine]:
    return {e.cluster_id: e for e in engines if e.role == "prefill" and e.holding}


def kept_prefills(engines: list[Engine]) -> dict[int, Engine]:
    """Prefills whose existing links stay: every one that is not leaving with nothing left to
    pull. A prefill whose readiness flaps or whose agent answered late this time keeps its
    links; only new links wait for it to be Ready and answering."""
    return {e.cluster_id: e for e in engines if e.role == "prefill" and not e.unfit and (not e.leaving or e.holding)}


@functools.lru_cache(maxsize=8192)
def _rank_addresses(ranks: tuple[tuple[int, str, int], ...]) -> dict[int, tuple[str, int]]:
    """A peer's rank map, cluster id -> (ip, port): made once per peer and report, not per link
    and call (it was most of a settled pass's time at 64P x 64D x TP 8). Read-only."""
    return {cid: (ip, port) for cid, ip, port in ranks}


Verdict = tuple[bool, bool, int | None]   # (stale, the engine says broken, rank links up if not stale)


class Reported(list):
    """A decoder's reported links as decide dumps them, once per agent report, and read-only from
    then on: what each link was judged to be against its peer is kept with them, and what
    per_decoder and plan made of them all against the decoder's peers, so a pass in which neither
    changed judges no link again (64P x 64D x TP 8: 4096 links of 8 ranks, twice a pass).
    Anything else passed as reported links is judged afresh."""

    def __init__(self, links: Iterable[dict] = ()):
        super().__init__(links)
        self.by_cid = {l["cluster_id"]: l for l in self}
        self.judged: dict[int, tuple[dict, tuple, Verdict]] = {}   # cluster id -> (link, peer key, verdict)
        self.rows: dict[str, tuple] = {}   # what per_decoder and plan made of all of them, and against what peers


class _Peers:
    """The peer lists one call judges links against, each as a key of what judging depends on,
    and what a decoder's links were judged against last time compared with it at most once per
    call: decoders judged in one call share their key (desired() hands every decoder of one
    CacheDesc the same list), so a pass compares one key per peer list, not one per decoder."""

    def __init__(self) -> None:
        self.keys: dict[int, tuple[list[Engine], tuple]] = {}   # id of a list -> (it, its key)
        self.same: dict[int, tuple[tuple, bool]] = {}           # id of an earlier key -> (it, equal)

    def key(self, peers: list[Engine]) -> tuple:
        got = self.keys.get(id(peers))
        if got is None or got[0] is not peers:
            got = self.keys[id(peers)] = (peers, tuple((e.cluster_id, e.ip, e.port, e.boot_id, e.ranks,
                                                        e.cache_desc) for e in peers))
        return got[1]

    def matches(self, earlier: tuple, key: tuple) -> bool:
        if earlier is key:
            return True
        got = self.same.get(id(earlier))
        if got is None or got[0] is not earlier:
            got = self.same[id(earlier)] = (earlier, earlier == key)
        return got[1]


def _by_cid(links: list[dict]) -> dict[int, dict]:
    return links.by_cid if isinstance(links, Reported) else {l["cluster_id"]: l for l in links}


def judge(link: dict, target: Engine, links: list[dict] | None = None) -> Verdict:
    """The link against its peer: stale (_stale), broken by the engine's word, and its rank links
    that are up unless stale (None: it has no rank links, the pod link counts as the decoder's
    TP). Kept in `links` (the decoder's reported links) if they are a Reported, until the link or
    the peer's address, ranks or boot id change."""
    memo = links.judged if isinstance(links, Reported) else None
    key = (target.ip, target.port, target.boot_id, target.ranks)
    if memo is not None:
        seen = memo.get(link["cluster_id"])
        if seen is not None and seen[0] is link and seen[1] == key:
            return seen[2]
    ranks = link.get("ranks")
    verdict = (_stale(link, target), _engine_says_broken(link), sum(
        1 for r in ranks if r.get("healthy", True) and r.get("code") not in BROKEN_CODES) if ranks else None)
    if memo is not None:
        memo[link["cluster_id"]] = (link, key, verdict)
    return verdict


def _stale(link: dict, target: Engine) -> bool:
    """The peer moved (an address, or a rank's) or restarted since the link was made."""
    if link.get("ip") != target.ip or link.get("port") != target.port:
        return True
    if link.get("ranks") and target.ranks:
        # each rank link against the peer rank it pairs with (by cluster id: any TP mapping)
        at = _rank_addresses(target.ranks)
        if any(at.get(r["cluster_id"]) != (r.get("ip"), r.get("port")) for r in link["ranks"]
               if r.get("healthy", True) and r.get("code") not in BROKEN_CODES):
            return True
    seen = link.get("peer_boot_id")
    return bool(seen and target.boot_id and seen != target.boot_id)


def broken(link: dict, target: Engine) -> bool:
    """Whether a reported link to `target` must be re-made (a multi-rank pod's: if any rank's is
    broken, as the agent's worst code says)."""
    return _engine_says_broken(link) or _stale(link, target)


def rank_links(decoder: Engine) -> int:
    """Rank links a decoder's pod link stands for: each of its ranks links one prefill rank."""
    return max(1, decoder.tp)


def ranks_up(link: dict, decoder: Engine, target: Engine) -> int:
    """Rank links up within a reported pod link."""
    return _up(judge(link, target), decoder)


def _up(verdict: Verdict, decoder: Engine) -> int:
    stale, says_broken, ranks = verdict
    if stale:
        return 0
    if ranks is not None:
        return ranks
    return 0 if says_broken else rank_links(decoder)


def compatible(d: Engine, p: Engine) -> bool:
    """Only engines with an identical CacheDesc (a model roll mixes them) and of one revision (an
    image roll mixes them: KV layouts and transfer protocols can differ) can move KV caches."""
    return d.cache_desc == p.cache_desc and pairable(d.revision, p.revision)


def desired(engines: list[Engine], topology: str = "FullMesh") -> dict[str, list[Engine]]:
    """FullMesh: every decoder links every prefill that runs the same CacheDesc."""
    if topology != "FullMesh":
        raise ValueError(f"unknown topology {topology!r}")
    prefills = prefills_of(engines)
    by_desc: dict[str | None, list[Engine]] = {}
    for p in prefills:
        by_desc.setdefault(p.cache_desc, []).append(p)
    return {d.pod: [] if d.unfit else [p for p in by_desc.get(d.cache_desc, []) if pairable(p.revision, d.revision)]
            for d in decoders_of(engines)}


def mismatches(engines: list[Engine]) -> list[tuple[Engine, Engine]]:
    """(decoder, prefill) pairs that FullMesh would link but whose CacheDescs differ: never dialled."""
    by_desc: dict[str | None, list[Engine]] = {}
    for p in prefills_of(engines):
        by_desc.setdefault(p.cache_desc, []).append(p)
    return [(d, p) for d in decoders_of(engines) for desc, ps in by_desc.items() if desc != d.cache_desc
            for p in ps]


def plan(engines: list[Engine], reported: dict[str, list[dict]], topology: str = "FullMesh",
         due: Callable[[str, int], bool] = lambda d, c: True) -> list[DecoderPlan]:
    """`reported[decoder] = [{name, cluster_id, ip, port, code, healthy, peer_boot_id}, ...]`
    from each agent's status."""
    want = desired(engines, topology)
    kept = kept_prefills(engines)
    by_pod = {e.pod: e for e in engines}
    known = _Peers()
    plans = []
    for dpod, peers in want.items():
        d, links = by_pod[dpod], reported.get(dpod, [])
        dumped = links if isinstance(links, Reported) else None
        if dumped is not None and _same_row(dumped, "plan", known, peers, d.cache_desc):
            continue   # linked to these very peers and nothing broken, as last time: nothing to do
        p, asked = _decoder_plan(d, peers, links, {} if d.unfit else kept, due)
        if not p.empty:
            plans.append(p)
        elif dumped is not None and not asked and set(dumped.by_cid) <= {e.cluster_id for e in peers}:
            dumped.rows["plan"] = (known.key(peers), d.cache_desc, None)   # (whatever backoffs and kept say)
    # decoders that are not serving (leaving, not ready) keep their links until they go
    # or the switcher handles them; prefills never dial.
    return plans


def _decoder_plan(d: Engine, peers: list[Engine], links: list[dict], kept: dict[int, Engine],
                  due: Callable[[str, int], bool]) -> tuple[DecoderPlan, bool]:
    """One decoder's plan, and whether any link's backoff was asked (whether it mattered)."""
    p = DecoderPlan(d)
    have = _by_cid(links)
    wanted = {e.cluster_id: e for e in peers}
    asked = False
    for cid, link in have.items():
        target = wanted.get(cid) or kept.get(cid)
        if target is not None and not compatible(d, target):
            target = None  # a link across CacheDescs cannot carry a cache: drop it
        # a link well and wanted needs nothing; one to drop or re-make waits out the backoff
        # of its last failed attempt (`due`)
        if target is None:
            asked = True
            if due(d.pod, cid):   # gone, scaled away, or a leaving prefill with nothing left to pull
                (p.force_unlink if _engine_says_broken(link) else p.unlink).append(link)
        elif any(judge(link, target, links)[:2]):   # broken, as `broken` says
            asked = True
            if due(d.pod, cid):
                p.force_unlink.append(link)  # re-make it (a leaving prefill gets no new link)
                if cid in wanted:
                    p.link.append(target)
    for cid, target in wanted.items():
        if cid not in have:
            asked = True
            if due(d.pod, cid):
                p.link.append(target)
    return p, asked


def _engine_says_broken(link: dict) -> bool:
    code = link.get("code", "LLM_SUCCESS")
    return code in BROKEN_CODES or not link.get("healthy", True)


def per_decoder(engines: list[Engine], reported: dict[str, list[dict]],
                topology: str = "FullMesh") -> dict[str, tuple[int, int, list[dict]]]:
    """decoder -> (expected, up, reported links that are down), over desired links, counted in
    rank links (a pod link between TP-rank pods is TP rank links)."""
    out = {}
    by_pod = {e.pod: e for e in engines}
    known = _Peers()
    for dpod, peers in desired(engines, topology).items():
        d, links = by_pod[dpod], reported.get(dpod, [])
        if not isinstance(links, Reported):
            out[dpod] = _decoder_counts(d, peers, links)
        elif _same_row(links, "per", known, peers, d.tp):   # the same peers as last time: the same counts
            out[dpod] = links.rows["per"][2]
        else:
            out[dpod] = _decoder_counts(d, peers, links)
            links.rows["per"] = (known.key(peers), d.tp, out[dpod])
    return out


def _same_row(links: Reported, row: str, known: _Peers, peers: list[Engine], decoder: object) -> bool:
    """Whether `links` were last made `row` of against these peers and a decoder like this one
    (its TP, its CacheDesc): then they make the same again. The row is given this call's key."""
    seen = links.rows.get(row)
    if seen is None or seen[1] != decoder:
        return False
    key = known.key(peers)
    if not known.matches(seen[0], key):
        return False
    if seen[0] is not key:
        links.rows[row] = (key, *seen[1:])
    return True


def _decoder_counts(d: Engine, peers: list[Engine], links: list[dict]) -> tuple[int, int, list[dict]]:
    have = _by_cid(links)
    up, down = 0, []
    for e in peers:
        link = have.get(e.cluster_id)
        if link is None:
            continue
        verdict = judge(link, e, links)
        if verdict[0] or verdict[1]:
            down.append(link)
        up += _up(verdict, d)
    return rank_links(d) * len(peers), up, down


def totals(per: dict[str, tuple[int, int, list[dict]]]) -> tuple[int, int]:
    """(expected, up) summed over a per_decoder result."""
    return sum(e for e, _, _ in per.values()), sum(u for _, u, _ in per.values())


def counts(engines: list[Engine], reported: dict[str, list[dict]], topology: str = "FullMesh") -> tuple[int, int]:
    """(expected, up) over desired links."""
    return totals(per_decoder(engines, reported, topology))


def completes(engines: list[Engine], reported: dict[str, list[dict]], plans: list[DecoderPlan],
              topology: str = "FullMesh") -> frozenset | None:
    """The full link set, as (decoder, prefill cluster id) pairs, if carrying out `plans`
    successfully brings every desired link up; else None."""
    planned = {(p.decoder.pod, e.cluster_id) for p in plans for e in p.link}
    full = set()
    for dpod, peers in desired(engines, topology).items():
        links = reported.get(dpod, [])
        have = _by_cid(links)
        for e in peers:
            ok = (dpod, e.cluster_id) in planned or (e.cluster_id in have and not any(
                judge(have[e.cluster_id], e, links)[:2]))
            if not ok:
                return None
            full.add((dpod, e.cluster_id))
    # what the decoders will report afterwards: the full mesh, plus links the plans leave alone
    dropped = {(p.decoder.pod, l["cluster_id"]) for p in plans for l in p.unlink + p.force_unlink}
    kept = {(d, l["cluster_id"]) for d, ls in reported.items() for l in ls} - dropped
    return frozenset(full | kept) if full else None


def holding_links(engines: list[Engine], reported: dict[str, list[dict]]) -> int:
    """Links still kept to leaving prefills (the loop re-checks soon while there are any)."""
    held = held_prefills(engines)
    return sum(1 for ls in reported.values() for l in ls if l["cluster_id"] in held)


def verify_pairs(engines: list[Engine], round_no: int) -> list[tuple[Engine, Engine]]:
    """Each decoder probes one prefill per round, rotating, so every P-D path is covered
    over max(P) rounds."""
    want = desired(engines)
    out = []
    for i, d in enumerate(decoders_of(engines)):
        prefills = want[d.pod]
        if prefills:
            out.append((d, prefills[(round_no + i) % len(prefills)]))
    return out
