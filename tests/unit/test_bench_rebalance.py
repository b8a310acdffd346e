"""bench_rebalance.py --workload: one generated workload on the cluster, beside the model's
prediction for the same workload, fleet and policy; the dry run starts no cluster."""
import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import bench_rebalance as br  # noqa: E402
import workloads as wl  # noqa: E402


def test_a_workload_is_named_family_colon_seed_and_a_trace_is_not_one():
    assert br.parse_workload("steps:101") == ("steps", 101)
    assert br.parse_workload("shift") is None
    for bad in ("weekly:1", "steps:x"):
        with pytest.raises(SystemExit):
            br.parse_workload(bad)


def test_runs_are_named_in_any_case_and_an_unknown_one_is_refused():
    assert br.run_names(["goodput", "Load+Replace"], 16, "steps:101") == ["Goodput", "Load+Replace"]
    with pytest.raises(SystemExit):
        br.run_names(["Goodputs"], 16, "steps:101")


def test_the_dry_run_writes_the_generators_requests_and_the_models_prediction(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(br, "RESULTS", tmp_path)
    model = br.dry_run("steady:1", 4, ["Goodput"])
    rows = [json.loads(x) for x in (tmp_path / "work" / "steady-1-4.jsonl").read_text().splitlines()]
    want = wl.generate("steady", 1, 4, br.sc.DURATION_S, br.sc.MAX_BATCH)
    assert [(r["input_length"], r["output_length"]) for r in rows] == [(p, o) for _, p, o in want]
    assert [r["timestamp"] for r in rows] == [round(t * 1000) for t, _, _ in want]
    # the steady workload runs at 0.6-0.8 of what the fleet carries: most of it is served in time
    assert 0.5 * len(want) / br.sc.DURATION_S < model["Goodput"] <= len(want) / br.sc.DURATION_S
    assert f"{model['Goodput']:.3f} req/s" in capsys.readouterr().out


def test_the_cluster_goodput_is_compared_with_the_models_within_ten_percent(monkeypatch):
    monkeypatch.setattr(br, "model_goodput", lambda kind, engines, names: {n: 10.0 for n in names})
    out = br.beside_model("steps:101", 16, {"Goodput": {"goodput_rps": 9.5}})
    assert out["Goodput"]["model_goodput_rps"] == 10.0 and out["Goodput"]["diff"] == pytest.approx(0.05)
