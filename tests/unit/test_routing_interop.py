"""Routing interop (pure): llm-d's labels through a switch, the wait before the drain, the
InferencePools a deployment keeps and their condition, and the model-server metrics' names."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from pd_contract.names import LLMD_ROLE, LLMD_SERVING, llmd_labels
from pd_operator import pools
from pd_operator.api import PDDeploymentSpec
from pd_operator.links import Engine
from pd_operator.rebalance import leave_pool_s, repairs
from pd_operator.switch import SWITCHING, Switch, View, advance

T0 = 1_800_000_000.0
OWNER = {"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDDeployment", "name": "m", "uid": "u", "controller": True}


def spec(**routing) -> PDDeploymentSpec:
    doc = {"image": "x", "model": {"name": "m", "kvCache": {"numLayers": 2, "numKvHeads": 2, "headDim": 8,
                                                            "tensorParallel": 1, "maxBatch": 2, "maxSeqLen": 64}}}
    if routing:
        doc["routing"] = routing
    return PDDeploymentSpec.model_validate(doc)


def pod(name: str, labels: dict, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "labels": labels},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


# ---- labels --------------------------------------------------------------------------------------

def test_llmd_labels_follow_the_role_label_and_go_while_switching():
    assert llmd_labels("prefill") == {LLMD_ROLE: "prefill", LLMD_SERVING: "true"}
    assert llmd_labels("decoder") == {LLMD_ROLE: "decode", LLMD_SERVING: "true"}
    assert llmd_labels(SWITCHING) == {LLMD_ROLE: None, LLMD_SERVING: None}


def test_a_pod_without_llmd_labels_is_repaired_and_one_with_them_is_left_alone():
    e = Engine(pod="p0", group="prefill", role="prefill", label="prefill", cluster_id=0, ip="1.1.1.1", port=1,
               agent_ok=True, engine_role="prefill", llmd_ok=False)
    assert [(i.kind, i.role) for i in repairs([e], [])] == [("label", "prefill")]
    ok = Engine(pod="p0", group="prefill", role="prefill", label="prefill", cluster_id=0, ip="1.1.1.1", port=1,
                agent_ok=True, engine_role="prefill", llmd_ok=True)
    assert repairs([ok], []) == []
    # left `switching` and drained (a switch whose record was lost): undrained first, then labelled
    left = Engine(pod="p0", group="prefill", role=SWITCHING, label=SWITCHING, cluster_id=0, ip="1.1.1.1", port=1,
                  agent_ok=True, engine_role="prefill", llmd_ok=True, draining=True)
    assert [(i.kind, i.role) for i in repairs([left], [])] == [("undrain", None), ("label", "prefill")]


# ---- the switch: labels go before the drain, come back after the undrain ---------------------------

def sw(step="Drain", t=T0) -> Switch:
    return Switch(pod="d1", uid="u1", from_="decoder", to="prefill", step=step, started=T0, step_started=t)


def view(**kw) -> View:
    base = dict(exists=True, uid="u1", label="decoder", assigned="decoder", agent_ok=True, engine_role="decoder",
                draining=False)
    return View(**{**base, **kw})


def kinds(its) -> list[tuple[str, str | None]]:
    return [(i.kind, i.role) for i in its]


def test_with_routing_the_drain_waits_for_pools_to_see_the_labels_go():
    s, its, _ = advance(sw(), view(), T0 + 0.1, 30, leave_pool_s=2.0)
    assert kinds(its) == [("label", SWITCHING)] and not s.unpooled   # labels first, no drain yet
    # the label patch was late (a failed patch, a restart): the wait counts from when it is seen gone
    s, its, _ = advance(s, view(label=SWITCHING), T0 + 5.0, 30, leave_pool_s=2.0)
    assert kinds(its) == [] and s.unpooled == T0 + 5.0
    assert Switch.from_status(s.to_status()).unpooled == pytest.approx(T0 + 5.0)   # survives a restart
    s, its, _ = advance(s, view(label=SWITCHING), T0 + 6.0, 30, leave_pool_s=2.0)
    assert kinds(its) == []                                           # still in the window
    s, its, _ = advance(s, view(label=SWITCHING), T0 + 7.1, 30, leave_pool_s=2.0)
    assert kinds(its) == [("drain", None)]
    # the drain timeout is the drain's own: counted from the end of the wait
    s, _, out = advance(s, view(label=SWITCHING, draining=True, in_flight=1), T0 + 7.0 + 29.5, 30, leave_pool_s=2.0)
    assert out is None and s.step == "Drain"
    s, _, out = advance(s, view(label=SWITCHING, draining=True, in_flight=1), T0 + 7.0 + 30.5, 30, leave_pool_s=2.0)
    assert s.step == "Abort" and "drain timed out" in s.message
    # status.lastSwitch says when the pod left the pools (what a router's own checks compare with)
    _, _, ended = advance(s, view(label="decoder", draining=False), T0 + 40, 30, leave_pool_s=2.0)
    assert ended is not None and ended.record()["unpooledAt"] == "2027-01-15T08:00:05.000Z"
    # without routing: label and drain in the same pass, as before
    _, its, _ = advance(sw(), view(), T0 + 0.1, 30)
    assert kinds(its) == [("label", SWITCHING), ("drain", None)]


def test_undrain_comes_before_the_new_role_label_and_abort_likewise():
    undrain = sw(step="Undrain")
    obs = dict(label=SWITCHING, engine_role="prefill", assigned="prefill", draining=True)
    _, its, _ = advance(undrain, view(**obs), T0 + 5, 30)
    assert kinds(its) == [("undrain", None), ("label", "prefill")]
    # an agent not heard this pass (the observer knows nothing of its drain): the label waits for
    # its word that it serves
    _, its, _ = advance(undrain, view(**{**obs, "agent_ok": False, "draining": None}), T0 + 5, 30)
    assert kinds(its) == []
    aborting = Switch(pod="d1", uid="u1", from_="decoder", to="prefill", step="Abort", started=T0, step_started=T0)
    _, its, _ = advance(aborting, view(label=SWITCHING, agent_ok=False, draining=None), T0 + 5, 30)
    assert kinds(its) == []
    aborting = Switch(pod="d1", uid="u1", from_="decoder", to="prefill", step="Abort", started=T0, step_started=T0)
    _, its, _ = advance(aborting, view(label=SWITCHING, draining=True), T0 + 5, 30)
    assert kinds(its) == [("undrain", None), ("label", "decoder")]


def test_leave_pool_seconds_only_with_routing():
    assert leave_pool_s(spec()) == 0.0
    assert leave_pool_s(spec(leavePoolSeconds=3)) == 3.0
    assert leave_pool_s(spec(inferencePool=True)) == 2.0


# ---- pools -------------------------------------------------------------------------------------------

def test_without_the_crd_nothing_is_created_and_the_condition_says_why():
    p = pools.plan("m", "ns", OWNER, spec(inferencePool=True), False, {}, [])
    assert p.apply == () and p.delete == ()
    ok, reason, msg = p.verdict
    assert (ok, reason) == (False, "CRDNotInstalled")
    assert "inferencepools.inference.networking.k8s.io" in msg and "spec.routing.inferencePool" in msg


def test_a_deployment_pool_selects_serving_pods_with_the_spec_s_ports_and_picker():
    s = spec(inferencePool=True, targetPorts=[8000], endpointPickerRef={"name": "epp", "port": 9010})
    p = pools.plan("m", "ns", OWNER, s, True, {}, [])
    [obj] = p.apply
    assert obj["kind"] == "InferencePool" and obj["apiVersion"] == "inference.networking.k8s.io/v1"
    assert obj["metadata"]["name"] == "m" and obj["metadata"]["ownerReferences"] == [OWNER]
    assert obj["spec"]["selector"]["matchLabels"] == {"pdoperator.io/deployment": "m", LLMD_SERVING: "true"}
    assert obj["spec"]["targetPorts"] == [{"number": 8000}]
    assert obj["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "epp",
                                                "port": {"number": 9010}, "failureMode": "FailClose"}
    assert p.verdict[:2] == (False, "Applying")


def test_role_pools_count_their_serving_pods_and_a_stored_pool_is_not_applied_again():
    s = spec(inferencePool=True, poolScope="Role",
             endpointPickerRefs={"prefill": {"name": "epp-p"}, "decode": {"name": "epp-d"}})
    want = {o["metadata"]["name"]: o for o in pools.desired("m", "ns", OWNER, s)}
    assert sorted(want) == ["m-decode", "m-prefill"]
    assert want["m-decode"]["spec"]["selector"]["matchLabels"][LLMD_ROLE] == "decode"
    assert want["m-prefill"]["spec"]["endpointPickerRef"]["name"] == "epp-p"
    base = {"pdoperator.io/deployment": "m"}
    live = [pod("p0", {**base, **llmd_labels("prefill")}), pod("p1", {**base, **llmd_labels(SWITCHING)}),
            pod("d0", {**base, **llmd_labels("decoder")}), pod("d1", {**base, **llmd_labels("decoder")}, ready=False)]
    p = pools.plan("m", "ns", OWNER, s, True, want.values(), live)
    assert p.apply == () and p.delete == ()
    assert p.verdict == (True, "Kept", "InferencePools kept: m-prefill: 1 serving pod; m-decode: 1 serving pod")
    # the scope changed back: the Role pools go, the Deployment pool comes
    p = pools.plan("m", "ns", OWNER, spec(inferencePool=True), True, want.values(), live)
    assert [o["metadata"]["name"] for o in p.apply] == ["m"] and p.delete == ("m-decode", "m-prefill")


def test_pools_go_when_routing_is_turned_off_and_nothing_is_asked_without_the_api():
    kept = [{"metadata": {"name": "m", "ownerReferences": [OWNER | {"controller": True}]}},
            {"metadata": {"name": "theirs", "labels": {"pdoperator.io/deployment": "m"}}}]
    assert pools.plan("m", "ns", OWNER, spec(), True, kept, []) == pools.PoolPlan(delete=("m",))
    assert pools.plan("m", "ns", OWNER, spec(), None, (), []) == pools.PoolPlan()


def test_a_pool_of_the_same_name_not_ours_is_never_written_and_the_condition_names_it():
    other = {"metadata": {"name": "m", "ownerReferences": [{"kind": "HelmRelease", "name": "gw", "uid": "x",
                                                            "controller": True}]}, "spec": {}}
    p = pools.plan("m", "ns", OWNER, spec(inferencePool=True), True, [other], [])
    assert p.apply == () and p.delete == ()
    assert p.verdict[:2] == (False, "NameTaken") and "controlled by HelmRelease gw" in p.verdict[2]
    unowned = {"metadata": {"name": "m"}, "spec": {}}
    assert pools.plan("m", "ns", OWNER, spec(inferencePool=True), True, [unowned], []).verdict[1] == "NameTaken"


def test_fields_others_set_on_our_pool_do_not_make_it_apply_again_and_failures_are_named():
    s = spec(inferencePool=True, targetPorts=[8000])
    [want] = pools.desired("m", "ns", OWNER, s)
    stored = {**want, "metadata": {**want["metadata"], "ownerReferences": [OWNER | {"controller": True}]},
              "spec": {**want["spec"], "endpointPickerRef": {"name": "added-by-hand", "port": {"number": 9002}}}}
    assert pools.plan("m", "ns", OWNER, s, True, [stored], []).apply == ()
    changed = {**stored, "spec": {**stored["spec"], "targetPorts": [{"number": 9000}]}}
    p = pools.plan("m", "ns", OWNER, s, True, [changed], [], "InferencePool m not applied: 403 forbidden")
    assert len(p.apply) == 1 and p.verdict == (False, "ApplyFailed", "InferencePool m not applied: 403 forbidden")
    p = pools.plan("m", "ns", OWNER, s, True, None, [], "cannot read InferencePools: 403 forbidden")
    assert p.apply == () and p.verdict[:2] == (False, "Unknown") and "403" in p.verdict[2]


def test_picker_refs_must_match_the_scope_naming_the_field():
    with pytest.raises(ValidationError, match="ge|less|greater"):
        spec(inferencePool=True, leavePoolSeconds=-1)
    # the CEL rules are the API server's; their messages name the field
    rules = PDDeploymentSpec.model_json_schema()["$defs"]["Routing"]["x-kubernetes-validations"]
    assert {r["fieldPath"] for r in rules} == {".endpointPickerRef", ".endpointPickerRefs", ".targetPorts"}


# ---- metrics -------------------------------------------------------------------------------------------

def test_model_server_metrics_carry_the_protocol_names_and_follow_the_load():
    from pd_agent.metrics import AgentMetrics
    m = AgentMetrics()
    desc = {"num_tensors": 4, "shape": [4, 256, 1, 64], "paged": {"num_blocks": 512, "block_size": 128}}
    m.model_server("m", waiting=3, running=2, kv_used=25, kv_capacity=100, cache_desc=desc)
    m.model_server("m", waiting=5, running=1, kv_used=50, kv_capacity=100, cache_desc=desc)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    assert got[("vllm:num_requests_waiting", (("model_name", "m"),))] == 5
    assert got[("vllm:num_requests_running", (("model_name", "m"),))] == 1
    assert got[("vllm:kv_cache_usage_perc", (("model_name", "m"),))] == 0.5
    info = [k for k in got if k[0] == "vllm:cache_config_info"]
    assert info == [("vllm:cache_config_info", (("block_size", "128"), ("model_name", "m"),
                                                ("num_gpu_blocks", "512")))]
