"""A PDGateway's decisions (pure): which deployments it serves, conflicts, its objects and status."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from pd_operator import crdgen
from pd_operator.api_gateway import PDGatewaySpec, Selector, parse_spec
from pd_operator.sharedgateway import (
    OWNER_OUTAGE_GRACE_S,
    current_owners,
    keys_state,
    matches,
    objects,
    owner_reference,
    routing,
    status,
)
from tests.conftest import REPO

BASE = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
AT = "2026-12-05T00:00:00Z"


def dep(name: str, model: str, aliases=None, labels=None) -> dict:
    d = copy.deepcopy(BASE)
    d["metadata"] = {"name": name, "namespace": "t", "labels": labels or {}}
    d["spec"]["model"]["name"] = model
    if aliases:
        d["spec"]["model"]["aliases"] = aliases
    return d


@pytest.mark.parametrize("labels, selector, want", [
    ({}, None, True),
    ({}, {}, True),
    ({"team": "a"}, {"matchLabels": {"team": "a"}}, True),
    ({"team": "b"}, {"matchLabels": {"team": "a"}}, False),
    ({"tier": "gold"}, {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold", "silver"]}]}, True),
    ({"tier": "gold"}, {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]}, False),
    ({}, {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]}, True),
    ({}, {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, False),
    ({"x": "1"}, {"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, False),
])
def test_label_selector(labels, selector, want):
    sel = None if selector is None else Selector.model_validate(selector)
    assert matches(labels, sel) is want


def test_routing_serves_each_model_and_reports_conflicts():
    deps = [dep("a", "llama-8b", ["llama"]), dep("b", "qwen-7b"), dep("c", "qwen-7b"),
            dep("d", "mistral", ["llama"], labels={"team": "x"})]
    r = routing(deps, None)   # none serves: the oldest claim (same age here: by name) is routed
    assert [(s.model, s.deployment, s.aliases) for s in r.served] == [
        ("llama-8b", "a", ["llama"]), ("qwen-7b", "b", []), ("mistral", "d", [])]
    assert r.conflicts == {"llama": ["a", "d"], "qwen-7b": ["b", "c"]}
    r = routing(deps, Selector.model_validate({"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}))
    assert [(s.model, s.aliases) for s in r.served] == [("llama-8b", ["llama"]), ("qwen-7b", [])]
    broken = dep("e", "x")
    broken["spec"]["model"]["kvCache"]["numLayers"] = 0
    assert "e" in routing([broken], None).invalid


def aged(d: dict, created: str, prefill: int = 0, decoder: int = 0) -> dict:
    d["metadata"]["creationTimestamp"] = created
    d["status"] = {"prefill": prefill, "decoder": decoder}
    return d


def test_an_owner_keeps_its_model_through_a_short_outage():
    """The attack: while the model's owner briefly has no ready engines, a later deployment naming
    the model as an alias would take its route."""
    owner = aged(dep("owner", "llama-8b"), "2026-12-01T00:00:00Z")   # restarting: no serving pair
    later = aged(dep("later", "mine", ["llama-8b"]), "2026-12-02T00:00:00Z", prefill=1, decoder=1)
    current = current_owners({"models": [{"model": "llama-8b", "deployment": "owner"}]})
    r = routing([owner, later], None, current=current, outage={"owner": 30.0})
    assert ("llama-8b", "owner") in [(s.model, s.deployment) for s in r.served]
    assert r.conflicts == {"llama-8b": ["owner", "later"]}
    # past the grace a serving claim takes it; and without a current owner, as before
    r = routing([owner, later], None, current=current, outage={"owner": OWNER_OUTAGE_GRACE_S + 1})
    assert r.conflicts == {"llama-8b": ["later", "owner"]}
    assert routing([owner, later], None).conflicts == {"llama-8b": ["later", "owner"]}
    # an owner that no longer claims the name keeps nothing
    renamed = aged(dep("owner", "other"), "2026-12-01T00:00:00Z")
    r = routing([renamed, later], None, current=current, outage={"owner": 1.0})
    assert sorted((s.model, s.deployment, tuple(s.aliases)) for s in r.served) == [
        ("mine", "later", ("llama-8b",)), ("other", "owner", ())]


def test_a_deployment_that_does_not_serve_cannot_take_a_served_model_offline():
    """The attack: a 0-replica PDDeployment claiming a served model's name."""
    live = aged(dep("live", "llama-8b"), "2026-12-02T00:00:00Z", prefill=2, decoder=2)
    idle = aged(dep("idle", "llama-8b", ["qwen-7b"]), "2026-12-01T00:00:00Z")
    r = routing([live, idle], None)
    assert [(s.model, s.deployment) for s in r.served] == [("qwen-7b", "idle"), ("llama-8b", "live")]
    assert r.conflicts == {"llama-8b": ["live", "idle"]}
    # both serve: the older claim keeps it; neither does: the older claim too
    newer = aged(dep("newer", "llama-8b"), "2026-12-03T00:00:00Z", prefill=1, decoder=1)
    assert routing([newer, live], None).conflicts == {"llama-8b": ["live", "newer"]}
    assert routing([aged(dep("b", "m"), "2026-12-02T00:00:00Z"), aged(dep("a", "m"), "2026-12-03T00:00:00Z")],
                   None).conflicts == {"m": ["b", "a"]}
    # one role without a Ready pod does not serve
    half = aged(dep("half", "llama-8b"), "2026-11-01T00:00:00Z", prefill=1)
    assert routing([half, live], None).conflicts == {"llama-8b": ["live", "half"]}


def test_objects_least_privilege_and_routes():
    spec = parse_spec({"apiKeysSecret": "keys", "keys": {"team-a": {"models": ["llama-8b"], "tokensPerDay": 1000}}})
    r = routing([dep("a", "llama-8b", ["llama"]), dep("b", "qwen-7b")], None)
    owner = owner_reference("shared", "uid-1")
    objs = {o["kind"]: o for o in objects("shared", "t", spec, owner, r, "img/pd-gateway:1", keys_allowed=True)}
    assert set(objs) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget",
                         "NetworkPolicy"}
    assert objs["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1   # a drain never blocks on it
    # it may reach the agents of the deployments it routes to, and only their agent port
    np = objs["NetworkPolicy"]["spec"]
    assert np["podSelector"] == {"matchLabels": {"pdoperator.io/pdgateway": "shared"}}
    assert np["egress"][0] == {"to": [{"podSelector": {"matchExpressions": [
        {"key": "pdoperator.io/deployment", "operator": "In", "values": ["a", "b"]}]}}],
        "ports": [{"protocol": "TCP", "port": 8080}]}
    rules = objs["Role"]["rules"]
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["keys"]} in rules
    assert {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get"],
            "resourceNames": ["a-prefill", "a-decoder", "b-prefill", "b-decoder"]} in rules
    assert all("list" not in r["verbs"] or r["resources"] == ["pods"] for r in rules)
    env = {e["name"]: e for e in objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    routes = json.loads(env["PD_GATEWAY_ROUTES"]["value"])
    assert [(r["model"], r["aliases"], r["deployment"]) for r in routes] == [("llama-8b", ["llama"], "a"),
                                                                             ("qwen-7b", [], "b")]
    assert env[routes[1]["tokenEnv"]]["valueFrom"]["secretKeyRef"] == {"name": "b-agent-data-token", "key": "token",
                                                                       "optional": True}
    # a deployment joining does not rename the others' token variables (no needless restart)
    more = routing([dep("0-first", "mistral"), dep("a", "llama-8b", ["llama"]), dep("b", "qwen-7b")], None)
    env2 = {e["name"] for e in objects("shared", "t", spec, owner, more, "img", True)[3]["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert {r["tokenEnv"] for r in routes} <= env2
    assert json.loads(env["PD_GATEWAY_KEY_POLICY"]["value"]) == {"team-a": {"models": ["llama-8b"],
                                                                           "tokensPerDay": 1000}}
    assert objs["Service"]["metadata"]["name"] == "shared" and objs["Service"]["spec"]["ports"][0]["port"] == 8000
    assert objs["Deployment"]["spec"]["replicas"] == 2
    # the Secret has not opted in: the Role no longer names it, no pod runs
    objs = {o["kind"]: o for o in objects("shared", "t", spec, owner, r, "img", keys_allowed=False)}
    assert not any("secrets" in r["resources"] for r in objs["Role"]["rules"])
    assert objs["Deployment"]["spec"]["replicas"] == 0


@pytest.mark.parametrize("secret, reason", [
    (None, "KeysSecretNotFound"),
    ({"metadata": {"labels": {}}, "data": {"a": "eA=="}}, "KeysSecretNotOptedIn"),
    ({"metadata": {"labels": {"pdoperator.io/keys": "true"}}, "data": {"a": "eA=="}}, "KeysSecretReady"),
])
def test_keys_secret_state(secret, reason):
    assert keys_state(secret, "keys")[1] == reason


def test_status_names_conflicts_and_readiness():
    gw = {"metadata": {"name": "shared", "namespace": "t", "generation": 3}, "status": {}}
    r = routing([dep("a", "m"), dep("b", "m"), dep("c", "n")], None)
    st = status(gw, r, (True, "KeysSecretReady", "ok"), {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}},
                AT)
    served = {c["type"]: c for c in st["conditions"]}
    assert served["ModelsServed"]["reason"] == "ModelConflict"
    assert "claimed by a, b: routed to a, b left out" in served["ModelsServed"]["message"]
    assert st["phase"] == "Degraded" and st["models"] == [{"model": "m", "deployment": "a"},
                                                          {"model": "n", "deployment": "c"}]
    assert st["url"] == "http://shared.t.svc:8000/v1"
    st = status(gw, routing([dep("c", "n")], None), (True, "KeysSecretReady", "ok"),
                {"spec": {"replicas": 2}, "status": {}}, AT)
    assert st["phase"] == "Pending" and {c["type"]: c for c in st["conditions"]}["Ready"]["reason"] == "NoReadyReplica"


def test_key_names_are_checked_at_admission():
    crd = crdgen.gateway_crd()
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    assert any("self.keys.all" in r["rule"] for r in rules)
    assert PDGatewaySpec.model_validate({"apiKeysSecret": "k"}).replicas == 2


def test_the_checked_in_crds_are_generated():
    for kind, name in (("PDGateway", "pdgateway.yaml"), ("PDDeployment", "pddeployment.yaml")):
        assert (REPO / "crds" / name).read_text() == crdgen.render(kind), "run `make crd`"
        assert (REPO / "charts" / "pd-operator" / "crds" / name).read_text() == crdgen.render(kind)


def test_a_deployment_is_routed_once_its_token_exists():
    r = routing([dep("a", "m"), dep("b", "n")], None, tokens={"a"})
    assert [s.deployment for s in r.served] == ["a"] and r.waiting == ["b"]
    gw = {"metadata": {"name": "g", "namespace": "t", "generation": 1}}
    st = status(gw, routing([dep("b", "n")], None, tokens=set()), (True, "KeysSecretReady", "ok"), None, AT)
    assert {c["type"]: c for c in st["conditions"]}["ModelsServed"]["reason"] == "WaitingForDeployments"


async def test_a_pass_reads_and_applies_what_changed_only():
    """Data-token Secrets once seen, and objects once applied, are not asked for or applied again
    every pass; a missing object, a change, or RECHECK_S later, they are."""
    import asyncio

    from pd_operator import gatewaycontroller as gc
    from pd_operator.config import OperatorConfig
    from pd_operator.events import Events
    from pd_operator.tokens import digest
    from tests.unit.controller_fakes import FakeKube, Log

    log = Log()
    kube = FakeKube(log)
    gets: list[tuple[str, str]] = []
    real_get = kube.get

    async def get(api_version, kind, namespace, name):
        gets.append((kind, name))
        return await real_get(api_version, kind, namespace, name)
    kube.get = get  # type: ignore[method-assign]
    clock = [1000.0]

    class Clock:
        def monotonic(self) -> float:
            return clock[0]

        def time(self) -> float:
            return clock[0]
    for d in (dep("a", "llama-8b"), dep("b", "qwen-7b")):
        d["apiVersion"], d["kind"] = "pdoperator.io/v1alpha1", "PDDeployment"
        d["status"] = {"tokenDigests": {"data": digest("x")}}   # the operator made the data token "x"
        kube.store(d)
        kube.store({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{d['metadata']['name']}"
                     "-agent-data-token", "namespace": "t"}, "data": {"token": "eA=="}})
    kube.store({"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDGateway",
                 "metadata": {"name": "shared", "namespace": "t", "generation": 1},
                 "spec": {"apiKeysSecret": "keys"}})
    ctl = gc.GatewayController(kube, Events(kube), OperatorConfig(gateway_image="img/pd-gateway:1"),  # type: ignore[arg-type]
                               asyncio.Event(), clock=Clock())

    def applied() -> int:
        return sum(1 for c in log if c[0] == "apply")

    def token_gets() -> int:
        return sum(1 for k, n in gets if k == "Secret" and n.endswith("-agent-data-token"))

    await ctl.reconcile(("t", "shared"))
    first_applies, first_gets = applied(), token_gets()
    assert first_applies >= 5 and first_gets == 2
    clock[0] += 5
    await ctl.reconcile(("t", "shared"))
    assert applied() == first_applies and token_gets() == first_gets, "nothing changed: nothing read or applied"
    del kube.objects[("Service", "t", "shared")]     # someone deleted it
    await ctl.reconcile(("t", "shared"))
    assert applied() == 2 * first_applies and ("Service", "t", "shared") in kube.objects
    clock[0] += gc.RECHECK_S
    await ctl.reconcile(("t", "shared"))
    assert token_gets() == 2 * first_gets and applied() == 3 * first_applies, "read and applied again after a while"
