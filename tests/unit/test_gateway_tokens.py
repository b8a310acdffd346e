"""pd-gateway with its tokenizer, in process (the fake agents of test_gateway_hardening): the
prompt reaches the prefill as the token ids of its chat text, `usage` counts them, sampling
goes to both engines, the reply is the decoder's ids decoded (a character split across tokens
arrives once, whole), and a request that does not fit the context is a 400
context_length_exceeded before any engine work."""
from __future__ import annotations

import json
import threading

import pytest

from pd_contract import tokens
from pd_gateway import server
from tests.unit import test_gateway_hardening
from tests.unit.test_gateway_hardening import (
    CHAT,
    COMPLETIONS,
    CONTEXT,
    DECODER,
    MESSAGES,
    MODEL,
    PREFILL,
    FakeAgents,
    anthropic_shaped,
    openai_shaped,
)

serve = test_gateway_hardening.serve   # the fixture: a gateway on a loopback port in front of FakeAgents

RESPONSES = "/v1/responses"
# a reply whose characters are split across tokens (CJK, emoji with joiners) among whole words
SPLIT = "héllo 漢字 wörld 😀👨\u200d👩\u200d👧 ok"


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def words(n: int) -> str:
    """Content of n tokens after the chat template's "user:" (each " x" is a token)."""
    return "x" + " x" * (n - 1)


async def test_the_prompt_reaches_the_prefill_tokenized_and_usage_counts_it(serve):
    s = await serve()
    body = {"model": MODEL, "max_tokens": 5, "messages": [
        {"role": "system", "content": "Be brief. <|endoftext|> is text here."},
        {"role": "user", "content": [{"type": "text", "text": "漢字 and emoji 😀"}]}]}
    r = await s.post(CHAT, body)
    assert r.status_code == 200, r.text
    text = "system: Be brief. <|endoftext|> is text here.\nuser: 漢字 and emoji 😀"
    ids = tokens.encode(text)
    assert tokens.ENDOFTEXT not in ids, "a special token's spelling is plain text"
    assert r.json()["usage"] == {"prompt_tokens": tokens.count(text), "completion_tokens": 5,
                                 "total_tokens": tokens.count(text) + 5}
    prefill = s.agents.bodies["/v1/prefill"][-1]
    assert prefill["token_ids"] == ids and prefill["prompt_tokens"] == len(ids)
    assert s.agents.bodies["/v1/decode"][-1]["prompt_tokens"] == len(ids)
    r = await s.post(MESSAGES, {"model": MODEL, "max_tokens": 3, "system": "be brief",
                                "messages": [{"role": "user", "content": "hi"}]}, api="anthropic")
    assert r.json()["usage"]["input_tokens"] == tokens.count("system: be brief\nuser: hi")
    r = await s.post(COMPLETIONS, {"model": MODEL, "prompt": "", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1
    assert s.agents.bodies["/v1/prefill"][-1]["token_ids"] == [tokens.ENDOFTEXT], "an empty prompt: a boundary"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES, RESPONSES])
async def test_the_reply_is_the_decoders_tokens_decoded(serve, path):
    agents = FakeAgents()
    agents.reply_ids = tokens.encode(SPLIT)
    n = len(agents.reply_ids)
    s = await serve(agents)
    api = "anthropic" if path == MESSAGES else "openai"
    body = {"model": MODEL, "input": "hi", "max_output_tokens": n} if path == RESPONSES else \
        {"model": MODEL, "prompt": "hi", "max_tokens": n} if path == COMPLETIONS else chat("hi", max_tokens=n)
    whole = await s.post(path, body, api=api)
    assert whole.status_code == 200, whole.text
    got = whole.json()
    text = {CHAT: lambda: got["choices"][0]["message"]["content"], COMPLETIONS: lambda: got["choices"][0]["text"],
            MESSAGES: lambda: got["content"][0]["text"], RESPONSES: lambda: got["output"][0]["content"][0]["text"]}
    assert text[path]() == tokens.decode(agents.reply_ids) == SPLIT

    streamed = await s.post(path, {**body, "stream": True}, api=api)
    assert streamed.status_code == 200, streamed.text
    evs = events(streamed)
    if path == MESSAGES:
        deltas = [e["delta"]["text"] for e in evs if e.get("type") == "content_block_delta"]
        assert [e["usage"]["output_tokens"] for e in evs if e.get("type") == "message_delta"] == [n]
    elif path == RESPONSES:
        deltas = [e["delta"] for e in evs if e.get("type") == "response.output_text.delta"]
        assert evs[-1]["response"]["usage"]["output_tokens"] == n
    else:
        deltas = [c["delta"].get("content") if path == CHAT else c["text"]
                  for e in evs for c in e.get("choices", [])]
        deltas = [d for d in deltas if d]
    assert "".join(deltas) == SPLIT
    assert all(deltas) and len(deltas) < n, "no empty chunk: a split character waits for its last token"
    for ch in "漢字😀👨👩👧":
        assert sum(ch in d for d in deltas) == 1, (ch, deltas)


async def test_an_unknown_or_malformed_token_id(serve):
    agents = FakeAgents()
    agents.reply_ids = [15339, 100256, 2**31, 1917]   # "hello", a gap, past the vocabulary, " world"
    s = await serve(agents)
    r = await s.post(CHAT, chat("hi", max_tokens=4))
    assert r.json()["choices"][0]["message"]["content"] == "hello\ufffd\ufffd world"
    agents.lines = [b'{"token": 0, "id": 15339}\n', b'{"token": 1, "id": "1917"}\n']
    r = await s.post(CHAT, chat("hi", max_tokens=4))
    assert r.status_code == 502 and openai_shaped(r)["code"] == "BAD_STREAM"
    agents.lines = [b'{"token": 0, "id": 15339}\n', b'{"token": 1, "id": true}\n']
    assert (await s.post(CHAT, chat("hi", max_tokens=4))).status_code == 502


async def test_an_engine_that_only_models_timing_gets_the_count_alone(serve):
    """Its requests stay what they were (the benchmarks' numbers do not move): no ids, no sampling."""
    agents = FakeAgents()
    agents.reply_ids = None
    agents.status = {h: {**st, "engine": "timing"} for h, st in agents.status.items()}
    s = await serve(agents)
    r = await s.post(CHAT, chat("hello there", max_tokens=3, temperature=0))
    assert r.status_code == 200, r.text
    assert s.agents.bodies["/v1/prefill"][-1].keys() == {"req_id", "prompt_tokens"}
    assert s.agents.bodies["/v1/prefill"][-1]["prompt_tokens"] == tokens.count("user: hello there")
    assert "sampling" not in s.agents.bodies["/v1/decode"][-1] and "first_token" not in s.agents.bodies[
        "/v1/decode"][-1]


async def test_a_decoder_without_token_ids_still_gets_placeholder_text(serve):
    agents = FakeAgents()
    agents.reply_ids = None
    s = await serve(agents)
    r = await s.post(CHAT, chat("hi", max_tokens=6, stream=True))
    deltas = [c["delta"]["content"] for e in events(r) for c in e.get("choices", []) if c["delta"].get("content")]
    assert len(deltas) == 6 and all(d.strip() for d in deltas)
    again = await s.post(CHAT, chat("hi", max_tokens=6))
    assert again.json()["choices"][0]["message"]["content"] == "".join(deltas), "deterministic for a prompt"


async def test_sampling_reaches_both_engines(serve):
    s = await serve()
    await s.post(CHAT, chat("hi", max_tokens=2, temperature=0, top_p=0.5, seed=42))
    want = {"temperature": 0.0, "top_p": 0.5, "seed": 42}
    assert s.agents.bodies["/v1/prefill"][-1]["sampling"] == want == s.agents.bodies["/v1/decode"][-1]["sampling"]
    seeds = set()
    for _ in range(2):   # the API's defaults, and a seed of the gateway's own per request
        await s.post(CHAT, chat("hi", max_tokens=2))
        got = s.agents.bodies["/v1/prefill"][-1]["sampling"]
        assert got["temperature"] == 1.0 and got["top_p"] == 1.0 and 0 <= got["seed"] < 2**63
        assert s.agents.bodies["/v1/decode"][-1]["sampling"] == got
        seeds.add(got["seed"])
    assert len(seeds) == 2
    await s.post(COMPLETIONS, {"model": MODEL, "prompt": "hi", "seed": -1, "top_p": 0, "temperature": 0.7})
    assert s.agents.bodies["/v1/prefill"][-1]["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": 2**63 - 1}
    await s.post(MESSAGES, {"model": MODEL, "max_tokens": 2, "temperature": 0.3,
                            "messages": [{"role": "user", "content": "hi"}]}, api="anthropic")
    assert s.agents.bodies["/v1/prefill"][-1]["sampling"]["temperature"] == 0.3


# ---- the context ------------------------------------------------------------------------------

CONTEXT_CASES = [   # path, the body for a prompt of content c asking for n output tokens, its param
    (CHAT, lambda c, n: chat(c, max_tokens=n), "messages"),
    (CHAT, lambda c, n: chat(c, max_completion_tokens=n), "messages"),
    (COMPLETIONS, lambda c, n: {"model": MODEL, "prompt": c, "max_tokens": n}, "prompt"),
    (RESPONSES, lambda c, n: {"model": MODEL, "input": c, "max_output_tokens": n}, "input"),
    (MESSAGES, lambda c, n: {"model": MODEL, "max_tokens": n, "messages": [{"role": "user", "content": c}]},
     None),
]


@pytest.mark.parametrize("path,make,param", CONTEXT_CASES, ids=["chat max_tokens", "chat max_completion_tokens",
                                                                "completions", "responses", "anthropic"])
async def test_prompt_and_output_past_the_context_is_400_before_any_engine_work(serve, path, make, param):
    s = await serve()
    content = words(700)
    text = f"user: {content}" if path in (CHAT, MESSAGES) else content
    p = tokens.count(text)
    assert 690 < p < 710
    r = await s.post(path, make(content, CONTEXT - p + 1), api="anthropic" if path == MESSAGES else "openai")
    assert r.status_code == 400, r.text
    assert s.agents.calls["/v1/prefill"] == 0 and s.agents.engine_calls == 0
    if path == MESSAGES:
        msg = anthropic_shaped(r)["message"]
        assert msg == (f"input length and `max_tokens` exceed context limit: {p} + {CONTEXT - p + 1} > {CONTEXT}, "
                       f"decrease input length or `max_tokens` and try again")
    else:
        err = openai_shaped(r)
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert err["type"] == "invalid_request_error"
        assert err["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, you "
                                         f"requested {CONTEXT + 1} tokens ({p} in the ")
    ok = await s.post(path, make(content, CONTEXT - p), api="anthropic" if path == MESSAGES else "openai")
    assert ok.status_code == 200, ok.text
    assert s.agents.bodies["/v1/decode"][-1]["output_tokens"] == CONTEXT - p


async def test_a_prompt_alone_past_the_context_is_refused_and_the_default_output_shrinks_to_fit(serve):
    s = await serve()
    over = words(CONTEXT - 1)   # "user" and ":" make it CONTEXT + 1 tokens
    r = await s.post(CHAT, chat(over))
    err = openai_shaped(r)
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"your messages resulted in {CONTEXT + 1} tokens" in err["message"]
    r = await s.post(CHAT, chat(words(CONTEXT - 2)))   # exactly the context: no room for one token
    assert r.status_code == 400 and "leaves no room" in openai_shaped(r)["message"]
    r = await s.post(MESSAGES, {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": over}]},
                     api="anthropic")
    assert r.status_code == 400
    assert anthropic_shaped(r)["message"] == f"prompt is too long: {CONTEXT + 1} tokens > {CONTEXT} maximum"
    assert s.agents.engine_calls == 0
    # no max_tokens: the default (256) shrinks to the 10 tokens left, as an engine would do
    r = await s.post(CHAT, chat(words(CONTEXT - 12)))
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": CONTEXT - 10, "completion_tokens": 10,
                                                          "total_tokens": CONTEXT}
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = await s.post(COMPLETIONS, {"model": MODEL, "prompt": "hi"})
    assert r.json()["usage"]["completion_tokens"] == 16, "the completions API's default"


async def test_the_context_is_the_engines_once_they_report_it_never_more_than_configured(serve):
    agents = FakeAgents()
    shape = lambda seq: {"shape": [1, seq, 8, 128], "dtype": "float16"}  # noqa: E731
    agents.status = {h: {**st, "cache_desc": shape(600)} for h, st in ((PREFILL["ip"], PREFILL),
                                                                        (DECODER["ip"], DECODER))}
    s = await serve(agents)
    assert s.gw.fleet.context() == 600
    r = await s.post(CHAT, chat("hi", max_tokens=599))
    err = openai_shaped(r)
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "maximum context length is 600 tokens" in err["message"]
    r = await s.post(CHAT, chat("hi", max_tokens=601))
    assert r.status_code == 400 and openai_shaped(r)["param"] == "max_tokens", "more than the context by itself"
    assert agents.engine_calls == 0
    agents.status = {h: {**st, "cache_desc": shape(1 << 20)} for h, st in agents.status.items()}
    await s.gw.fleet.refresh()
    r = await s.post(CHAT, chat("hi", max_tokens=CONTEXT + 1))
    assert r.status_code == 400 and f"context of {CONTEXT} tokens" in openai_shaped(r)["message"]
    assert (await s.post(CHAT, chat("hi", max_tokens=CONTEXT - 10))).status_code == 200


async def test_a_long_prompt_is_tokenized_off_the_event_loop(serve, monkeypatch):
    s = await serve(max_body_bytes=1 << 20, max_context_tokens=1 << 20)
    where: list[str] = []
    real = tokens.encode

    def encode(text: str) -> list[int]:
        where.append(threading.current_thread().name)
        return real(text)
    monkeypatch.setattr(tokens, "encode", encode)
    loop_thread = threading.current_thread().name
    for size in (1000, server.THREAD_TOKENIZE_CHARS + 1):
        r = await s.post(CHAT, chat(words(size // 2), max_tokens=2))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(real(f"user: {words(size // 2)}"))
    assert where[0] == loop_thread and where[1] != loop_thread, where
