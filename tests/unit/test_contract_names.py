"""The names processes agree on live in pd_contract: the engine pod's environment (one
EngineIdentity that writes and reads itself), the agent API's paths, the cluster-id formula.
Every other module takes them from there, so a rename is one edit and a reader finds every
writer and reader of a variable by its constant."""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from pd_contract import engine_env as ev
from pd_contract import gateway_env
from pd_contract.agent_api import AgentPath
from pd_contract.engine_env import EngineIdentity

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("operator/pd_operator", "gateway/pd_gateway", "router/pd_router", "agent", "simulator", "engines/pd_engine")

# env names (the variables' own spellings, and the PD_SIM_ prefixes) and agent API paths
ENV_NAMES = {v for module in (ev, gateway_env) for k, v in vars(module).items()
             if k.isupper() and isinstance(v, str) and v.startswith(("PD_", "LLM_DATADIST_"))}
# (not "/v1/" alone: the gateway's OpenAI API is under /v1/ too)
AGENT_PATHS = {v for k, v in vars(AgentPath).items() if k.isupper() and isinstance(v, str)
               and v.startswith(AgentPath.API) and v != AgentPath.API and "{" not in v} | {"/v1/kv/", "/r/"}

# modules whose owners have yet to take these names from pd_contract (they may only shrink)
PENDING: dict[str, set[str]] = {}


@pytest.mark.parametrize("ident", [
    EngineIdentity(role="prompt", cluster_id=7, ip="10.0.0.7", port=26001),
    EngineIdentity(role="decoder", cluster_id=1013, ip="192.168.1.15", port=26000, model_id=3,
                   tensor_parallel=4, rank=3, device_id=3, npu=5),
])
def test_an_engine_identity_reads_back_what_it_writes(ident):
    env = ident.to_env()
    assert EngineIdentity.from_env(env) == ident
    assert set(env) <= ENV_NAMES


def test_the_cluster_id_is_computed_from_the_groups_base_and_the_pod_index():
    """What the operator injects (the downward API cannot add): base + pod index x TP + rank."""
    pod = {ev.LLM_DATADIST_CLUSTER_ID_BASE: "1000", ev.LLM_DATADIST_POD_INDEX: "2", ev.PD_TENSOR_PARALLEL: "4",
           ev.LLM_DATADIST_ROLE: "prefill", ev.LLM_DATADIST_IP: "10.0.0.9"}
    ident = EngineIdentity.from_env(pod)
    assert ident.cluster_id == ev.cluster_id(1000, 2, 4) == 1008 and ident.role == "prompt"
    assert EngineIdentity.from_env({**pod, ev.PD_RANK: "3"}).cluster_id == 1011
    rank3 = ident.for_rank(3)
    assert rank3.cluster_id == 1011 and rank3.pod_cluster_id == 1008
    assert EngineIdentity.from_env(rank3.to_env()) == rank3
    # an explicit cluster id wins; the pod IP stands in for a missing engine IP
    assert EngineIdentity.from_env({**pod, ev.LLM_DATADIST_CLUSTER_ID: "5"}).cluster_id == 5
    assert EngineIdentity.from_env({ev.LLM_DATADIST_CLUSTER_ID: "5", ev.PD_LOCAL_POD_IP: "10.1.1.1"}).ip == "10.1.1.1"


@pytest.mark.parametrize("env, names", [
    ({}, ev.LLM_DATADIST_CLUSTER_ID),
    ({ev.LLM_DATADIST_CLUSTER_ID_BASE: "0"}, ev.LLM_DATADIST_POD_INDEX),
    ({ev.LLM_DATADIST_CLUSTER_ID: "x"}, ev.LLM_DATADIST_CLUSTER_ID),
    ({ev.LLM_DATADIST_CLUSTER_ID: "1", ev.LLM_DATADIST_ROLE: "router"}, ev.LLM_DATADIST_ROLE),
    ({ev.LLM_DATADIST_CLUSTER_ID: "1", ev.PD_TENSOR_PARALLEL: "0"}, ev.PD_TENSOR_PARALLEL),
    ({ev.LLM_DATADIST_CLUSTER_ID: "1", ev.PD_RANK: "-1"}, ev.PD_RANK),
])
def test_a_wrong_identity_names_its_variable(env, names):
    with pytest.raises(ValueError, match=names):
        EngineIdentity.from_env(env)


def test_the_agent_reads_the_identity_the_contract_writes():
    from pd_agent.identity import Identity
    ident = EngineIdentity(role="decoder", cluster_id=1013, ip="192.168.1.15", tensor_parallel=4, rank=1)
    agent = Identity.from_env(ident.to_env())
    assert (agent.role, agent.cluster_id, agent.ip, agent.port, agent.rank, agent.tensor_parallel) == \
        (ident.role, ident.cluster_id, ident.ip, ident.port, ident.rank, ident.tensor_parallel)
    assert replace(ident, rank=0).pod_cluster_id == ident.cluster_id


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants, f-strings' literal parts included, docstrings left out."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_the_check_sees_f_strings_and_skips_docstrings():
    tree = ast.parse('"""PD_RANK, /v1/status"""\n'
                     'def f(u):\n    """PD_RANK"""\n    return f"{u}/v1/status", "PD_RANK"\n')
    assert sorted(v for _, v in _literals(tree)) == ["/v1/status", "PD_RANK"]


def test_no_module_outside_pd_contract_spells_a_shared_name():
    found: dict[str, set[str]] = {}
    where: list[str] = []
    for src in SOURCES:
        for path in sorted((ROOT / src).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, value in _literals(ast.parse(path.read_text(), rel)):
                if value in ENV_NAMES or value in AGENT_PATHS:
                    found.setdefault(rel, set()).add(value)
                    if value not in PENDING.get(rel, set()):
                        where.append(f"{rel}:{line}: {value!r}")
    assert not where, "take these from pd_contract (engine_env, agent_api.AgentPath):\n" + "\n".join(where)
