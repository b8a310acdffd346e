"""The workload family of bench-policy-sim (bench/workloads.py): seeded, shaped as named, the
rate scaled with the fleet, tuning and held-out seeds apart."""
import statistics
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import workloads as wl  # noqa: E402

D = 600.0


@pytest.mark.parametrize("family", wl.FAMILIES)
def test_a_seed_gives_the_same_rows_and_another_seed_others(family):
    a = wl.generate(family, 7, 4, 120)
    assert a == wl.generate(family, 7, 4, 120)
    assert a != wl.generate(family, 8, 4, 120)
    assert all(0 <= t < 120 and p >= 1 and o >= 1 for t, p, o in a)
    assert [t for t, _, _ in a] == sorted(t for t, _, _ in a)


def curve(f, step=1.0):
    return [f(i * step) for i in range(int(D / step))]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_families_have_their_shapes(seed):
    steady = wl.shape("steady", seed, D)
    assert max(curve(steady.mix)) - min(curve(steady.mix)) < 0.35, "steady: noise only"
    drift = curve(wl.shape("drift", seed, D).mix)
    assert max(drift) - min(drift) > 0.3, "drift: the mix travels"
    assert max(abs(b - a) for a, b in zip(drift, drift[1:])) < 0.1, "drift: continuously"
    steps = curve(wl.shape("steps", seed, D).mix)
    assert max(abs(b - a) for a, b in zip(steps, steps[1:])) > 0.25, "steps: the mix jumps"
    b = wl.shape("bursts", seed, D)
    load = curve(b.load)
    assert max(load) > 1.2 * statistics.median(load), "bursts: the load rises well above its usual"
    di = wl.shape("diurnal", seed, D)
    assert max(curve(di.load)) - min(curve(di.load)) > 0.2, "diurnal: a peak and a trough"
    assert max(curve(di.mix)) - min(curve(di.mix)) > 0.3, "diurnal: the mix follows the day"


def test_the_mix_runs_from_prompt_heavy_to_decode_heavy():
    assert wl.mix_means(0) == pytest.approx(wl.PROMPT_HEAVY)
    assert wl.mix_means(1) == pytest.approx(wl.DECODE_HEAVY)
    p, o = wl.mix_means(0.5)
    assert wl.DECODE_HEAVY[0] < p < wl.PROMPT_HEAVY[0] and wl.PROMPT_HEAVY[1] < o < wl.DECODE_HEAVY[1]


def test_the_rate_scales_with_the_fleet():
    small, big = len(wl.generate("steady", 1, 4, 300)), len(wl.generate("steady", 1, 32, 300))
    assert 6 < big / small < 11


def test_the_held_out_seeds_were_never_tuning_seeds():
    assert not set(wl.TUNE_SEEDS) & set(wl.HELD_OUT_SEEDS)
    assert set(wl.SHIFTING) <= set(wl.FAMILIES) and set(wl.STEADY) <= set(wl.FAMILIES)


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown workload family"):
        wl.shape("sawtooth", 1, D)
