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
