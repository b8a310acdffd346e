"""The token path is honest: a field it does not implement (tools, tool_choice, functions, logprobs,
top_logprobs, response_format) is a 400 naming it, before any engine work, while the values that ask
for nothing pass; `stop` and `n` are implemented on tokens (the text ends before a stop sequence, each
of n choices is a generation of its own), streamed and not, in the OpenAI and Anthropic shapes."""
from __future__ import annotations

import json

import pytest

from pd_contract import tokens
from tests.unit import test_gateway_hardening
from tests.unit.test_gateway_hardening import CHAT, COMPLETIONS, MESSAGES, REPLY, with_

serve = test_gateway_hardening.serve   # the fixture: a gateway on a loopback port in front of FakeAgents

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "tools", TOOLS), (CHAT, "tool_choice", "auto"), (CHAT, "tool_choice", "required"),
    (CHAT, "functions", [{"name": "f"}]), (CHAT, "function_call", "auto"), (CHAT, "logprobs", True),
    (CHAT, "top_logprobs", 2), (CHAT, "response_format", {"type": "json_object"}),
    (COMPLETIONS, "logprobs", 0), (COMPLETIONS, "logprobs", 3), (MESSAGES, "tools", [{"name": "f"}]),
    (MESSAGES, "tool_choice", {"type": "auto"}),
])
async def test_a_field_the_token_path_does_not_implement_is_refused_naming_it(serve, path, field, value):
    s = await serve()
    r = await s.post(path, with_(path, **{field: value}), api="anthropic" if path == MESSAGES else "openai")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"]
    if path != MESSAGES:
        assert err["param"] == field and err["code"] == "unsupported_parameter"
    assert s.agents.engine_calls == 0


@pytest.mark.parametrize("field,value", [("tools", []), ("tool_choice", "none"), ("logprobs", False),
                                         ("top_logprobs", 0), ("response_format", {"type": "text"}),
                                         ("logprobs", None)])
async def test_values_that_ask_for_nothing_are_served(serve, field, value):
    s = await serve()
    r = await s.post(CHAT, with_(CHAT, **{field: value}))
    assert r.status_code == 200, r.text


def cut(stop: str) -> str:
    return REPLY[:REPLY.find(stop)]


async def test_stop_ends_the_text_before_the_stop_sequence(serve):
    s = await serve()
    n = len(tokens.encode(REPLY))
    r = (await s.post(CHAT, with_(CHAT, max_tokens=n, stop=["prefill", "never"]))).json()
    c = r["choices"][0]
    assert c["message"]["content"] == cut("prefill") and c["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < n            # the generation ended there
    r = (await s.post(COMPLETIONS, with_(COMPLETIONS, max_tokens=n, stop="decode"))).json()
    assert r["choices"][0]["text"] == cut("decode") and r["choices"][0]["finish_reason"] == "stop"
    r = (await s.post(MESSAGES, with_(MESSAGES, max_tokens=n, stop_sequences=["link"]), api="anthropic")).json()
    assert r["content"][0]["text"] == cut("link")
    assert r["stop_reason"] == "stop_sequence" and r["stop_sequence"] == "link"
    r = (await s.post(CHAT, with_(CHAT, max_tokens=3, stop="zzz"))).json()
    assert r["choices"][0]["finish_reason"] == "length"


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_a_streamed_stop_never_sends_text_it_takes_back(serve):
    s = await serve()
    n = len(tokens.encode(REPLY))
    # "from pre" could start "from prefill": held back until it is known
    r = await s.post(CHAT, with_(CHAT, max_tokens=n, stream=True, stop=["from prefill"]))
    chunks = sse(r.text)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == cut("from prefill")
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


async def test_n_choices_are_generations_of_their_own(serve):
    s = await serve()
    r = (await s.post(CHAT, with_(CHAT, n=3, max_tokens=4, temperature=0.7, seed=41))).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 12 and r["usage"]["prompt_tokens"] == len(tokens.encode("user: hi"))
    seeds = [b["sampling"]["seed"] for b in s.agents.bodies["/v1/prefill"]]
    assert seeds == [41, 42, 43]
    r = await s.post(COMPLETIONS, with_(COMPLETIONS, n=2, max_tokens=4, stream=True,
                                        stream_options={"include_usage": True}))
    chunks = sse(r.text)
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    for bad in (0, 17, "2"):
        r = await s.post(CHAT, with_(CHAT, n=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


async def test_bad_stop_values_are_400_naming_stop(serve):
    s = await serve()
    for bad in (3, [""], ["x"] * 17, ["a" * 257], [1]):
        r = await s.post(CHAT, with_(CHAT, stop=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", (bad, r.text)
