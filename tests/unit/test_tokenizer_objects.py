"""spec.model.tokenizer as the operator applies it: the ConfigMap (or claim) mounted read-only in the
gateway, its path and the chat template in the gateway's env (a PDGateway's route), exactly one
source, paths inside the volume."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from pd_operator import sharedgateway
from pd_operator.api import parse_spec
from pd_operator.api_gateway import PDGatewaySpec
from pd_operator.config import OperatorConfig
from pd_operator.gateway import gateway_objects
from tests.conftest import REPO

BASE = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())


def spec(tokenizer: dict | None) -> dict:
    s = copy.deepcopy(BASE["spec"])
    s["gateway"] = {"enabled": True, "apiKeysSecret": "keys"}
    if tokenizer is not None:
        s["model"]["tokenizer"] = tokenizer
    return s


def pod(objs: list[dict], name: str) -> dict:
    return next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name)["spec"]["template"][
        "spec"]


def test_a_configmap_tokenizer_is_mounted_and_named_in_the_env():
    sp = parse_spec(spec({"configMap": {"name": "qwen-tok", "key": "tok.json"}, "chatTemplate": "{{ x }}",
                          "bosToken": "<s>"}))
    p = pod(gateway_objects("d", "ns", sp, {"uid": "u"}, image="g:1", config=OperatorConfig()), "d-gateway")
    vol = next(v for v in p["volumes"] if "configMap" in v)
    assert vol["configMap"] == {"name": "qwen-tok", "optional": True,
                                "items": [{"key": "tok.json", "path": "tokenizer.json"}]}
    c = p["containers"][0]
    mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
    assert mount["readOnly"] is True and mount["mountPath"] == "/etc/pd-gateway/tokenizers/d"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PD_GATEWAY_TOKENIZER"] == "/etc/pd-gateway/tokenizers/d/tokenizer.json"
    assert env["PD_GATEWAY_CHAT_TEMPLATE"] == "{{ x }}" and env["PD_GATEWAY_BOS_TOKEN"] == "<s>"
    assert "PD_GATEWAY_EOS_TOKEN" not in env


def test_a_claim_tokenizer_is_mounted_read_only():
    sp = parse_spec(spec({"persistentVolumeClaim": {"claimName": "weights", "path": "qwen/tokenizer.json"}}))
    p = pod(gateway_objects("d", "ns", sp, {"uid": "u"}, image="g:1", config=OperatorConfig()), "d-gateway")
    vol = next(v for v in p["volumes"] if "persistentVolumeClaim" in v)
    assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    env = {e["name"]: e.get("value") for e in p["containers"][0]["env"]}
    assert env["PD_GATEWAY_TOKENIZER"] == "/etc/pd-gateway/tokenizers/d/qwen/tokenizer.json"
    assert "PD_GATEWAY_CHAT_TEMPLATE" not in env


def test_without_a_tokenizer_the_gateway_pod_is_as_before():
    p = pod(gateway_objects("d", "ns", parse_spec(spec(None)), {"uid": "u"}, image="g:1", config=OperatorConfig()),
            "d-gateway")
    assert [v["name"] for v in p["volumes"]] == ["tmp"]


@pytest.mark.parametrize("bad", [{}, {"configMap": {"name": "a"}, "persistentVolumeClaim": {"claimName": "b",
                                                                                              "path": "t.json"}}])
def test_exactly_one_source(bad):
    with pytest.raises(ValueError, match="exactly one of configMap and persistentVolumeClaim"):
        parse_spec(spec(bad))


def test_a_pdgateway_mounts_each_routes_tokenizer():
    deps = []
    for name, tok in (("a", {"configMap": {"name": "tok-a"}, "chatTemplate": "T"}), ("b", None)):
        s = spec(tok)
        s["model"]["name"] = f"model-{name}"
        deps.append({"metadata": {"name": name, "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
                     "spec": s, "status": {"prefill": 1, "decoder": 1}})
    r = sharedgateway.routing(deps, None)
    objs = sharedgateway.objects("shared", "ns", PDGatewaySpec.model_validate({"apiKeysSecret": "keys"}),
                                 {"uid": "u"}, r, "g:1", True, OperatorConfig())
    p = pod(objs, "shared")
    env = {e["name"]: e.get("value") for e in p["containers"][0]["env"]}
    routes = {x["deployment"]: x for x in json.loads(env["PD_GATEWAY_ROUTES"])}
    assert routes["a"]["tokenizer"] == "/etc/pd-gateway/tokenizers/a/tokenizer.json"
    assert env[routes["a"]["chatTemplateEnv"]] == "T" and "chatTemplate" not in routes["a"]
    assert "tokenizer" not in routes["b"]
    assert [v["configMap"]["name"] for v in p["volumes"] if "configMap" in v] == ["tok-a"]
