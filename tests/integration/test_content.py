"""Real content end to end, on the reference engine (spec.sim.engine: reference): prompts are
tokenized by pd-gateway, prefilled on P (real KV, sharded by rank), pulled by D over the links
and decoded there. Every completion must equal one engine's decode of the same prompt, token
for token: with GQA at equal TP, with MLA at unequal TP, and across live switches under load.
A shard served wrong (corrupted, truncated, swapped) is caught by the content probe and named.
Over-long requests are refused before any engine works on them."""
from __future__ import annotations

import concurrent.futures
import contextlib
import random
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from llm_datadist_sim.refmodel import Model, Profile
from pd_contract import tokens
from tests.conftest import Cluster, wait_for
from tests.integration.conftest import agent_post, condition, events, keys_secret, sample, wait_phase
from tests.integration.test_switching import REBALANCE, set_prefill, switched
from tests.integration.test_traffic import Load

pytestmark = pytest.mark.integration
KEY = "sk-pd-test-content-0001"
NPU = "huawei.com/Ascend910"
SEED = 11
PROFILE = {"numLayers": 2, "numKvHeads": 4, "headDim": 16, "maxSeqLen": 512, "dtype": "float16", "maxBatch": 4}
WORDS = ("cache", "prefill", "decode", "link", "rank", "token", "switch", "engine", "model", "drain", "tensor",
         "shard", "operator", "pull", "latency", "queue", "ratio", "policy", "probe", "gateway")


def reference_doc(tp_prefill: int, tp_decoder: int, attention: str = "GQA", **extra) -> dict:
    doc = sample(**{"datadist.verifyIntervalSeconds": 5, "drainTimeoutSeconds": 30,
                    "sim": {"engine": "reference", "seed": SEED, "timeScale": 0.3},
                    "gateway": {"enabled": True, "apiKeysSecret": "sim-small-keys"}}, **extra)
    kv = doc["spec"]["model"]["kvCache"]
    kv.update(PROFILE, tensorParallel=tp_prefill, attention=attention)
    if attention == "MLA":
        kv["latentDim"] = 32
    for g, tp in (("prefill", tp_prefill), ("decoder", tp_decoder)):
        doc["spec"][g]["tensorParallel"] = tp
        doc["spec"][g]["resources"] = {"limits": {NPU: tp}}
    return doc


def one_engine(doc: dict) -> Model:
    """The model every engine of `doc` runs, here in the test: a single engine's decode."""
    kv = doc["spec"]["model"]["kvCache"]
    return Model.get(Profile.from_json({**{k: kv[k] for k in ("attention", "numLayers", "numKvHeads", "headDim",
                                                              "dtype", "maxSeqLen")},
                                        **({"latentDim": kv["latentDim"]} if "latentDim" in kv else {}),
                                        "seed": SEED}))


def prefill_calls(cluster: Cluster, ns: str) -> int:
    """POST /v1/prefill calls the prefill pods' agents have answered, whatever the answer."""
    n = 0
    for i in (0, 1):
        ip = cluster.get_json("pod", f"sim-small-prefill-{i}", "-n", ns)["status"]["podIP"]
        for line in httpx.get(f"http://{ip}:8080/metrics", trust_env=False, timeout=5).text.splitlines():
            if line.startswith("pd_agent_api_calls_total{") and 'op="prefill"' in line:
                n += int(float(line.rsplit(" ", 1)[1]))
    return n


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) + "?" for _ in range(n)]


def gateway_url(cluster: Cluster, ns: str, decoders: int = 2) -> str:
    def ready() -> str | None:
        pods = cluster.get_json("pods", "-n", ns, "-l", "pdoperator.io/gateway=sim-small")["items"]
        p = next((p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))), None)
        return p and f"http://{p['status']['podIP']}:8000"
    url = wait_for("the gateway Ready", ready, timeout=90)
    wait_for("the gateway sees the fleet", lambda: httpx.get(f"{url}/healthz", trust_env=False).json()[
        "decoders"] >= decoders, timeout=60)
    return url


class Checker:
    """Completions through pd-gateway with the real openai client, each compared with one
    engine's greedy decode of the same prompt (the gateway returns the ids it detokenized)."""

    def __init__(self, url: str, model: Model, max_tokens: int = 16):
        import openai
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120,
                                    http_client=httpx.Client(trust_env=False, timeout=120))
        self.model, self.max_tokens = model, max_tokens
        self.served = self.client.models.list().data[0].id
        self.lock = threading.Lock()
        self.results: list[dict] = []

    def one(self, text: str) -> dict:
        ids = tokens.encode(f"user: {text}")
        want = self.model.generate(ids, self.max_tokens)
        t0 = time.time()
        try:
            r = self.client.chat.completions.create(
                model=self.served, messages=[{"role": "user", "content": text}], max_tokens=self.max_tokens,
                temperature=0, extra_body={"return_token_ids": True})
            got = r.choices[0].model_extra.get("token_ids")
            out = {"ok": True, "match": got == want and r.choices[0].message.content == tokens.decode(want),
                   "prompt_tokens": r.usage.prompt_tokens, "want_prompt": len(ids), "got": got, "want": want,
                   "completion_tokens": r.usage.completion_tokens,
                   "text": r.choices[0].message.content}
        except Exception as e:  # noqa: BLE001 - a failed request is counted, and shown
            out = {"ok": False, "match": False, "error": f"{type(e).__name__}: {e}"}
        out.update(sent_at=t0, done_at=time.time())
        with self.lock:
            self.results.append(out)
        return out

    def run(self, texts: list[str], workers: int = 6) -> list[dict]:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self.one, texts))

    @contextlib.contextmanager
    def running(self, seed: int, batch: int = 4) -> Iterator[None]:
        """Completions checked in a loop (batches of `batch` prompts, seeds from `seed`) for as long as
        the block runs: what a change is measured against. The loop ends with the block."""
        stop = threading.Event()

        def loop() -> None:
            i = 0
            while not stop.is_set():
                self.run(prompts(batch, seed=seed + i), workers=batch)
                i += 1
        checker = threading.Thread(target=loop, daemon=True)
        checker.start()
        try:
            yield
        finally:
            stop.set()
            checker.join(timeout=180)

    def summary(self) -> dict:
        bad = [r for r in self.results if not r["match"]]
        return {"requests": len(self.results), "failed": sum(not r["ok"] for r in self.results),
                "mismatched": sum(r["ok"] and not r["match"] for r in self.results), "first_bad": bad[:2]}


def switch_both_ways(cluster: Cluster, ns: str, check: Checker, load: Load, seed: int, links: tuple[str, str],
                     timeout: float) -> tuple[dict, dict]:
    """Prefill 2 -> 3 -> 2 by live switches (Manual policy) while `load` runs and `check` compares
    content; `links`: the links summary after each. The loadgen's result and the checks' summary."""
    with check.running(seed=seed):
        time.sleep(3)
        with load.change("decoder -> prefill"):
            set_prefill(cluster, ns, 3)
            last = switched(cluster, ns, "prefill", None, links[0], timeout=timeout)["status"]["lastSwitch"]
        time.sleep(3)
        with load.change("prefill -> decoder"):
            set_prefill(cluster, ns, 2)
            switched(cluster, ns, "decoder", last["at"], links[1], timeout=timeout)
        time.sleep(3)
    return load.stop(), check.summary()


def assert_all_match(results: list[dict]) -> None:
    bad = [r for r in results if not r["match"]]
    assert not bad, f"{len(bad)} of {len(results)} completions differ from one engine's decode: {bad[:3]}"
    assert all(r["prompt_tokens"] == r["want_prompt"] for r in results), "usage.prompt_tokens is the tokenizer's"
    assert all(r["completion_tokens"] == len(r["want"]) for r in results), "usage.completion_tokens: the output's"


@pytest.fixture
def gqa(cluster: Cluster, namespace: str, operator):
    keys_secret(cluster, namespace, **{"team-a": KEY})
    doc = reference_doc(2, 2, rebalance=REBALANCE)
    cluster.apply(doc, namespace)
    wait_phase(cluster, namespace, "Ready", timeout=180, extra=lambda o: o["status"]["linksSummary"] == "8/8"
               and condition(o, "KVContentMismatch").get("status") == "False")
    return namespace, doc, gateway_url(cluster, namespace)


def test_gqa_tp2_completions_equal_one_engine_and_stay_equal_across_live_switches(cluster: Cluster, gqa):
    import openai
    ns, doc, url = gqa
    check = Checker(url, one_engine(doc))
    t0 = time.monotonic()
    assert_all_match(check.run(prompts(50, seed=1)))
    print(f"\n50 prompts, GQA TP 2: all equal to one engine's decode ({time.monotonic() - t0:.1f}s)")
    sample_reply = check.results[0]
    print(f"a reply: {sample_reply['text']!r}")

    # refused before any engine work: prompt + max_tokens beyond the model's 512 positions
    before = prefill_calls(cluster, ns)
    assert before >= 50
    with pytest.raises(openai.BadRequestError) as err:
        check.client.chat.completions.create(model=check.served, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=600)
    assert err.value.code == "context_length_exceeded", err.value
    with pytest.raises(openai.BadRequestError):
        check.client.chat.completions.create(model=check.served, max_tokens=4,
                                             messages=[{"role": "user", "content": " x" * 700}])
    time.sleep(1)
    after = prefill_calls(cluster, ns)
    assert after == before, "a refused request reached an engine"

    # live switches 2 -> 3 -> 2 with traffic running, content checked throughout
    load = Load(cluster, ns, duration=300, rate=4, gateway=url, api_key=KEY, max_prompt=256, max_output=24)
    s, c = switch_both_ways(cluster, ns, check, load, 1000, ("6/6", "8/8"), timeout=150)
    print(f"through the switches: loadgen {s['completed']}/{s['requests']} completed; content checks {c}")
    assert s["failed"] == 0, s["failed_by_reason"]
    assert s["completed"] == s["requests"], s
    load.assert_traffic_through_changes()
    assert c["failed"] == 0 and c["mismatched"] == 0, c
    for what, (a, b) in load.changes.items():
        during = [r for r in check.results if r["sent_at"] <= b and r["done_at"] >= a]
        print(f"content checks in flight during {what}: {len(during)}")
        assert during, f"no content check ran during {what}"
    assert condition(wait_phase(cluster, ns, "Ready"), "KVContentMismatch")["status"] == "False"


def test_mla_unequal_tp_equal_one_engine_and_a_shard_served_wrong_is_caught(cluster: Cluster, namespace: str,
                                                                            operator):
    ns = namespace
    keys_secret(cluster, ns, **{"team-a": KEY})
    doc = reference_doc(4, 2, attention="MLA")
    cluster.apply(doc, ns)
    wait_phase(cluster, ns, "Ready", timeout=240, extra=lambda o: o["status"]["linksSummary"] == "8/8"
               and condition(o, "KVContentMismatch").get("status") == "False")
    check = Checker(gateway_url(cluster, ns), one_engine(doc))
    assert_all_match(check.run(prompts(50, seed=2)))
    print("\n50 prompts, MLA prefill TP 4 / decoder TP 2: all equal to one engine's decode")

    # decoder rank 1 reads prefill rank 2 (the mapping): serve that shard wrong, each way
    for fault in ("corrupt", "truncate", "swap"):
        agent_post(cluster, ns, "sim-small-prefill-0", "/r/2/v1/admin/faults", {"kv_fault": fault})
        t0 = time.monotonic()
        obj = wait_for(f"KVContentMismatch for a {fault} shard", lambda: (
            o if condition(o := cluster.get_json("pdd", "sim-small", "-n", ns), "KVContentMismatch").get("status")
            == "True" else None), timeout=60)
        took = time.monotonic() - t0
        msg = condition(obj, "KVContentMismatch")["message"]
        print(f"{fault}: caught in {took:.1f}s (verify interval 5s): {msg[:300]}")
        assert "sim-small-prefill-0 rank 2" in msg and "rank 1" in msg, msg
        assert condition(obj, "Ready")["status"] == "False"
        agent_post(cluster, ns, "sim-small-prefill-0", "/r/2/v1/admin/faults", {"kv_fault": ""})
        wait_for("the content probe passing again", lambda: condition(
            cluster.get_json("pdd", "sim-small", "-n", ns), "KVContentMismatch").get("status") == "False", timeout=60)
    assert any(e["reason"] == "KVContentMismatch" for e in events(cluster, ns))
