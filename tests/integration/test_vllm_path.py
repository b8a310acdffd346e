"""The vLLM path on the local cluster: `spec.engine.adapter: vLLM` with a stand-in for `vllm serve`
(pd_engine.vllm_standin) that loads pd-operator's KV connector from the `--kv-transfer-config` the
operator added, as vLLM does. The operator links the connector's ranks and verifies them; a prefill
on one engine returns kv_transfer_params, a decoder engine pulls those blocks over the operator's
link, and the bytes are the prefill's. A remote the decoder is not linked to is an error naming it."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import condition, sample, wait_phase

pytestmark = pytest.mark.integration

NPU = "huawei.com/Ascend910"
STANDIN_PORT = 8001


def vllm_doc() -> dict:
    doc = sample(**{"datadist.verifyIntervalSeconds": 5})
    doc["spec"]["engine"] = {"image": "example.com/pd/pd-reference-engine:0.1.0", "adapter": "vLLM"}
    doc["spec"]["model"]["kvCache"].update(numLayers=2, numKvHeads=2, headDim=8, maxSeqLen=64,
                                           paged={"blockSize": 4, "numBlocks": 32})
    for g in ("prefill", "decoder"):
        doc["spec"][g].update(replicas=1, resources={"limits": {NPU: 1}},
                              command=["python3", "-m", "pd_engine.vllm_standin", "--port", str(STANDIN_PORT)])
    return doc


def standin(cluster: Cluster, ns: str, pod: str) -> str:
    ip = cluster.get_json("pod", pod, "-n", ns)["status"]["podIP"]
    url = f"http://{ip}:{STANDIN_PORT}"
    wait_for(f"{pod}'s engine answers", lambda: httpx.get(f"{url}/healthz", trust_env=False, timeout=5)
             .status_code == 200, timeout=60)
    return url


def test_a_vllm_engine_prefills_and_a_decoder_pulls_the_blocks_over_the_operators_link(
        cluster: Cluster, namespace: str, operator) -> None:
    ns = namespace
    doc = vllm_doc()
    cluster.apply(doc, ns)
    obj = wait_phase(cluster, ns, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "1/1"
                     and condition(o, "KVPathVerified").get("status") == "True")

    # the operator added vLLM's arguments; the stand-in loaded the connector from them
    engine = cluster.get_json("pod", "sim-small-decoder-0", "-n", ns)["spec"]["containers"][1]
    args = engine["args"]
    cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "PDOperatorConnector" and cfg["kv_role"] == "kv_both"
    assert args[args.index("--tensor-parallel-size") + 1] == "1"

    p, d = standin(cluster, ns, "sim-small-prefill-0"), standin(cluster, ns, "sim-small-decoder-0")
    prefill_cid = next(m["clusterId"] for m in obj["status"]["members"] if m["pod"] == "sim-small-prefill-0")
    with httpx.Client(trust_env=False, timeout=60) as http:
        for i, prompt_len in enumerate((3, 9, 17)):
            rid = f"req-{i}"
            pre = http.post(f"{p}/prefill", json={"request_id": rid, "prompt_len": prompt_len, "seed": 100 + i})
            assert pre.status_code == 200, pre.text
            params = pre.json()["kv_transfer_params"]
            assert params["remote_cluster_id"] == prefill_cid and params["do_remote_prefill"] is True
            assert len(params["remote_block_ids"]) == -(-prompt_len // 4)
            dec = http.post(f"{d}/decode", json={"request_id": f"d-{rid}", "kv_transfer_params": params})
            assert dec.status_code == 200, dec.text
            got = dec.json()
            assert got["errors"] == {} and got["failed_blocks"] == [], got
            assert got["finished"] == [f"d-{rid}"]
            assert got["sha256"] == pre.json()["sha256"], "the decoder's blocks are not the prefill's"

        # the decoder's agent told the prefill's agent of the pulls: the prefill releases the blocks
        wait_for("the prefill released the pulled blocks",
                 lambda: http.get(f"{p}/healthz").json()["held"] == 0, timeout=30)

        # a remote the operator did not link: nothing pulled, the error names the cluster id
        bad = {**params, "remote_cluster_id": 4242}
        dec = http.post(f"{d}/decode", json={"request_id": "d-unlinked", "kv_transfer_params": bad}).json()
        assert "not linked to prompt cluster 4242" in dec["errors"]["d-unlinked"], dec
        assert dec["failed_blocks"] == sorted(dec["blocks"])


# ---- behind pd-gateway, with vLLM's P-D protocol ------------------------------------------------

def vllm_gateway_doc() -> tuple[dict, dict]:
    """2 prefill + 2 decoder vLLM stand-ins computing with the reference model, pd-gateway in front."""
    from tests.integration.test_content import PROFILE, SEED
    from tests.integration.test_switching import REBALANCE
    doc = sample(**{"datadist.verifyIntervalSeconds": 5, "drainTimeoutSeconds": 30,
                    "gateway": {"enabled": True, "apiKeysSecret": "sim-small-keys"}}, rebalance=REBALANCE)
    doc["spec"]["engine"] = {"image": "example.com/pd/pd-reference-engine:0.1.0", "adapter": "vLLM",
                             "port": STANDIN_PORT}
    kv = doc["spec"]["model"]["kvCache"]
    kv.update(PROFILE, attention="GQA", tensorParallel=1, paged={"blockSize": 16, "numBlocks": 256})
    profile = {"attention": "GQA", **{k: kv[k] for k in ("numLayers", "numKvHeads", "headDim", "dtype", "maxSeqLen")},
               "seed": SEED}
    for g in ("prefill", "decoder"):
        doc["spec"][g].update(replicas=2, resources={"limits": {NPU: 1}},
                              command=["python3", "-m", "pd_engine.vllm_standin", "--port", str(STANDIN_PORT),
                                       "--reference-model", json.dumps(profile)])
    return doc, profile


def recorded(cluster: Cluster, ns: str) -> list[dict]:
    out = []
    for group in ("prefill", "decoder"):
        for i in (0, 1):
            ip = cluster.get_json("pod", f"sim-small-{group}-{i}", "-n", ns)["status"]["podIP"]
            out += httpx.get(f"http://{ip}:{STANDIN_PORT}/standin/requests", trust_env=False,
                             timeout=10).json()["requests"]
    return out


def test_pd_gateway_routes_vllm_engines_with_vllms_pd_protocol_through_a_live_switch(
        cluster: Cluster, namespace: str, operator) -> None:
    import time

    from llm_datadist_sim.refmodel import Model, Profile
    from tests.integration.conftest import keys_secret
    from tests.integration.test_content import (
        KEY,
        Checker,
        assert_all_match,
        gateway_url,
        prompts,
        switch_both_ways,
    )
    from tests.integration.test_traffic import Load
    ns = namespace
    keys_secret(cluster, ns, **{"team-a": KEY})
    doc, profile = vllm_gateway_doc()
    cluster.apply(doc, ns)
    wait_phase(cluster, ns, "Ready", timeout=240, extra=lambda o: o["status"]["linksSummary"] == "4/4"
               and condition(o, "KVPathVerified").get("status") == "True")
    svc = cluster.get_json("service", "sim-small-decoder-role", "-n", ns)["spec"]["ports"]
    assert {"name": "serving", "port": STANDIN_PORT, "targetPort": "serving", "protocol": "TCP"} in svc

    url = gateway_url(cluster, ns)
    check = Checker(url, Model.get(Profile.from_json(profile)))
    t0 = time.monotonic()
    assert_all_match(check.run(prompts(50, seed=7)))
    print(f"\n50 prompts through pd-gateway to vLLM stand-ins: all equal to one engine's decode "
          f"({time.monotonic() - t0:.1f}s)")
    seen = recorded(cluster, ns)
    prefills = [r for r in seen if (r.get("kv_transfer_params") or {}).get("do_remote_decode")]
    decodes = [r for r in seen if (r.get("kv_transfer_params") or {}).get("do_remote_prefill")]
    assert len(prefills) >= 50 and len(decodes) >= 50, (len(prefills), len(decodes))
    assert all(r["max_tokens"] == 1 and r["stream"] is False for r in prefills)

    # the OpenAI body reaches the engine as the client sent it: tools, tool_choice, stop, n
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find a link",
                                               "parameters": {"type": "object", "properties": {}}}}]
    r = check.client.chat.completions.create(model=check.served, messages=[{"role": "user", "content": "tools?"}],
                                             max_tokens=8, temperature=0, tools=tools, tool_choice="auto",
                                             stop=["zz-stop"], n=2)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 16, r
    got = [b for b in recorded(cluster, ns) if b.get("stop") == ["zz-stop"]]
    assert {bool((b.get("kv_transfer_params") or {}).get("do_remote_prefill")) for b in got} == {True, False}
    for b in got:
        assert b["tools"] == tools and b["tool_choice"] == "auto" and b["n"] == 2, b

    # a live switch each way with traffic and content checks running: nothing failed, nothing differs
    load = Load(cluster, ns, duration=300, rate=3, gateway=url, api_key=KEY, max_prompt=200, max_output=16)
    s, c = switch_both_ways(cluster, ns, check, load, 2000, ("3/3", "4/4"), timeout=180)
    print(f"through the switches: loadgen {s['completed']}/{s['requests']} completed; content checks {c}")
    assert s["failed"] == 0, s["failed_by_reason"]
    assert c["failed"] == 0 and c["mismatched"] == 0, c
    load.assert_traffic_through_changes()
