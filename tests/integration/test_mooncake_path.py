"""vllm-ascend's own Mooncake connectors on the local cluster (`spec.engine.kvTransfer: mooncake` and
`mooncake-layerwise`), with the vLLM stand-in's MooncakeConnectorV1 and MooncakeLayerwiseConnector
(pd_engine.mooncake_standin: vllm-ascend's config and kv_transfer_params, real TCP reads and pushes
of real blocks; layerwise runs decoder first through pd-gateway's metaserver). The engine containers
run under pd_engine.launch; the operator pairs and verifies each pair with a real request, pd-gateway
routes with vLLM's P-D protocol (or decoder first), and a role switch is a drained restart of the
server in place with the flipped kv_role: the pod, its UID and its container stay, traffic runs
through it and no request fails."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import condition, wait_phase

pytestmark = pytest.mark.integration

STANDIN_PORT = 8001
KV_PORT = 30000


def mooncake_doc(kind: str) -> tuple[dict, dict]:
    from tests.integration.test_vllm_path import vllm_gateway_doc
    doc, profile = vllm_gateway_doc()
    doc["spec"]["engine"].update(kvTransfer=kind, kvPort=KV_PORT)
    return doc, profile


def engine_health(cluster: Cluster, ns: str, pod: str) -> dict:
    ip = cluster.get_json("pod", pod, "-n", ns)["status"]["podIP"]
    return httpx.get(f"http://{ip}:{STANDIN_PORT}/healthz", trust_env=False, timeout=10).json()


def pods(cluster: Cluster, ns: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in cluster.get_json(
        "pods", "-n", ns, "-l", "pdoperator.io/deployment=sim-small")["items"]}


@pytest.mark.parametrize("kind,connector", [("mooncake", "MooncakeConnectorV1"),
                                            ("mooncake-layerwise", "MooncakeLayerwiseConnector")])
def test_a_mooncake_deployment_serves_and_switches_a_decoder_by_a_drained_restart_in_place(
        cluster: Cluster, namespace: str, operator, kind: str, connector: str) -> None:
    from llm_datadist_sim.refmodel import Model, Profile
    from tests.integration.conftest import keys_secret
    from tests.integration.test_content import KEY, Checker, assert_all_match, gateway_url, prompts
    from tests.integration.test_switching import set_prefill, switched
    from tests.integration.test_traffic import Load
    ns = namespace
    keys_secret(cluster, ns, **{"team-a": KEY})
    doc, profile = mooncake_doc(kind)
    if kind == "mooncake-layerwise":   # a server that loads for longer than switch_role waits (3 s)
        doc["spec"].setdefault("sim", {})["engineStartSeconds"] = 5
    cluster.apply(doc, ns)
    obj = wait_phase(cluster, ns, "Ready", timeout=240, extra=lambda o: o["status"]["linksSummary"] == "4/4"
                     and condition(o, "KVPathVerified").get("status") == "True")
    assert obj["status"]["phase"] == "Ready"

    # the engine container runs under the launcher; each server runs vllm-ascend's config for its role
    engine = pods(cluster, ns)["sim-small-decoder-0"]["spec"]["containers"][1]
    assert engine["command"][:4] == ["python3", "-m", "pd_engine.launch", "--"], engine["command"]
    assert "--kv-transfer-config" not in engine.get("args", [])
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["PD_KV_TRANSFER"] == kind and env["PD_KV_PORT"] == str(KV_PORT)
    assert json.loads(env["PD_KV_PARALLEL"]) == {"prefill": {"tp_size": 1, "dp_size": 1},
                                                 "decode": {"tp_size": 1, "dp_size": 1}}
    for pod, want in (("sim-small-prefill-0", "kv_producer"), ("sim-small-prefill-1", "kv_producer"),
                      ("sim-small-decoder-0", "kv_consumer"), ("sim-small-decoder-1", "kv_consumer")):
        h = engine_health(cluster, ns, pod)
        assert h["kv_connector"] == connector and h["kv_role"] == want, (pod, h)

    # through pd-gateway: every completion equal to one engine's, the KV read from the prefills
    url = gateway_url(cluster, ns)
    check = Checker(url, Model.get(Profile.from_json(profile)))
    assert_all_match(check.run(prompts(30, seed=11)))
    decoded = sum(engine_health(cluster, ns, f"sim-small-decoder-{i}")["decode"] for i in (0, 1))
    recomputed = sum(engine_health(cluster, ns, f"sim-small-decoder-{i}")["recomputed"] for i in (0, 1))
    assert decoded >= 30 and recomputed == 0, (decoded, recomputed)

    # decoder -> prefill with traffic and content checks running: a drained restart in place
    before = pods(cluster, ns)
    load = Load(cluster, ns, duration=240, rate=3, gateway=url, api_key=KEY, max_prompt=200, max_output=16)
    t0 = time.monotonic()
    with check.running(seed=2024):
        time.sleep(3)
        with load.change("decoder -> prefill"):
            set_prefill(cluster, ns, 3)
            last = switched(cluster, ns, "prefill", None, "3/3", timeout=240)["status"]["lastSwitch"]
        time.sleep(3)
    took = time.monotonic() - t0
    s, c = load.stop(), check.summary()
    moved = last["pod"]
    print(f"\n{kind}: switch of {moved}: {last}; loadgen {s['completed']}/{s['requests']} completed, "
          f"content checks {c} ({took:.0f}s)")
    assert s["failed"] == 0, s["failed_by_reason"]
    assert c["failed"] == 0 and c["mismatched"] == 0, c
    if kind == "mooncake-layerwise":   # the switch waited for the server's load, past switch_role's 3 s
        assert last["switchMs"] >= 5000, last
    load.assert_traffic_through_changes()
    after = pods(cluster, ns)
    # the same pod (not rescheduled), the same containers (no container restart): the server restarted inside
    assert after[moved]["metadata"]["uid"] == before[moved]["metadata"]["uid"]
    assert after[moved]["spec"]["nodeName"] == before[moved]["spec"]["nodeName"]
    assert [cs.get("restartCount", 0) for cs in after[moved]["status"]["containerStatuses"]] == \
        [cs.get("restartCount", 0) for cs in before[moved]["status"]["containerStatuses"]]
    assert engine_health(cluster, ns, moved)["kv_role"] == "kv_producer"

    def verified() -> bool:
        o = cluster.get_json("pdd", "sim-small", "-n", ns)
        return condition(o, "KVPathVerified").get("status") == "True" and o["status"]["linksSummary"] == "3/3"
    wait_for("the pairs through the switched prefill verified", verified, timeout=120)
    assert_all_match(check.run(prompts(10, seed=12)))
