"""kubectl pdd's verify and status lines for tensor-parallel pods, from agent bodies (pure)."""
from __future__ import annotations

from pd_contract.agent_api import (
    AgentStatus,
    LinkState,
    Peer,
    RankInfo,
    RankLinkState,
    RankVerify,
    VerifyRequest,
    VerifyResult,
)
from pd_operator.kubectl_pdd import format_links, format_probe, format_ranks, probe_peer

TP = 4


def rank_infos(cid: int, base_ip: int, initialized: bool = True) -> list[RankInfo]:
    return [RankInfo(rank=r, cluster_id=cid + r, device_id=4 + r, ip=f"127.101.200.{base_ip + r}", port=26000,
                     initialized=initialized, registered=True) for r in range(TP)]


def agent(pod: str, role: str, cid: int, base_ip: int, links: list[LinkState] | None = None, tp: int = TP,
          **kw) -> dict:
    ranks = rank_infos(cid, base_ip) if tp > 1 else []
    st = AgentStatus(pod=pod, role=role, cluster_id=cid, boot_id="b", backend="sim", initialized=True,  # type: ignore[arg-type]
                     ip=ranks[0].ip if ranks else f"10.0.0.{base_ip}", port=26000, model_id=7, links=links or [],
                     tensor_parallel=tp, ranks=ranks, device_ips="annotation" if tp > 1 else "", **kw)
    return st.model_dump(mode="json")


def tp_link(name: str, cid: int, base_ip: int, down: dict[int, str] | None = None) -> LinkState:
    down = down or {}
    ranks = [RankLinkState(rank=r, cluster_id=cid + r, ip="" if down.get(r) == "LLM_NOT_YET_LINK"
                           else f"127.101.200.{base_ip + r}", port=0 if down.get(r) == "LLM_NOT_YET_LINK" else 26000,
                           code=down.get(r, "LLM_SUCCESS"), healthy=r not in down) for r in range(TP)]
    worst = next((x for x in ranks if not x.healthy), ranks[0])
    return LinkState(name=name, cluster_id=cid, ip=ranks[0].ip, port=26000, code=worst.code,
                     healthy=not down, ranks=ranks)


def tp_statuses() -> dict[str, dict]:
    """decoder-0 (cluster ids 2000-2003) linked to prefill-0 (1000-1003), all ranks up, and to
    prefill-1 (1004-1007), whose rank 2 refused the link."""
    return {
        "prefill-0": agent("prefill-0", "prompt", 1000, 1),
        "prefill-1": agent("prefill-1", "prompt", 1004, 5),
        "decoder-0": agent("decoder-0", "decoder", 2000, 9, links=[
            tp_link("prefill-0", 1000, 1), tp_link("prefill-1", 1004, 5, {2: "LLM_LINK_FAILED"})]),
    }


def test_tp_links_summarise_healthy_ranks_and_name_the_failing_one():
    failures, lines = format_links("decoder-0", tp_statuses(), timeout_ms=3000)
    assert failures == 1
    assert lines[0] == "  ok  decoder-0 -> prefill-0: LLM_SUCCESS, 4/4 ranks up"
    assert lines[1] == "  FAIL decoder-0 -> prefill-1: 3/4 ranks up"
    assert lines[2].startswith("         rank 2 LLM_LINK_FAILED (EndpointUnreachable): prefill-1 rank 2 "
                               "(127.101.200.7:26000) refused or did not answer the link from decoder-0 rank 2")
    assert len(lines) == 3


def test_a_rank_never_linked_takes_its_address_from_the_prefills_report():
    sts = tp_statuses()
    sts["decoder-0"]["links"] = [tp_link("prefill-0", 1000, 1).model_dump(mode="json"),
                                 tp_link("prefill-1", 1004, 5, {1: "LLM_NOT_YET_LINK", 3: "LLM_TIMEOUT"})
                                 .model_dump(mode="json")]
    failures, lines = format_links("decoder-0", sts, timeout_ms=500)
    assert failures == 1 and lines[1] == "  FAIL decoder-0 -> prefill-1: 2/4 ranks up"
    assert "rank 1 LLM_NOT_YET_LINK (LinkFailed): link from decoder-0 rank 1 to prefill-1 rank 1 " \
           "(127.101.200.6:26000)" in lines[2]
    assert lines[3].startswith("         rank 3 LLM_TIMEOUT (LinkTimeout): ") and "after 500 ms" in lines[3]


def test_single_rank_links_print_as_before():
    bad = LinkState(name="prefill-1", cluster_id=11, ip="10.0.0.2", port=26000, code="LLM_LINK_FAILED",
                    healthy=False)
    sts = {"prefill-0": agent("prefill-0", "prompt", 10, 1, tp=1),
           "prefill-1": agent("prefill-1", "prompt", 11, 2, tp=1),
           "prefill-2": agent("prefill-2", "prompt", 12, 3, tp=1),
           "decoder-0": agent("decoder-0", "decoder", 20, 9, tp=1, links=[
               LinkState(name="prefill-0", cluster_id=10, ip="10.0.0.1", port=26000, code="LLM_SUCCESS"), bad])}
    failures, lines = format_links("decoder-0", sts, timeout_ms=3000)
    assert failures == 2
    assert lines == [
        "  ok  decoder-0 -> prefill-0: LLM_SUCCESS",
        "  FAIL decoder-0 -> prefill-1: LLM_LINK_FAILED (EndpointUnreachable): prefill-1 (10.0.0.2:26000) refused "
        "or did not answer the link from decoder-0: check that prefill-1 listens on port 26000 and that no "
        "NetworkPolicy or firewall blocks it",
        "  FAIL decoder-0 -> prefill-2: not linked",
    ]


def test_probe_peer_lists_a_multi_rank_prefills_ranks_and_validates():
    sts = tp_statuses()
    member = {"pod": "prefill-1", "clusterId": 1004, "ip": "10.244.0.5", "port": 26000}
    peer = probe_peer(member, sts["prefill-1"])
    assert [(r["rank"], r["cluster_id"], r["ip"]) for r in peer["ranks"]] == \
        [(r, 1004 + r, f"127.101.200.{5 + r}") for r in range(TP)]
    VerifyRequest(peer=Peer.model_validate(peer))   # what the decoder's agent accepts
    single = probe_peer({"pod": "prefill-0", "clusterId": 10, "ip": "10.0.0.1", "port": 26000},
                        agent("prefill-0", "prompt", 10, 1, tp=1))
    assert single == {"name": "prefill-0", "cluster_id": 10, "ip": "10.0.0.1", "port": 26000,
                      "agent_url": "http://10.0.0.1:8080"}


def test_tp_probe_lists_every_rank_pair_and_diagnoses_the_failing_one():
    ranks = [RankVerify(rank=r, ok=True, code="LLM_SUCCESS", bytes=1024, pull_ms=0.25 + r / 10) for r in range(TP)]
    good = VerifyResult(ok=True, code="LLM_SUCCESS", prefill="prefill-1", decoder="decoder-0", bytes=4096,
                        pull_ms=0.55, ranks=ranks).model_dump(mode="json")
    ok, lines = format_probe("decoder-0", "prefill-1", 200, good, 7)
    assert ok and lines[0] == "  ok  decoder-0 <- prefill-1: 4 rank pairs, 4096 bytes in 0.55 ms, bytes match"
    assert lines[1:] == [f"         rank {r}: 1024 bytes in {0.25 + r / 10:.2f} ms" for r in range(TP)]

    ranks[2] = RankVerify(rank=2, ok=False, code="LLM_KV_CACHE_NOT_EXIST", message="no cache for req 9")
    bad = VerifyResult(ok=False, code="LLM_KV_CACHE_NOT_EXIST", message="rank 2: no cache for req 9",
                       prefill="prefill-1", decoder="decoder-0", bytes=3072, pull_ms=0.55,
                       ranks=ranks).model_dump(mode="json")
    ok, lines = format_probe("decoder-0", "prefill-1", 200, bad, 7)
    assert not ok and lines[0] == "  FAIL decoder-0 <- prefill-1: 3/4 rank pairs pulled the probe"
    assert lines[3].startswith("         rank 2 LLM_KV_CACHE_NOT_EXIST (CacheKeyMismatch): decoder-0 rank 2 <- "
                               "prefill-1 rank 2: the prompt side has no cache")
    assert "spec.model.modelId=7" in lines[3] and lines[3].endswith("no cache for req 9")


def test_single_rank_probe_and_refusals_print_as_before():
    good = VerifyResult(ok=True, code="LLM_SUCCESS", prefill="prefill-0", decoder="decoder-0", bytes=2048,
                        pull_ms=1.234).model_dump(mode="json")
    assert format_probe("decoder-0", "prefill-0", 200, good, 7) == \
        (True, ["  ok  decoder-0 <- prefill-0: 2048 bytes in 1.23 ms, bytes match"])
    refused = {"code": "LLM_PARAM_INVALID", "message": "peer prefill-0 has 1 rank(s) and this pod 4: rank-matched "
                                                      "links need equal tensor parallelism"}
    ok, lines = format_probe("decoder-0", "prefill-0", 400, refused, 7)
    assert not ok and lines[0].startswith("  FAIL decoder-0 <- prefill-0: LLM_PARAM_INVALID (CacheDescMismatch): ")
    assert format_probe("decoder-0", "prefill-0", 0, "ConnectError: refused", 7)[1] == \
        ["  FAIL decoder-0 <- prefill-0: 0 (VerifyFailed): decoder-0 <- prefill-0: 0 ConnectError: refused"]


def test_status_lists_each_rank_under_a_tp_pod():
    st = agent("prefill-1", "prompt", 1004, 5)
    st["ranks"][3].update(initialized=False, registered=False, ip="", port=0, device_id=None,
                          last_error="rank 3 has not registered with the pod's agent")
    st["device_error"] = "rank 3 (device 7): no device_ip in the device plugin's annotation"
    lines = format_ranks(st, {"tensorParallel": 4, "initialized": 3, "deviceIps": "annotation"}, "")
    assert lines == [
        "    TP 4: 3/4 ranks initialised, device IPs from the device plugin's annotation",
        "      rank 0   cluster 1004     device 4   127.101.200.5:26000   initialised",
        "      rank 1   cluster 1005     device 5   127.101.200.6:26000   initialised",
        "      rank 2   cluster 1006     device 6   127.101.200.7:26000   initialised",
        "      rank 3   cluster 1007     device -   ?:?                   not registered: rank 3 has not "
        "registered with the pod's agent",
        "    DeviceIPUnknown: rank 3 (device 7): no device_ip in the device plugin's annotation",
    ]
    # the member's lastError already carries the device error (the operator's DeviceIPUnknown)
    assert not format_ranks(st, None, f"prefill-1: {st['device_error']}")[-1].startswith("    DeviceIPUnknown")


def test_status_of_a_tp_pod_whose_agent_did_not_answer_uses_the_members_summary():
    assert format_ranks(None, {"tensorParallel": 8, "initialized": 6, "deviceIps": "hccn.conf"}) == \
        ["    TP 8: 6/8 ranks initialised, device IPs from hccn.conf"]


def test_status_of_a_single_rank_pod_is_unchanged():
    assert format_ranks(agent("decoder-0", "decoder", 20, 9, tp=1), None, "") == []
    assert format_ranks(None, None, "") == []
    # a single NPU rank on the real backend: the member's summary says where its IP came from, nothing to list
    assert format_ranks(agent("decoder-0", "decoder", 20, 9, tp=1), {"tensorParallel": 1, "initialized": 1,
                                                                      "deviceIps": "annotation"}) == []
