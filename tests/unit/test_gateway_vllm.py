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
