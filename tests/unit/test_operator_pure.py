"""Builders, CacheDesc derivation, link planning, status and the generated CRD."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pd_operator import builders, conditions, crdgen, gateway, links
from pd_operator.api import KvCache, parse_spec
from pd_operator.cachedesc import derive
from pd_operator.members import member_of, with_report
from pd_operator.status import Observed, build_status

AT = "2026-12-05T00:00:00Z"   # the pass's clock, as decide gives it

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())["spec"]


# ---- CacheDesc --------------------------------------------------------------------------

def test_gqa_llama70b():
    d = derive(KvCache(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16", tensor_parallel=8,
                       max_batch=4, max_seq_len=2048))
    assert d.num_tensors == 160 and d.shape == [4, 2048, 1, 128] and d.data_type == "DT_BF16"
    assert d.bytes_per_token == 320 * 1024  # Llama-3-70B: 320 KiB per token
    assert d.cache_bytes == 160 * 4 * 2048 * 1 * 128 * 2


def test_gqa_llama8b_bytes_per_token():
    assert derive(KvCache(num_layers=32, num_kv_heads=8, head_dim=128)).bytes_per_token == 128 * 1024


def test_tp_larger_than_kv_heads_keeps_one_head():
    d = derive(KvCache(num_layers=2, num_kv_heads=4, head_dim=64, tensor_parallel=8))
    assert d.shape[2] == 1


def test_mla_not_split_by_tp():
    d = derive(KvCache(attention="MLA", num_layers=61, latent_dim=576, tensor_parallel=8, max_batch=2,
                       max_seq_len=4096, dtype="bfloat16"))
    assert d.num_tensors == 61 and d.shape == [2, 4096, 1, 576]
    assert d.bytes_per_token == 61 * 576 * 2


def test_mla_needs_latent_dim():
    with pytest.raises(ValueError):
        derive(KvCache(attention="MLA", num_layers=2))


def test_paged_blocks_shape():
    d = derive(KvCache(num_layers=2, num_kv_heads=8, head_dim=128, tensor_parallel=2,
                       paged={"block_size": 128, "num_blocks": 64}))
    assert d.blocks_shape == [64, 128, 4, 128]
    assert d.cache_bytes == 4 * 64 * 128 * 4 * 128 * 2
    assert d.agent_json()["paged"] == {"num_blocks": 64, "block_size": 128}


def test_sim_memory_scale():
    d = derive(KvCache(num_layers=80, num_kv_heads=8, head_dim=128, tensor_parallel=8, max_batch=4))
    assert d.sim_memory_scale(64 << 20) == -(-d.cache_bytes // (64 << 20))
    assert derive(KvCache(num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=8)).sim_memory_scale() == 1


# ---- builders ---------------------------------------------------------------------------

def children():
    return builders.desired_children("llm", "ns", "uid-1", parse_spec(SPEC))


def by_kind_name(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_children_set_and_owner():
    objs = by_kind_name(children())
    assert set(objs) == {("ConfigMap", "llm-config"), ("Service", "llm-prefill"), ("Service", "llm-decoder"),
                         ("Service", "llm-prefill-role"), ("Service", "llm-decoder-role"),
                         ("StatefulSet", "llm-prefill"), ("StatefulSet", "llm-decoder"),
                         ("NetworkPolicy", "llm-engines"),
                         ("PodDisruptionBudget", "llm-prefill"), ("PodDisruptionBudget", "llm-decoder")}
    for o in objs.values():
        ref = o["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "uid-1" and ref["controller"] and ref["kind"] == "PDDeployment"


def test_gateway_objects_least_privilege_and_network_policy():
    from pd_operator import gateway
    spec = parse_spec({**SPEC, "image": "reg:5000/org/pd-sim-agent:0.3", "gateway": {
        "enabled": True, "apiKeysSecret": "llm-keys", "rateLimits": {"team-b": 60}}})
    objs = by_kind_name(builders.desired_children("llm", "ns", "uid-1", spec))
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"):
        assert (kind, "llm-gateway") in objs
    role = objs[("Role", "llm-gateway")]["rules"]
    assert role == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                    {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get"],
                     "resourceNames": ["llm-prefill", "llm-decoder"]},
                    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["llm-keys"]}]
    dep = objs[("Deployment", "llm-gateway")]
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"]["pdoperator.io/gateway"] == "llm"
    assert "pdoperator.io/deployment" not in pod["metadata"]["labels"], "not an engine pod"
    c = pod["spec"]["containers"][0]
    assert c["image"] == "reg:5000/org/pd-gateway:0.3" and c["ports"][0]["containerPort"] == 8000
    env = {e["name"]: e for e in c["env"]}
    assert env["PD_AGENT_DATA_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "llm-agent-data-token"
    assert "PD_AGENT_TOKEN" not in env, "the gateway never holds the control token"
    assert env["PD_GATEWAY_RPM"]["value"] == '{"team-b": 60}'
    np = objs[("NetworkPolicy", "llm-engines")]["spec"]
    agent_rule, datadist_rule, metrics_rule = np["ingress"]
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": 9091}]   # the monitoring namespace's
    assert agent_rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert {"podSelector": {"matchLabels": {"pdoperator.io/gateway": "llm"}}} in agent_rule["from"]
    assert datadist_rule == {"from": [{"podSelector": {"matchLabels": {"pdoperator.io/deployment": "llm"}}}],
                             "ports": [{"protocol": "TCP", "port": 26000}]}
    assert gateway.gateway_image(parse_spec({**SPEC, "image": "pd-sim-agent"})) == "pd-gateway"
    with pytest.raises(ValueError):
        parse_spec({**SPEC, "gateway": {"rateLimits": {"x": 0}}})


def test_sim_settings_and_drain_timeout_reach_the_pods():
    spec = parse_spec({**SPEC, "drainTimeoutSeconds": 45, "sim": {
        "timeScale": 0.1, "engineStartSeconds": 2, "timing": {"prefillC": 5},
        "faults": {"pullDelayMs": 200, "pullFail": True}}})
    sts = builders.statefulset("x", "ns", spec, "prefill", builders.owner_reference("x", "u"))
    pod = sts["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["PD_SIM_TIME_SCALE"] == "0.1" and env["PD_SIM_ENGINE_START_S"] == "2.0"
    assert env["PD_SIM_PREFILL_C"] == "5.0" and "PD_SIM_DECODE_C" not in env
    assert env["PD_SIM_FAULT_PULL_DELAY_MS"] == "200" and env["PD_SIM_FAULT_PULL_FAIL"] == "1"
    assert env["PD_DRAIN_TIMEOUT_S"] == "45"
    assert pod["terminationGracePeriodSeconds"] == 45 + builders.TERMINATION_MARGIN_S
    # the agent and the simulator read these names back
    from llm_datadist_sim.faults import Faults
    from pd_agent.identity import Identity
    from pd_agent.timing import TimingModel
    assert TimingModel.from_env(env).time_scale == 0.1 and TimingModel.from_env(env).prefill_c == 5
    f = Faults.from_env(env)
    assert f.pull_delay_ms == 200 and f.pull_fail is True
    # the role comes from the assigned-role annotation (the downward API), "prefill" meaning prompt
    role_ref = next(e for e in pod["containers"][0]["env"] if e["name"] == "LLM_DATADIST_ROLE")
    assert role_ref["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{builders.ANNOTATION_ROLE}']"
    assert sts["spec"]["template"]["metadata"]["annotations"][builders.ANNOTATION_ROLE] == "prefill"
    ident = Identity.from_env({**env, "LLM_DATADIST_CLUSTER_ID": "3", "LLM_DATADIST_ROLE": "prefill"})
    assert ident.drain_timeout_s == 45 and ident.engine_start_s == 2 and ident.role == "prompt"
    assert ident.switchable is False  # no spec.rebalance: the engine is not initialised to switch


def test_statefulset_shape():
    sts = by_kind_name(children())[("StatefulSet", "llm-decoder")]
    spec = sts["spec"]
    assert spec["podManagementPolicy"] == "Parallel" and spec["replicas"] == 2
    assert spec["selector"]["matchLabels"] == {"pdoperator.io/deployment": "llm", "pdoperator.io/group": "decoder"}
    assert "pdoperator.io/role" not in spec["selector"]["matchLabels"]
    tmpl = spec["template"]
    assert tmpl["metadata"]["labels"]["pdoperator.io/role"] == "decoder"
    c = tmpl["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert tmpl["metadata"]["annotations"]["pdoperator.io/assigned-role"] == "decoder"
    assert "pdoperator.io/assigned-role" in env["LLM_DATADIST_ROLE"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert env["LLM_DATADIST_CLUSTER_ID_BASE"]["value"] == "1000"
    assert env["LLM_DATADIST_POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["LLM_DATADIST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["LLM_DATADIST_PORT"]["value"] == "26000"
    assert env["LLM_DATADIST_CACHE_DESC"]["valueFrom"]["configMapKeyRef"] == {"name": "llm-config", "key": "cacheDesc"}
    assert env["PD_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "llm-agent-token"
    assert env["PD_AGENT_PEER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "llm-agent-peer-token", "key": "token", "optional": True}
    # the spec's NPU limit, and a default for what it leaves unset (TP 1: one rank's worth)
    assert c["resources"] == {"limits": {"huawei.com/Ascend910": 1, "cpu": "1", "memory": "1024Mi",
                                         "ephemeral-storage": "256Mi"},
                              "requests": {"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "64Mi"}}
    assert tmpl["spec"]["automountServiceAccountToken"] is False   # engines never call the API server
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # not readiness's; a TCP check, so an agent image from before /livez is not restarted for a 404
    assert c["livenessProbe"]["tcpSocket"] == {"port": "http"} and "httpGet" not in c["livenessProbe"]
    prefill = by_kind_name(children())[("StatefulSet", "llm-prefill")]
    penv = {e["name"]: e for e in prefill["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert prefill["spec"]["template"]["metadata"]["annotations"]["pdoperator.io/assigned-role"] == "prefill"
    assert penv["LLM_DATADIST_CLUSTER_ID_BASE"]["value"] == "0"


def test_role_services_select_on_role():
    objs = by_kind_name(children())
    assert objs[("Service", "llm-prefill-role")]["spec"]["selector"] == {
        "pdoperator.io/deployment": "llm", "pdoperator.io/role": "prefill"}
    assert objs[("Service", "llm-decoder")]["spec"]["clusterIP"] == "None"


def test_config_hash_rolls_on_model_change():
    a = builders.config_hash(parse_spec(SPEC))
    changed = {**SPEC, "model": {**SPEC["model"], "kvCache": {**SPEC["model"]["kvCache"], "numLayers": 8}}}
    assert builders.config_hash(parse_spec(changed)) != a


def test_cluster_id_base_override():
    spec = parse_spec({**SPEC, "decoder": {"replicas": 2, "clusterIdBase": 5000}})
    assert builders.cluster_id(spec, "decoder", 3) == 5003 and builders.cluster_id(spec, "prefill", 1) == 1


def test_llm_datadist_backend_mounts_host_paths():
    spec = parse_spec({**SPEC, "backend": "llm-datadist"})
    sts = builders.statefulset("llm", "ns", spec, "prefill", builders.owner_reference("llm", "u"))
    pod = sts["spec"]["template"]["spec"]
    paths = [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v]
    assert "/etc/hccn.conf" in paths and "/usr/local/Ascend/driver" in paths
    assert all(m["readOnly"] for m in pod["containers"][0]["volumeMounts"] if m["name"] != "tmp")
    assert not any(e["name"] == "PD_SIM_MEMORY_SCALE" for e in pod["containers"][0]["env"])
    # the NPU driver's devices belong to its own user: the image's user stays unless the
    # operator's configuration names one (the chart's engine.runAsUser)
    assert "runAsUser" not in pod["securityContext"]
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("backend", ["sim", "llm-datadist"])
def test_every_pod_is_hardened(backend):
    spec = parse_spec({**SPEC, "backend": backend, "gateway": {"enabled": True, "apiKeysSecret": "keys"}})
    sts = builders.statefulset("x", "ns", spec, "decoder", builders.owner_reference("x", "u"))
    gw = next(o for o in gateway.gateway_objects("x", "ns", spec, builders.owner_reference("x", "u"))
              if o["kind"] == "Deployment")
    for pod in (sts["spec"]["template"]["spec"], gw["spec"]["template"]["spec"]):
        c = pod["containers"][0]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert gw["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert ("runAsUser" in sts["spec"]["template"]["spec"]["securityContext"]) == (backend == "sim")


# ---- links ---------------------------------------------------------------------------------

def eng(pod, role, cid, ip="127.0.0.1", ready=True, ok=True):
    return links.Engine(pod=pod, group=role, role=role, cluster_id=cid, ip=ip, port=26000, ready=ready,
                        agent_ok=ok, agent_url=f"http://{ip}:8080")


def up(e):
    return {"name": e.pod, "cluster_id": e.cluster_id, "ip": e.ip, "port": e.port, "code": "LLM_SUCCESS"}


def test_plan_full_mesh_from_nothing():
    es = [eng("p0", "prefill", 0), eng("p1", "prefill", 1), eng("d0", "decoder", 1000), eng("d1", "decoder", 1001)]
    plans = links.plan(es, {})
    assert {p.decoder.pod: [e.pod for e in p.link] for p in plans} == {"d0": ["p0", "p1"], "d1": ["p0", "p1"]}
    assert links.counts(es, {}) == (4, 0)


def test_plan_nothing_to_do_when_converged():
    p0, d0 = eng("p0", "prefill", 0), eng("d0", "decoder", 1000)
    assert links.plan([p0, d0], {"d0": [up(p0)]}) == []
    assert links.counts([p0, d0], {"d0": [up(p0)]}) == (1, 1)


def test_plan_removes_stale_and_relinks_broken_or_moved():
    p0, p1, d0 = eng("p0", "prefill", 0), eng("p1", "prefill", 1, ip="127.0.0.9"), eng("d0", "decoder", 1000)
    gone = {"name": "p7", "cluster_id": 7, "ip": "127.0.0.7", "port": 26000, "code": "LLM_SUCCESS"}
    broken = {**up(p0), "code": "LLM_LINK_FAILED"}
    moved = {**up(p1), "ip": "127.0.0.2"}
    [plan] = links.plan([p0, p1, d0], {"d0": [gone, broken, moved]})
    assert plan.unlink == [gone]
    assert plan.force_unlink == [broken, moved]
    assert [e.pod for e in plan.link] == ["p0", "p1"]


@pytest.mark.parametrize("code", ["LLM_LINK_BUSY", "LLM_PROCESSING_LINK", "LLM_SUCCESS"])
def test_a_busy_or_linking_link_is_healthy(code):
    """check_link_status gives LINK_BUSY during a pull: that link is at work, not broken."""
    p0, d0 = eng("p0", "prefill", 0), eng("d0", "decoder", 1000)
    assert links.plan([p0, d0], {"d0": [{**up(p0), "code": code}]}) == []
    assert links.counts([p0, d0], {"d0": [{**up(p0), "code": code}]}) == (1, 1)


@pytest.mark.parametrize("code", ["LLM_NOT_YET_LINK", "LLM_LINK_FAILED", "LLM_WAIT_PROCESS_TIMEOUT"])
def test_the_engine_says_broken(code):
    p0, d0 = eng("p0", "prefill", 0), eng("d0", "decoder", 1000)
    bad = {**up(p0), "code": code, "healthy": False}
    [plan] = links.plan([p0, d0], {"d0": [bad]})
    assert plan.force_unlink == [bad] and [e.pod for e in plan.link] == ["p0"]


def test_a_restarted_prefill_is_relinked_by_boot_id():
    from dataclasses import replace
    p0, d0 = replace(eng("p0", "prefill", 0), boot_id="new"), eng("d0", "decoder", 1000)
    old = {**up(p0), "peer_boot_id": "old"}
    [plan] = links.plan([p0, d0], {"d0": [old]})
    assert plan.force_unlink == [old] and [e.pod for e in plan.link] == ["p0"]
    assert links.plan([p0, d0], {"d0": [{**up(p0), "peer_boot_id": "new"}]}) == []


def test_a_leaving_prefill_keeps_its_links_while_caches_wait():
    from dataclasses import replace
    p0, d0 = eng("p0", "prefill", 0), eng("d0", "decoder", 1000)
    p1 = replace(eng("p1", "prefill", 1), terminating=True, draining=True, busy=True)
    reported = {"d0": [up(p0), up(p1)]}
    assert links.plan([p0, p1, d0], reported) == []           # held: caches wait on p1
    assert links.counts([p0, p1, d0], reported) == (1, 1)      # but not expected any more
    assert links.holding_links([p0, p1, d0], reported) == 1
    unknown = replace(p1, busy=None)                            # its agent has not said yet
    assert links.plan([p0, unknown, d0], reported) == []
    draining = replace(p1, terminating=False, draining=True)   # drained, not terminating: same
    assert links.plan([p0, draining, d0], reported) == []
    # deleted, idle, but its agent still takes requests (no SIGTERM yet): held, or a request
    # prefilled there now could not be pulled
    taking = replace(p1, draining=False, busy=False)
    assert links.plan([p0, taking, d0], reported) == [] and links.holding_links([p0, taking, d0], reported) == 1
    # a leaving prefill gets no new link
    [plan] = links.plan([p0, p1, d0], {"d0": [up(p0)]}) or [None]
    assert plan is None
    # nothing left to pull: unlinked normally (both ends), not by force
    done = replace(p1, busy=False)
    [plan] = links.plan([p0, done, d0], reported)
    assert plan.unlink == [up(p1)] and plan.force_unlink == [] and plan.link == []
    assert links.holding_links([p0, done, d0], reported) == 0
    # a held link the engine says is broken is dropped, never re-made
    [plan] = links.plan([p0, p1, d0], {"d0": [up(p0), {**up(p1), "code": "LLM_LINK_FAILED"}]})
    assert plan.force_unlink == [{**up(p1), "code": "LLM_LINK_FAILED"}] and plan.link == []


def test_a_leaving_decoder_dials_nothing_and_keeps_its_links():
    from dataclasses import replace
    p0, p1 = eng("p0", "prefill", 0), eng("p1", "prefill", 1)
    d0 = replace(eng("d0", "decoder", 1000), terminating=True)
    assert links.plan([p0, p1, d0], {"d0": [up(p0)]}) == []
    assert links.counts([p0, p1, d0], {"d0": [up(p0)]}) == (0, 0)


def test_plan_skips_unanswering_and_switching_and_prefills_never_dial():
    es = [eng("p0", "prefill", 0), eng("p1", "prefill", 1, ok=False), eng("s", "switching", 2),
          eng("d0", "decoder", 1000), eng("d1", "decoder", 1001, ok=False)]
    plans = links.plan(es, {})
    assert [(p.decoder.pod, [e.pod for e in p.link]) for p in plans] == [("d0", ["p0"])]


def test_plan_respects_backoff():
    es = [eng("p0", "prefill", 0), eng("p1", "prefill", 1), eng("d0", "decoder", 1000)]
    [plan] = links.plan(es, {}, due=lambda d, c: c != 1)
    assert [e.pod for e in plan.link] == ["p0"]


def test_link_batches_of_16():
    es = [eng(f"p{i}", "prefill", i) for i in range(40)] + [eng("d0", "decoder", 1000)]
    [plan] = links.plan(es, {})
    assert [len(b) for b in plan.link_batches()] == [16, 16, 8]


def test_verify_pairs_rotate_over_every_path():
    es = [eng(f"p{i}", "prefill", i) for i in range(3)] + [eng(f"d{i}", "decoder", 1000 + i) for i in range(2)]
    seen = set()
    for r in range(3):
        seen |= {(d.pod, p.pod) for d, p in links.verify_pairs(es, r)}
    assert len(seen) == 6


# ---- status and conditions -------------------------------------------------------------------

def pod(name, group, idx, ready=True, ip="127.1.0.1", waiting=None):
    st = {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if waiting:
        st["containerStatuses"] = [{"state": {"waiting": waiting}}]
    return {"metadata": {"name": name, "labels": {"pdoperator.io/group": group, "pdoperator.io/role": group,
                                                  "apps.kubernetes.io/pod-index": str(idx)}}, "status": st}


def test_status_ready_and_pending():
    spec = parse_spec({**SPEC, "prefill": {"replicas": 1}, "decoder": {"replicas": 1}})
    pods = [pod("x-prefill-0", "prefill", 0, ip="127.1.0.1"), pod("x-decoder-0", "decoder", 0, ip="127.1.0.2")]
    from dataclasses import replace
    engines = [replace(member_of(p, spec), agent_ok=True) for p in pods]
    obs = Observed(generation=3, pods=pods, engines=engines, boot_ids={"x-prefill-0": "a", "x-decoder-0": "b"},
                   reported={"x-decoder-0": [up(engines[0])]}, observed_generation=3,
                   verify={"x-decoder-0": {"ok": True, "code": "LLM_SUCCESS", "decoder": "x-decoder-0",
                                           "prefill": "x-prefill-0", "bytes": 10, "pull_ms": 1.0}})
    s = build_status(spec, obs, None, at=AT)
    assert s["phase"] == "Ready" and s["linksSummary"] == "1/1" and s["observedGeneration"] == 3
    assert s["prefill"] == 1 and s["decoder"] == 1
    dec = next(m for m in s["members"] if m["pod"] == "x-decoder-0")
    assert dec["clusterId"] == 1000 and dec["links"] == {"expected": 1, "up": 1} and "failingLinks" not in dec
    assert conditions.is_true(s["conditions"], "KVPathVerified")
    obs.pods = [pod("x-prefill-0", "prefill", 0, ready=False), pods[1]]
    assert build_status(spec, obs, s, at=AT)["phase"] == "Pending"


def test_status_image_error_is_degraded_with_reason():
    spec = parse_spec({**SPEC, "prefill": {"replicas": 1}, "decoder": {"replicas": 0}})
    p = pod("x-prefill-0", "prefill", 0, ready=False,
            waiting={"reason": "ImagePullBackOff", "message": "image nope:1 not available"})
    s = build_status(spec, Observed(generation=1, pods=[p], engines=[member_of(p, spec)]), None, at=AT)
    c = conditions.get(s["conditions"], "PodsReady")
    assert s["phase"] == "Degraded" and c["reason"] == "ImagePullError" and "nope:1" in c["message"]


def test_condition_transition_time_moves_only_on_flip():
    c1 = conditions.set_condition(None, "Ready", False, "A", "m", 1, at="t1")
    c2 = conditions.set_condition(c1, "Ready", False, "B", "m2", 2, at="t2")
    assert c2[0]["lastTransitionTime"] == "t1" and c2[0]["reason"] == "B"
    c3 = conditions.set_condition(c2, "Ready", True, "C", "", 2, at="t3")
    assert c3[0]["lastTransitionTime"] == "t3"


# ---- CRD -------------------------------------------------------------------------------------

def test_crd_file_is_generated_from_the_models():
    assert (REPO / "crds" / "pddeployment.yaml").read_text() == crdgen.render(), "run `make crd`"
    chart_copy = REPO / "charts" / "pd-operator" / "crds" / "pddeployment.yaml"
    assert chart_copy.read_text() == crdgen.render(), "the chart must ship the same CRD; run `make crd`"


def test_crd_schema_is_structural_and_complete():
    crd = crdgen.crd()
    v = crd["spec"]["versions"][0]
    assert crd["metadata"]["name"] == "pddeployments.pdoperator.io"
    assert crd["spec"]["names"]["shortNames"] == ["pdd"] and crd["spec"]["names"]["categories"] == ["all"]
    assert v["subresources"] == {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                       "statusReplicasPath": ".status.replicas",
                                                       "labelSelectorPath": ".status.selector"}}
    assert [c["name"] for c in v["additionalPrinterColumns"]] == ["Phase", "Prefill", "Decoder", "Links", "Age"]
    text = yaml.safe_dump(crd)
    assert "$ref" not in text and "anyOf" not in text and "title" not in text
    spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["datadist"]["properties"]["port"]["default"] == 26000
    assert spec["backend"]["enum"] == ["sim", "llm-datadist"]
    assert spec["prefill"]["properties"]["resources"]["properties"]["limits"]["additionalProperties"] == {
        "x-kubernetes-int-or-string": True}


# ---- status at scale, children, the reconcile's pure parts -------------------------------------

def _fleet(n_prefill: int, n_decoder: int, failing: int = 0):
    """Pods, engines and decoder link reports of a converged FullMesh deployment."""
    from dataclasses import replace
    spec = parse_spec({**SPEC, "prefill": {"replicas": n_prefill}, "decoder": {"replicas": n_decoder}})
    pods = [pod(f"big-prefill-{i}", "prefill", i, ip=f"127.2.{i // 250}.{i % 250 + 1}") for i in range(n_prefill)]
    pods += [pod(f"big-decoder-{i}", "decoder", i, ip=f"127.3.{i // 250}.{i % 250 + 1}") for i in range(n_decoder)]
    engines = [replace(member_of(p, spec), agent_ok=True, boot_id="b" * 32, cache_desc="{}") for p in pods]
    prefills = [e for e in engines if e.group == "prefill"]
    reported = {e.pod: [{**up(p), "healthy": True, "since": 1.0, "peer_boot_id": "b" * 32} for p in prefills]
                for e in engines if e.group == "decoder"}
    for d in list(reported)[:failing]:
        reported[d][0] = {**reported[d][0], "code": "LLM_LINK_FAILED", "healthy": False}
    return spec, pods, engines, reported


def test_status_of_256_prefills_and_256_decoders_stays_small():
    import json
    spec, pods, engines, reported = _fleet(256, 256, failing=16)
    verify = {d: {"ok": True, "code": "LLM_SUCCESS", "decoder": d, "prefill": "big-prefill-0", "bytes": 524288,
                  "pull_ms": 1.5} for d in reported}
    obs = Observed(generation=1, pods=pods, engines=engines, reported=reported, verify=verify, observed_generation=1,
                   boot_ids={e.pod: e.boot_id for e in engines})
    s = build_status(spec, obs, None, at=AT)
    size = len(json.dumps(s))
    assert size < 256 * 1024, size
    assert s["links"] == {"expected": 256 * 256, "up": 256 * 256 - 16}
    bad = [m for m in s["members"] if m.get("failingLinks")]
    assert len(bad) == 16 and bad[0]["failingLinks"] == [{"peer": "big-prefill-0", "clusterId": 0,
                                                          "code": "LLM_LINK_FAILED"}]
    healthy = next(m for m in s["members"] if m["pod"] == "big-decoder-100")
    assert healthy["links"] == {"expected": 256, "up": 256} and "failingLinks" not in healthy
    # messages stay the same from pass to pass: a second build with other pull times is identical but lastVerified
    verify2 = {d: {**v, "pull_ms": 9.9} for d, v in verify.items()}
    s2 = build_status(spec, Observed(generation=1, pods=pods, engines=engines, reported=reported, verify=verify2,
                                     observed_generation=1, boot_ids=obs.boot_ids), s, at=AT)
    assert s2["conditions"] == s["conditions"] and s2["lastVerified"] != s["lastVerified"]


def test_build_status_reads_each_link_report_once():
    """Work linear in reported links plus members: every decoder's report is read once."""
    class Counting(dict):
        reads = 0

        def get(self, *a):
            Counting.reads += 1
            return super().get(*a)
    spec, pods, engines, reported = _fleet(32, 32)
    build_status(spec, Observed(generation=1, pods=pods, engines=engines, reported=Counting(reported)), None, at=AT)
    assert Counting.reads == 32


def test_members_that_cannot_be_read_are_problems_not_exceptions():
    from pd_operator.members import Problem
    spec = parse_spec(SPEC)
    no_index = {"metadata": {"name": "x-stray", "labels": {"pdoperator.io/group": "decoder"}}, "status": {}}
    odd = {"metadata": {"name": "x-router-0", "labels": {"pdoperator.io/group": "router"}}, "status": {}}
    assert isinstance(member_of(no_index, spec), Problem) and "pod-index" in member_of(no_index, spec).message
    assert isinstance(member_of(odd, spec), Problem) and "router" in member_of(odd, spec).message
    s = build_status(spec, Observed(generation=1, pods=[no_index, odd], engines=[],
                                    problems=[member_of(no_index, spec), member_of(odd, spec)]), None, at=AT)
    assert {m["pod"]: m["lastError"][:10] for m in s["members"]} == {"x-router-0": "unknown pd",
                                                                     "x-stray": "no apps.ku"}


def test_identity_comes_from_the_agents_report():
    from pd_contract.agent_api import AgentStatus
    spec = parse_spec(SPEC)
    e = member_of(pod("x-prefill-1", "prefill", 1, ip="127.1.0.5"), spec)
    rep = AgentStatus(pod="x-prefill-1", role="prompt", cluster_id=4242, boot_id="z", backend="sim", initialized=True,
                      ip="10.9.9.9", port=27000, model_id=0, cache_desc={"num_tensors": 2, "shape": [1]},
                      unknown_future_field=1)
    got = with_report(e, rep)
    assert (got.cluster_id, got.ip, got.port, got.agent_ok) == (4242, "10.9.9.9", 27000, True)
    assert got.cache_desc == '{"num_tensors":2,"shape":[1]}' and got.agent_url == e.agent_url


def test_links_only_between_identical_cache_descs():
    from dataclasses import replace
    old, new = '{"n":4}', '{"n":8}'
    p0, p1 = replace(eng("p0", "prefill", 0), cache_desc=old), replace(eng("p1", "prefill", 1), cache_desc=new)
    d0, d1 = replace(eng("d0", "decoder", 1000), cache_desc=old), replace(eng("d1", "decoder", 1001), cache_desc=new)
    plans = {p.decoder.pod: [e.pod for e in p.link] for p in links.plan([p0, p1, d0, d1], {})}
    assert plans == {"d0": ["p0"], "d1": ["p1"]}
    assert {(d.pod, p.pod) for d, p in links.mismatches([p0, p1, d0, d1])} == {("d0", "p1"), ("d1", "p0")}
    # an existing link across CacheDescs (made before a roll) is dropped, never kept
    plan = {p.decoder.pod: p for p in links.plan([p0, p1, d0, d1], {"d0": [up(p0), up(p1)]})}["d0"]
    assert plan.unlink == [up(p1)] and plan.link == []


def test_children_applied_when_missing_changed_or_drifted():
    from pd_operator import children as ch
    spec = parse_spec(SPEC)
    desired = builders.desired_children("x", "ns", "uid", spec)
    assert ch.to_apply(desired, {}, {}) == desired                       # nothing there yet
    sts = next(o for o in desired if o["kind"] == "StatefulSet")
    seen = {ch.child_key(o): {**o, "metadata": {**o["metadata"], "generation": 1, "resourceVersion": "5"}}
            for o in desired}
    applied = {k: (ch.digest(o), ch.marker(seen[k])) for k, o in ((ch.child_key(o), o) for o in desired)}
    assert ch.to_apply(desired, seen, applied) == []                     # converged
    k = ch.child_key(sts)
    seen_status = {**seen, k: {**seen[k], "metadata": {**seen[k]["metadata"], "resourceVersion": "9"}}}
    assert ch.to_apply(desired, seen_status, applied) == []              # a status update is not drift
    scaled = {**seen, k: {**seen[k], "metadata": {**seen[k]["metadata"], "generation": 2}}}
    assert ch.to_apply(desired, scaled, applied) == [sts]                # kubectl scale is drift
    gone = {kk: v for kk, v in seen.items() if kk != ("ConfigMap", "x-config")}
    assert [o["kind"] for o in ch.to_apply(desired, gone, applied)] == ["ConfigMap"]


def test_error_policy_and_spec_changes():
    from pd_operator.reconcile import TerminalError, error_policy, spec_changes
    assert error_policy(TerminalError("InvalidSpec", "x"), 1) is None
    assert [error_policy(RuntimeError(), n) for n in (1, 2, 3, 8)] == [0.5, 1.0, 2.0, 30.0]
    assert spec_changes({"a": {"b": 1, "c": 2}}, {"a": {"b": 3, "c": 2}, "d": 4}) == [
        "spec.a.b: 1 -> 3", "spec.d: None -> 4"]


def test_a_prefill_that_flaps_not_ready_keeps_its_links():
    from dataclasses import replace
    p0, d0 = eng("p0", "prefill", 0), eng("d0", "decoder", 1000)
    flapping = replace(eng("p1", "prefill", 1), ready=False)       # its agent still answers
    assert links.plan([p0, flapping, d0], {"d0": [up(p0), up(flapping)]}) == []
    slow_agent = replace(eng("p1", "prefill", 1), agent_ok=False)  # its agent did not answer this time
    assert links.plan([p0, slow_agent, d0], {"d0": [up(p0), up(slow_agent)]}) == []
    assert links.plan([p0, slow_agent, d0], {"d0": [up(p0)]}) == []   # but no new link until it answers


def test_ready_summarises_by_declared_polarity():
    ok = lambda t, s: {"type": t, "status": s}  # noqa: E731
    conds = [ok("PodsReady", "True"), ok("AgentsReady", "True"), ok("LinksReady", "True"),
             ok("KVPathVerified", "Unknown"), ok("ProxyEnvironment", "True"), ok("Rebalancing", "True")]
    assert conditions.polarity("ProxyEnvironment") == "negative" and conditions.polarity("Ready") == "positive"
    assert not conditions.healthy(conds[4]) and conditions.healthy(conds[5])   # a warning; informational
    assert conditions.first_unhealthy(conds)["type"] == "KVPathVerified"      # Unknown is not good
    conds[3]["status"] = "True"
    assert conditions.first_unhealthy(conds) is None, "a proxy warning does not make the deployment unready"


def test_status_of_128_prefills_and_128_decoders_at_tp8_with_every_link_failing_stays_under_256k():
    """The worst case: every rank link of every decoder down and every agent in error. The failing
    links are summarised per member (counts per code, the first few named), so the status write
    does not fail exactly when it matters (etcd refuses objects over 1.5 MiB)."""
    import json

    from pd_operator import status as status_mod
    spec, pods, engines, reported = _fleet(128, 128)
    spec = parse_spec({**SPEC, "model": {**SPEC["model"], "kvCache": {**SPEC["model"]["kvCache"],
                                                                     "tensorParallel": 8, "numKvHeads": 8}},
                       "prefill": {"replicas": 128}, "decoder": {"replicas": 128}})
    codes = ["LLM_LINK_FAILED", "LLM_WAIT_PROCESS_TIMEOUT", "LLM_NOT_YET_LINK"]
    for d, reports in reported.items():
        reported[d] = [{**l, "code": "LLM_LINK_FAILED", "healthy": False,
                        "ranks": [{"rank": r, "code": codes[(i + r) % 3], "healthy": False} for r in range(8)]}
                       for i, l in enumerate(reports)]
    errors = {e.pod: ("AgentUnreachable", f"agent of {e.pod} at http://{e.ip}:8080: " + "ConnectError(" * 8 + "x"
                      * 300) for e in engines}
    obs = Observed(generation=1, pods=pods, engines=engines, reported=reported, observed_generation=1,
                   boot_ids={e.pod: e.boot_id for e in engines}, agent_errors=errors,
                   rank_reports={e.pod: (8, 8, "annotation") for e in engines})
    s = build_status(spec, obs, None, at=AT)
    size = len(json.dumps(s))
    print(f"status of 128P+128D TP 8, every link failing: {size / 1024:.1f} KiB")
    assert size < 256 * 1024, size
    d0 = next(m for m in s["members"] if m["pod"] == "big-decoder-0")
    assert len(d0["failingLinks"]) == status_mod.MAX_FAILING_NAMED
    assert set(d0["failingLinkCounts"]) == set(codes)
    assert sum(d0["failingLinkCounts"].values()) == 128 * 8
    assert d0["failingLinks"][0] == {"peer": "big-prefill-0", "clusterId": 0, "code": "LLM_LINK_FAILED", "rank": 0}
