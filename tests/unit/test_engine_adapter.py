"""pd_engine's adapter interface, implemented for the reference engine: a prompt rank and a decoder
rank in this process (two simulated engines, real TCP link and bytes), each built by
`serve_rank`; the decoder linked by its agent core as the operator does. The P-D answer equals
one engine's `Model.generate` token for token."""
from __future__ import annotations

import json

import pytest

import llm_datadist_sim.engine as sim_engine
from llm_datadist_sim.refmodel import Model, Profile
from pd_agent.identity import Identity
from pd_contract.agent_api import LinkRequest, Peer
from pd_engine.adapter import CacheHandle, DecodeRequest, EngineAdapter, NotLinked, PrefillRequest, Sampling
from pd_engine.rank import serve_rank
from pd_engine.reference import ReferenceAdapter
from tests.unit.test_sim import free_port

PROFILE = {"attention": "GQA", "numLayers": 2, "numKvHeads": 2, "headDim": 16, "dtype": "float16",
           "maxSeqLen": 64, "seed": 3}
DESC = {"num_tensors": 4, "shape": [1, 64, 2, 16], "data_type": "DT_FLOAT16"}


def env(role: str, cluster_id: int, port: int) -> dict:
    return {"LLM_DATADIST_ROLE": role, "LLM_DATADIST_CLUSTER_ID": str(cluster_id), "LLM_DATADIST_IP": "127.0.0.1",
            "LLM_DATADIST_PORT": str(port), "PD_BACKEND": "sim", "LLM_DATADIST_CACHE_DESC": json.dumps(DESC),
            "PD_SIM_ENGINE": "reference", "PD_REFERENCE_MODEL": json.dumps(PROFILE), "PD_AGENT_TOKEN": "t",
            "POD_NAME": f"{role}-0"}


class Agent:
    def __init__(self):
        self.calls = []

    def register(self, rank, url, boot_id):
        self.calls.append((rank, url, boot_id))


@pytest.fixture
def ranks():
    """serve_rank twice in one process: the simulator's one-engine guard is cleared between."""
    made = []

    def make(e):
        sim_engine._active_engine = None
        agent = Agent()
        s = serve_rank(ReferenceAdapter(Identity.from_env(e)), e, agent=agent, block=False)
        made.append(s)
        assert agent.calls == [(0, s.url, s.core.boot_id)]
        return s
    yield make
    for s in made:
        s.stop()
    sim_engine._active_engine = None


def test_reference_adapter_prefill_pull_decode_equals_one_engine(ranks):
    port = free_port()
    p = ranks(env("prompt", 7, port))
    d = ranks(env("decoder", 1007, free_port()))
    assert isinstance(p.adapter, EngineAdapter)
    prompt = (791, 3938, 1917, 315, 3526, 374, 264, 1296, 369, 1475, 2038)

    with pytest.raises(NotLinked, match="prompt cluster 7"):
        d.decode(CacheHandle(7, 1, 0, len(prompt)), DecodeRequest(300, 4))

    res = d.run(d.core.link(LinkRequest(peers=[Peer(name="prompt-0", cluster_id=7, ip="127.0.0.1", port=port,
                                                    agent_url=p.url)])))
    assert res.ret == "LLM_SUCCESS", res
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=11)):
        req_id = 100 + sampling.seed
        out = p.prefill(PrefillRequest(req_id, prompt, sampling))
        assert out.handle == CacheHandle(7, req_id, 0, len(prompt))
        assert p.core.kv_pending and req_id in p.core.kv_pending
        handle = CacheHandle.from_json(json.loads(json.dumps(out.handle.to_json())))   # as a router carries it
        tokens = d.decode(handle, DecodeRequest(out.first_token, 12, sampling))
        alone = Model.get(Profile.from_json(PROFILE)).generate(list(prompt), 12, sampling.temperature,
                                                               sampling.top_p, sampling.seed)
        assert tokens == alone
    assert d.adapter.load().running == 0
    assert p.core.status().load.kv_capacity_bytes > 0


def test_serve_rank_refuses_a_layout_other_than_the_operators(ranks):
    e = env("prompt", 7, free_port())
    ident = Identity.from_env(e)
    bad = {**e, "LLM_DATADIST_CACHE_DESC": json.dumps({**DESC, "num_tensors": 6})}
    sim_engine._active_engine = None
    with pytest.raises(ValueError, match="num_tensors 4"):
        serve_rank(ReferenceAdapter(ident), bad, agent=Agent(), block=False)
    sim_engine._active_engine = None


def test_switch_hooks_follow_the_adapter(ranks):
    p = ranks(env("prompt", 8, free_port()))
    p.adapter._running = 1
    from pd_agent.core import AgentError
    with pytest.raises(AgentError, match="refused the switch: 1 requests in flight"):
        p.run(p.core.switch_role("decoder"))
    p.adapter._running = 0
    p.run(p.core.switch_role("decoder"))
    assert p.rank.role == "decoder"


def test_the_agent_api_of_an_adapter_rank_serves_prefill_and_decode(ranks):
    """What pd-gateway and the pod's agent send (/v1/prefill, /v1/decode) reaches the adapter."""
    import httpx
    port = free_port()
    p = ranks(env("prompt", 9, port))
    d = ranks(env("decoder", 1009, free_port()))
    d.run(d.core.link(LinkRequest(peers=[Peer(name="prompt-0", cluster_id=9, ip="127.0.0.1", port=port,
                                                agent_url=p.url)])))
    prompt = [791, 3938, 1917, 315, 3526]
    auth = {"Authorization": "Bearer t"}
    with httpx.Client(trust_env=False, timeout=30, headers=auth) as http:
        r = http.post(f"{p.url}/v1/prefill", json={"req_id": 5, "prompt_tokens": 5, "token_ids": prompt})
        assert r.status_code == 200, r.text
        first = r.json()["first_token"]
        assert r.json()["prompt_cluster_id"] == 9
        r = http.post(f"{d.url}/v1/decode", json={"req_id": 5, "prompt_cluster_id": 9, "prompt_tokens": 5,
                                                  "output_tokens": 6, "first_token": first})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == Model.get(Profile.from_json(PROFILE)).generate(prompt, 6, 0.0, 1.0, 0)
        # the load report counts it as Goodput reads the mix: prompts at the prefill, tokens and decodes here
        load = http.get(f"{d.url}/v1/status").json()["load"]
        assert (load["output_tokens"], load["decodes_completed"]) == (6, 1), load
        assert http.get(f"{p.url}/v1/status").json()["load"]["prompt_tokens_arrived"] == 5
        # a decode from a prefill this decoder is not linked to: NOT_LINKED, nothing pulled
        r = http.post(f"{d.url}/v1/decode", json={"req_id": 6, "prompt_cluster_id": 77, "prompt_tokens": 5,
                                                  "output_tokens": 2, "first_token": first})
        assert r.status_code == 503 and r.json()["code"] == "NOT_LINKED", r.text
        # a prefill without the prompt's tokens is the caller's error
        r = http.post(f"{p.url}/v1/prefill", json={"req_id": 7, "prompt_tokens": 3})
        assert r.status_code == 400 and "token_ids" in r.text
        # the content probe compares this engine's real KV
        v = http.post(f"{d.url}/v1/verify", json={"peer": {"name": "prompt-0", "cluster_id": 9, "ip": "127.0.0.1",
                                                           "port": port, "agent_url": p.url}})
        assert v.status_code == 200 and v.json()["ok"] is True, v.text


def test_rank_env_for_gives_each_rank_its_identity():
    from pd_engine.rank import rank_env_for
    pod = {**env("prompt", 0, 26000), "LLM_DATADIST_CLUSTER_ID_BASE": "100", "LLM_DATADIST_POD_INDEX": "2",
           "PD_TENSOR_PARALLEL": "4", "PD_AGENT_URL": "http://10.0.0.5:8080"}
    pod.pop("LLM_DATADIST_CLUSTER_ID")
    r3 = rank_env_for(pod, 3)
    assert r3["PD_RANK"] == "3" and r3["LLM_DATADIST_CLUSTER_ID"] == str(100 + 2 * 4 + 3)
    assert r3["PD_RANK_REGISTER_URL"] == "http://10.0.0.5:8080/v1/ranks"
    with pytest.raises(ValueError, match="rank 4"):
        rank_env_for(pod, 4)


def test_what_an_adapter_rank_pulls_is_freed_however_the_decode_ends(ranks):
    """/v1/pull then /v1/decode with kv_pulled_ms (the pod's agent's path): the tokens are one
    engine's and the decoder's cache memory is back where it was; a pull retried for the same request
    holds one target; a decode refused after the pull frees it; a decode for the wrong role is
    ROLE_CHANGED (503, a router sends it elsewhere)."""
    import httpx
    port = free_port()
    p = ranks(env("prompt", 21, port))
    d = ranks(env("decoder", 1021, free_port()))
    d.run(d.core.link(LinkRequest(peers=[Peer(name="prompt-0", cluster_id=21, ip="127.0.0.1", port=port,
                                                agent_url=p.url)])))
    mgr = d.rank.kv_cache_manager
    idle = mgr.used_bytes
    prompt = [791, 3938, 1917, 315, 3526, 374]
    with httpx.Client(trust_env=False, timeout=30, headers={"Authorization": "Bearer t"}) as http:
        def prefill(req_id):
            r = http.post(f"{p.url}/v1/prefill", json={"req_id": req_id, "prompt_tokens": 6, "token_ids": prompt})
            assert r.status_code == 200, r.text
            return r.json()["first_token"]

        def pull(req_id):
            return http.post(f"{d.url}/v1/pull", json={"req_id": req_id, "prompt_cluster_id": 21,
                                                       "prompt_tokens": 6, "admitted": True})
        first = prefill(1)
        assert pull(1).status_code == 200 and mgr.used_bytes > idle
        r = http.post(f"{d.url}/v1/decode", json={"req_id": 1, "prompt_cluster_id": 21, "prompt_tokens": 6,
                                                  "output_tokens": 5, "first_token": first, "kv_pulled_ms": 1.0,
                                                  "admitted": True})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == Model.get(Profile.from_json(PROFILE)).generate(prompt, 5, 0.0, 1.0, 0)
        assert mgr.used_bytes == idle and not d.core.inference.held

        prefill(2)
        assert pull(2).status_code == 200
        assert list(d.core.inference.held) == [2]
        r = http.post(f"{d.url}/v1/decode", json={"req_id": 2, "prompt_cluster_id": 21, "prompt_tokens": 6,
                                                  "output_tokens": 5, "kv_pulled_ms": 1.0, "admitted": True})
        assert r.status_code == 400 and "first_token" in r.text      # refused: the pulled target goes
        assert mgr.used_bytes == idle and not d.core.inference.held

        r = http.post(f"{p.url}/v1/decode", json={"req_id": 3, "prompt_cluster_id": 1021, "prompt_tokens": 6,
                                                  "output_tokens": 5, "first_token": first})
        assert r.status_code == 503 and r.json()["code"] == "ROLE_CHANGED", r.text

    # a retried pull (the pod's agent timed out on the first): the first target is freed, one is held
    serving, handle = d.core.inference, CacheHandle(21, 9, 0, 6)
    for _ in range(2):
        serving._hold(9, handle, d.adapter.pull_target(handle))
    assert list(serving.held) == [9]
    d.run(serving.stop())
    assert mgr.used_bytes == idle
