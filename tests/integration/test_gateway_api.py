"""pd-gateway as a process in front of real agent processes, used by the real `openai` and
`anthropic` clients and by curl: what a client sees, streamed and not, and every error a
client must be able to read."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import httpx
import pytest

from pd_contract import tokens
from tests.agent_procs import next_ip
from tests.conftest import wait_for
from tests.procs import end, spawn

pytestmark = pytest.mark.integration
KEYS = {"team-a": "sk-team-a-0000000123", "team-b": "sk-team-b-0000000456"}
MODEL = "llama-3-70b"
DATA_TOKEN = "data-token-for-routers"


class GatewayProc:
    def __init__(self, agents: list[str], env: dict | None = None):
        self.ip = next_ip()
        self.url = f"http://{self.ip}:8000"
        self.metrics_url = f"http://{self.ip}:9090"   # /metrics and /stats: not on the API port
        e = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        e.update(PD_GATEWAY_AGENTS=",".join(agents), PD_GATEWAY_API_KEYS=json.dumps(KEYS), PD_MODEL_NAME=MODEL,
                 PD_AGENT_DATA_TOKEN=DATA_TOKEN, PD_LOCAL_POD_IP=self.ip, **(env or {}))
        self.log = tempfile.TemporaryFile("w+")
        self.proc = spawn([sys.executable, "-m", "pd_gateway"], env=e, stdout=self.log, stderr=subprocess.STDOUT,
                          text=True)
        wait_for("the gateway sees a linked pair", self._ready, timeout=30)

    def _ready(self) -> bool:
        try:
            h = httpx.get(f"{self.url}/healthz", trust_env=False, timeout=2).json()
            return h["prefills"] >= 1 and h["decoders"] >= 1
        except httpx.HTTPError:
            return False

    def stop(self) -> str:
        end(self.proc)
        self.log.seek(0)
        return self.log.read()


@pytest.fixture
def gateway(agents):
    env = {"PD_AGENT_DATA_TOKEN": DATA_TOKEN, "PD_SIM_TIME_SCALE": "10"}
    p = agents("prompt", 0, env=env)
    d = agents("decoder", 1000, env=env)
    assert d.post("/v1/link", {"peers": [p.peer()]}).json()["ret"] == "LLM_SUCCESS"
    gw = GatewayProc([p.url, d.url], env={"PD_GATEWAY_RPM": json.dumps({"team-b": 2})})
    gw.decoder = d
    yield gw
    gw.stop()


def test_openai_client_streams_and_not(gateway):
    import openai
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["team-a"], http_client=httpx.Client(trust_env=False))
    assert [m.id for m in c.models.list()] == [MODEL]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == tokens.count("user: hello there")
    again = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8)
    assert again.choices[0].message.content == r.choices[0].message.content, "deterministic text"
    # streamed: chunks as the decoder emits tokens (the decode is still running when the
    # first one arrives), a usage chunk, [DONE]
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                                       stream=True, stream_options={"include_usage": True})
    pieces, usage, running_at_first = [], None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces:
                running_at_first = gateway.decoder.status()["load"]["in_flight"]
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert len(pieces) == 60 and usage.completion_tokens == 60
    assert running_at_first == 1, "the first token reached the client while the decode was still running"
    comp = c.completions.create(model=MODEL, prompt="Say this is a test", max_tokens=5)
    assert comp.choices[0].text and comp.usage.completion_tokens == 5
    pieces = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
              if ch.choices]
    assert "".join(pieces).strip()


def test_openai_client_errors_explain_themselves(gateway):
    import openai
    http = httpx.Client(trust_env=False)
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-typo", http_client=http)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert "invalid API key" in str(e.value)
    doubled = openai.OpenAI(base_url=f"{gateway.url}/v1/v1", api_key=KEYS["team-a"], http_client=http)
    with pytest.raises(openai.NotFoundError) as e:
        doubled.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert "doubles /v1" in str(e.value)
    good = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["team-a"], http_client=http)
    with pytest.raises(openai.NotFoundError) as e:
        good.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert MODEL in str(e.value)
    missing = httpx.post(f"{gateway.url}/chat/completions", json={}, trust_env=False)
    assert missing.status_code == 404 and "missing /v1" in missing.json()["error"]["message"]
    # a per-key limit: team-b may send 2 per minute
    limited = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["team-b"], http_client=http, max_retries=0)
    for _ in range(2):
        limited.completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        limited.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert int(e.value.response.headers["Retry-After"]) >= 1
    assert httpx.get(f"{gateway.url}/metrics", trust_env=False).status_code == 404   # not on the public port
    metrics = httpx.get(f"{gateway.metrics_url}/metrics", trust_env=False).text
    assert 'pd_gateway_requests_total{api="completions",key="team-b",status="429"} 1.0' in metrics
    assert "sk-team" not in metrics


def test_anthropic_client(gateway):
    import anthropic
    import httpx2  # the anthropic SDK's own HTTP client package
    http = httpx2.Client(trust_env=False)
    c = anthropic.Anthropic(base_url=gateway.url, api_key=KEYS["team-a"], http_client=http)
    m = c.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hello"}])
    assert m.content[0].text and m.usage.output_tokens == 6 and m.stop_reason == "max_tokens"
    with c.messages.stream(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hello"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.output_tokens == 10
    bad = anthropic.Anthropic(base_url=gateway.url, api_key="nope", http_client=http)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hello"}])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(gateway):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       "stream": True})
    out = subprocess.run(["curl", "-sN", "--noproxy", "*", f"{gateway.url}/v1/chat/completions",
                          "-H", f"Authorization: Bearer {KEYS['team-a']}", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=30).stdout
    lines = [line for line in out.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 1 + 3 + 1 + 1


def test_data_token_cannot_control_engines(gateway, agents):
    p = agents("prompt", 5, env={"PD_AGENT_DATA_TOKEN": DATA_TOKEN})
    h = {"Authorization": f"Bearer {DATA_TOKEN}"}
    assert httpx.get(f"{p.url}/v1/status", headers=h, trust_env=False).status_code == 200
    r = httpx.post(f"{p.url}/v1/switch_role", json={"role": "decoder"}, headers=h, trust_env=False)
    assert r.status_code == 403 and r.json()["code"] == "AgentForbidden"
    assert httpx.post(f"{p.url}/v1/drain", json={}, headers=h, trust_env=False).status_code == 403


def test_client_disconnect_cancels_the_decode(gateway):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 200,
            "stream": True}
    with httpx.Client(trust_env=False) as c:
        with c.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEYS['team-a']}"}) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break   # the first token: hang up
    wait_for("the decoder freed the request", lambda: gateway.decoder.status()["load"]["in_flight"] == 0,
             timeout=15)
    metrics = httpx.get(f"{gateway.decoder.url}/metrics", trust_env=False).text
    assert 'pd_agent_requests_failed_total{reason="cancelled"} 1.0' in metrics
