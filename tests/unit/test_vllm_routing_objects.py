"""What the operator applies for vLLM engines behind pd-gateway: the engines' port on the role
Services, the port in the gateway's env and NetworkPolicy (its own, and a PDGateway's route); a spec
without a vLLM engine renders as before."""
from __future__ import annotations

import copy
import json

import yaml

from pd_operator import sharedgateway
from pd_operator.api import parse_spec
from pd_operator.builders import desired_children
from pd_operator.config import OperatorConfig
from pd_operator.gateway import gateway_objects
from tests.conftest import REPO

BASE = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())


def spec(vllm: bool) -> dict:
    s = copy.deepcopy(BASE["spec"])
    s["gateway"] = {"enabled": True, "apiKeysSecret": "keys"}
    if vllm:
        s["engine"] = {"image": "e:1", "adapter": "vLLM", "port": 8001}
        s["model"]["kvCache"]["paged"] = {"blockSize": 16, "numBlocks": 64}
    return s


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_role_services_and_the_gateway_carry_the_engines_port():
    sp = parse_spec(spec(True))
    svc = by_kind(desired_children("d", "ns", "uid", sp, {}), "Service")
    for role in ("prefill", "decoder"):
        assert {"name": "serving", "port": 8001, "targetPort": "serving"} in svc[f"d-{role}-role"]["spec"]["ports"]
    gw = gateway_objects("d", "ns", sp, {"uid": "u"}, image="g:1", config=OperatorConfig())
    dep = by_kind(gw, "Deployment")["d-gateway"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PD_GATEWAY_ENGINE_PORT"] == "8001"
    egress = by_kind(gw, "NetworkPolicy")["d-gateway"]["spec"]["egress"][0]["ports"]
    assert {"protocol": "TCP", "port": 8001} in egress and {"protocol": "TCP", "port": 8080} in egress


def test_without_a_vllm_engine_nothing_changes():
    sp = parse_spec(spec(False))
    svc = by_kind(desired_children("d", "ns", "uid", sp, {}), "Service")
    assert [p["name"] for p in svc["d-prefill-role"]["spec"]["ports"]] == ["http"]
    gw = gateway_objects("d", "ns", sp, {"uid": "u"}, image="g:1", config=OperatorConfig())
    container = by_kind(gw, "Deployment")["d-gateway"]["spec"]["template"]["spec"]["containers"][0]
    env = [e["name"] for e in container["env"]]
    assert "PD_GATEWAY_ENGINE_PORT" not in env
    assert by_kind(gw, "NetworkPolicy")["d-gateway"]["spec"]["egress"][0]["ports"] == [{"protocol": "TCP",
                                                                                       "port": 8080}]


def test_a_pdgateway_routes_a_vllm_deployment_to_its_engines_port():
    deps = []
    for name, vllm in (("a", True), ("b", False)):
        s = spec(vllm)
        s["model"]["name"] = f"model-{name}"
        deps.append({"metadata": {"name": name, "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
                     "spec": s, "status": {"prefill": 1, "decoder": 1}})
    r = sharedgateway.routing(deps, None)
    assert {s.deployment: s.engine_port for s in r.served} == {"a": 8001, "b": None}
    from pd_operator.api_gateway import PDGatewaySpec
    objs = sharedgateway.objects("shared", "ns", PDGatewaySpec.model_validate({"apiKeysSecret": "keys"}),
                                 {"uid": "u"}, r, "g:1", True, OperatorConfig())
    env = {e["name"]: e.get("value") for e in by_kind(objs, "Deployment")["shared"]["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    routes = {x["deployment"]: x for x in json.loads(env["PD_GATEWAY_ROUTES"])}
    assert routes["a"]["enginePort"] == 8001 and "enginePort" not in routes["b"]
    assert {"protocol": "TCP", "port": 8001} in by_kind(objs, "NetworkPolicy")["shared"]["spec"]["egress"][0]["ports"]
