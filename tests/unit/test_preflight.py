"""The network preflight: hccn_tool's answers parsed and judged, the simulator's answers for its
loopback devices, a pod's report, and the operator's NetworkPreflight condition and held pods."""
from __future__ import annotations

import asyncio

import pytest

from llm_datadist_sim.hccn import NetFaults, answer, gateway_of
from pd_agent.devices import Device, Devices
from pd_agent.preflight import Preflight, evaluate, held
from pd_contract import preflight as pf
from pd_contract.agent_api import AgentStatus, FaultsRequest, PreflightReport
from pd_operator import preflight as op

DEVS = [Device(rank=0, device_id=4, ip="127.101.200.5", port=26000),
        Device(rank=1, device_id=5, ip="127.101.200.6", port=26000)]


def sim_answers(faults: NetFaults, devs=DEVS) -> dict:
    return {(d.rank, c): answer(c, d.device_id, d.rank, d.ip, faults) for d in devs for c in pf.CHECKS}


@pytest.mark.parametrize("check,text,value", [
    ("link", "link status: UP\n", "UP"),
    ("link", "link status: DOWN", "DOWN"),
    ("net_health", "net health status: Success\n", "Success"),
    ("net_health", "net health status: Socket fail\n", "Socket fail"),
    ("netdetect", "netdetect address: 10.0.0.1\n", "10.0.0.1"),
    ("gateway", "default gateway:10.0.0.254, ifname:eth0\n", "10.0.0.254"),
    ("gateway", "default gateway:, ifname:eth0\n", ""),
    ("ip", "ipaddr:10.0.0.8\nnetmask:255.255.255.0\n", "10.0.0.8"),
    ("tls", "dev_id:0, tls switch[1](0:disable, 1:enable), tls preconfigured[1]", "1"),
    ("link", "", None),
])
def test_answers_parse(check, text, value):
    assert pf.parse(check, text) == value


def test_judge_names_what_is_wrong():
    assert pf.judge("link", "UP") == "" and pf.judge("link", "DOWN") == "link DOWN"
    assert pf.judge("net_health", "Success") == "" and "Fault" in pf.judge("net_health", "Fault")
    assert pf.judge("gateway", "") == "no gateway address" and pf.judge("gateway", "0.0.0.0")
    assert pf.judge("ip", "10.0.0.8", "10.0.0.9") == "ip 10.0.0.8, expected 10.0.0.9"
    assert pf.judge("ip", "10.0.0.8", "10.0.0.8") == "" and pf.judge("tls", None) == "no answer"


def test_the_simulated_devices_pass_without_faults():
    rep = evaluate(DEVS, sim_answers(NetFaults()), "sim", True, 1.0)
    assert rep.state == "passed" and rep.failures == [] and rep.tls_switch == "0" and rep.devices == 2
    assert gateway_of("127.101.200.5") == "127.101.200.254"


@pytest.mark.parametrize("faults,checks", [
    (NetFaults(link_down=(1,)), {(5, "link"), (5, "net_health")}),
    (NetFaults(no_gateway=True), {(4, "gateway"), (5, "gateway"), (4, "net_health"), (5, "net_health")}),
])
def test_each_fault_fails_its_check_on_its_device(faults, checks):
    rep = evaluate(DEVS, sim_answers(faults), "sim", True, 1.0)
    assert rep.state == "failed" and {(f.device_id, f.check) for f in rep.failures} == checks


def test_a_wrong_device_ip_and_tls_differing_within_the_pod_fail():
    answers = sim_answers(NetFaults())
    answers[(1, "ip")] = "ipaddr:127.9.9.9\n"
    answers[(0, "tls")] = answer("tls", 4, 0, DEVS[0].ip, NetFaults(tls_switch=1))
    rep = evaluate(DEVS, answers, "sim", True, 1.0)
    assert {(f.device_id, f.check) for f in rep.failures} == {(5, "ip"), (5, "tls")}
    assert rep.tls_switch == "" and "differs" in [f for f in rep.failures if f.check == "tls"][0].message


async def until(ok, timeout: float = 30.0) -> None:
    """Until `ok()` holds (what the test observes), bounded."""
    async def poll() -> None:
        while not ok():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


def test_a_pod_gate_waits_until_fixed_and_a_fault_at_run_time_is_seen():
    async def run():
        pre = Preflight(Devices(source="annotation", ranks=tuple(DEVS)), True, "sim", None, lambda: 5.0)
        pre.faults = NetFaults(link_down=(0,))
        stop = asyncio.Event()
        gate = asyncio.create_task(pre.gate(stop))
        await until(lambda: pre.report.state != "pending")
        assert not gate.done() and pre.report.state == "failed"
        assert pre.set_faults(FaultsRequest(preflight_link_down=[]))
        await asyncio.wait_for(gate, 10)
        assert pre.report.state == "passed" and pre.report.checked_at == 5.0
        pre.start(stop)
        pre.set_faults(FaultsRequest(preflight_no_gateway=True))
        await until(lambda: pre.fails >= 1)
        assert pre.report.state == "passed", "one failed run of a serving pod holds nothing"
        await until(lambda: pre.report.state == "failed")   # the second run, RETRY_S later
        assert {f.check for f in pre.report.failures} >= {"gateway"} and held(pre)
        assert not pre.set_faults(FaultsRequest(pull_fail=True))
        stop.set()   # the recheck loop ends with the pod
        await asyncio.wait_for(pre.task, 5)
    asyncio.run(run())


def test_off_or_a_pod_without_devices_runs_none_and_a_bad_mode_is_named():
    devs = Devices(source="annotation", ranks=tuple(DEVS))
    assert Preflight.from_env(devs, lambda: 0, {"PD_PREFLIGHT": "off", "PD_TENSOR_PARALLEL": "2"}) is None
    assert Preflight.from_env(devs, lambda: 0, {}) is None
    rep = Preflight.from_env(devs, lambda: 0, {"PD_PREFLIGHT": "report", "PD_TENSOR_PARALLEL": "2"})
    assert rep is not None and not rep.enforced and rep.source == "sim"
    real = Preflight.from_env(devs, lambda: 0, {"PD_TENSOR_PARALLEL": "2", "PD_BACKEND": "llm-datadist",
                                                "PD_HCCN_TOOL": "/nonexistent/hccn_tool"})
    assert real is not None and real.source == "hccn_tool" and real.enforced
    with pytest.raises(ValueError, match="PD_PREFLIGHT"):
        Preflight.from_env(devs, lambda: 0, {"PD_PREFLIGHT": "maybe", "PD_TENSOR_PARALLEL": "2"})


def test_a_missing_hccn_tool_fails_the_preflight_and_says_so():
    devs = Devices(source="annotation", ranks=tuple(DEVS))
    real = Preflight.from_env(devs, lambda: 0, {"PD_TENSOR_PARALLEL": "2", "PD_BACKEND": "llm-datadist",
                                                "PD_HCCN_TOOL": "/nonexistent/hccn_tool"})
    assert real is not None
    rep = asyncio.run(real.run())
    assert rep.state == "failed" and [f.check for f in rep.failures] == ["hccn_tool"]
    assert "spec.ascend.driverPath" in rep.failures[0].message and "No such file" in rep.failures[0].value


# ---- the operator's condition ----------------------------------------------------------------

def pod(name: str, node: str) -> dict:
    return {"metadata": {"name": name}, "spec": {"nodeName": node}}


def status(name: str, report: PreflightReport | None) -> AgentStatus:
    return AgentStatus(pod=name, role="prompt", cluster_id=0, boot_id="b", backend="sim", initialized=True,
                       ip="127.0.0.1", port=26000, model_id=0, preflight=report)


def passed(tls: str = "0") -> PreflightReport:
    return PreflightReport(state="passed", devices=2, tls_switch=tls)


PODS = [pod("x-prefill-0", "node-0"), pod("x-decoder-0", "node-1"), pod("x-decoder-1", "node-2")]


def test_all_passed_is_true_and_holds_none():
    reports = {p["metadata"]["name"]: status(p["metadata"]["name"], passed()) for p in PODS}
    v, held = op.verdict(PODS, reports, "Enforce")
    assert v == (True, "Passed", "3 pods on 3 nodes passed (TLS switch 0 everywhere)") and held == frozenset()


def test_a_failed_check_names_pod_node_device_check_and_runbook_and_holds_the_pod():
    rep = evaluate(DEVS, sim_answers(NetFaults(link_down=(0,))), "sim", True, 1.0)
    reports = {"x-prefill-0": status("x-prefill-0", passed()), "x-decoder-0": status("x-decoder-0", rep)}
    v, held = op.verdict(PODS, reports, "Enforce")
    assert v is not None and v[0] is False and v[1] == "CheckFailed"
    assert "x-decoder-0 on node node-1: device 4 link: link DOWN" in v[2] and pf.RUNBOOK in v[2]
    assert held == {"x-decoder-0"}
    v, held = op.verdict(PODS, reports, "Report")
    assert v is not None and v[1] == "CheckFailed" and "reported only" in v[2] and held == frozenset()


def test_a_tls_switch_off_the_common_one_names_its_node_and_holds_its_pod():
    reports = {"x-prefill-0": status("x-prefill-0", passed("0")), "x-decoder-0": status("x-decoder-0", passed("0")),
               "x-decoder-1": status("x-decoder-1", passed("1"))}
    v, held = op.verdict(PODS, reports, "Enforce")
    assert v is not None and v[:2] == (False, "TLSDiffers")
    assert "TLS switch 1 on node-2 (x-decoder-1)" in v[2] and "other nodes run 0" in v[2]
    assert held == {"x-decoder-1"}


def test_common_tls_counts_nodes_then_pods_then_prefers_the_default():
    nodes = {"a": "n0", "b": "n0", "c": "n1"}
    assert op.common_tls({"a": "1", "b": "1", "c": "0"}, nodes) == "1"   # nodes tie 1 to 1, then pods: 2 to 1
    assert op.common_tls({"a": "1", "b": "0", "c": "0"}, {"a": "n0", "b": "n1", "c": "n2"}) == "0"   # nodes 2 to 1
    assert op.common_tls({"a": "1", "c": "0"}, nodes) == "0"                     # a full tie: the default


def test_pending_off_and_pods_without_devices():
    assert op.verdict(PODS, {}, "Enforce")[0] == ("Unknown", "Pending",
                                                  "no engine pod has reported its network preflight yet")
    assert op.verdict(PODS, {"x-prefill-0": status("x-prefill-0", None)}, "Enforce") == (None, frozenset())
    assert op.verdict(PODS, {"x-prefill-0": status("x-prefill-0", passed())}, "Off") == (None, frozenset())
    v, _ = op.verdict(PODS, {"x-prefill-0": status("x-prefill-0", PreflightReport())}, "Enforce")
    assert v is not None and v[:2] == ("Unknown", "Pending") and "x-prefill-0" in v[2]


def test_the_pods_get_the_mode_only_off_the_default_and_the_simulated_faults():
    from tests.unit.test_engine_pod import pod_of, spec_with
    from tests.unit.test_operator_pure import SPEC

    def env(spec) -> dict:
        return {e["name"]: e.get("value") for e in pod_of(spec)["containers"][0]["env"]}
    npus = {"replicas": 1, "resources": {"limits": {"huawei.com/Ascend910": 2}}, "tensorParallel": 2}
    default = env(spec_with(prefill=npus))
    assert "PD_TENSOR_PARALLEL" in default and "PD_PREFLIGHT" not in default   # no roll for the default
    report = env(spec_with(prefill=npus, datadist={**SPEC.get("datadist", {}), "preflight": "Report"}))
    assert report["PD_PREFLIGHT"] == "report"
    faulted = env(spec_with(prefill=npus, sim={"faults": {"preflightLinkDown": [0, 1], "preflightNoGateway": True}}))
    assert faulted["PD_SIM_FAULT_PREFLIGHT_LINK_DOWN"] == "0,1" and faulted["PD_SIM_FAULT_PREFLIGHT_NO_GATEWAY"] == "1"
    assert "PD_SIM_FAULT_PREFLIGHT_TLS_SWITCH" not in faulted
    assert NetFaults.from_env(faulted) == NetFaults(link_down=(0, 1), no_gateway=True)


def test_an_unfit_decoder_unlinks_everything_and_an_unfit_prefill_is_unlinked_by_every_decoder():
    from dataclasses import replace

    from pd_operator import links
    from tests.unit.test_operator_pure import eng, up
    p0, p1, d0, d1 = eng("p0", "prefill", 0), eng("p1", "prefill", 1), eng("d0", "decoder", 1000), \
        eng("d1", "decoder", 1001)
    reported = {"d0": [up(p0), up(p1)], "d1": [up(p0), up(p1)]}
    assert links.plan([p0, p1, d0, d1], reported) == []
    [plan] = links.plan([p0, p1, replace(d0, unfit=True), d1], reported)
    assert plan.decoder.pod == "d0" and plan.unlink == [up(p0), up(p1)] and not plan.link
    plans = links.plan([replace(p1, unfit=True), p0, d0, d1], reported)
    assert {p.decoder.pod: p.unlink for p in plans} == {"d0": [up(p1)], "d1": [up(p1)]}
    assert links.counts([p0, p1, replace(d0, unfit=True), d1], reported)[0] == 2   # d1's two; none expected of d0


# ---- A3 superpods ------------------------------------------------------------------------------

def test_the_annotation_gives_the_superpod_and_the_report_carries_it(tmp_path):
    import json

    from pd_agent.devices import resolve, superpod_of
    ann = {"pod_name": "p", "server_id": "10.0.0.1", "super_pod_id": 3,
           "devices": [{"device_id": "0", "device_ip": "127.1.200.1"}]}
    assert superpod_of(json.dumps(ann)) == "3" and superpod_of(json.dumps({**ann, "super_pod_id": "1"})) == "1"
    assert superpod_of(json.dumps({"devices": []})) == "" and superpod_of("{bad") == ""
    assert superpod_of(json.dumps({**ann, "super_pod_id": -1})) == "" and superpod_of('{"super_pod_id": true}') == ""
    f = tmp_path / "ann"
    f.write_text(json.dumps(ann))
    devs = resolve(1, 26000, {"PD_DEVICE_ANNOTATION_FILE": str(f)}, "10.0.0.9", "sim")
    assert devs.superpod == "3" and devs.source == "annotation"
    pre = Preflight(devs, True, "sim", None, lambda: 1.0)
    assert pre.report.superpod == "3" and asyncio.run(pre.run()).superpod == "3"


def test_superpod_pairs_count_linked_pod_pairs_with_both_superpods_known():
    def st(pod, sp):
        return status(pod, PreflightReport(state="passed", superpod=sp))
    reports = {"p0": st("p0", "0"), "p1": st("p1", "1"), "d0": st("d0", "0"), "d1": st("d1", ""),
               "d2": st("d2", "1")}
    reported = {"d0": [{"name": "p0"}, {"name": "p1"}], "d1": [{"name": "p0"}], "d2": [{"name": "p1"}]}
    assert op.superpod_pairs(reported, reports) == {"within": 2, "across": 1}
    assert op.superpod_pairs(reported, {"p0": status("p0", passed())}) is None


def test_a_decoder_in_the_prefills_superpod_is_preferred_unless_busier():
    from pd_router.routing import Fleet

    def eng(url, sp, running=0):
        return {"url": url, "cluster_id": hash(url) % 1000, "links": [{"cluster_id": 7}],
                "load": {"running": running, "queue_depth": 0, "kv_used_bytes": 0},
                "preflight": {"superpod": sp}}
    fleet = Fleet(None, None, lambda: [])   # type: ignore[arg-type]
    p = {**eng("p", "0"), "cluster_id": 7}
    fleet.decoders = [eng("d-far", "1"), eng("d-near", "0")]
    picks = [fleet.pick_decoder(p, set())["url"] for _ in range(4)]
    assert picks[0] == "d-near" and fleet.pulls["within"] >= 2     # each pick counts as sent: they alternate
    fleet = Fleet(None, None, lambda: [])   # type: ignore[arg-type]
    fleet.decoders = [eng("d-far", "1"), eng("d-near", "0", running=3)]
    assert fleet.pick_decoder(p, set())["url"] == "d-far" and fleet.pulls == {"within": 0, "across": 1, "unknown": 0}
    fleet.decoders = [eng("d-far", ""), eng("d-near", "")]
    fleet.pick_decoder(p, set())
    assert fleet.pulls["unknown"] == 1


def test_the_switcher_takes_from_the_superpod_with_most_of_the_role_at_no_cost():
    from pd_operator.switch import Candidate, Limits, choose

    def c(pod, role, sp, in_flight=0):
        return Candidate(pod=pod, uid=pod, group=role, role=role, available=True, switchable=True,
                         in_flight=in_flight, superpod=sp)
    # superpod 0: 2 decoders, 1 prefill; superpod 1: 1 decoder, 1 prefill -> a decoder of superpod 0 moves
    members = [c("a-d0", "decoder", "1"), c("b-d1", "decoder", "0"), c("c-d2", "decoder", "0"),
               c("p0", "prefill", "0"), c("p1", "prefill", "1")]
    d = choose(members, [], 3, Limits(), 0.0, "test")
    assert [s.pod for s in d.starts] == ["b-d1"]
    # fewer in flight still comes first
    members[0] = c("a-d0", "decoder", "1", in_flight=0)
    members[1] = c("b-d1", "decoder", "0", in_flight=2)
    members[2] = c("c-d2", "decoder", "0", in_flight=2)
    assert [s.pod for s in choose(members, [], 3, Limits(), 0.0, "test").starts] == ["a-d0"]


def test_hccn_tool_answers_are_read_from_the_real_tool(tmp_path):
    import stat
    tool = tmp_path / "hccn_tool"
    tool.write_text("#!/bin/sh\ncase \"$3\" in\n -link) echo 'link status: DOWN';;\n -net_health) echo 'net health "
                    "status: Success';;\n -netdetect) echo 'netdetect address: 10.0.0.254';;\n -gateway) echo "
                    "'default gateway:10.0.0.254, ifname:eth0';;\n -ip) echo \"ipaddr:127.101.200.$(($2+1))\";;\n"
                    " -tls) echo 'dev_id:0, tls switch[0](0:disable, 1:enable)';;\nesac\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    devs = Devices(source="annotation", ranks=tuple(DEVS))
    real = Preflight.from_env(devs, lambda: 0, {"PD_TENSOR_PARALLEL": "2", "PD_BACKEND": "llm-datadist",
                                                "PD_HCCN_TOOL": str(tool)})
    assert real is not None
    rep = asyncio.run(real.run())
    assert {(f.device_id, f.check) for f in rep.failures} == {(4, "link"), (5, "link")}, rep.failures
    assert rep.tls_switch == "0" and rep.source == "hccn_tool"


def test_a_report_out_of_bounds_is_refused_and_the_agent_keeps_its_own_within_them():
    import pydantic
    with pytest.raises(pydantic.ValidationError):
        PreflightReport(tls_switch="1" * 100)
    with pytest.raises(pydantic.ValidationError):
        status("p", PreflightReport(superpod="x" * 1000))
    answers = sim_answers(NetFaults())
    answers[(0, "ip")] = "ipaddr:" + "9" * 5000
    rep = evaluate(DEVS, answers, "sim", True, 1.0)
    [bad] = rep.failures
    assert bad.check == "ip" and len(bad.value) == 256 and len(bad.message) <= 512
    from pd_agent.devices import superpod_of
    assert superpod_of('{"super_pod_id": "' + "9" * 100 + '"}') == ""
