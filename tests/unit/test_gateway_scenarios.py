"""PDGateway controller scenarios: the real GatewayController's passes against the fake API server
(controller_fakes.FakeKube), with every call recorded in order and time driven through an
injected clock. Each runs in milliseconds."""
from __future__ import annotations

import asyncio
import base64
import copy

import pytest
import yaml

from pd_operator.config import OperatorConfig
from pd_operator.events import Events
from pd_operator.gatewaycontroller import RECHECK_S, GatewayController
from pd_operator.tokens import digest
from tests.conftest import REPO
from tests.unit.controller_fakes import FakeKube, Log

BASE = yaml.safe_load((REPO / "examples" / "sim-small.yaml").read_text())
KEY = ("t", "shared")
TOKEN = "data-token-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class World:
    def __init__(self, image: str = "example.com/pd/pd-gateway:0.1.0", opted_in: bool = True):
        self.log = Log()
        self.kube = FakeKube(self.log)
        self.clock = Clock()
        self.leading = asyncio.Event()
        self.leading.set()
        self.gc = GatewayController(self.kube, Events(self.kube), OperatorConfig(gateway_image=image), self.leading,
                                    clock=self.clock)
        self.put({"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDGateway",
                  "metadata": {"name": "shared", "namespace": "t", "uid": "uid-gw", "generation": 1},
                  "spec": {"apiKeysSecret": "keys"}})
        self.put({"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": "keys", "namespace": "t",
                               "labels": {"pdoperator.io/keys": "true"} if opted_in else {}},
                  "data": {"team-a": base64.b64encode(b"sk-a").decode()}})

    def put(self, obj: dict) -> dict:
        return self.kube.store(obj)

    def deployment(self, name: str, model: str, created: str = "2026-01-01T00:00:00Z", prefill: int = 1,
                   decoder: int = 1, token: str | None = TOKEN, recorded: str | None = TOKEN) -> None:
        d = copy.deepcopy(BASE)
        d["metadata"] = {"name": name, "namespace": "t", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created}
        d["spec"]["model"]["name"] = model
        d["status"] = {"prefill": prefill, "decoder": decoder, "observedGeneration": 1,
                       "tokenDigests": {"data": digest(recorded)} if recorded else {}}
        self.put(d)
        if token is not None:
            self.put({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-agent-data-token",
                                                                       "namespace": "t"},
                      "data": {"token": base64.b64encode(token.encode()).decode()}})

    async def step(self) -> None:
        await self.gc.reconcile(KEY)

    @property
    def status(self) -> dict:
        return self.kube.objects[("PDGateway", "t", "shared")].get("status") or {}

    def cond(self, ctype: str) -> dict:
        return next((c for c in self.status.get("conditions", []) if c["type"] == ctype), {})

    def events(self, since: int = 0) -> list[tuple]:
        return [c for c in self.log[since:] if c[0] == "event"]

    def applied(self, since: int = 0) -> list[tuple]:
        return [c for c in self.log[since:] if c[0] == "apply"]


async def test_first_pass_applies_the_gateway_records_status_and_says_what_it_routes():
    w = World()
    w.deployment("llama", "llama-8b")
    await w.step()
    assert {c[1] for c in w.applied()} >= {"Deployment", "Service"}
    assert ("create", "ConfigMap", "shared-usage") in w.log            # created once: the replicas own its data
    assert w.cond("GatewayKeys")["status"] == "True"
    assert ("event", "ModelsServed", "routing llama-8b -> llama") in w.log
    dep = w.kube.objects[("Deployment", "t", "shared")]
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-gw"


async def test_a_settled_pass_writes_nothing_and_drift_is_reapplied_after_the_recheck():
    w = World()
    w.deployment("llama", "llama-8b")
    await w.step()
    before = len(w.log)
    await w.step()
    assert w.log[before:] == [], "a settled pass applies, writes status or posts nothing"
    w.clock.now += RECHECK_S           # what others changed is put back every RECHECK_S
    await w.step()
    assert {c[1] for c in w.applied(before)} >= {"Deployment", "Service"}
    assert not [c for c in w.log[before:] if c[0] == "status"]


async def test_a_keys_secret_not_opted_in_runs_no_pod_and_says_so():
    w = World(opted_in=False)
    w.deployment("llama", "llama-8b")
    await w.step()
    assert w.cond("GatewayKeys")["reason"] == "KeysSecretNotOptedIn"
    assert any(e[1] == "KeysSecretNotOptedIn" for e in w.events())
    dep = w.kube.objects[("Deployment", "t", "shared")]
    assert dep["spec"]["replicas"] == 0


async def test_two_deployments_claiming_a_model_are_a_conflict_routed_to_the_one_that_serves():
    w = World()
    w.deployment("old", "qwen-7b", created="2026-01-01T00:00:00Z", prefill=0, decoder=0)
    w.deployment("new", "qwen-7b", created="2026-02-01T00:00:00Z")
    await w.step()
    assert ("event", "ModelsServed", "routing qwen-7b -> new") in w.log
    conflict = [e for e in w.events() if e[1] == "ModelConflict"]
    assert conflict and "routed to new" in conflict[0][2] and "old left out" in conflict[0][2]
    assert w.cond("ModelsServed")["reason"] == "ModelConflict"


async def test_a_deployment_whose_data_token_is_not_the_operators_is_not_routed():
    w = World()
    w.deployment("good", "llama-8b")
    w.deployment("planted", "qwen-7b", token="someone-elses", recorded=TOKEN)
    w.deployment("tokenless", "mistral", token=None)
    await w.step()
    served = [e for e in w.events() if e[1] == "ModelsServed"]
    assert served == [("event", "ModelsServed", "routing llama-8b -> good")]


@pytest.mark.parametrize("api_version,kind", [("apps/v1", "Deployment"), ("networking.k8s.io/v1", "NetworkPolicy"),
                                              ("v1", "ServiceAccount"), ("policy/v1", "PodDisruptionBudget")])
async def test_names_another_owner_controls_are_refused_not_fought_over(api_version, kind):
    """Every object the gateway applies is checked (a PDGateway named <deployment>-engines must not take
    the engines' NetworkPolicy), not only its Deployment."""
    w = World()
    w.deployment("llama", "llama-8b")
    w.put({"apiVersion": api_version, "kind": kind, "metadata": {
        "name": "shared", "namespace": "t", "ownerReferences": [{"kind": "PDDeployment", "name": "x",
                                                                 "uid": "uid-other", "controller": True}]}})
    await w.step()
    assert w.applied() == []
    assert w.cond("Ready")["reason"] == "NameTaken" and w.status["phase"] == "Degraded"
    assert f"{kind} shared" in w.cond("Ready")["message"]
    assert any(e[1] == "NameTaken" for e in w.events())


async def test_without_a_gateway_image_it_is_degraded_and_applies_nothing():
    w = World(image="")
    await w.step()
    assert w.applied() == [] and w.cond("Ready")["reason"] == "NoGatewayImage"
    assert any(e[1] == "NoGatewayImage" for e in w.events())


async def test_a_spec_that_does_not_parse_is_reported_and_nothing_applied():
    w = World()
    w.kube.objects[("PDGateway", "t", "shared")]["spec"] = {"apiKeysSecret": "keys", "replicas": 0}
    await w.step()
    assert w.cond("Ready")["reason"] == "InvalidSpec" and w.applied() == []
    assert w.cond("Ready")["message"].startswith("the spec does not parse: ")


async def test_a_data_token_seen_once_is_read_again_only_after_the_recheck():
    w = World()
    w.deployment("llama", "llama-8b")
    reads: list[str] = []
    get = w.kube.get

    async def counting(api_version, kind, ns, name):
        if kind == "Secret" and name.endswith("-agent-data-token"):
            reads.append(name)
        return await get(api_version, kind, ns, name)
    w.kube.get = counting  # type: ignore[method-assign]
    await w.step()
    await w.step()
    assert reads == ["llama-agent-data-token"]
    w.clock.now += RECHECK_S
    await w.step()
    await w.step()
    assert reads == ["llama-agent-data-token"] * 2


async def test_a_standby_runs_no_pass_and_leadership_loss_cancels_the_pass_in_flight():
    w = World()
    w.deployment("llama", "llama-8b")
    started, release = asyncio.Event(), asyncio.Event()
    passes: list[str] = []
    real = w.gc.reconcile

    async def slow(key):
        passes.append("start")
        started.set()
        await release.wait()
        await real(key)
        passes.append("done")
    w.gc.reconcile = slow  # type: ignore[method-assign]
    w.gc.on_gateway("ADDED", copy.deepcopy(w.kube.objects[("PDGateway", "t", "shared")]))
    await asyncio.wait_for(started.wait(), 5)
    w.leading.clear()
    await w.gc.follow()               # lost the Lease: the pass in flight is cancelled, not finished
    release.set()
    await asyncio.sleep(0.1)
    assert passes == ["start"] and w.applied() == []
    started.clear()
    w.leading.set()
    await w.gc.lead()
    await asyncio.wait_for(started.wait(), 5)
    for _ in range(50):
        if "done" in passes:
            break
        await asyncio.sleep(0.02)
    assert passes == ["start", "start", "done"] and w.applied()
    await w.gc.stop()


@pytest.mark.parametrize("etype", ["DELETED", "MODIFIED"])
async def test_a_deployment_status_write_does_not_wake_the_gateway_but_a_spec_change_does(etype):
    w = World()
    w.leading.clear()                 # a standby: the worker waits, the wake-ups are what is tested
    w.gc.on_gateway("ADDED", copy.deepcopy(w.kube.objects[("PDGateway", "t", "shared")]))
    d = {"metadata": {"name": "llama", "namespace": "t", "generation": 1, "labels": {}}}
    w.gc.on_deployment("ADDED", d)
    await w.gc.runtime.once(KEY)   # takes the wake-ups so far (the pass itself waits for nothing here)
    assert not w.gc.runtime.woken(KEY)
    w.gc.on_deployment("MODIFIED", {**d, "status": {"phase": "Ready"}})   # a status write: same generation
    assert not w.gc.runtime.woken(KEY)
    w.gc.on_deployment(etype, {**d, "metadata": {**d["metadata"], "generation": 2}})
    assert w.gc.runtime.woken(KEY)
    await w.gc.stop()

