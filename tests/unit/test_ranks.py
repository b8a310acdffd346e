"""Tensor-parallel ranks: device IP resolution, cluster ids, pod specs, rank-link counting and
the status rows (pure)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from pd_agent.devices import DeviceError, parse_annotation, parse_hccn, resolve
from pd_agent.front import rank_env
from pd_agent.identity import Identity
from pd_operator import builders, links
from pd_operator.api import parse_spec
from pd_operator.status import Observed, build_status

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())["spec"]
ANN = {"pod_name": "p", "server_id": "10.0.0.1",
       "devices": [{"device_id": "5", "device_ip": "192.168.1.15"}, {"device_id": "4", "device_ip": "192.168.1.14"}]}


def tp_spec(tp: int, **extra) -> dict:
    s = copy.deepcopy(SPEC)
    s["model"]["kvCache"]["tensorParallel"] = tp
    for g in ("prefill", "decoder"):
        s[g]["resources"] = {"limits": {"huawei.com/Ascend910": tp}}
    s.update(extra)
    return s


# ---- device IPs -------------------------------------------------------------------------------

def write(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def test_annotation_ranks_in_device_order(tmp_path):
    env = {"PD_DEVICE_ANNOTATION_FILE": write(tmp_path, "ann", json.dumps(ANN))}
    d = resolve(2, 26000, env, "10.1.1.1", "llm-datadist")
    assert d.source == "annotation" and d.complete
    assert [(x.rank, x.device_id, x.ip, x.port) for x in d.ranks] == [(0, 4, "192.168.1.14", 26000),
                                                                      (1, 5, "192.168.1.15", 26000)]


def test_annotation_missing_a_rank_names_it(tmp_path):
    env = {"PD_DEVICE_ANNOTATION_FILE": write(tmp_path, "ann", json.dumps(ANN))}
    d = resolve(3, 26000, env, "10.1.1.1", "sim")
    assert not d.complete and "rank 2" in d.error and "lists 2 device(s) for 3 ranks" in d.error
    no_ip = {**ANN, "devices": [{"device_id": "0", "device_ip": "192.168.1.10"}, {"device_id": "1"}]}
    d = resolve(2, 26000, {"PD_DEVICE_ANNOTATION_FILE": write(tmp_path, "ann2", json.dumps(no_ip))}, "x", "sim")
    assert d.error.startswith("rank 1 (device 1): no device_ip")


def test_annotation_that_is_not_the_plugins_json():
    with pytest.raises(DeviceError, match="device_id"):
        parse_annotation('{"devices": [{"device_ip": "1.2.3.4"}]}')
    with pytest.raises(DeviceError):
        parse_annotation('{"devices": [{"device_id": "0", "device_ip": "not-an-ip"}]}')


def test_hccn_conf_for_visible_devices(tmp_path):
    conf = "address_2=192.168.100.102\nnetmask_2=255.255.255.0\n# comment\n\naddress_3=192.168.100.103\n"
    env = {"PD_HCCN_CONF": write(tmp_path, "hccn.conf", conf), "ASCEND_VISIBLE_DEVICES": "3,2",
           "PD_DEVICE_ANNOTATION_FILE": write(tmp_path, "empty", "")}   # the volume's file, no annotation yet
    d = resolve(2, 26000, env, "x", "llm-datadist")
    assert d.source == "hccn.conf" and [(x.device_id, x.ip) for x in d.ranks] == [(2, "192.168.100.102"),
                                                                                   (3, "192.168.100.103")]


def test_hccn_conf_line_that_does_not_parse_is_named():
    with pytest.raises(DeviceError, match=r"/etc/hccn.conf line 2: 'address 1 192.168.1.1' does not parse"):
        parse_hccn("address_0=192.168.1.0\naddress 1 192.168.1.1\n")
    with pytest.raises(DeviceError, match=r"line 1: .*'192.168.1.300' is not an IP address"):
        parse_hccn("address_0=192.168.1.300\n")


def test_list_then_pod_ip_only_on_the_simulator(tmp_path):
    d = resolve(2, 26000, {"PD_DEVICE_IPS": "10.9.0.1, 10.9.0.2", "PD_HCCN_CONF": str(tmp_path / "none")}, "x", "sim")
    assert d.source == "list" and [x.ip for x in d.ranks] == ["10.9.0.1", "10.9.0.2"]
    d = resolve(3, 26000, {"PD_HCCN_CONF": str(tmp_path / "none")}, "10.1.1.1", "sim")
    assert d.source == "pod-ip" and [(x.ip, x.port) for x in d.ranks] == [("10.1.1.1", 26000), ("10.1.1.1", 26001),
                                                                        ("10.1.1.1", 26002)]
    d = resolve(2, 26000, {"PD_HCCN_CONF": str(tmp_path / "none")}, "10.1.1.1", "llm-datadist")
    assert not d.complete and "no device IPs for ranks 0-1" in d.error


def test_mounted_files_under_the_local_root(tmp_path):
    (tmp_path / "etc/pd-podinfo").mkdir(parents=True)
    (tmp_path / "etc/pd-podinfo/ascend-910-configuration").write_text(json.dumps(ANN))
    d = resolve(2, 26000, {"PD_LOCAL_ROOT": str(tmp_path)}, "x", "sim")
    assert d.source == "annotation"


# ---- the rank contract ------------------------------------------------------------------------

def test_rank_env_and_cluster_ids(tmp_path):
    pod = {"LLM_DATADIST_CLUSTER_ID_BASE": "1000", "LLM_DATADIST_POD_INDEX": "2", "LLM_DATADIST_ROLE": "decoder",
           "PD_TENSOR_PARALLEL": "2", "POD_NAME": "d-2", "LLM_DATADIST_IP": "10.1.1.1"}
    d = resolve(2, 26000, {"PD_DEVICE_ANNOTATION_FILE": write(tmp_path, "a", json.dumps(ANN))}, "x", "sim")
    env = rank_env(pod, d, 1, "http://10.1.1.1:8080/v1/ranks")
    assert env["LLM_DATADIST_CLUSTER_ID"] == "1005" and env["PD_RANK"] == "1" and env["PD_DEVICE_ID"] == "5"
    assert env["LLM_DATADIST_DEVICE_ID"] == "1" and env["LLM_DATADIST_IP"] == "192.168.1.15"
    ident = Identity.from_env({**pod, "PD_RANK": "1"})
    assert ident.cluster_id == 1005          # base + pod index x TP + rank, computed the same way
    assert Identity.from_env(pod).cluster_id == 1004


def test_operator_cluster_ids_follow_the_convention():
    spec = parse_spec(tp_spec(4))
    assert [builders.cluster_id(spec, "prefill", i) for i in range(3)] == [0, 4, 8]
    assert builders.cluster_id(spec, "decoder", 1, rank=3) == 1007


# ---- pod specs --------------------------------------------------------------------------------

def pod_spec(spec: dict, group: str = "decoder", resource: str = "huawei.com/Ascend910") -> dict:
    objs = builders.desired_children("llm", "ns", "uid", parse_spec(spec), resource=resource)
    return next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == f"llm-{group}")[
        "spec"]["template"]["spec"]


def test_multi_rank_pods_read_the_annotation_through_a_downward_api_volume():
    ps = pod_spec(tp_spec(4))
    env = {e["name"]: e.get("value") for e in ps["containers"][0]["env"]}
    assert env["PD_TENSOR_PARALLEL"] == "4"
    vol = next(v for v in ps["volumes"] if v["name"] == "podinfo")
    assert vol["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['ascend.kubectl.kubernetes.io/ascend-910-configuration']"
    assert env["PD_DEVICE_ANNOTATION_FILE"].startswith(ps["containers"][0]["volumeMounts"][0]["mountPath"])


def test_single_rank_sim_pod_without_npus_keeps_todays_pod_spec():
    s = copy.deepcopy(SPEC)
    for g in ("prefill", "decoder"):
        s[g].pop("resources", None)
    ps = pod_spec(s)
    assert not any("downwardAPI" in v for v in ps.get("volumes", []))
    assert not any(e["name"] == "PD_TENSOR_PARALLEL" for e in ps["containers"][0]["env"])


def test_real_backend_requests_one_npu_per_rank_under_the_configured_resource():
    s = tp_spec(8, backend="llm-datadist")
    s["model"]["kvCache"]["numKvHeads"] = 8
    for g in ("prefill", "decoder"):
        s[g].pop("resources")
    ps = pod_spec(s, resource="example.com/npu")
    # one NPU per rank, and per-rank defaults for the rest
    assert ps["containers"][0]["resources"] == {
        "limits": {"example.com/npu": 8, "cpu": "64", "memory": "512Gi", "ephemeral-storage": "64Gi"},
        "requests": {"example.com/npu": 8, "cpu": "8000m", "memory": "65536Mi", "ephemeral-storage": "8Gi"}}
    env = {e["name"]: e.get("value") for e in ps["containers"][0]["env"]}
    assert env["PD_HCCN_CONF"] == "/etc/hccn.conf"


def test_npu_request_that_disagrees_with_tp_is_named():
    spec = parse_spec(tp_spec(4))
    assert builders.npu_mismatch(spec, "huawei.com/Ascend910") is None
    s = tp_spec(4)
    s["prefill"]["resources"] = {"limits": {"huawei.com/Ascend910": 2}}
    msg = builders.npu_mismatch(parse_spec(s), "huawei.com/Ascend910")
    assert msg and "spec.prefill.resources['huawei.com/Ascend910'] is 2" in msg and "4 tensor-parallel" in msg
    assert builders.npu_mismatch(parse_spec(s), "example.com/npu") is None   # not the configured resource


# ---- rank links ------------------------------------------------------------------------------

def engine(pod: str, role: str, cid: int, tp: int = 4) -> links.Engine:
    ranks = tuple((cid + r, f"10.0.{cid}.{r + 1}", 26000) for r in range(tp))
    return links.Engine(pod=pod, group=role, role=role, cluster_id=cid, ip=ranks[0][1], port=26000, ready=True,
                        agent_ok=True, agent_url=f"http://{pod}:8080", boot_id=f"boot-{pod}", cache_desc="d",
                        tp=tp, ranks=ranks)


def link_to(p: links.Engine, codes: list[str]) -> dict:
    return {"name": p.pod, "cluster_id": p.cluster_id, "ip": p.ip, "port": p.port, "peer_boot_id": p.boot_id,
            "code": next((c for c in codes if c != "LLM_SUCCESS"), "LLM_SUCCESS"),
            "healthy": all(c == "LLM_SUCCESS" for c in codes),
            "ranks": [{"rank": r, "cluster_id": p.cluster_id + r, "ip": p.ranks[r][1], "port": 26000, "code": c,
                       "healthy": c == "LLM_SUCCESS"} for r, c in enumerate(codes)]}


def test_rank_links_are_counted_and_a_failing_rank_is_listed():
    p0, p1, d0 = engine("p-0", "prefill", 0), engine("p-1", "prefill", 4), engine("d-0", "decoder", 1000)
    ok = ["LLM_SUCCESS"] * 4
    reported = {"d-0": [link_to(p0, ok), link_to(p1, ["LLM_SUCCESS", "LLM_SUCCESS", "LLM_LINK_FAILED", "LLM_SUCCESS"])]}
    per = links.per_decoder([p0, p1, d0], reported)
    assert per["d-0"][:2] == (8, 7)
    # the pod link with a broken rank is re-made (local end first); the healthy one is left alone
    plans = links.plan([p0, p1, d0], reported)
    assert [l["name"] for l in plans[0].force_unlink] == ["p-1"] and [e.pod for e in plans[0].link] == ["p-1"]
    # a rank's address that moved (the device plugin gave the pod another NPU) is stale
    moved = link_to(p0, ok)
    moved["ranks"][3]["ip"] = "10.9.9.9"
    assert links.broken(moved, p0) and links.ranks_up(moved, d0, p0) == 0

    obs = Observed(generation=1, pods=[], engines=[p0, p1, d0], reported=reported)
    obs.per_decoder = per
    st = build_status(parse_spec(tp_spec(4)), obs, None, at="2026-12-05T00:00:00Z")
    assert st["links"] == {"expected": 8, "up": 7} and st["linksSummary"] == "7/8"


def test_member_rows_list_failing_rank_links_and_summarise_ranks():
    p0, d0 = engine("p-0", "prefill", 0), engine("d-0", "decoder", 1000)
    pods = [{"metadata": {"name": n, "labels": {"pdoperator.io/group": g}},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
            for n, g in (("p-0", "prefill"), ("d-0", "decoder"))]
    reported = {"d-0": [link_to(p0, ["LLM_SUCCESS", "LLM_NOT_YET_LINK", "LLM_SUCCESS", "LLM_SUCCESS"])]}
    obs = Observed(generation=1, pods=pods, engines=[p0, d0], reported=reported,
                   rank_reports={"d-0": (4, 4, "annotation"), "p-0": (4, 4, "pod-ip")})
    st = build_status(parse_spec(tp_spec(4)), obs, None, at="2026-12-05T00:00:00Z")
    rows = {m["pod"]: m for m in st["members"]}
    assert rows["d-0"]["failingLinks"] == [{"peer": "p-0", "clusterId": 0, "code": "LLM_NOT_YET_LINK", "rank": 1}]
    assert rows["d-0"]["ranks"] == {"tensorParallel": 4, "initialized": 4, "deviceIps": "annotation"}
    assert rows["p-0"]["ranks"]["deviceIps"] == "pod-ip"     # the simulator says it runs on the pod IP


# ---- unequal TP: which peer rank each rank pairs with ----------------------------------------------

@pytest.mark.parametrize("local,peer,expected", [
    (4, 4, [0, 1, 2, 3]),        # equal: rank r <-> rank r
    (2, 4, [0, 2]),              # a decoder of TP 2 reads every 2nd prefill rank (MLA: each holds the latent)
    (4, 2, [0, 0, 1, 1]),        # a decoder of TP 4 shares each prefill rank between 2 of its ranks
    (1, 8, [0]),
    (8, 1, [0] * 8),
])
def test_rank_map(local, peer, expected):
    from pd_agent.front import rank_map
    assert [rank_map(local, peer, r) for r in range(local)] == expected


def test_rank_map_needs_one_tp_to_divide_the_other():
    from pd_agent.core import AgentError
    from pd_agent.front import rank_map
    with pytest.raises(AgentError, match="one must divide the other"):
        rank_map(4, 6, 1)


def test_unequal_tp_is_counted_in_decoder_rank_links():
    p0 = engine("p-0", "prefill", 0, tp=4)
    d0 = engine("d-0", "decoder", 1000, tp=2)
    link = link_to(p0, ["LLM_SUCCESS"] * 4)
    # decoder rank r reads prefill rank 2r: two rank links, the second one down
    link["ranks"] = [{**link["ranks"][0]}, {**link["ranks"][2], "rank": 1, "code": "LLM_LINK_FAILED",
                                            "healthy": False}]
    link["code"], link["healthy"] = "LLM_LINK_FAILED", False
    per = links.per_decoder([p0, d0], {"d-0": [link]})
    assert per["d-0"][:2] == (2, 1)


def test_judged_links_kept_with_a_report_follow_the_peer():
    """A decoder's dumped links (links.Reported) keep what each was judged to be; a peer that
    moved a rank or restarted is judged again, and the answers are those of plain lists."""
    from dataclasses import replace
    p0, p1, d0 = engine("p-0", "prefill", 0), engine("p-1", "prefill", 4), engine("d-0", "decoder", 1000)
    ok = ["LLM_SUCCESS"] * 4
    plain = [link_to(p0, ok), link_to(p1, ["LLM_SUCCESS", "LLM_LINK_FAILED", "LLM_SUCCESS", "LLM_SUCCESS"])]
    dumped = links.Reported(plain)
    for _ in range(2):   # the second time from what was kept
        assert links.per_decoder([p0, p1, d0], {"d-0": dumped}) == links.per_decoder([p0, p1, d0], {"d-0": plain})
        assert links.plan([p0, p1, d0], {"d-0": dumped}) == links.plan([p0, p1, d0], {"d-0": plain})
    assert len(dumped.judged) == 2
    moved = replace(p0, ranks=p0.ranks[:3] + ((3, "10.9.9.9", 26000),))
    restarted = replace(p0, boot_id="boot-again")
    for peer in (moved, restarted):
        assert links.per_decoder([peer, p1, d0], {"d-0": dumped})["d-0"][:2] == (8, 3)
        assert [e.pod for e in links.plan([peer, p1, d0], {"d-0": dumped})[0].link] == ["p-0", "p-1"]


def test_a_decoder_linked_to_the_same_peers_is_not_judged_again_but_any_change_is_seen():
    from dataclasses import replace
    p0, p1, d0 = engine("p-0", "prefill", 0), engine("p-1", "prefill", 4), engine("d-0", "decoder", 1000)
    ok = ["LLM_SUCCESS"] * 4
    good = links.Reported([link_to(p0, ok), link_to(p1, ok)])
    for _ in range(2):
        assert links.plan([p0, p1, d0], {"d-0": good}) == []
        assert links.per_decoder([p0, p1, d0], {"d-0": good})["d-0"] == (8, 8, [])
    assert set(good.rows) == {"plan", "per"}
    p2 = engine("p-2", "prefill", 8)   # a prefill more: linked, and counted as missing
    assert [e.pod for e in links.plan([p0, p1, p2, d0], {"d-0": good})[0].link] == ["p-2"]
    assert links.per_decoder([p0, p1, p2, d0], {"d-0": good})["d-0"][:2] == (12, 8)
    assert links.plan([p0, replace(p1, cache_desc="other"), d0], {"d-0": good})[0].unlink == [good[1]]
    # a broken link waiting out its backoff is no link to leave alone: once due, it is re-made
    broken = links.Reported([link_to(p0, ok), link_to(p1, ["LLM_LINK_FAILED"] + ok[1:])])
    assert links.plan([p0, p1, d0], {"d-0": broken}, due=lambda d, c: False) == []
    assert [e.pod for e in links.plan([p0, p1, d0], {"d-0": broken})[0].link] == ["p-1"]
