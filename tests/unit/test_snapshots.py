"""A pass's Snapshot recorded as JSON and replayed: decide gives the same Plan."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pd_operator import snapshots
from pd_operator.decide import Plan, decide
from tests.unit.test_controller_scenarios import KEY, MANUAL, SPEC, World, ready_world

RECORDED = Path(__file__).parent / "data" / "snapshot-switch-in-flight.json"
PLAN_FIELDS = ("status", "to_apply", "links", "verify", "verify_after_links", "switch_intents", "switch_probes",
               "started", "outcomes", "events", "decisions", "clear_abort")


def summary(plan: Plan) -> dict:
    """What a pass would do, as JSON (the memory kept aside: it is the next pass's input)."""
    return json.loads(json.dumps({f: snapshots.encode(getattr(plan, f)) for f in PLAN_FIELDS}))


async def switch_in_flight() -> World:
    w = await ready_world({**SPEC, "rebalance": MANUAL})
    w.patch_spec(manual={"prefill": 3})
    await w.step()   # a switch in flight, Goodput-free: the richest kind of pass
    return w


async def test_a_recorded_snapshot_replays_to_the_same_plan():
    w = await switch_in_flight()
    snap = await w.ctl.observer.observe(KEY, w.ctl.deployments[KEY])
    text = snapshots.dumps(snap)
    again = snapshots.loads(text)
    assert snapshots.dumps(again) == text
    assert summary(decide(again)) == summary(decide(snap))
    assert summary(decide(again))["switch_intents"], "a pass that acts"


async def test_the_checked_in_recording_still_replays_to_its_plan():
    """A Snapshot recorded from a pass with a switch in flight: if decide changes what it does
    on it, this says what changed (PD_RECORD_SNAPSHOTS=1 records it again, on purpose)."""
    if os.environ.get("PD_RECORD_SNAPSHOTS") == "1":
        w = await switch_in_flight()
        snap = await w.ctl.observer.observe(KEY, w.ctl.deployments[KEY])
        RECORDED.write_text(json.dumps({"recording": json.loads(snapshots.dumps(snap)),
                                        "plan": summary(decide(snap))}, indent=1) + "\n")
    doc = json.loads(RECORDED.read_text())
    plan = summary(decide(snapshots.loads(json.dumps(doc["recording"]))))
    for f in PLAN_FIELDS:
        assert plan[f] == doc["plan"][f], f


def test_a_recording_names_only_the_operators_types():
    evil = {"format": snapshots.FORMAT, "snapshot": {"__object": "os:system", "d": {}}}
    with pytest.raises(ValueError, match="only the operator's types"):
        snapshots.loads(json.dumps(evil))
    with pytest.raises(ValueError, match="format"):
        snapshots.loads(json.dumps({"format": 0, "snapshot": {}}))


async def test_the_operator_records_each_pass_for_replay_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PD_OPERATOR_RECORD_DIR", str(tmp_path))
    w = await switch_in_flight()
    await w.step()
    recorded = tmp_path / "ns_x.json"
    snap = snapshots.loads(recorded.read_text())
    assert snap.key == KEY and [f.name for f in tmp_path.iterdir()] == ["ns_x.json"]
    snapshots.main([str(recorded)])
    out = json.loads(capsys.readouterr().out)
    assert out["status"]["switches"], "the replayed pass has the switch in flight"


def test_a_recording_cannot_reach_a_type_through_an_operator_modules_imports(tmp_path):
    """`pd_operator.<module>:tempfile._TemporaryFileCloser` walks from an operator module into one
    it imports: a type whose __del__ unlinks the file it names. Only types the operator's and the
    contract's modules define are rebuilt, by name, without walking attributes."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    import pd_operator.kube  # noqa: F401 - imports kubernetes' client, which imports tempfile
    for qual in ("pd_operator.kube:k8s_client.api_client.tempfile._TemporaryFileCloser",
                 "pd_operator.snapshots:os.PathLike",
                 "pd_operator.snapshots:json.JSONDecoder", "pd_operator.decide:Snapshot.__class__"):
        evil = {"format": snapshots.FORMAT, "snapshot": {"__object": qual, "d": {"name": str(victim),
                                                                                 "delete": True}}}
        with pytest.raises(ValueError):
            snapshots.loads(json.dumps(evil))
    import gc
    gc.collect()
    assert victim.read_text() == "keep me"


async def test_a_recording_holds_no_token_and_only_its_owner_reads_it(tmp_path):
    w = await switch_in_flight()
    snap = await w.ctl.observer.observe(KEY, w.ctl.deployments[KEY])
    assert snap.token, "a pass with the deployment's control token"
    snapshots.record(str(tmp_path), snap)
    path = next(tmp_path.glob("*.json"))
    text = path.read_text()
    assert snap.token not in text
    assert (path.stat().st_mode & 0o777) == 0o600
    assert summary(decide(snapshots.loads(text))) == summary(decide(snap)), "the same plan without the token"


def test_the_checked_in_recording_holds_no_token():
    doc = json.loads(RECORDED.read_text())
    assert doc["recording"]["snapshot"]["__dataclass"].endswith("Snapshot")
    assert doc["recording"]["snapshot"]["f"]["token"] == snapshots.REDACTED
