"""One Base URL and one key for two models: a PDGateway in front of two PDDeployments, reached
with the real `openai` and `anthropic` clients; keys scoped to models, quotas, expiry, usage
shared by the gateway's replicas, keys removed without a restart, and a live switch in one
deployment under load through the shared gateway."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import Cluster, wait_for
from tests.integration.conftest import keys_secret, pdd, sample, wait_phase
from tests.integration.test_switching import switched
from tests.integration.test_traffic import TRAFFIC_SPEC, Load

pytestmark = pytest.mark.integration
IMAGE = "example.com/pd/pd-gateway:0.1.0"
KEYS = {"team-a": "sk-shared-team-a-000001", "team-b": "sk-shared-team-b-000002", "ops": "sk-shared-ops-00000003",
        "small": "sk-shared-small-0000004", "old": "sk-shared-old-000000005", "gone": "sk-shared-gone-00000006"}
POLICY = {"team-b": {"models": ["llama-8b"]}, "ops": {"admin": True}, "small": {"tokensPerDay": 10},
          "old": {"expires": "2026-01-01T00:00:00Z"}}


def gateway_urls(cluster: Cluster, ns: str) -> list[str]:
    pods = cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/pdgateway=shared")["items"]
    return [f"http://{p['status']['podIP']}:8000" for p in pods if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


def switch_a(cluster: Cluster, ns: str, n: int) -> None:
    cluster.kubectl("patch", "pdd", "sim-a", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"rebalance": {"manual": {"prefill": n}}}}))


@pytest.fixture
def shared(cluster: Cluster, namespace: str, operator):
    ns = namespace
    operator.stop()
    operator.start(PD_OPERATOR_GATEWAY_IMAGE=IMAGE)
    keys_secret(cluster, ns, name="shared-keys", **KEYS)
    a = sample("sim-a", **TRAFFIC_SPEC, rebalance={"policy": "Manual", "manual": {"prefill": 2}, "cooldownSeconds": 0})
    a["spec"]["model"].update(name="llama-8b", aliases=["llama"])
    b = sample("sim-b", **TRAFFIC_SPEC)
    b["spec"]["model"]["name"] = "qwen-7b"
    b["spec"]["prefill"]["replicas"] = b["spec"]["decoder"]["replicas"] = 1
    for d in (a, b):
        cluster.apply(d, ns)
    cluster.apply({"apiVersion": "pdoperator.io/v1alpha1", "kind": "PDGateway", "metadata": {"name": "shared"},
                   "spec": {"apiKeysSecret": "shared-keys", "replicas": 2, "keys": POLICY}}, ns)
    wait_phase(cluster, ns, "Ready", name="sim-a", timeout=150, extra=lambda o: o["status"]["linksSummary"] == "4/4")
    wait_phase(cluster, ns, "Ready", name="sim-b", timeout=90, extra=lambda o: o["status"]["linksSummary"] == "1/1")
    def settled():
        """Ready, serving both models, its rollout done (the routes change as the deployments'
        tokens appear), and each pod seeing both fleets."""
        o = cluster.get_json("pdgw", "shared", "-n", ns)
        if o.get("status", {}).get("phase") != "Ready" or len(o["status"].get("models") or []) != 2:
            return None
        d = cluster.get_json("deployment", "shared", "-n", ns)
        st = d.get("status", {})
        if not (st.get("observedGeneration") == d["metadata"]["generation"]
                and st.get("updatedReplicas") == st.get("readyReplicas") == st.get("replicas") == 2):
            return None
        urls = gateway_urls(cluster, ns)
        if len(urls) != 2 or not all(all(m["decoders"] >= 1 for m in httpx.get(
                f"{u}/healthz", trust_env=False, timeout=5).json().get("models", {"-": {"decoders": 0}}).values())
                for u in urls):
            return None
        return o, urls
    gw, urls = wait_for("the PDGateway Ready, rolled out, seeing both fleets", settled, timeout=150)
    return ns, urls, gw


def test_one_url_one_key_two_models(cluster: Cluster, shared):
    import anthropic
    import openai
    ns, urls, gw = shared
    url = urls[0]
    assert gw["status"]["models"] == [{"model": "llama-8b", "deployment": "sim-a", "aliases": ["llama"]},
                                      {"model": "qwen-7b", "deployment": "sim-b"}]
    assert gw["status"]["url"] == f"http://shared.{ns}.svc:8000/v1"
    sa = f"system:serviceaccount:{ns}:shared"
    can = lambda *a: cluster.kubectl("auth", "can-i", *a, f"--as={sa}", "-n", ns, check=False).stdout.strip()  # noqa
    assert can("get", "secret/shared-keys") == "yes" and can("get", "secret/sim-a-agent-token") == "no"
    assert can("patch", "configmap/shared-usage") == "yes" and can("patch", "configmap/sim-a-prefill") == "no"

    import httpx2  # the anthropic SDK's own HTTP client package
    http = httpx.Client(trust_env=False)
    http2 = httpx2.Client(trust_env=False)
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["team-a"], http_client=http)
    an = anthropic.Anthropic(base_url=url, api_key=KEYS["team-a"], http_client=http2)
    assert [m.id for m in oa.models.list().data] == ["llama-8b", "llama", "qwen-7b"]
    sent: dict[str, list[int]] = {"llama-8b": [0, 0, 0], "qwen-7b": [0, 0, 0]}   # requests, input, output

    def count(model: str, usage_in: int, usage_out: int) -> None:
        c = sent[model]
        c[0], c[1], c[2] = c[0] + 1, c[1] + usage_in, c[2] + usage_out

    for model in ("llama-8b", "llama", "qwen-7b"):
        r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello " + model}],
                                       max_tokens=5)
        assert r.choices[0].message.content and r.usage.completion_tokens == 5
        count(r.model, r.usage.prompt_tokens, r.usage.completion_tokens)
        stream = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "again"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 4
        count(chunks[-1].model, chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)
    for model in ("qwen-7b", "llama-8b"):
        m = an.messages.create(model=model, max_tokens=6, messages=[{"role": "user", "content": "hi " + model}])
        assert m.content[0].text and m.usage.output_tokens == 6
        count(m.model, m.usage.input_tokens, m.usage.output_tokens)
        with an.messages.stream(model=model, max_tokens=3, messages=[{"role": "user", "content": "yo"}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert text and final.usage.output_tokens == 3
        count(final.model, final.usage.input_tokens, final.usage.output_tokens)

    # a key scoped to one model
    ob = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["team-b"], http_client=http)
    assert ob.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                      max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.PermissionDeniedError, match="model not allowed for this key"):
        ob.chat.completions.create(model="qwen-7b", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    with pytest.raises(anthropic.PermissionDeniedError, match="model not allowed for this key"):
        anthropic.Anthropic(base_url=url, api_key=KEYS["team-b"], http_client=http2).messages.create(
            model="qwen-7b", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    # a small token quota, an expired key
    osmall = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["small"], http_client=http, max_retries=0)
    # its prompt (9 tokens) and max_tokens (1) fit the quota of 10 exactly; nothing more does today
    osmall.chat.completions.create(model="qwen-7b", messages=[{"role": "user", "content": "x" * 40}], max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        osmall.chat.completions.create(model="qwen-7b", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert "tokensPerDay 10" in str(e.value) and "resets at" in str(e.value)
    assert int(e.value.response.headers["Retry-After"]) > 0
    with pytest.raises(openai.AuthenticationError, match="expired"):
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["old"], http_client=http).models.list()

    # usage: what was sent, per model; the other replica has it once synced
    own = http.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {KEYS['team-a']}"}).json()
    day = next(iter(own["usage"]["team-a"]))
    got = {m: [c["requests"], c["input"], c["output"]] for m, c in own["usage"]["team-a"][day].items()}
    print(f"\nsent {sent}; usage {got}")
    assert got == sent and set(own["usage"]) == {"team-a"}
    admin = {"Authorization": f"Bearer {KEYS['ops']}"}
    here = http.get(f"{url}/v1/usage", headers=admin).json()["usage"]
    assert {"team-a", "team-b", "small"} <= set(here)
    wait_for("the other replica to have the same usage", lambda: http.get(
        f"{urls[1]}/v1/usage", headers=admin).json()["usage"] == here, timeout=30)
    cm = cluster.get_json("configmap", "shared-usage", "-n", ns)
    assert json.loads(cm["data"]["usage.json"])["days"][day]["team-a"]["qwen-7b"]["requests"] == sent["qwen-7b"][0]

    # a key removed from the Secret is refused within the reload interval (10 s)
    cluster.kubectl("patch", "secret", "shared-keys", "-n", ns, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/data/gone"}]))
    t0 = time.monotonic()
    wait_for("the removed key refused", lambda: httpx.get(f"{url}/v1/models", trust_env=False, headers={
        "Authorization": f"Bearer {KEYS['gone']}"}).status_code == 401, timeout=30)
    print(f"removed key refused {time.monotonic() - t0:.1f}s after the Secret changed")
    connect_checks(cluster, ns, urls)


def connect_checks(cluster: Cluster, ns: str, urls: list[str]) -> None:
    """`kubectl pdd connect`: each client's configuration parses and carries the three things,
    the curl line works, --check passes, and explains a wrong key."""
    import shlex
    import subprocess
    import tomllib

    from tests.integration.test_gateway import kubectl_pdd
    r = kubectl_pdd(cluster, "connect", "shared", "-n", ns, "--client", "codex", "--key-name", "team-b")
    assert r.returncode == 0, r.stderr
    cfg = tomllib.loads(r.stdout)
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert provider["base_url"] in {u + "/v1" for u in urls} and "loopback addresses" in r.stderr
    assert cfg["model"] == "llama-8b" and f"export {provider['env_key']}={KEYS['team-b']}" in r.stdout
    r = kubectl_pdd(cluster, "connect", "shared", "-n", ns, "--client", "cline", "--key-name", "team-a",
                    "--model", "qwen-7b")
    cline = json.loads(r.stdout[r.stdout.index("\n{") + 1:])["providers"]["openai-compatible"]["settings"]
    assert cline["apiKey"] == KEYS["team-a"] and cline["model"] == "qwen-7b"
    assert cline["baseUrl"] in {u + "/v1" for u in urls}
    r = kubectl_pdd(cluster, "connect", "shared", "-n", ns, "--client", "curl", "--key-name", "team-a")
    out = subprocess.run(shlex.split(r.stdout), capture_output=True, text=True, timeout=30)
    assert json.loads(out.stdout)["choices"][0]["message"]["content"], out.stdout + out.stderr
    for client in ("openai", "claude-code", "codex", "cline", "anthropic"):
        r = kubectl_pdd(cluster, "connect", "shared", "-n", ns, "--client", client, "--key-name", "team-a", "--check")
        assert r.returncode == 0 and "check passed" in r.stderr, r.stdout + r.stderr
    r = kubectl_pdd(cluster, "connect", "shared", "-n", ns, "--client", "openai", "--check",
                    "--api-key", "sk-not-a-key-of-this-gateway")
    print(r.stderr)
    assert r.returncode == 1 and "401: the key was refused" in r.stderr


def test_a_live_switch_through_the_shared_gateway(cluster: Cluster, shared):
    ns, urls, _ = shared
    load = Load(cluster, ns, duration=300, gateway=urls[0], api_key=KEYS["team-a"], name="sim-a")
    time.sleep(3)
    with load.change("decoder -> prefill"):
        switch_a(cluster, ns, 3)
        last = switched(cluster, ns, "prefill", None, "3/3", name="sim-a")
    time.sleep(2)
    with load.change("prefill -> decoder"):
        switch_a(cluster, ns, 2)
        switched(cluster, ns, "decoder", last["status"]["lastSwitch"]["at"], "4/4", name="sim-a")
    time.sleep(2)
    s = load.stop()
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"], s
    load.assert_traffic_through_changes()
    assert pdd(cluster, ns, "sim-b")["status"]["phase"] == "Ready"
