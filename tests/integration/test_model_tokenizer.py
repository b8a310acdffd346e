"""spec.model.tokenizer on the local cluster: a tokenizer.json in a ConfigMap, mounted in the
deployment's gateway by the operator; a completion's usage.prompt_tokens is that tokenizer's count of
the chat as the chat template lays it out, not cl100k's."""
from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pd_contract import tokens
from tests.conftest import Cluster
from tests.integration.conftest import keys_secret, sample, wait_phase
from tests.integration.test_content import KEY, gateway_url

pytestmark = pytest.mark.integration
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def test_the_gateway_counts_usage_with_the_models_tokenizer(cluster: Cluster, namespace: str, operator,
                                                            tmp_path) -> None:
    ns = namespace
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["prefill and decode engines share the load"] * 50,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    cluster.kubectl("create", "configmap", "tiny-tok", "-n", ns, f"--from-file=tokenizer.json={path}")
    keys_secret(cluster, ns, **{"team-a": KEY})
    doc = sample(**{"gateway": {"enabled": True, "apiKeysSecret": "sim-small-keys"}})
    doc["spec"]["model"]["tokenizer"] = {"configMap": {"name": "tiny-tok"}, "chatTemplate": TEMPLATE}
    for g in ("prefill", "decoder"):
        doc["spec"][g]["replicas"] = 1
    cluster.apply(doc, ns)
    wait_phase(cluster, ns, "Ready", timeout=180)
    url = gateway_url(cluster, ns, decoders=1)
    text = "prefill and decode engines share the load, while a tokenizer counts"
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, trust_env=False,
                   timeout=60, json={"model": "tiny-llama", "max_tokens": 4,
                                     "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    want = len(tok.encode(f"<|user|>{text}\n<|assistant|>", add_special_tokens=False).ids)
    got = r.json()["usage"]["prompt_tokens"]
    print(f"\nusage.prompt_tokens {got}: the model's tokenizer counts {want}, cl100k would count "
          f"{len(tokens.encode('user: ' + text))}")
    assert got == want and want != len(tokens.encode(f"user: {text}"))
    env = {e["name"]: e.get("value") for e in cluster.get_json("deployment", "sim-small-gateway", "-n", ns)[
        "spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PD_GATEWAY_TOKENIZER"].endswith("/sim-small/tokenizer.json")
    assert env["PD_GATEWAY_CHAT_TEMPLATE"] == TEMPLATE
