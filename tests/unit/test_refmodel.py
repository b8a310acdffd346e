"""The reference model (llm_datadist_sim.refmodel): a decode from KV shards pulled over the wire equals one
engine's output token for token whatever the tensor parallelism, and a shard that arrives wrong
changes the output."""
from __future__ import annotations

import numpy as np
import pytest

from llm_datadist_sim.refmodel import (
    OUT_BASE,
    PROBE_PROMPT,
    VOCAB,
    Model,
    Profile,
    from_bytes,
    from_storage,
    shard_bytes,
    shard_from_bytes,
    to_bytes,
    to_storage,
)

MAX_TOKENS = 16
GREEDY = (0.0, 1.0, 0)
SAMPLED = (0.8, 0.9, 7)
SAMPLINGS = [pytest.param(GREEDY, id="greedy"), pytest.param(SAMPLED, id="sampled")]


def gqa(dtype: str = "float16", max_seq: int = 512, seed: int = 0) -> Profile:
    return Profile("GQA", num_layers=2, num_kv_heads=4, head_dim=16, latent_dim=None, dtype=dtype, max_seq=max_seq,
                   seed=seed)


def mla(dtype: str = "float16") -> Profile:
    return Profile("MLA", num_layers=2, num_kv_heads=8, head_dim=16, latent_dim=32, dtype=dtype, max_seq=512)


def prompts(count: int = 10, seed: int = 3, lo: int = 1, hi: int = 60) -> list[list[int]]:
    """Tokenized prompts of random lengths, ids as a tokenizer gives them (beyond VOCAB too)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 100_000, int(rng.integers(lo, hi + 1)))] for _ in range(count)]


def heads_per_shard(m: Model, tp: int) -> int:
    return 1 if m.mla else m.kv_heads // tp


def prefill_wire(m: Model, prompt: list[int], tp: int, sampling) -> tuple[list[list[bytes]], int]:
    """A prefill of `tp` ranks: each rank's shard as the bytes of its cache tensors, and the first token."""
    kv, logits = m.prefill(prompt)
    first = m.sample(logits, *sampling, 0)
    return [shard_bytes(m.shard(kv, r, tp)) for r in range(tp)], first


def decode(m: Model, wire: list[list[bytes]], n: int, prefill_tp: int, pulls: list[int], first: int,
           sampling, reserve: int | None = None) -> list[int]:
    """A decoder whose rank i pulled prefill rank pulls[i]'s bytes."""
    shards = [shard_from_bytes(wire[r], n, heads_per_shard(m, prefill_tp), m.kv_dim, m.storage) for r in pulls]
    st = m.state(shards, n, reserve=reserve)
    return list(m.continue_(st, first, MAX_TOKENS, *sampling))


def in_range(ids: list[int]) -> bool:
    return all(OUT_BASE <= t < OUT_BASE + VOCAB for t in ids)


# ---- the same function in every process ---------------------------------------------------------

def test_same_profile_same_weights_and_outputs():
    a, b = Model(gqa()), Model(gqa())
    assert a.weights.keys() == b.weights.keys()
    for name, w in a.weights.items():
        assert w.dtype == np.float32
        assert np.array_equal(w, b.weights[name]), name
    for p in prompts(3):
        assert a.generate(p, MAX_TOKENS, *SAMPLED) == b.generate(p, MAX_TOKENS, *SAMPLED)
        kva, la = a.prefill(p)
        kvb, lb = b.prefill(p)
        assert kva.tobytes() == kvb.tobytes() and la.tobytes() == lb.tobytes()
    assert Model.get(gqa()) is Model.get(gqa())
    assert Model.get(gqa()) is not a
    other = Model(gqa(seed=1))
    assert not np.array_equal(other.weights["embed"], a.weights["embed"])


# ---- P-D equals one engine -----------------------------------------------------------------------

@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("dtype,tp", [("float16", 1), ("float16", 2), ("float16", 4), ("bfloat16", 4),
                                      ("float32", 2)])
def test_gqa_pd_equals_one_engine(dtype, tp, sampling):
    m = Model.get(gqa(dtype))
    assert m.num_tensors == 4 and m.kv_heads == 4 and m.kv_dim == 16
    for p in prompts():
        alone = m.generate(p, MAX_TOKENS, *sampling)
        wire, first = prefill_wire(m, p, tp, sampling)
        assert len(wire) == tp and all(len(bufs) == m.num_tensors for bufs in wire)
        assert decode(m, wire, len(p), tp, list(range(tp)), first, sampling) == alone
        assert len(alone) == MAX_TOKENS and in_range(alone)


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mla_pd_equals_one_engine(dtype, sampling):
    """Prefill TP 4, decoder TP 2: decoder rank r pulls prefill rank 2r's whole latent."""
    m = Model.get(mla(dtype))
    assert m.num_tensors == 2 and m.kv_heads == 1 and m.kv_dim == 32
    for p in prompts():
        alone = m.generate(p, MAX_TOKENS, *sampling)
        wire, first = prefill_wire(m, p, 4, sampling)
        assert decode(m, wire, len(p), 4, [0, 2], first, sampling) == alone
        assert in_range(alone)


@pytest.mark.parametrize("profile", [gqa(), mla("bfloat16")], ids=["GQA", "MLA"])
def test_state_grows_without_changing_the_output(profile):
    m = Model.get(profile)
    for p in prompts(4):
        wire, first = prefill_wire(m, p, 2, SAMPLED)
        assert decode(m, wire, len(p), 2, [0, 1], first, SAMPLED, reserve=len(p)) == m.generate(p, MAX_TOKENS,
                                                                                                 *SAMPLED)


def test_output_depends_on_the_context_not_only_the_last_token():
    m = Model.get(gqa())
    rng = np.random.default_rng(11)
    differ = 0
    for p in prompts(6, lo=8, hi=40):
        other = [int(t) for t in rng.integers(0, 100_000, len(p) - 1)] + [p[-1]]
        differ += m.generate(p, MAX_TOKENS) != m.generate(other, MAX_TOKENS)
    assert differ >= 5


# ---- a wrong shard shows in the output -----------------------------------------------------------

def corrupt(bufs: list[bytes], n: int, row: int, itemsize: int) -> list[bytes]:
    """The exponent's top bit of a few values of the last tensor flipped."""
    t = len(bufs) - 1
    raw = bytearray(bufs[t])
    values = n * row // itemsize
    for v in np.random.default_rng(5).choice(values, size=min(4, values), replace=False):
        raw[int(v) * itemsize + itemsize - 1] ^= 0x40
    return bufs[:t] + [bytes(raw)] + bufs[t + 1:]


def truncate(bufs: list[bytes], n: int, row: int, itemsize: int) -> list[bytes]:
    """The second half of the sequence never arrived: zeros."""
    keep = (n // 2) * row
    return [b[:keep] + bytes(len(b) - keep) for b in bufs]


def swap(bufs: list[bytes], n: int, row: int, itemsize: int) -> list[bytes]:
    """The first two tensors in the wrong order: K and V of layer 0 (GQA), layers 0 and 1 (MLA)."""
    return [bufs[1], bufs[0]] + bufs[2:]


@pytest.mark.parametrize("fault", [corrupt, truncate, swap], ids=lambda f: f.__name__)
@pytest.mark.parametrize("profile,prefill_tp,pulls", [(gqa(), 2, [0, 1]), (mla("bfloat16"), 4, [0, 2])],
                         ids=["GQA-tp2", "MLA-tp4-to-2"])
def test_a_wrong_shard_changes_the_output(fault, profile, prefill_tp, pulls):
    m = Model.get(profile)
    row = heads_per_shard(m, prefill_tp) * m.kv_dim * m.storage.itemsize
    changed = 0
    for p in prompts(4, seed=8, lo=8, hi=40):
        alone = m.generate(p, MAX_TOKENS)
        wire, first = prefill_wire(m, p, prefill_tp, GREEDY)
        bad = pulls[1]
        wrong = fault(wire[bad], len(p), row, m.storage.itemsize)
        assert wrong != wire[bad]
        assert [len(b) for b in wrong] == [len(b) for b in wire[bad]]
        wire[bad] = wrong
        out = decode(m, wire, len(p), prefill_tp, pulls, first, GREEDY)
        assert len(out) == MAX_TOKENS and in_range(out)
        changed += out != alone
    assert changed >= 1


# ---- profiles ------------------------------------------------------------------------------------

GQA_JSON = {"attention": "GQA", "numLayers": 2, "numKvHeads": 4, "headDim": 16, "dtype": "float16",
            "maxSeqLen": 512}
MLA_JSON = {"attention": "MLA", "numLayers": 2, "headDim": 16, "latentDim": 32, "dtype": "bfloat16",
            "maxSeqLen": 512}


@pytest.mark.parametrize("base,change,field", [
    (GQA_JSON, {"numLayers": 80}, "numLayers"),
    (GQA_JSON, {"dtype": "int8"}, "dtype"),
    (MLA_JSON, {"latentDim": None}, "latentDim"),
    (MLA_JSON, {"latentDim": 2048}, "latentDim"),
    (GQA_JSON, {"maxSeqLen": 16384}, "maxSeqLen"),
    (GQA_JSON, {"maxSeqLen": 24}, "maxSeqLen"),
    (GQA_JSON, {"numKvHeads": 8, "headDim": 128}, "numKvHeads"),
    (MLA_JSON, {"headDim": 256}, "headDim"),
    (GQA_JSON, {"attention": "MHA"}, "attention"),
])
def test_check_names_the_field(base, change, field):
    profile = Profile.from_json({**base, **change})
    with pytest.raises(ValueError, match=field):
        profile.check()
    with pytest.raises(ValueError, match=field):
        Model(profile)


def test_from_json():
    assert Profile.from_json({"numLayers": 2}) == Profile("GQA", 2, 8, 128, None, "float16", 2048, 0)
    crd = {**GQA_JSON, "latentDim": 64, "tensorParallel": 2, "maxBatch": 1, "seed": 9}
    assert Profile.from_json(crd) == gqa(seed=9)
    assert Profile.from_json(MLA_JSON) == mla("bfloat16")
    with pytest.raises(ValueError, match="numLayers"):
        Profile.from_json({})


# ---- storage and bytes ---------------------------------------------------------------------------

@pytest.mark.parametrize("value,bits", [
    (1.0, 0x3F80),
    (1.0 + 2.0 ** -8, 0x3F80),                    # halfway: to the even neighbour below
    (1.0 + 3 * 2.0 ** -8, 0x3F82),                # halfway: to the even neighbour above
    (1.0 + 2.0 ** -8 + 2.0 ** -20, 0x3F81),       # above halfway
    (-2.5, 0xC020),
    (float(np.finfo(np.float32).max), 0x7F80),   # rounds up to infinity
    (float("inf"), 0x7F80),
    (0.0, 0x0000),
])
def test_bfloat16_rounds_to_nearest_even(value, bits):
    stored = to_storage(np.array([value], dtype=np.float32), "bfloat16")
    assert stored.dtype == np.uint16 and int(stored[0]) == bits


def test_storage_round_trips():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert np.isnan(from_storage(to_storage(np.array([np.nan], dtype=np.float32), "bfloat16"))[0])
    assert np.array_equal(from_storage(to_storage(x, "float16")), x.astype(np.float16).astype(np.float32))
    assert np.array_equal(from_storage(to_storage(x, "float32")), x)
    bf = from_storage(to_storage(x, "bfloat16"))
    assert bf.dtype == np.float32 and np.all(np.abs(bf - x) <= np.abs(x) * 2.0 ** -8)
    assert np.array_equal(from_storage(to_storage(bf, "bfloat16")), bf)


def test_bytes_round_trip_and_lengths():
    m = Model.get(gqa("bfloat16"))
    kv, _ = m.prefill(list(PROBE_PROMPT))
    shard = m.shard(kv, 1, 2)
    assert shard.shape == (4, len(PROBE_PROMPT), 2, 16) and shard.dtype == np.uint16
    raw = to_bytes(shard[0])
    assert len(raw) == len(PROBE_PROMPT) * 2 * 16 * 2
    assert np.array_equal(from_bytes(memoryview(raw), len(PROBE_PROMPT), 2, 16, m.storage), shard[0])
    # a slot of more positions: the first n are the prompt's
    assert np.array_equal(from_bytes(raw + bytes(64), len(PROBE_PROMPT), 2, 16, "bfloat16"), shard[0])
    with pytest.raises(ValueError):
        from_bytes(raw[:-2], len(PROBE_PROMPT), 2, 16, m.storage)
    assert np.array_equal(shard_from_bytes(shard_bytes(shard), len(PROBE_PROMPT), 2, 16, m.storage), shard)


def test_probe_prompt():
    assert len(PROBE_PROMPT) == 24 and in_range(list(PROBE_PROMPT))


# ---- limits --------------------------------------------------------------------------------------

def test_shards_that_do_not_fit_are_refused():
    m = Model.get(gqa())
    kv, _ = m.prefill([1, 2, 3])
    with pytest.raises(ValueError):
        m.shard(kv, 0, 3)
    with pytest.raises(ValueError):
        m.shard(kv, 2, 2)
    with pytest.raises(ValueError):
        m.state([m.shard(kv, r, 4) for r in range(3)], 3)
    with pytest.raises(ValueError):
        m.state([kv.astype(np.float32)], 3)
    with pytest.raises(ValueError):
        m.state([kv], 4)


def test_max_seq_bounds_prompt_and_output():
    m = Model(gqa(max_seq=64))
    out = m.generate(list(range(58)), 100)
    assert len(out) == 6
    with pytest.raises(ValueError, match="maxSeqLen"):
        m.prefill(list(range(64)))
    kv, _ = m.prefill(list(range(63)))
    st = m.state([kv], 63)
    m.step(st, out[0])
    with pytest.raises(ValueError, match="maxSeqLen"):
        m.step(st, out[0])
