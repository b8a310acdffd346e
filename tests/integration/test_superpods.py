"""A3 superpods on the local cluster (its nodes split into two superpods): each pod's superpod
comes from the device plugin's annotation through its agent, status counts linked pairs within and
across superpods, and pd-gateway's router keeps KV pulls inside a superpod where the decoder there
is not busier (the share before and after the preference is printed for the record)."""
from __future__ import annotations

import asyncio
import base64

import pytest

from tests.conftest import Cluster
from tests.integration.conftest import agent_status, sample, wait_phase

pytestmark = pytest.mark.integration
NAME = "sp"
REQUESTS = 60


def spec() -> dict:
    doc = sample(NAME, **{"prefill.replicas": 2, "decoder.replicas": 2, "model.kvCache.tensorParallel": 1})
    for g in ("prefill", "decoder"):
        doc["spec"][g]["resources"] = {"limits": {"huawei.com/Ascend910": 1}}
        # one pod of each group in each superpod: where the preference has something to choose
        doc["spec"][g]["topologySpreadConstraints"] = [{
            "maxSkew": 1, "topologyKey": "pdoperator.io/superpod", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"pdoperator.io/deployment": NAME, "pdoperator.io/group": g}}}]
    return doc


async def route(urls: list[str], token: str, prefer: bool) -> dict[str, int]:
    import httpx

    from pd_agent.loadgen import direct_request
    from pd_router import routing
    before = routing.SUPERPOD_FACTOR, routing.SUPERPOD_SLACK
    routing.SUPERPOD_FACTOR, routing.SUPERPOD_SLACK = before if prefer else (1, 0)
    try:
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": f"Bearer {token}"}) as http:
            fleet = routing.Fleet(http, token, routing.fixed_finder(urls))
            await fleet.refresh()
            results = [await direct_request(fleet, 9000 + i, 32, 2) for i in range(REQUESTS)]
        assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
        return dict(fleet.pulls)
    finally:
        routing.SUPERPOD_FACTOR, routing.SUPERPOD_SLACK = before


def test_superpods_are_reported_counted_and_preferred(cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    cluster.apply(spec(), ns)
    obj = wait_phase(cluster, ns, "Ready", name=NAME, timeout=180,
                     extra=lambda o: o["status"]["linksSummary"] == "4/4" and "superpodPairs" in o["status"])
    pods = [f"{NAME}-{g}-{i}" for g in ("prefill", "decoder") for i in (0, 1)]
    nodes = {n["metadata"]["name"]: i for i, n in enumerate(sorted(cluster.get_json("nodes")["items"],
                                                                   key=lambda n: n["metadata"]["name"]))}
    sp = {}
    for p in pods:
        st = agent_status(cluster, ns, p, NAME)
        node = cluster.get_json("pod", p, "-n", ns)["spec"]["nodeName"]
        sp[p] = st["preflight"]["superpod"]
        # the local cluster's 3 nodes in 2 superpods: local-node-1 and -2 in 0, local-node-3 in 1
        assert sp[p] == str(nodes[node] * 2 // len(nodes)), (p, node, sp[p])
    within = sum(1 for d in pods[2:] for p in pods[:2] if sp[d] == sp[p])
    assert obj["status"]["superpodPairs"] == {"within": within, "across": 4 - within}
    assert within == 2, sp   # each group spread over both superpods: each prefill has a decoder beside it

    token = base64.b64decode(cluster.get_json("secret", f"{NAME}-agent-data-token", "-n", ns)["data"]["token"]).decode()
    urls = [f"http://{cluster.get_json('pod', p, '-n', ns)['status']['podIP']}:8080" for p in pods]
    before = asyncio.run(route(urls, token, False))
    after = asyncio.run(route(urls, token, True))
    for pulls in (before, after):
        assert sum(pulls.values()) >= REQUESTS and pulls["unknown"] == 0, pulls
    share = {k: round(v["within"] / sum(v.values()), 2) for k, v in (("before", before), ("after", after))}
    # each prefill has a decoder in its superpod carrying about what the other does: the pull stays
    # (a tie at the first requests may go either way)
    assert after["within"] >= 0.9 * sum(after.values()), after
    print(f"\nsuperpods {sp}: linked pairs within {within}/4; pulls within a superpod: "
          f"before {before} ({share['before']:.0%}), after {after} ({share['after']:.0%})")
