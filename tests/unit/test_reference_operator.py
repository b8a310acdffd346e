"""The operator's side of the reference engine (pure): what reaches the pods, the CRD's rules,
and the content probe's condition."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

from llm_datadist_sim.refmodel import Profile
from pd_operator import builders, conditions
from pd_operator.api import parse_spec
from pd_operator.status import Observed, build_status, kv_content

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "examples" / "sim-chat.yaml").read_text())["spec"]


def env_of(spec: dict, group: str = "prefill") -> dict[str, str]:
    return {e["name"]: e.get("value") for e in builders._env("x", parse_spec(spec), group)}


def test_the_reference_engine_reaches_every_rank_with_its_profile_and_unscaled_caches():
    env = env_of(SPEC)
    assert env["PD_SIM_ENGINE"] == "reference" and env["PD_SIM_MEMORY_SCALE"] == "1"
    prof = json.loads(env["PD_REFERENCE_MODEL"])
    assert prof == {"attention": "GQA", "numLayers": 4, "numKvHeads": 4, "headDim": 64, "dtype": "float16",
                    "maxSeqLen": 1024, "seed": 7}
    Profile.from_json(prof).check()     # what the operator sends, the engine builds
    assert env["OPENBLAS_NUM_THREADS"] == "1"


def test_the_timing_engine_is_the_default_and_gets_no_profile():
    spec = copy.deepcopy(SPEC)
    del spec["sim"]["engine"]
    env = env_of(spec)
    assert "PD_SIM_ENGINE" not in env and "PD_REFERENCE_MODEL" not in env
    assert parse_spec(spec).sim.engine == "timing"


def test_the_crd_rules_name_the_field_for_profiles_too_big_for_the_reference_engine():
    crd = yaml.safe_load((REPO / "crds" / "pddeployment.yaml").read_text())
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    ref = [r for r in rules if "reference" in r["rule"]]
    assert {"numLayers", "maxSeqLen", "int8", "headDim", "latentDim", "numKvHeads"} <= {
        w for r in ref for w in ("numLayers", "maxSeqLen", "int8", "headDim", "latentDim", "numKvHeads")
        if w in r["message"]}
    assert all(r.get("fieldPath") == ".sim" for r in ref)


def _obs(verify: dict) -> Observed:
    return Observed(generation=1, pods=[], engines=[], verify=verify)


def test_a_content_mismatch_names_the_pair_and_both_ranks():
    bad = {"ok": False, "code": "KV_CONTENT_MISMATCH", "prefill": "p-0", "decoder": "d-1",
           "message": "rank 1 (from prefill rank 2): tensor 0 differs",
           "ranks": [{"rank": 0, "peer_rank": 0, "ok": True, "code": "LLM_SUCCESS"},
                     {"rank": 1, "peer_rank": 2, "ok": False, "code": "KV_CONTENT_MISMATCH"}]}
    good = {"ok": True, "code": "LLM_SUCCESS", "prefill": "p-1", "decoder": "d-0", "message": ""}
    status, reason, message = kv_content(_obs({"d-1": bad, "d-0": good}))
    assert status is True and reason == "KVContentMismatch"
    assert "d-1 rank 1 <- p-0 rank 2" in message and "tensor 0 differs" in message
    assert kv_content(_obs({"d-0": good}))[:2] == (False, "ContentMatches")
    assert kv_content(_obs({})) is None
    assert conditions.polarity("KVContentMismatch") == "negative"


def test_the_condition_is_kept_only_for_reference_deployments():
    bad = {"ok": False, "code": "KV_CONTENT_MISMATCH", "prefill": "p-0", "decoder": "d-0", "message": "x"}
    s = build_status(parse_spec(SPEC), _obs({"d-0": bad}), None, at="2026-12-05T00:00:00Z")
    c = next(c for c in s["conditions"] if c["type"] == "KVContentMismatch")
    assert c["status"] == "True"
    assert next(c for c in s["conditions"] if c["type"] == "KVPathVerified")["reason"] == "KVContentMismatch"
    timing = copy.deepcopy(SPEC)
    timing["sim"]["engine"] = "timing"
    s = build_status(parse_spec(timing), _obs({"d-0": bad}), {"conditions": s["conditions"]}, at="2026-12-05T00:00:00Z")
    assert all(c["type"] != "KVContentMismatch" for c in s["conditions"])
