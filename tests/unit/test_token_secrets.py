"""Which agent token Secrets the operator may use (tokens.judge): only those whose token's digest
it recorded in status before creating them."""
from __future__ import annotations

import base64

from pd_operator import tokens as tk

UID = "d-uid"


def secret(name: str, token: str, owned: bool = True) -> dict:
    meta: dict = {"name": name, "namespace": "ns"}
    if owned:   # anyone who can read the deployment knows its uid
        meta["ownerReferences"] = [{"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDDeployment", "name": "d",
                                    "uid": UID, "controller": True}]
    return {"metadata": meta, "data": {"token": base64.b64encode(token.encode()).decode()}}


def found(**tokens: str) -> dict:
    names = {"control": "d-agent-token", "data": "d-agent-data-token", "peer": "d-agent-peer-token"}
    return {role: secret(names[role], tok) for role, tok in tokens.items()}


def counter():
    n = iter(range(100))
    return lambda: f"t{next(n)}"


def test_a_new_deployment_records_digests_of_tokens_it_is_about_to_create() -> None:
    v = tk.judge("d", "ns", UID, {}, None, {}, make=counter())
    assert v.create == {"control": "t0", "data": "t1", "peer": "t2"}
    assert v.digests == {r: tk.digest(t) for r, t in v.create.items()}
    assert v.token is None and not v.foreign and v.problem is None


def test_secrets_planted_with_the_deployments_owner_reference_are_refused() -> None:
    """The attack: Secrets created right after the PDDeployment appeared, with its uid."""
    v = tk.judge("d", "ns", UID, found(control="chosen", data="chosen", peer="chosen"), None, {})
    assert v.token is None
    assert v.foreign == ["d-agent-token", "d-agent-data-token", "d-agent-peer-token"]
    assert "d-agent-token" in v.problem and "status.tokenDigests" in v.problem and "delete it" in v.problem


def test_the_operators_own_secrets_are_used() -> None:
    status = {"tokenDigests": {"control": tk.digest("a"), "data": tk.digest("b"), "peer": tk.digest("c")}}
    v = tk.judge("d", "ns", UID, found(control="a", data="b", peer="c"), status, {})
    assert v.token == "a" and not v.create and not v.foreign and v.digests == status["tokenDigests"]


def test_one_planted_between_the_status_write_and_the_create_is_refused() -> None:
    status = {"tokenDigests": {"control": tk.digest("a"), "data": tk.digest("b"), "peer": tk.digest("c")}}
    v = tk.judge("d", "ns", UID, found(control="a", data="theirs", peer="c"), status, {"data": "b"})
    assert v.foreign == ["d-agent-data-token"] and v.token == "a"
    assert v.digests["data"] == tk.digest("b"), "the record of the operator's own token is kept"


def test_a_token_recorded_but_not_yet_created_is_created_with_the_same_value() -> None:
    status = {"tokenDigests": {"control": tk.digest("a"), "data": tk.digest("b"), "peer": tk.digest("c")}}
    v = tk.judge("d", "ns", UID, found(control="a", peer="c"), status, {"data": "b"}, make=counter())
    assert v.create == {"data": "b"}
    # after a restart the pending token is gone: a new one (and a new record) replaces it
    v = tk.judge("d", "ns", UID, found(control="a", peer="c"), status, {}, make=counter())
    assert v.create == {"data": "t0"} and v.digests["data"] == tk.digest("t0")


def test_a_deployment_reconciled_before_digests_adopts_the_secrets_it_owns_once() -> None:
    legacy = {"observedGeneration": 3, "phase": "Ready"}
    v = tk.judge("d", "ns", UID, found(control="a", data="b", peer="c"), legacy, {})
    assert v.token == "a" and v.digests == {"control": tk.digest("a"), "data": tk.digest("b"), "peer": tk.digest("c")}
    unowned = {"control": secret("d-agent-token", "a", owned=False), **{
        r: s for r, s in found(data="b", peer="c").items()}}
    v = tk.judge("d", "ns", UID, unowned, legacy, {})
    assert v.foreign == ["d-agent-token"] and v.token is None


def test_a_secret_without_a_readable_token_is_refused() -> None:
    bad = secret("d-agent-token", "x")
    bad["data"]["token"] = "***"
    status = {"tokenDigests": {"control": tk.digest("a")}}
    v = tk.judge("d", "ns", UID, {"control": bad, **found(data="b", peer="c")}, status, {})
    assert "d-agent-token" in v.foreign


def test_the_shared_gateway_routes_to_a_deployment_only_with_the_operators_data_token() -> None:
    data = secret("d-agent-data-token", "b")
    assert tk.made_by_operator({"status": {"tokenDigests": {"data": tk.digest("b")}}}, data)
    assert not tk.made_by_operator({"status": {"tokenDigests": {"data": tk.digest("other")}}}, data)
    assert not tk.made_by_operator({"status": {"tokenDigests": {"data": tk.digest("b")}}}, None)
    assert not tk.made_by_operator({}, data), "a new deployment's planted Secret"
    assert tk.made_by_operator({"status": {"observedGeneration": 1}}, data), "reconciled before digests"


def test_an_agent_refuses_to_start_with_a_token_someone_else_put_in_its_secret():
    """Deleted to rotate it, the Secret was made again by someone else first: pods that restart
    read their token; the operator's record (in the pod template) says it is not its own."""
    import pytest

    from pd_agent.identity import ConfigError, Identity
    base = {"LLM_DATADIST_ROLE": "prompt", "LLM_DATADIST_CLUSTER_ID": "0", "PD_AGENT_TOKEN": "theirs",
            "PD_AGENT_TOKEN_SHA256": tk.digest("ours")}
    with pytest.raises(ConfigError, match="PD_AGENT_TOKEN: the token in its Secret is not the one the operator made"):
        Identity.from_env(base)
    assert Identity.from_env({**base, "PD_AGENT_TOKEN": "ours"}).token == "ours"
    with pytest.raises(ConfigError, match="PD_AGENT_DATA_TOKEN"):
        Identity.from_env({**base, "PD_AGENT_TOKEN": "ours", "PD_AGENT_DATA_TOKEN": "x",
                           "PD_AGENT_DATA_TOKEN_SHA256": tk.digest("y")})


def test_the_pod_template_carries_the_recorded_digests():
    from pd_operator import builders
    from pd_operator.api import parse_spec
    from tests.unit.test_operator_pure import SPEC
    digests = {"control": tk.digest("a"), "data": tk.digest("b"), "peer": tk.digest("c")}
    objs = builders.desired_children("llm", "ns", "uid", parse_spec(SPEC), token_digests=digests)
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PD_AGENT_TOKEN_SHA256"] == tk.digest("a") and env["PD_AGENT_DATA_TOKEN_SHA256"] == tk.digest("b")
    assert env["PD_AGENT_PEER_TOKEN_SHA256"] == tk.digest("c")
