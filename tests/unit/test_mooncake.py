"""vllm-ascend's Mooncake connector as pd-operator renders it, checked against vllm-ascend's own source
(`make vllm-ascend-src`: its sdist, read, never installed), and the stand-in connector that speaks its
kv_transfer_params: two vLLM stand-ins in this process, a kv_producer and a kv_consumer, the
consumer reading the producer's blocks over TCP; the tokens are one engine's."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from llm_datadist_sim.refmodel import Model, Profile
from pd_contract import mooncake
from pd_engine import vllm_standin as vs
from pd_engine.vllm_standin_http import generation
from tests.unit.test_sim import free_port
from tests.unit.test_vllm_standin import DESC, PROFILE, chat

SRC = Path.home() / ".cache/pd-operator/vllm-ascend/vllm_ascend-0.23.0.post1"   # make vllm-ascend-src
KV = SRC / "vllm_ascend/distributed/kv_transfer"


@pytest.fixture(scope="module")
def src() -> Path:
    assert (KV / "kv_p2p/mooncake_connector.py").is_file(), f"no vllm-ascend source at {SRC}: make vllm-ascend-src"
    return KV


def test_the_connector_name_is_the_one_vllm_ascend_registers(src):
    tree = ast.parse((src / "__init__.py").read_text())
    registered = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_connector":
            name, module, cls = (a.value for a in node.args)  # type: ignore[attr-defined]
            registered[name] = (module, cls)
    assert registered[mooncake.CONNECTOR] == ("vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector",
                                              "MooncakeConnector")
    assert vs.REGISTERED[mooncake.CONNECTOR][1] == registered[mooncake.CONNECTOR][1]


def test_the_rendered_config_has_what_the_connector_reads(src):
    code = (src / "kv_p2p/mooncake_connector.py").read_text()
    cfg = mooncake.kv_transfer_config("decoder", kv_port=30000, engine_id="d-0", prefill_tp=4, decoder_tp=2)
    # the extra config's sections and the keys vllm-ascend asserts in each
    for section, var in (("prefill", "prefill_parallel_config"), ("decode", "decode_parallel_config")):
        assert f'get_from_extra_config("{section}", {{}})' in code
        for key in ("tp_size", "dp_size"):
            assert f'assert "{key}" in {var}' in code
            assert key in cfg["kv_connector_extra_config"][section]
    assert cfg["kv_connector_extra_config"]["prefill"]["tp_size"] == 4
    assert cfg["kv_connector_extra_config"]["decode"]["tp_size"] == 2
    # kv_role's two values, kv_port and engine_id, read from the config
    for role in ("kv_producer", "kv_consumer"):
        assert f'self.kv_role == "{role}"' in code
    assert set(mooncake.KV_ROLES.values()) == {"kv_producer", "kv_consumer"}
    assert "kv_transfer_config.kv_port" in code and "kv_transfer_config.engine_id" in code
    assert cfg["kv_role"] == "kv_consumer" and cfg["kv_port"] == 30000 and cfg["engine_id"] == "d-0"
    assert "kv_connector_module_path" not in cfg      # the registry names it
    # the side channel: kv_port + dp_rank x TP x PP x PCP, then + the rank's index
    assert re.search(r"kv_transfer_config\.kv_port\s*\+\s*vllm_config\.parallel_config\.data_parallel_rank", code)
    # the prefill's TP must be at least the decoder's
    assert "prefill_tp_size: {self._prefill_tp_size} must be greater than" in code
    with pytest.raises(ValueError, match="at least the decoder's"):
        mooncake.kv_transfer_config("prompt", kv_port=30000, engine_id="p", prefill_tp=1, decoder_tp=2)


def test_the_stand_ins_params_are_the_connectors(src):
    code = (src / "kv_p2p/mooncake_connector.py").read_text()
    tree = ast.parse(code)
    # what the consumer requires of a request's kv_transfer_params (add_new_req, update_state_after_alloc)
    required = set(re.findall(r'kv_transfer_params\["(\w+)"\]', code))
    assert {"remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port"} <= required
    # what the producer returns from request_finished
    returned: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "request_finished":
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "dict":
                    returned |= {k.arg for k in call.keywords if k.arg}
    assert required <= returned
    from types import SimpleNamespace

    from pd_engine.mooncake_standin import MooncakeConnector
    conf = SimpleNamespace(kv_transfer_config=SimpleNamespace(**mooncake.kv_transfer_config(
        "prompt", kv_port=free_port(), engine_id="p-0", prefill_tp=1, decoder_tp=1)))
    c = MooncakeConnector(conf, "scheduler", env={"PD_LOCAL_POD_IP": "127.0.0.1"})
    req = SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True}, prompt_token_ids=[1, 2])
    delay, params = c.request_finished(req, [3, 4])
    assert delay is True and required <= set(params) <= returned | {"do_remote_prefill", "do_remote_decode"}


def test_the_port_rule_is_the_deployment_guides(src):
    guide = (SRC / "examples/disaggregated_prefill_v1/mooncake_connector_deployment_guide.md")
    assert guide.is_file()
    assert mooncake.random_port_range(8) == (20000, 28000) and mooncake.random_port_range(16) == (20000, 36000)
    assert "[20000, 28000) for 8 NPUs per node" in mooncake.kv_port_problem(26000, 8)
    assert mooncake.kv_port_problem(28000, 8) is None and mooncake.kv_port_problem(36000, 16) is None
    assert mooncake.kv_port_problem(30000, 16) is not None
    assert mooncake.kv_port_problem(19990, 8, tensor_parallel=16) is not None   # its side channels reach 20000
    assert mooncake.kv_port_problem(14579, 8) is None                           # below the range, clear of it
    assert mooncake.kv_port_problem(65530, 8, tensor_parallel=8) is not None


# ---- the stand-in: a kv_producer and a kv_consumer in this process --------------------------------

def _env(role: str) -> dict:
    return {"LLM_DATADIST_CACHE_DESC": json.dumps(DESC), "PD_REFERENCE_MODEL": json.dumps(PROFILE),
            "POD_NAME": f"{role}-0", "PD_LOCAL_POD_IP": "127.0.0.1"}


def _pair(kind: str):
    made = []

    def make(role: str) -> vs.StandIn:
        cfg = mooncake.kv_transfer_config(role, kv_port=free_port(), engine_id=f"{role}-0", prefill_tp=1,
                                          decoder_tp=1, kind=kind)  # type: ignore[arg-type]
        s = vs.StandIn(vs.load_connector(cfg), cfg, 1, _env(role))
        made.append(s)
        return s
    yield make("prompt"), make("decoder")
    for s in made:
        s.worker.shutdown()


@pytest.fixture
def mooncake_pair():
    yield from _pair("mooncake")


def test_a_consumer_reads_the_producers_blocks_and_decodes_as_one_engine(mooncake_pair):
    p, d = mooncake_pair
    model = Model.get(Profile.from_json(PROFILE))
    for i, text in enumerate(("hello there", "the blocks move on request, no link first", "y" * 50)):
        gen = generation(p, chat(text))
        choices, params = p.prefill_remote(f"r{i}", gen)
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prompt-0"
        assert params["remote_port"] == p.worker.side_channel_port and params["remote_host"] == "127.0.0.1"
        assert len(params["remote_block_ids"][0]) == -(-len(gen.ids) // 16)
        got = [c.token_ids for c, _ in d.choices(gen, d.decode_remote(f"d{i}", gen, params))][-1]
        assert got == model.generate(gen.ids, 12), text
    assert d.counts["recomputed"] == 0 and d.counts["decode"] == 3 and d.worker.counts["read"] == 3
    p.tick()                  # the consumer said done: the producer frees the blocks
    assert p.held == {} and len(p.free) == p.num_blocks
    assert p.worker.counts["sent"] == 3


def test_a_read_that_fails_is_recomputed_and_still_one_engines(mooncake_pair):
    p, d = mooncake_pair
    model = Model.get(Profile.from_json(PROFILE))
    gen = generation(p, chat("read twice"))
    _, params = p.prefill_remote("r", gen)
    got = [c.token_ids for c, _ in d.choices(gen, d.decode_remote("d1", gen, params))][-1]
    assert got == model.generate(gen.ids, 12)
    # read again after the done: the producer no longer holds it; the consumer computes it itself
    got = [c.token_ids for c, _ in d.choices(gen, d.decode_remote("d2", gen, params))][-1]
    assert got == model.generate(gen.ids, 12) and d.counts["recomputed"] == 1
    # a remote of the consumer's own engine id is refused, as vllm-ascend refuses it
    _, params = p.prefill_remote("r2", gen)
    list(d.decode_remote("d3", gen, {**params, "remote_engine_id": "decoder-0"}))
    assert d.counts["recomputed"] == 2


def test_the_connector_asserts_both_roles_parallel_sizes():
    cfg = mooncake.kv_transfer_config("prompt", kv_port=free_port(), engine_id="p", prefill_tp=1, decoder_tp=1)
    del cfg["kv_connector_extra_config"]["decode"]["dp_size"]
    with pytest.raises(ValueError, match="decode.dp_size is required"):
        vs.StandIn(vs.load_connector(cfg), cfg, 1, _env("prompt"))


# ---- pd_engine.launch: what it starts the server with --------------------------------------------

def _settings(command: tuple[str, ...], role: str = "decoder"):
    from pd_engine.launch import Settings
    env = {"POD_NAME": "sim-small-decoder-1", "LLM_DATADIST_ROLE": role, "LLM_DATADIST_CLUSTER_ID": "1001",
           "PD_BACKEND": "sim", "PD_KV_TRANSFER": "mooncake", "PD_KV_PORT": "30000", "PD_ENGINE_PORT": "8001",
           "PD_KV_PARALLEL": json.dumps(mooncake.extra_config(2, 2)), "PD_TENSOR_PARALLEL": "2",
           "LLM_DATADIST_IP": "10.0.0.7"}
    return Settings.from_env(["--", *command], env)


def test_the_launcher_renders_the_roles_config_and_replaces_one_given():
    s = _settings(("vllm", "serve", "/models/qwen", "--kv-transfer-config", '{"kv_role": "kv_both"}', "--port", "8001"))
    assert s.pod == "sim-small-decoder-1" and s.role == "decoder" and s.engine_port == 8001 and s.host == "10.0.0.7"
    for role, kv_role in (("decoder", "kv_consumer"), ("prompt", "kv_producer")):
        argv = s.argv(role, "sim-small-decoder-1-0a1b2c3d")
        assert argv[:5] == ["vllm", "serve", "/models/qwen", "--port", "8001"]
        assert argv.count("--kv-transfer-config") == 1
        cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert cfg == mooncake.kv_transfer_config(role, kv_port=30000, engine_id="sim-small-decoder-1-0a1b2c3d",  # type: ignore
                                                  prefill_tp=2, decoder_tp=2)
        assert cfg["kv_role"] == kv_role
    assert _settings(()).command == ("vllm", "serve")       # no command: the image's vllm serve
    eq = _settings(("vllm", "serve", "--kv-transfer-config={}")).argv("decoder", "e")
    assert not any(a.startswith("--kv-transfer-config=") for a in eq)
    with pytest.raises(SystemExit, match="--port 8000 is not PD_ENGINE_PORT 8001"):
        _settings(("vllm", "serve", "--port=8000"))


def test_the_launcher_reads_vllms_own_load_metrics():
    from pd_engine.launch import parse_load
    text = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\nvllm:kv_cache_usage_perc 0.5\n')
    assert parse_load(text) == (4, 2)
    assert parse_load("") == (0, 0)


# ---- mooncake-layerwise: decoder first, a metaserver, pushes layer by layer ------------------------

def test_the_layerwise_config_and_protocol_are_vllm_ascends(src):
    tree = ast.parse((src / "__init__.py").read_text())
    names = {n.args[0].value: n.args[2].value for n in ast.walk(tree) if isinstance(n, ast.Call)  # type: ignore
             and getattr(n.func, "attr", "") == "register_connector"}
    assert names[mooncake.CONNECTORS["mooncake-layerwise"]] == "MooncakeLayerwiseConnector"
    assert vs.REGISTERED["MooncakeLayerwiseConnector"][1] == "MooncakeLayerwiseConnector"
    code = (src / "kv_p2p/mooncake_layerwise_connector.py").read_text()
    # the decoder posts its blocks to the request's metaserver; these are what the prefill reads
    assert 'params.get("metaserver"' in code and "self._access_metaserver" in code
    for key in ("request_id", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_host",
                "remote_port", "remote_tp_size"):
        assert f"{key}=" in code, key
    assert "# layer_wise push, not need delay_free_blocks\n        return False, None" in code
    assert "kv_transfer_config.kv_port" in code and "kv_transfer_config.engine_id" in code
    proxy = (SRC / "examples/disaggregated_prefill_v1/load_balance_proxy_layerwise_server_example.py").read_text()
    assert '"do_remote_prefill": True,\n            "metaserver":' in proxy
    assert 'req_data["kv_transfer_params"] = kv_transfer_params' in proxy and '@app.post("/v1/metaserver")' in proxy
    assert mooncake.METASERVER_PATH == "/v1/metaserver" and mooncake.decoder_first("mooncake-layerwise")
    cfg = mooncake.kv_transfer_config("prompt", kv_port=36000, engine_id="p", prefill_tp=1, decoder_tp=1,
                                      kind="mooncake-layerwise")
    assert cfg["kv_connector"] == "MooncakeLayerwiseConnector" and cfg["kv_role"] == "kv_producer"


@pytest.fixture
def layerwise_pair():
    yield from _pair("mooncake-layerwise")


def test_layerwise_the_decoder_asks_the_metaserver_and_the_prefill_pushes_every_layer(layerwise_pair):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    p, d = layerwise_pair
    model = Model.get(Profile.from_json(PROFILE))
    texts = ("pushed layer by layer", "the decoder goes first " * 3)
    gens = {f"chatcmpl-{i}": generation(p, chat(t)) for i, t in enumerate(texts)}
    asked: list[dict] = []

    class Metaserver(BaseHTTPRequestHandler):      # what pd-gateway does with the decoder's message
        def do_POST(self) -> None:
            msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append(msg)
            # the router sends both engines one request id (X-Request-Id): the push names it
            choices, out = p.prefill_remote(msg["request_id"], gens[msg["request_id"]], msg)
            assert out is None and len(choices[0].token_ids) == 1
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metaserver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver"
        for rid, gen in gens.items():
            params = {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": url}
            got = [c.token_ids for c, _ in d.choices(gen, d.decode_remote(rid, gen, params))][-1]
            assert got == model.generate(gen.ids, 12), rid
    finally:
        server.shutdown()
    assert [m["request_id"] for m in asked] == list(gens)
    assert all(m["do_remote_decode"] is True and m["remote_port"] == d.worker.side_channel_port for m in asked)
    assert d.counts["recomputed"] == 0 and d.worker.counts["received"] == 2 and p.worker.counts["pushed"] == 2
    p.tick()
    assert len(p.free) == p.num_blocks     # the prefill keeps nothing after its push
