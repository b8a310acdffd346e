"""One key cannot stall pd-gateway for the others: body bytes are charged as they arrive, with a
key's share; a body's JSON values are bounded before it is parsed; a prompt too long for any
tokenization is refused before it is tokenized; a key's heavy requests take turns in its lane.
(bench-gateway's abuse mode measures another key's latency under these loads.)"""
from __future__ import annotations

import asyncio
import json
import threading

from pd_gateway import bodies, server, tokenizer
from tests.unit import test_gateway_hardening
from tests.unit.test_gateway_hardening import (
    BODY_LIMIT,
    CHAT,
    COMPLETIONS,
    KEY,
    MODEL,
    OTHER,
    _raw,
    openai_shaped,
    with_,
)

serve = test_gateway_hardening.serve


async def until(done, timeout: float = 30) -> None:
    async def poll():
        while not done():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


def test_counting_values_is_linear_whatever_the_strings():
    """Strings that never close, escaped quotes by the hundred thousand, empty strings back to back:
    one pass each (a backtracking scan of these would hold the event loop's lock for hours)."""
    bound = 65536
    assert bodies.values(b'{"a": [1, 2, {"b": "x,[{"}], "c": "q\\"{,"}', bound) == 6
    assert bodies.values(b'"' + b'\\"' * 500_000 + b"," * 70_000, bound) == 0      # one string, never closed
    assert bodies.values(b'"' + b'\\"' * 500_000 + b"\\", bound) == 0
    assert bodies.values(b'""' * 2_000_000, bound) <= bound                           # not JSON: ends early
    assert bodies.values(b"[" + b'"",' * 2_000_000 + b'""]', bound) == bound + 1        # stops past the bound


async def test_connections_that_send_only_headers_hold_no_body_budget(serve):
    s = await serve(max_body_bytes=BODY_LIMIT, max_body_bytes_in_flight=3 * BODY_LIMIT, body_timeout_s=30)
    idle = []
    for framing in [f"Content-Length: {BODY_LIMIT}"] * 3 + ["Transfer-Encoding: chunked"] * 2:
        idle.append(await _raw(s.port, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                                       f"Content-Type: application/json\r\n{framing}\r\n\r\n".encode()))
    await until(lambda: s.gw.streams.count == 5)
    assert s.gw.body_bytes.used == 0
    r = await s.post(CHAT, with_(CHAT), key=OTHER)
    assert r.status_code == 200, r.text
    for _, writer in idle:
        writer.close()


async def test_a_body_of_too_many_json_values_is_refused_before_it_is_parsed(serve):
    s = await serve(max_body_bytes=1 << 20, max_json_values=1000)
    many = with_(CHAT, messages=[{"role": "user", "content": "x"}] * 2000)
    r = await s.post(CHAT, many)
    assert r.status_code == 400 and "JSON values" in openai_shaped(r)["message"], r.text
    empties = b'{"model": "m-1", "max_tokens": 4, "messages": [' + b",".join([b"[]"] * 50_000) + b"]}"
    r = await s.post(CHAT, empties)
    assert r.status_code == 400 and "JSON values" in openai_shaped(r)["message"], r.text
    assert s.agents.engine_calls == 0
    # marks inside strings are not values: a prompt full of them is served
    r = await s.post(COMPLETIONS, with_(COMPLETIONS, prompt="{[," * 400))
    assert r.status_code == 200, r.text


async def test_a_prompt_no_tokenization_could_fit_is_refused_before_it_is_tokenized(serve, monkeypatch):
    s = await serve(max_body_bytes=1 << 20)
    seen: list[int] = []
    encode = tokenizer.Cl100k.encode
    monkeypatch.setattr(tokenizer.Cl100k, "encode", lambda self, text, templated=False: (
        seen.append(len(text)), encode(self, text, templated))[1])
    longest = tokenizer.Cl100k().max_token_chars()
    r = await s.post(COMPLETIONS, with_(COMPLETIONS, prompt="a" * (test_gateway_hardening.CONTEXT * longest)))
    err = openai_shaped(r)
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "at least" in err["message"], r.text
    assert seen == [] and s.agents.engine_calls == 0
    r = await s.post(COMPLETIONS, with_(COMPLETIONS, prompt="a" * (test_gateway_hardening.CONTEXT * longest - 200)))
    assert r.status_code == 400 and seen, "one shorter is tokenized, then refused by its count"


async def test_a_keys_heavy_requests_take_turns_and_never_hold_up_another_key(serve, monkeypatch):
    s = await serve(max_body_bytes=1 << 20)
    release, inside, most = threading.Event(), [0], [0]
    lock = threading.Lock()
    encode = tokenizer.Cl100k.encode

    def held_encode(self, text: str, templated: bool = False) -> list[int]:
        if len(text) <= server.THREAD_TOKENIZE_CHARS:
            return encode(self, text, templated)
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        release.wait(30)
        with lock:
            inside[0] -= 1
        return encode(self, text, templated)
    monkeypatch.setattr(tokenizer.Cl100k, "encode", held_encode)
    heavy = with_(COMPLETIONS, prompt="hello " * 20_000)
    first = asyncio.create_task(s.post(COMPLETIONS, heavy))
    await until(lambda: inside[0] == 1)
    second = asyncio.create_task(s.post(COMPLETIONS, heavy))
    await until(lambda: s.gw.lanes.locks.get("team-a", (None, 0))[1] == 2)   # queued behind the first
    await asyncio.sleep(0.3)
    assert inside[0] == 1 and not second.done(), "the key's second heavy request waits for its turn"
    r = await s.post(CHAT, with_(CHAT), key=OTHER)   # another key is served meanwhile
    assert r.status_code == 200, r.text
    r = await s.post(CHAT, with_(CHAT), key=KEY)     # and so is the same key's small request
    assert r.status_code == 200, r.text
    release.set()
    for t in (first, second):
        r = await t
        assert r.status_code == 400 and openai_shaped(r)["code"] == "context_length_exceeded", r.text
    assert most[0] == 1 and s.gw.lanes.locks == {}
    assert json.loads((await s.post(CHAT, with_(CHAT), key=OTHER)).text)["model"] == MODEL
