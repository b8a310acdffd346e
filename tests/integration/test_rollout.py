"""An engine image upgrade under traffic with spec.rollout.maxSkew: prefill and decoder roll
together, the pods at each group's new revision never differ by more than maxSkew while both
groups still have old pods, no link and no routed pair ever joins two revisions (read from the
agents' own link reports and the router's picks), condition RevisionSkew while both exist, and
no request fails."""
from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import pytest

from pd_contract.revisions import revision_of
from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_status, condition, pdd, sample, wait_phase

pytestmark = pytest.mark.integration
NAME = "roll"
SKEW = 1


class Traffic:
    """Requests through pd-gateway's router (pd_router, with its own pod discovery) from a thread,
    a few at a time, until stopped; every pick's revisions recorded."""

    def __init__(self, cluster: Cluster, ns: str, token: str):
        self.cluster, self.ns, self.token = cluster, ns, token
        self.ok = self.failed = 0
        self.reasons: list[str] = []
        self.pairs: list[tuple[str, str]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.main, daemon=True)

    def main(self) -> None:
        try:
            asyncio.run(self.run())
        except BaseException as e:   # noqa: BLE001 - reported by the test
            self.error = e

    async def run(self) -> None:
        import httpx

        from pd_agent.loadgen import direct_request
        from pd_router.routing import Fleet, pod_finder
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": f"Bearer {self.token}"}) as http:
            fleet = Fleet(http, self.token, pod_finder(self.ns, NAME, str(self.cluster.kubeconfig)))
            pick = fleet.pick_decoder

            def recorded(p: dict, avoid: set[str]) -> dict | None:
                d = pick(p, avoid)
                if d is not None:
                    self.pairs.append((p.get("revision", ""), d.get("revision", "")))
                return d
            fleet.pick_decoder = recorded   # type: ignore[method-assign]
            refresher = asyncio.create_task(fleet.run(0.5))
            await fleet.refresh()
            n = 0

            async def one(i: int) -> None:
                r = await direct_request(fleet, 20000 + i, 48, 8)   # pd-gateway's own retry window
                if r.ok:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.reasons.append(str(r.reason))
            while not self.stop.is_set():
                await asyncio.gather(*(one(n + k) for k in range(3)))
                n += 3
            refresher.cancel()


def updated_counts(cluster: Cluster, ns: str) -> dict[str, tuple[int, int]]:
    """group -> (pods at its StatefulSet's update revision, pods still older)."""
    out = {}
    for g in ("prefill", "decoder"):
        update = (cluster.get_json("statefulset", f"{NAME}-{g}", "-n", ns).get("status") or {}).get("updateRevision")
        pods = [p for p in cluster.get_json("pods", "-n", ns, "-l", f"pdoperator.io/group={g}")["items"]
                if not p["metadata"].get("deletionTimestamp")]
        new = sum(1 for p in pods if p["metadata"]["labels"].get("controller-revision-hash") == update)
        out[g] = (new, len(pods) - new)
    return out


def test_an_upgrade_rolls_prefill_and_decoder_together(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    doc = sample(NAME, **{"prefill.replicas": 2, "decoder.replicas": 2, "rollout": {"maxSkew": SKEW}})
    cluster.apply(doc, ns)
    wait_phase(cluster, ns, "Ready", name=NAME, timeout=180, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    old = revision_of(cluster.get_json("pod", f"{NAME}-prefill-0", "-n", ns)["spec"])
    token = base64.b64decode(cluster.get_json("secret", f"{NAME}-agent-data-token", "-n", ns)["data"]["token"]).decode()
    traffic = Traffic(cluster, ns, token)
    traffic.thread.start()
    wait_for("traffic flowing", lambda: traffic.ok >= 6 or traffic.error, timeout=60, interval=0.5)
    assert traffic.error is None, repr(traffic.error)

    cluster.kubectl("patch", "pdd", NAME, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"image": "example.com/pd/pd-sim-agent:0.2-next"}}))
    boots: dict[str, str] = {}          # agent boot id -> its pod's revision
    cross: list[str] = []
    worst, skew_seen = 0, False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        counts = updated_counts(cluster, ns)
        if counts["prefill"][1] and counts["decoder"][1]:
            worst = max(worst, abs(counts["prefill"][0] - counts["decoder"][0]))
        skew_seen = skew_seen or condition(pdd(cluster, ns, NAME), "RevisionSkew").get("status") == "True"
        for p in cluster.get_json("pods", "-n", ns)["items"]:
            if p["metadata"].get("deletionTimestamp") or not p.get("status", {}).get("podIP"):
                continue
            try:
                st = agent_status(cluster, ns, p["metadata"]["name"], NAME)
            except Exception:   # noqa: BLE001 - a pod starting or leaving does not answer
                continue
            boots[st["boot_id"]] = revision_of(p["spec"])
            for link in st.get("links") or []:
                peer = boots.get(link.get("peer_boot_id") or "")
                if peer and peer != boots[st["boot_id"]] and link.get("code") == "LLM_SUCCESS":
                    cross.append(f"{p['metadata']['name']} -> {link['name']} ({boots[st['boot_id']]} vs {peer})")
        pods = cluster.get_json("pods", "-n", ns, "-l", f"pdoperator.io/deployment={NAME}")["items"]
        if len(pods) == 4 and all(p["spec"]["containers"][0]["image"].endswith(":0.2-next") for p in pods) and \
                pdd(cluster, ns, NAME)["status"].get("linksSummary") == "4/4":
            break
        time.sleep(0.3)
    obj = wait_phase(cluster, ns, "Ready", name=NAME, timeout=120,
                     extra=lambda o: o["status"]["linksSummary"] == "4/4")
    time.sleep(2)
    traffic.stop.set()
    traffic.thread.join(timeout=60)
    assert traffic.error is None, repr(traffic.error)
    new = revision_of(cluster.get_json("pod", f"{NAME}-prefill-0", "-n", ns)["spec"])
    print(f"\nupgrade {old} -> {new}: {traffic.ok} requests ok, {traffic.failed} failed, "
          f"{len(traffic.pairs)} picks, worst skew {worst} pods (maxSkew {SKEW})")
    assert new != old
    assert not cross, cross[:5]
    assert all(pairable for pairable in (a == b for a, b in traffic.pairs)), \
        [pair for pair in traffic.pairs if pair[0] != pair[1]][:5]
    assert {a for a, _ in traffic.pairs} >= {old, new}, "traffic ran on both revisions through the roll"
    assert traffic.failed == 0, traffic.reasons[:5]
    assert worst <= SKEW
    assert skew_seen, "RevisionSkew was True while both revisions ran"
    assert condition(obj, "RevisionSkew") == {}, "the condition goes once one revision is left"
    sts = cluster.get_json("statefulset", f"{NAME}-decoder", "-n", ns)
    assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 2, "held for the next upgrade"
