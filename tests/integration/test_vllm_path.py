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
