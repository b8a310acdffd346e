"""pd_engine.vllm_standin over the simulator, two engines in this process: a prefill engine computes
the prompt with the reference model into vLLM-layout blocks and returns the connector's
kv_transfer_params; a decoder engine pulls the blocks over the operator's link, computes the last
prompt token again (as vLLM does) and decodes: the tokens are one engine's. A pull that fails is
recomputed locally, and stop strings and n are applied as vLLM applies them."""
from __future__ import annotations

import json

import pytest

import llm_datadist_sim.engine as sim_engine
from llm_datadist_sim.refmodel import Model, Profile
from pd_contract import tokens
from pd_contract.agent_api import LinkRequest, Peer
from pd_engine import vllm_protocol as proto
from pd_engine import vllm_standin as vs
from pd_engine.vllm_standin_http import generation
from tests.unit.test_sim import free_port
from tests.unit.test_vllm_connector import Agent

PROFILE = {"attention": "GQA", "numLayers": 2, "numKvHeads": 4, "headDim": 16, "maxSeqLen": 256,
           "dtype": "float16", "seed": 5}
DESC = {"num_tensors": 4, "shape": [64, 16, 4, 16], "data_type": "DT_FLOAT16",
        "paged": {"num_blocks": 64, "block_size": 16}}
CFG = {"kv_connector": "PDOperatorConnector", "kv_connector_module_path": "pd_engine.vllm_connector",
       "kv_role": "kv_both"}


def env(role: str, cluster_id: int, port: int) -> dict:
    return {"LLM_DATADIST_ROLE": role, "LLM_DATADIST_CLUSTER_ID": str(cluster_id), "LLM_DATADIST_IP": "127.0.0.1",
            "LLM_DATADIST_PORT": str(port), "PD_BACKEND": "sim", "PD_RANK": "0", "PD_TENSOR_PARALLEL": "1",
            "LLM_DATADIST_CACHE_DESC": json.dumps(DESC), "POD_NAME": f"{role}-0", "PD_AGENT_TOKEN": "control-token",
            "PD_REFERENCE_MODEL": json.dumps(PROFILE)}


@pytest.fixture
def pair():
    made = []

    def make(role, cid, port):
        sim_engine._active_engine = None
        s = vs.StandIn(vs.load_connector(CFG), CFG, 1, env(role, cid, port), agent=Agent())
        made.append(s)
        return s
    port = free_port()
    p = make("prompt", 11, port)
    d = make("decoder", 1011, free_port())
    w = d.worker
    res = w.server.run(w.server.core.link(LinkRequest(peers=[
        Peer(name="prompt-0", cluster_id=11, ip="127.0.0.1", port=port, agent_url=p.worker.server.url)])))
    assert res.ret == "LLM_SUCCESS", res
    yield p, d
    for s in made:
        s.worker.shutdown()
    sim_engine._active_engine = None


def chat(text: str, **extra) -> proto.ChatCompletionRequest:
    return proto.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": text}],
                                                       "max_tokens": 12, "temperature": 0, **extra})


def test_prefill_on_one_engine_and_decode_on_another_equal_one_engine(pair):
    p, d = pair
    model = Model.get(Profile.from_json(PROFILE))
    for i, text in enumerate(("hello there", "the cache moves over the link and tokens follow", "x" * 40)):
        gen = generation(p, chat(text))
        assert gen.ids == tokens.encode(f"user: {text}")
        choices, params = p.prefill_remote(f"r{i}", gen)
        assert params["do_remote_prefill"] is True and params["remote_cluster_id"] == 11
        assert len(choices[0].token_ids) == 1
        got = [c.token_ids for c, _ in d.choices(gen, d.decode_remote(f"r{i}", gen, params))][-1]
        assert got == model.generate(gen.ids, 12), text
    assert d.counts["recomputed"] == 0 and d.counts["decode"] == 3


def test_a_pull_that_fails_is_recomputed_and_still_equal(pair):
    p, d = pair
    model = Model.get(Profile.from_json(PROFILE))
    gen = generation(p, chat("link me"))
    _, params = p.prefill_remote("r1", gen)
    bad = {**params, "remote_cluster_id": 4242}           # a prefill this decoder is not linked to
    got = [c.token_ids for c, _ in d.choices(gen, d.decode_remote("d1", gen, bad))][-1]
    assert got == model.generate(gen.ids, 12) and d.counts["recomputed"] == 1


def test_stop_strings_and_n(pair):
    _, d = pair
    gen = generation(d, chat("stop here", n=2))
    full = [c for c, _ in d.choices(gen, d.local(gen))]
    text = next(c.text for c in full if c.index == 0)
    assert text and {c.index for c in full} == {0, 1}
    stop = text[3:5]
    gen = generation(d, chat("stop here", stop=[stop]))
    pieces = list(d.choices(gen, d.local(gen)))
    c = pieces[-1][0]
    assert c.finish == "stop" and c.stop_reason == stop and c.text == text[:text.find(stop)]
    assert "".join(t for _, t in pieces) == c.text           # streamed pieces add up, nothing taken back


def test_requests_vllm_refuses_are_refused():
    for bad in ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
                {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function",
                                                                                "function": {"name": "f"}}}):
        with pytest.raises(ValueError):
            proto.ChatCompletionRequest.model_validate(bad)
    with pytest.raises(ValueError):
        proto.CompletionRequest.model_validate({"prompt": ""})
    r = proto.ChatCompletionRequest.model_validate({"messages": [], "tools": [{"type": "function"}], "foo": 1})
    assert r.model_extra == {"foo": 1} and r.tool_choice == "none"


def test_metrics_carry_vllm_s_names_and_the_blocks_a_held_prefill_uses(pair):
    from prometheus_client.parser import text_string_to_metric_families

    from pd_engine.vllm_standin_http import Metrics
    p, _ = pair
    m = Metrics("m", p)

    def scrape() -> dict:
        return {(s.name, s.labels.get("num_gpu_blocks")): s.value
                for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    idle = scrape()
    assert idle[("vllm:kv_cache_usage_perc", None)] == 0 and idle[("vllm:num_requests_running", None)] == 0
    assert idle[("vllm:cache_config_info", "64")] == 1
    p.prefill_remote("held", generation(p, chat("the blocks stay held until the decoder pulls them")))
    m.running = 1
    busy = scrape()
    assert 0 < busy[("vllm:kv_cache_usage_perc", None)] < 1 and busy[("vllm:num_requests_running", None)] == 1
