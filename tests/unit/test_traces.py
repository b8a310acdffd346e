"""Trace replay and the shipped synthetic traces (pure)."""
import io
import json
import random
from types import SimpleNamespace

import pytest

from pd_agent import loadgen, traces
from pd_agent.timing import TimingModel
from tests.conftest import REPO


def test_read_trace_mooncake_format():
    text = "\n".join(json.dumps(r) for r in [
        {"timestamp": 5000, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 9000, "output_length": 0},
        {"timestamp": 3000, "input_length": 7, "output_length": 2000}]) + "\n\n"
    plan = loadgen.read_trace(io.StringIO(text), speed=2.0, max_prompt=4096, max_output=512)
    assert plan == [(0.0, 4096, 1), (1.0, 7, 512), (2.0, 10, 3)]
    with pytest.raises(ValueError, match="trace line 1"):
        loadgen.read_trace(io.StringIO('{"timestamp": 1}\n'))


def test_request_plan_replays_the_trace_up_to_the_duration(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": 100, "output_length": 10}) + "\n"
                         for i in range(10)))
    args = SimpleNamespace(trace=str(f), trace_speed=1.0, max_prompt=2048, max_output=256, duration=4.5)
    assert [t for t, _, _ in loadgen.request_plan(args, random.Random(1))] == [0, 1, 2, 3, 4]
    args.duration = 0
    assert len(loadgen.request_plan(args, random.Random(1))) == 10


def test_generated_traces_are_deterministic_and_shaped():
    fleet = traces.Fleet(2, 2)
    a, info = traces.generate("shift", fleet, 240, period=120, seed=7)
    b, _ = traces.generate("shift", fleet, 240, period=120, seed=7)
    assert a == b and info["requests"] == len(a)
    first = [r for r in a if r["timestamp"] % 120000 < 60000]
    second = [r for r in a if r["timestamp"] % 120000 >= 60000]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(first, "input_length") > 5 * mean(second, "input_length")
    assert mean(second, "output_length") > 3 * mean(first, "output_length")
    # the rate is one a following ratio carries and the fixed 2P2D does not, in the decode-heavy phase
    assert info["phases"]["decode_heavy"]["fixed_capacity_rps"] < info["rate_rps"] <= info["capacity_rps"]
    assert info["phases"]["prompt_heavy"]["best_prefills"] > 2 > info["phases"]["decode_heavy"]["best_prefills"]
    step, s_info = traces.generate("step", fleet, 600, seed=1)
    early = sum(1 for r in step if r["timestamp"] < 300000)
    assert len(step) - early > 1.6 * early, "the rate steps up at the middle"


def test_capacity_follows_the_timing_model():
    t = TimingModel()
    assert traces.capacity(t, traces.Fleet(3, 1), 3000, 20) > traces.capacity(t, traces.Fleet(2, 2), 3000, 20)
    slow = TimingModel(time_scale=2.0)
    assert traces.capacity(slow, traces.Fleet(2, 2), 1500, 150) == pytest.approx(
        traces.capacity(t, traces.Fleet(2, 2), 1500, 150) / 2)


@pytest.mark.parametrize("kind", ["sine", "shift", "step"])
def test_shipped_traces_match_their_generator(kind):
    rows, _ = traces.generate(kind, traces.Fleet(2, 2), 480, period=240, seed=1)
    shipped = [json.loads(line) for line in (REPO / "bench" / "traces" / f"{kind}.jsonl").read_text().splitlines()]
    assert shipped == rows, f"regenerate with: python -m pd_agent.traces {kind} --out bench/traces/{kind}.jsonl"
