"""Invalid specs are rejected by the real API server, each with a message naming the field."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.conftest import REPO, Cluster
from tests.integration.conftest import sample

pytestmark = pytest.mark.integration


def with_(path: str, value):
    def mutate(doc):
        node = doc
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if value is DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return mutate


DELETE = object()


def on_reference(kv_field: str, value):
    """The reference engine with one spec.model.kvCache field it cannot compute."""
    return lambda d: (with_("spec.sim", {"engine": "reference"})(d), with_(f"spec.model.kvCache.{kv_field}", value)(d))
REBAL = {"policy": "Load", "minPrefill": 1, "minDecoder": 1}

CASES = [
    ("sim block on the real backend", lambda d: d["spec"].update(backend="llm-datadist", sim={"timeScale": 0.1}),
     "spec.sim"),
    ("zero time scale", with_("spec.sim", {"timeScale": 0}), "spec.sim.timeScale"),
    ("negative fault delay", with_("spec.sim", {"faults": {"pullDelayMs": -1}}), "spec.sim.faults.pullDelayMs"),
    ("unknown timing coefficient", with_("spec.sim", {"timing": {"prefillZ": 1}}), "spec.sim.timing"),
    ("negative drain timeout", with_("spec.drainTimeoutSeconds", -1), "spec.drainTimeoutSeconds"),
    ("negative replicas", with_("spec.prefill.replicas", -1), "spec.prefill.replicas"),
    ("port zero", with_("spec.datadist.port", 0), "spec.datadist.port"),
    ("port too big", with_("spec.datadist.port", 70000), "spec.datadist.port"),
    ("zero link timeout", with_("spec.datadist.linkTimeoutMs", 0), "spec.datadist.linkTimeoutMs"),
    ("unknown dtype", with_("spec.model.kvCache.dtype", "float8"), "spec.model.kvCache.dtype"),
    ("tp does not divide heads", with_("spec.model.kvCache.tensorParallel", 3), "tensorParallel"),
    ("zero layers", with_("spec.model.kvCache.numLayers", 0), "spec.model.kvCache.numLayers"),
    ("missing layers", with_("spec.model.kvCache.numLayers", DELETE), "numLayers"),
    ("MLA without latentDim", with_("spec.model.kvCache.attention", "MLA"), "latentDim"),
    ("unknown attention", with_("spec.model.kvCache.attention", "MHA2"), "spec.model.kvCache.attention"),
    ("paged zero block size", with_("spec.model.kvCache.paged", {"blockSize": 0, "numBlocks": 8}),
     "spec.model.kvCache.paged.blockSize"),
    ("paged zero blocks", with_("spec.model.kvCache.paged", {"blockSize": 16, "numBlocks": 0}),
     "spec.model.kvCache.paged.numBlocks"),
    ("unknown backend", with_("spec.backend", "cuda"), "spec.backend"),
    ("empty image", with_("spec.image", ""), "spec.image"),
    ("missing model", with_("spec.model", DELETE), "spec.model"),
    ("min counts exceed replicas", with_("spec.rebalance", {**REBAL, "minPrefill": 3, "minDecoder": 3}),
     "spec.rebalance.minPrefill"),
    ("Manual without manual", with_("spec.rebalance", {"policy": "Manual"}), "spec.rebalance.manual"),
    ("Manual below minPrefill",
     with_("spec.rebalance", {"policy": "Manual", "minPrefill": 2, "manual": {"prefill": 1}}),
     "spec.rebalance.manual.prefill"),
    ("Manual leaves no decoder", with_("spec.rebalance", {"policy": "Manual", "manual": {"prefill": 4}}),
     "spec.rebalance.manual.prefill"),
    ("Schedule without entries", with_("spec.rebalance", {"policy": "Schedule"}), "spec.rebalance.schedule"),
    ("Schedule bad cron",
     with_("spec.rebalance", {"policy": "Schedule", "schedule": [{"cron": "daily", "prefill": 2}]}),
     "spec.rebalance.schedule[0].cron"),
    ("Schedule leaves no decoder",
     with_("spec.rebalance", {"policy": "Schedule", "schedule": [{"cron": "0 1 * * *", "prefill": 4}]}),
     "spec.rebalance.schedule[].prefill"),
    ("SLO without targets", with_("spec.rebalance", {"policy": "SLO"}), "spec.rebalance.targets"),
    ("Goodput without targets", with_("spec.rebalance", {"policy": "Goodput"}), "spec.rebalance.targets"),
    ("Seasonal without its period",
     with_("spec.rebalance", {"policy": "Goodput", "targets": {"ttftP90Ms": 3000, "tbtP90Ms": 60},
                              "goodput": {"predictor": "Seasonal"}}), "spec.rebalance.goodput.seasonalPeriodSeconds"),
    ("maxConcurrentSwitches not a number or a percentage",
     with_("spec.rebalance", {"policy": "Load", "maxConcurrentSwitches": "half"}),
     "spec.rebalance.maxConcurrentSwitches"),
    ("unknown policy", with_("spec.rebalance", {"policy": "Magic"}), "spec.rebalance.policy"),
    ("gateway without keys", with_("spec.gateway", {"enabled": True}), "spec.gateway.apiKeysSecret"),
    ("gateway zero rate limit", with_("spec.gateway", {"rateLimits": {"team": 0}}), "spec.gateway.rateLimits.team"),
    ("SLO zero target", with_("spec.rebalance", {"policy": "SLO", "targets": {"ttftP90Ms": 0, "tbtP90Ms": 50}}),
     "spec.rebalance.targets.ttftP90Ms"),
    ("overlapping cluster ids", lambda d: (with_("spec.prefill.clusterIdBase", 0)(d),
                                           with_("spec.decoder.clusterIdBase", 1)(d)), "clusterIdBase"),
    ("prefill ids reach the default decoder base at TP 8",
     lambda d: (with_("spec.prefill.replicas", 126)(d), with_("spec.prefill.tensorParallel", 8)(d),
                with_("spec.decoder.tensorParallel", 8)(d), with_("spec.model.kvCache.numKvHeads", 8)(d)),
     "spec.prefill.clusterIdBase and spec.decoder.clusterIdBase ranges overlap"),
    ("decoder ids reach an explicit prefill base",
     lambda d: (with_("spec.prefill.clusterIdBase", 1001)(d)), "clusterIdBase"),
    ("unequal tensor parallelism",
     lambda d: (with_("spec.prefill.tensorParallel", 2)(d), with_("spec.decoder.tensorParallel", 4)(d)),
     "spec.prefill.tensorParallel and spec.decoder.tensorParallel must be equal"),
    ("live switching with unequal TP",
     lambda d: (with_("spec.model.kvCache", {"attention": "MLA", "latentDim": 64, "numLayers": 4})(d),
                with_("spec.prefill.tensorParallel", 4)(d), with_("spec.decoder.tensorParallel", 2)(d),
                with_("spec.rebalance", {"policy": "Manual", "manual": {"prefill": 2}})(d)),
     "spec.rebalance.method Switch needs equal spec.prefill.tensorParallel and spec.decoder.tensorParallel"),
    ("pods per instance that do not divide its ranks",
     lambda d: (with_("spec.prefill.tensorParallel", 4)(d), with_("spec.decoder.tensorParallel", 4)(d),
                with_("spec.prefill.podsPerInstance", 3)(d)),
     "spec.prefill.podsPerInstance must divide spec.prefill.tensorParallel x spec.prefill.dataParallel"),
    ("data parallelism without MLA",
     lambda d: with_("spec.decoder.dataParallel", 2)(d),
     "spec.decoder.dataParallel above 1 needs spec.model.kvCache.attention MLA"),
    ("a pod of an instance with more NPUs than a node",
     lambda d: (with_("spec.model.kvCache", {"attention": "MLA", "latentDim": 64, "numLayers": 4})(d),
                with_("spec.prefill.tensorParallel", 32)(d), with_("spec.decoder.tensorParallel", 32)(d),
                with_("spec.prefill.podsPerInstance", 2)(d)),
     "spec.prefill: tensorParallel x dataParallel / podsPerInstance is the NPUs of one pod and must not exceed"),
    ("MLA decoder TP that does not divide the prefill's",
     lambda d: (with_("spec.model.kvCache", {"attention": "MLA", "latentDim": 64, "numLayers": 4})(d),
                with_("spec.prefill.tensorParallel", 2)(d), with_("spec.decoder.tensorParallel", 4)(d)),
     "spec.prefill.tensorParallel and spec.decoder.tensorParallel must be equal, or with attention MLA the"),
    ("role tp does not divide heads",
     lambda d: (with_("spec.prefill.tensorParallel", 3)(d), with_("spec.decoder.tensorParallel", 3)(d)),
     "spec.prefill.tensorParallel and spec.decoder.tensorParallel must divide"),
    ("tp zero", with_("spec.decoder.tensorParallel", 0), "spec.decoder.tensorParallel"),
    ("reserved env", with_("spec.decoder.env", [{"name": "LLM_DATADIST_PORT", "value": "1"}]), "spec.decoder.env"),
    ("identity env overridden", with_("spec.prefill.env", [{"name": "POD_NAME", "value": "x"}]),
     "spec.prefill.env[].name: POD_NAME is set by the operator"),
    ("env with value and valueFrom",
     with_("spec.decoder.env", [{"name": "A", "value": "1",
                                 "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]),
     "spec.decoder.env"),
    ("the same env name twice", with_("spec.prefill.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
     "spec.prefill.env"),
    ("an engine image with spaces", with_("spec.engine", {"image": "my engine"}), "spec.engine.image"),
    ("an unknown engine adapter", with_("spec.engine", {"image": "e:1", "adapter": "TGI"}), "spec.engine.adapter"),
    ("an engine beside the agent with MindIE role pushes",
     lambda d: (with_("spec.engine", {"image": "e:1"})(d), with_("spec.mindie", {"enabled": True})(d)),
     "spec.engine and spec.mindie.enabled cannot be combined"),
    ("pd-gateway in front of a vLLM engine without its port",
     lambda d: (with_("spec.engine", {"image": "e:1", "adapter": "vLLM"})(d),
                with_("spec.model.kvCache.paged", {"blockSize": 16, "numBlocks": 64})(d),
                with_("spec.gateway", {"enabled": True, "apiKeysSecret": "k"})(d)),
     "spec.engine.port is required with spec.gateway.enabled and spec.engine.adapter vLLM"),
    ("a tokenizer with two sources", with_("spec.model.tokenizer", {
        "configMap": {"name": "a"}, "persistentVolumeClaim": {"claimName": "b", "path": "t.json"}}),
     "spec.model.tokenizer needs exactly one of configMap and persistentVolumeClaim"),
    ("a tokenizer path out of its volume", with_("spec.model.tokenizer", {
        "persistentVolumeClaim": {"claimName": "b", "path": "models/../../etc/passwd"}}),
     "must stay inside the volume"),
    ("a vLLM engine without a paged cache", with_("spec.engine", {"image": "e:1", "adapter": "vLLM"}),
     "spec.model.kvCache.paged is required with spec.engine.adapter vLLM"),
    ("the server's port on the agent's", with_("spec.engine", {"image": "e:1", "port": 8080}),
     "spec.engine.port must not be the agent's ports"),
    ("a Mooncake kv_port inside its transport's random range (8 NPUs per node)",
     lambda d: (with_("spec.engine", {"image": "e:1", "adapter": "vLLM", "port": 8001, "kvTransfer": "mooncake",
                                      "kvPort": 26000})(d),
                with_("spec.model.kvCache.paged", {"blockSize": 16, "numBlocks": 64})(d)),
     "spec.engine.kvPort is inside the Mooncake transport random port range [20000, 28000) for 8 NPUs per "
     "node (spec.ascend.npusPerNode): use 28000 or above"),
    ("a Mooncake kv_port inside the range of 16 NPUs per node",
     lambda d: (with_("spec.engine", {"image": "e:1", "adapter": "vLLM", "port": 8001, "kvTransfer": "mooncake",
                                      "kvPort": 30000})(d),
                with_("spec.ascend", {"npusPerNode": 16})(d),
                with_("spec.model.kvCache.paged", {"blockSize": 16, "numBlocks": 64})(d)),
     "[20000, 36000) for 16 NPUs per node"),
    ("a Mooncake side channel on the agent's port",
     lambda d: (with_("spec.engine", {"image": "e:1", "adapter": "vLLM", "port": 8001, "kvTransfer": "mooncake",
                                      "kvPort": 9091})(d),
                with_("spec.model.kvCache.paged", {"blockSize": 16, "numBlocks": 64})(d)),
     "spec.engine.kvPort and the ranks' side channels above it must not take the agent's ports"),
    ("Mooncake layerwise without the server's port",
     lambda d: (with_("spec.engine", {"image": "e:1", "adapter": "vLLM", "kvTransfer": "mooncake-layerwise"})(d),
                with_("spec.model.kvCache.paged", {"blockSize": 16, "numBlocks": 64})(d)),
     "spec.engine.port is required with spec.engine.kvTransfer mooncake"),
    ("Mooncake without vLLM", with_("spec.engine", {"image": "e:1", "kvTransfer": "mooncake", "port": 8001}),
     "spec.engine.kvTransfer mooncake and mooncake-layerwise need spec.engine.adapter vLLM"),
    ("Mooncake without the server's port",
     lambda d: (with_("spec.engine", {"image": "e:1", "adapter": "vLLM", "kvTransfer": "mooncake"})(d),
                with_("spec.model.kvCache.paged", {"blockSize": 16, "numBlocks": 64})(d)),
     "spec.engine.port is required with spec.engine.kvTransfer mooncake"),
    ("an unknown KV transfer", with_("spec.engine", {"image": "e:1", "kvTransfer": "nixl"}), "spec.engine.kvTransfer"),
    ("the operator's /tmp mounted over",
     lambda d: (with_("spec.decoder.volumes", [{"name": "scratch", "emptyDir": {}}])(d),
                with_("spec.decoder.volumeMounts", [{"name": "scratch", "mountPath": "/tmp"}])(d)),
     "spec.decoder.volumeMounts[].mountPath"),
    ("the operator's podinfo volume reused", with_("spec.prefill.volumes", [{"name": "podinfo", "emptyDir": {}}]),
     "spec.prefill.volumes[].name"),
    ("a mount of no volume", with_("spec.prefill.volumeMounts", [{"name": "weights", "mountPath": "/models"}]),
     "spec.prefill.volumeMounts[].name must name one of spec.prefill.volumes[]"),
    ("a volume with two sources",
     with_("spec.prefill.volumes", [{"name": "w", "emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}]),
     "exactly one of persistentVolumeClaim"),
    ("an agent token as env",
     with_("spec.prefill.env", [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "other-agent-token",
                                                                             "key": "token"}}}]),
     "spec.prefill.env[].valueFrom.secretKeyRef.name: the agent token Secrets"),
    ("an agent token as a volume",
     with_("spec.decoder.volumes", [{"name": "t", "secret": {"secretName": "x-agent-data-token"}}]),
     "spec.decoder.volumes[].secret.secretName: the agent token Secrets"),
    ("a mount under the rank table's directory",
     lambda d: (with_("spec.decoder.volumes", [{"name": "scratch", "emptyDir": {}}])(d),
                with_("spec.decoder.volumeMounts", [{"name": "scratch", "mountPath": "/etc/pd-mindie/x"}])(d)),
     "spec.decoder.volumeMounts[].mountPath"),
    ("unknown field", with_("spec.datadist.topolgy", "FullMesh"), "topolgy"),
    ("unknown topology", with_("spec.datadist.topology", "Ring"), "spec.datadist.topology"),
    ("name too long", with_("metadata.name", "x" * 45), "metadata.name"),
    ("unknown sim engine", with_("spec.sim", {"engine": "vllm"}), "spec.sim.engine"),
    ("reference engine, too many layers", on_reference("numLayers", 80),
     "spec.model.kvCache.numLayers must be at most 16 with spec.sim.engine reference"),
    ("reference engine, too short a context", on_reference("maxSeqLen", 16),
     "spec.model.kvCache.maxSeqLen must be 64 to 8192 with spec.sim.engine reference"),
    ("reference engine, int8", on_reference("dtype", "int8"),
     "spec.model.kvCache.dtype int8 is not computed by spec.sim.engine reference"),
    ("reference engine, too wide", on_reference("headDim", 256), "2 x numKvHeads x headDim"),
    ("reference engine, TP a multiple of the heads", on_reference("tensorParallel", 8),
     "must divide spec.model.kvCache.numKvHeads with spec.sim.engine reference"),
    ("InferencePools with no port a gateway can send to", with_("spec.routing", {"inferencePool": True}),
     "spec.routing.targetPorts (or spec.engine.port) is required with spec.routing.inferencePool"),
    ("an InferencePool port twice", with_("spec.routing", {"inferencePool": True, "targetPorts": [8000, 8000]}),
     "spec.routing.targetPorts must not repeat a port"),
    ("a Role pool's pickers on a Deployment pool",
     with_("spec.routing", {"inferencePool": True, "targetPorts": [8000], "endpointPickerRefs": {
         "prefill": {"name": "p"}}}), "spec.routing.endpointPickerRefs are the Role pools' pickers"),
    ("a negative leave-pool wait", with_("spec.routing", {"leavePoolSeconds": -1}), "spec.routing.leavePoolSeconds"),
]


@pytest.mark.parametrize("label,mutate,field", CASES, ids=[c[0] for c in CASES])
def test_invalid_spec_rejected(cluster: Cluster, crd, namespace: str, label, mutate, field) -> None:
    doc = copy.deepcopy(sample(f"bad-{abs(hash(label)) % 10000}"))
    mutate(doc)
    r = cluster.kubectl("create", "-n", namespace, "-f", "-", "--validate=strict",
                        input=json.dumps(doc), check=False)
    assert r.returncode != 0, f"{label}: accepted"
    assert field in r.stderr, f"{label}: message does not name {field}: {r.stderr}"


def test_valid_sample_is_accepted_with_defaults(cluster: Cluster, crd, namespace: str) -> None:
    doc = sample()
    del doc["spec"]["datadist"]
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    got = cluster.get_json("pdd", "sim-small", "-n", namespace)["spec"]
    assert got["datadist"] == {"port": 26000, "linkTimeoutMs": 5000, "syncKvTimeoutMs": 1000,
                               "topology": "FullMesh", "verifyIntervalSeconds": 60, "preflight": "Enforce"}
    assert got["model"]["kvCache"]["attention"] == "GQA"


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yaml")))
def test_examples_are_accepted(cluster: Cluster, crd, namespace: str, example: str) -> None:
    doc = yaml.safe_load((REPO / "examples" / example).read_text())
    doc["metadata"].pop("namespace", None)
    r = cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
    assert r.returncode == 0, r.stderr
