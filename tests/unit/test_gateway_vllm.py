"""pd-gateway's vLLM P-D protocol, the pure parts: what goes to the prefill and to the decoder (the
client's body otherwise untouched), what is read back (usage, SSE lines)."""
from __future__ import annotations

import json

from pd_gateway import vllm_route as vr

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True,
        "stream_options": {"include_usage": False}, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto", "stop": ["\n"], "n": 2, "logprobs": True, "response_format": {"type": "json_object"}}


def test_the_prefill_gets_one_token_unstreamed_and_the_decode_request():
    p = vr.prefill_body(BODY)
    assert p["kv_transfer_params"]["do_remote_decode"] is True and p["kv_transfer_params"]["do_remote_prefill"] is False
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert "max_completion_tokens" not in p
    assert vr.prefill_body({**BODY, "max_completion_tokens": 9})["max_completion_tokens"] == 1
    for k in ("tools", "tool_choice", "stop", "n", "logprobs", "response_format", "messages", "model"):
        assert p[k] == BODY[k]
    assert BODY["max_tokens"] == 40 and BODY["stream"] is True       # the client's body is not changed


def test_the_decoder_gets_the_clients_body_with_the_prefills_params():
    params = {"do_remote_prefill": True, "remote_cluster_id": 7, "remote_block_ids": [1, 2]}
    d, added = vr.decode_body(BODY, params)
    assert d["kv_transfer_params"] == params and added is True
    assert d["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in d.items() if k not in ("kv_transfer_params", "stream_options")} == \
        {k: v for k, v in BODY.items() if k != "stream_options"}
    smuggled = {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [7]}}
    d, _ = vr.decode_body(smuggled, None)
    assert "kv_transfer_params" not in d, "a client's own kv_transfer_params never reach a decoder"
    assert vr.prefill_body({**BODY, "min_tokens": 5})["max_tokens"] == 1
    assert "min_tokens" not in vr.prefill_body({**BODY, "min_tokens": 5})
    plain = {k: v for k, v in BODY.items() if k not in ("stream", "stream_options")}
    d, added = vr.decode_body(plain, params)
    assert added is False and "stream_options" not in d
    d, added = vr.decode_body({**BODY, "stream_options": {"include_usage": True}}, None)
    assert added is False and "kv_transfer_params" not in d


def test_usage_and_sse_lines_are_read_defensively():
    assert vr.usage_of({"usage": {"prompt_tokens": 5, "completion_tokens": 3}}) == (5, 3)
    for bad in ({}, {"usage": None}, {"usage": {"prompt_tokens": "5", "completion_tokens": 3}},
                {"usage": {"prompt_tokens": True, "completion_tokens": 3}}, {"usage": {"prompt_tokens": -1,
                                                                                       "completion_tokens": 3}}):
        assert vr.usage_of(bad) is None
    assert vr.sse_json(b'data: {"choices": []}') == {"choices": []}
    for line in (b"data: [DONE]", b"", b": keep-alive", b"data: {not json", b"data: " + b"[" * 100000,
                 b'data: "text"'):
        assert vr.sse_json(line) is None
    deep = b"data: " + json.dumps({"a": 1}).encode()
    assert vr.sse_json(deep) == {"a": 1}


# ---- decoder first (spec.engine.kvTransfer mooncake-layerwise): the metaserver's refusals ----------

async def _metaserver_app():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    app = web.Application()
    vr.attach(app, "http://10.0.0.9:8000", decoder_first=True)
    client = TestClient(TestServer(app))
    await client.start_server()
    return app, client


async def test_the_metaserver_answers_only_its_requests_at_their_secret_from_their_decoder():
    from types import SimpleNamespace
    app, client = await _metaserver_app()
    try:
        pairing = vr.Pairing(SimpleNamespace(drop=lambda url: None), 10.0)
        pairing.sent_to.append({"name": "d-0", "url": "http://10.1.0.4:8080", "engine_url": "http://10.1.0.4:8001",
                                "links": []})
        w = app[vr.PENDING][pairing.rid] = vr.Waiting(pairing, "/v1/completions", {"prompt": "x"}, {}, "s3cret",
                                                      vr.Relayed())
        msg = {"request_id": f"cmpl-{pairing.rid}-0", "remote_host": "10.1.0.4", "remote_block_ids": [[1]]}
        # an id this gateway did not send, or its id at another path: nothing happens
        r = await client.post("/v1/metaserver/s3cret", json={**msg, "request_id": "cmpl-" + "0" * 32 + "-0"})
        assert r.status == 404
        r = await client.post("/v1/metaserver/guess", json=msg)
        assert r.status == 404 and pairing.rid in app[vr.PENDING] and not w.aborted.is_set()
        # blocks of another host than the decoder it was sent to: refused, and the request ends
        r = await client.post("/v1/metaserver/s3cret", json={**msg, "remote_host": "10.66.0.1"})
        assert r.status == 400 and w.aborted.is_set() and "10.66.0.1" in w.why
        assert pairing.rid not in app[vr.PENDING]
        assert (await client.post("/v1/metaserver/s3cret", json=msg)).status == 404    # once only
    finally:
        await client.close()


async def test_decoder_first_refuses_what_one_post_cannot_name():
    from types import SimpleNamespace
    pairing = vr.Pairing(SimpleNamespace(), 10.0)
    for data in ({"messages": [], "n": 2}, {"prompt": ["a", "b"]}):
        out = vr.Relayed()
        d, r, _ = await vr.decoder_first(pairing, {}, "/v1/completions", data, 10, out)  # type: ignore[arg-type]
        assert r is None and out.status == 400 and b"mooncake-layerwise" in out.body
