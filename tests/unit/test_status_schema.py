"""Every status shape the operator writes is accepted by its own generated CRD.

The API server validates a status apply against the CRD's structural schema, and server-side
apply turns an empty map (`{}`) into null when the field held entries before
(kubernetes/kubernetes#135841), so the write is rejected with `Invalid value: "null"`. The
check below is the schema's own rules (types, required fields, enums, maps and lists), plus
that rule: no object in a status is empty."""
from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from pd_operator import crdgen
from pd_operator import rebalance as rb
from pd_operator import switch as sw
from pd_operator.api import parse_spec
from pd_operator.diagnosis import Diagnosis
from pd_operator.members import Problem, member_of
from pd_operator.status import Observed, build_status
from tests.unit.test_operator_pure import SPEC, pod, up

T0 = 1_800_000_000.0
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def violations(value, schema: dict, path: str = "status") -> list[str]:
    """What the API server's structural validation (and server-side apply) would refuse."""
    if value is None:
        return [] if schema.get("nullable") else [f'{path}: Invalid value: "null"']
    t = schema.get("type")
    if t == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t:
        ok = isinstance(value, TYPES[t])
    else:
        ok = True
    if not ok:
        return [f"{path}: must be of type {t}, got {type(value).__name__}"]
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        if not value:
            out.append(f"{path}: an empty object, which server-side apply may turn into null")
        for req in schema.get("required", []):
            if req not in value:
                out.append(f"{path}.{req}: Required value")
        props = schema.get("properties")
        for k, v in value.items():
            if props is not None and k in props:
                out += violations(v, props[k], f"{path}.{k}")
            elif isinstance(schema.get("additionalProperties"), dict):
                out += violations(v, schema["additionalProperties"], f"{path}.{k}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{k}: unknown field (pruned)")
    if isinstance(value, list):
        for i, item in enumerate(value):
            out += violations(item, schema.get("items", {}), f"{path}[{i}]")
        keys = schema.get("x-kubernetes-list-map-keys")
        if keys:
            seen = [tuple(item.get(k) for k in keys) for item in value]
            if len(seen) != len(set(seen)):
                out.append(f"{path}: duplicate map-list keys {seen}")
    return out


@pytest.fixture(scope="module")
def status_schema() -> dict:
    crd = yaml.safe_load(crdgen.render())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def _observed(spec, **kw) -> Observed:
    pods = [pod("x-prefill-0", "prefill", 0, ip="127.1.0.1"), pod("x-decoder-0", "decoder", 0, ip="127.1.0.2")]
    engines = [replace(member_of(p, spec), agent_ok=True, boot_id="b" * 32) for p in pods]
    base = dict(generation=2, pods=pods, engines=engines, boot_ids={e.pod: e.boot_id for e in engines},
                reported={"x-decoder-0": [up(engines[0])]}, observed_generation=2,
                verify={"x-decoder-0": {"ok": True, "code": "LLM_SUCCESS", "decoder": "x-decoder-0",
                                        "prefill": "x-prefill-0", "bytes": 10, "pull_ms": 1.0}},
                verified_at="2027-01-15T08:00:00Z", selector="pdoperator.io/deployment=x")
    return Observed(**{**base, **kw})


def _switch(frm: str, to: str, step: str, done: tuple[str, ...] = (), message: str = "") -> sw.Switch:
    s = sw.Switch(pod="x-decoder-0", uid="u", from_=frm, to=to, step="Drain", started=T0, step_started=T0,
                  reason="Manual: 2 prefills")
    for i, st in enumerate(done):
        s = s.at(sw.STEPS[i + 1] if i + 1 < len(sw.STEPS) else st, T0 + i + 1)
    return replace(s, step=step, message=message)


def _shapes():
    """(name, spec dict, Observed) for each kind of status a pass can produce."""
    manual = {**SPEC, "rebalance": {"policy": "Manual", "manual": {"prefill": 1}, "cooldownSeconds": 0}}
    replace_ = {**SPEC, "rebalance": {"policy": "Manual", "manual": {"prefill": 1}, "method": "Replace"}}
    load = {**SPEC, "rebalance": {"policy": "Load", "minPrefill": 1, "minDecoder": 1}}
    yield "plain, Ready", SPEC, {}
    yield "no pods", SPEC, dict(pods=[], engines=[], reported={}, verify={})
    p = pod("x-decoder-0", "decoder", 0, ready=False, waiting={"reason": "ImagePullBackOff", "message": "nope"})
    yield "pod problem and a stray", SPEC, dict(pods=[p], problems=[Problem("x-stray", "decoder", "no pod-index")])
    yield "agent error, failing link, failed verify, proxy", SPEC, dict(
        agent_errors={"x-prefill-0": ("AgentUnreachable", "connect refused")},
        link_failures={("x-decoder-0", 0): ("LLM_LINK_FAILED", Diagnosis("EndpointUnreachable", "refused"))},
        verify={"x-decoder-0": {"ok": False, "code": "LLM_KV_CACHE_NOT_EXIST", "decoder": "x-decoder-0",
                                "prefill": "x-prefill-0", "message": "m", "bytes": 0, "pull_ms": 0}},
        proxy={"x-decoder-0": {"https_proxy": "http://p:3128"}})
    yield "blocked", SPEC, dict(blocked=Diagnosis("ApplyRejected", "rejected"))
    no_policy = sw.Decision("NoPolicy", "no rebalancing policy sets a prefill count", current=1)
    yield "rebalance with no target and no cooldown", manual, dict(decision=no_policy)
    for direction in (("decoder", "prefill"), ("prefill", "decoder")):
        for i, step in enumerate(sw.STEPS + (sw.ABORT,)):
            done = sw.STEPS[:min(i, len(sw.STEPS) - 1)]
            s = _switch(*direction, step, done, message="drain timed out" if step == sw.ABORT else "")
            yield f"{direction[0]}->{direction[1]} at {step}", manual, dict(
                switches=[s], decision=sw.Decision("SwitchInFlight", "1 switch(es) in flight", target=1, current=1),
                cooldown_until=sw.iso(T0 + 60))
    for result in ("Completed", "Aborted", "Interrupted"):
        s = _switch("decoder", "prefill", "Undrain", sw.STEPS[:5])
        out = sw.Outcome(result, s, "" if result == "Completed" else "why", T0 + 9)
        yield f"lastSwitch {result}", manual, dict(last_switch=out.record(),
                                                   decision=sw.Decision("AtTarget", "ok", target=1, current=1))
    yield "Replace, a replacement growing", replace_, dict(
        decision=sw.Decision("Replacing", "m", target=1, current=1),
        group_sizes={"prefill": 2, "decoder": 1, "growing": "prefill"})
    # lastDecision as the policies record it
    for name, spec_d in (("Manual", manual), ("Load", load)):
        spec = parse_spec(spec_d)
        _, _, book = rb.decide_target(spec, sw.Book(), rb.policies.Signals(), 1, T0)
        yield f"lastDecision {name}", spec_d, dict(last_decision=book.decision,
                                                    decision=sw.Decision("AtTarget", "ok", target=book.target,
                                                                         current=1))


@pytest.mark.parametrize("name,spec_d,kw", list(_shapes()), ids=[s[0] for s in _shapes()])
def test_every_status_shape_is_valid_against_the_crd(status_schema, name, spec_d, kw):
    spec = parse_spec(spec_d)
    status = build_status(spec, _observed(spec, **kw), None, at="2026-12-05T00:00:00Z")
    assert violations(status, status_schema) == []


def test_a_switch_at_its_first_step_writes_no_empty_map(status_schema):
    """The cause of `status.switches[0].stepsMs: Invalid value: "null"`: a switch that has
    done no step yet wrote `stepsMs: {}`; an earlier switch of the same pod had filled it."""
    s = _switch("prefill", "decoder", "Drain")
    assert "stepsMs" not in s.to_status()
    assert sw.Switch.from_status(s.to_status()) == s
    assert violations({"switches": [s.to_status()]}, status_schema) == []


def test_the_checker_refuses_what_the_api_server_refuses(status_schema):
    assert violations({"switches": [{"pod": "p"}]}, status_schema)            # required fields
    assert violations({"phase": "Sideways"}, status_schema)                   # enum
    assert violations({"rebalance": {}}, status_schema)                       # {} -> null
    assert violations({"links": {"expected": "4"}}, status_schema)            # type
