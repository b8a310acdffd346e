"""The reference engine: a small decoder-only transformer with seeded weights, computed on the CPU.

A prefill engine runs `Model.prefill` and leaves each tensor-parallel rank's `Model.shard` of the
prompt's KV cache in its llm_datadist cache; a decoder pulls the shards, builds a `State` from them
and goes on with `Model.continue_`. The single engine (`Model.generate`) runs the very same
functions on buffers of the same shapes, so a P-D answer equals a single engine's token for token,
bit for bit, and a KV shard that arrives corrupted, truncated or out of order shows in the tokens.

Every KV value the model reads back is first rounded to the cache's storage dtype, in the prefill
and in every decode step, so what crosses the link is exactly what the model attends to.
"""
from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# One BLAS thread, when this module is the first to load numpy: the model's matrices are small, so
# threads only add synchronisation (and spin when the CPU is shared), and with one thread no sum's
# order depends on the machine's core count. A process that loads numpy earlier sets it itself.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

VOCAB = 4096            # rows of the embedding, tied to the LM head
OUT_BASE = 256          # output id = OUT_BASE + row: ids in [256, 4352), common subwords in cl100k
# a fixed prompt whose KV both sides can compute, to check a pulled shard's content
PROBE_PROMPT: tuple[int, ...] = (
    791, 3938, 1917, 315, 3526, 374, 264, 1296, 369, 1475, 2038, 430,
    4131, 279, 3575, 1174, 323, 433, 2011, 2586, 1203, 2132, 1101, 3639,
)

MAX_LAYERS = 16         # what a CPU computes in reasonable time (pd_operator.api.REFERENCE_MAX_*)
MAX_WIDTH = 1024
MAX_SEQ = 8192
MIN_SEQ = 64
MLA_QUERY_HEADS = 8
DTYPES = ("float16", "bfloat16", "float32")

# The token and position embeddings enter the residual stream at 1/sqrt(width): the blocks, not the
# tied LM head's echo of the current token, decide the output, so the output depends on the context.
_EMBED_GAIN = 1.0
_QUERY_GAIN = 4.0       # sharp attention: an output depends on particular earlier positions
_LOGIT_STD = 4.0        # logits of this spread: sampling at temperature ~1 picks among a few tens of ids
_EPS = np.float32(1e-6)
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))
_GELU_A = np.float32(0.044715)


@dataclass(frozen=True)
class Profile:
    """The model a CacheDesc is derived from (spec.model.kvCache) and the weights' seed."""
    attention: str          # "GQA" | "MLA"
    num_layers: int
    num_kv_heads: int       # GQA: KV heads of the whole model (all ranks); MLA: unused
    head_dim: int           # GQA: K/V head dim; MLA: per query head dim of the up-projections
    latent_dim: int | None  # MLA: the cached latent's width per layer; None for GQA
    dtype: str              # storage dtype of the KV cache: float16 | bfloat16 | float32
    max_seq: int            # positions the model handles, prompt and output
    seed: int = 0

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        """From spec.model.kvCache's keys (camelCase, other keys ignored) and `seed`."""
        if "numLayers" not in d:
            raise ValueError("numLayers is required")
        attention = d.get("attention", "GQA")
        latent = d.get("latentDim")
        return cls(attention=attention, num_layers=int(d["numLayers"]), num_kv_heads=int(d.get("numKvHeads", 8)),
                   head_dim=int(d.get("headDim", 128)),
                   latent_dim=int(latent) if latent is not None and attention == "MLA" else None,
                   dtype=d.get("dtype", "float16"), max_seq=int(d.get("maxSeqLen", 2048)),
                   seed=int(d.get("seed", 0)))

    @property
    def query_heads(self) -> int:
        return MLA_QUERY_HEADS if self.attention == "MLA" else 2 * self.num_kv_heads

    def check(self) -> None:
        """ValueError naming the field when this profile is unsupported or too big for the CPU."""
        if self.attention not in ("GQA", "MLA"):
            raise ValueError(f"attention {self.attention!r} is neither GQA nor MLA")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not computed by the reference model ({', '.join(DTYPES)})")
        for name, v in (("numLayers", self.num_layers), ("numKvHeads", self.num_kv_heads),
                        ("headDim", self.head_dim), ("maxSeqLen", self.max_seq)):
            if v < 1:
                raise ValueError(f"{name} {v} must be at least 1")
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"numLayers {self.num_layers} is more than the reference model's {MAX_LAYERS}")
        if self.max_seq < MIN_SEQ:
            raise ValueError(f"maxSeqLen {self.max_seq} is less than the reference model's {MIN_SEQ} (the content "
                             f"probe's prompt and its decode must fit)")
        if self.max_seq > MAX_SEQ:
            raise ValueError(f"maxSeqLen {self.max_seq} is more than the reference model's {MAX_SEQ}")
        width = self.query_heads * self.head_dim
        if width > MAX_WIDTH:
            what = "8 x headDim" if self.attention == "MLA" else "2 x numKvHeads x headDim"
            raise ValueError(f"{what} = {width} (the model width) is more than the reference model's {MAX_WIDTH}")
        if self.attention == "MLA":
            if self.latent_dim is None:
                raise ValueError("latentDim is required with attention MLA")
            if not 1 <= self.latent_dim <= MAX_WIDTH:
                raise ValueError(f"latentDim {self.latent_dim} must be in [1, {MAX_WIDTH}]")


# ---- storage dtypes ------------------------------------------------------------------------------

def storage_dtype(dtype) -> np.dtype:
    """The numpy dtype a cache of this dtype is held in: bfloat16 as uint16 (its bit pattern)."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return np.dtype(np.uint16 if dtype == "bfloat16" else dtype)
    dt = np.dtype(dtype)
    if dt not in (np.float16, np.uint16, np.float32):
        raise ValueError(f"storage dtype {dt} is none of float16, bfloat16 (uint16), float32")
    return dt


def to_storage(x, storage) -> np.ndarray:
    """float32 values rounded to the storage dtype (bfloat16: round to nearest even, NaN kept)."""
    dt = storage_dtype(storage)
    x = np.asarray(x, dtype=np.float32)
    if dt == np.float32:
        return x.copy()
    if dt == np.float16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    u = np.ascontiguousarray(x).view(np.uint32)
    out = ((u + ((u >> 16) & 1) + np.uint32(0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def from_storage(arr) -> np.ndarray:
    """A fresh float32 array of the stored values."""
    arr = np.asarray(arr)
    if arr.dtype == np.uint16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if arr.dtype in (np.float16, np.float32):
        return arr.astype(np.float32)
    raise ValueError(f"storage dtype {arr.dtype} is none of float16, bfloat16 (uint16), float32")


# ---- one cache tensor's bytes -------------------------------------------------------------------

def to_bytes(tensor_slice: np.ndarray) -> bytes:
    """One cache tensor's slot, [n, heads, dim] in the storage dtype, as raw bytes (C order)."""
    return np.ascontiguousarray(tensor_slice).tobytes()


def from_bytes(buf: bytes | memoryview, n: int, heads: int, dim: int, storage) -> np.ndarray:
    """A slot's first n positions as a fresh [n, heads, dim] array. The buffer may be longer (a
    slot of more positions); a shorter one is a ValueError."""
    dt = storage_dtype(storage)
    count = n * heads * dim
    mv = memoryview(buf).cast("B")
    if mv.nbytes < count * dt.itemsize:
        raise ValueError(f"{mv.nbytes} B for [{n}, {heads}, {dim}] {dt}: {count * dt.itemsize} B needed")
    return np.frombuffer(mv, dtype=dt, count=count).reshape(n, heads, dim).copy()


def shard_bytes(shard: np.ndarray) -> list[bytes]:
    """A rank's shard [num_tensors, n, heads, dim] as one buffer per cache tensor."""
    return [to_bytes(shard[t]) for t in range(shard.shape[0])]


def shard_from_bytes(buffers: Sequence[bytes | memoryview], n: int, heads: int, dim: int, storage) -> np.ndarray:
    """The inverse of shard_bytes: [len(buffers), n, heads, dim] in the storage dtype."""
    if not buffers:
        raise ValueError("no cache tensors")
    return np.stack([from_bytes(b, n, heads, dim, storage) for b in buffers])


# ---- the model ----------------------------------------------------------------------------------

def _rmsnorm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + _EPS)


def _gelu(x: np.ndarray) -> np.ndarray:
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(_GELU_C * (x + _GELU_A * x * x * x)))


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class _Layer:
    """One layer's weights: the query, output and MLP projections, and GQA's key and value
    projections or MLA's down-projection to the latent with its per-head up-projections (an
    attribute of the other attention is never set)."""
    __slots__ = ("wq", "wk", "wv", "wdkv", "wuk_t", "wuv", "wo", "w1", "w2")
    wq: np.ndarray
    wk: np.ndarray                   # GQA
    wv: np.ndarray                   # GQA
    wdkv: np.ndarray                 # MLA
    wuk_t: list[np.ndarray]          # MLA: per query head
    wuv: list[np.ndarray]            # MLA: per query head
    wo: np.ndarray
    w1: np.ndarray
    w2: np.ndarray


class State:
    """A decoder's working KV cache: positions [0, n) filled, in float32.

    bufs[t] is tensor t's list of copies, each a C-contiguous [heads, cap, dim] array: GQA one copy
    of all KV heads; MLA one latent copy per decoder rank (heads 1). Whatever the number of shards
    it was built from, every array an attention head reads has the same shape and values."""
    __slots__ = ("n", "cap", "bufs")

    def __init__(self, n: int, cap: int, bufs: list[list[np.ndarray]]):
        self.n, self.cap, self.bufs = n, cap, bufs

    def _grow(self, cap: int) -> None:
        for copies in self.bufs:
            for i, b in enumerate(copies):
                nb = np.zeros((b.shape[0], cap, b.shape[2]), dtype=np.float32)
                nb[:, :self.n] = b[:, :self.n]
                copies[i] = nb
        self.cap = cap


class Model:
    """The reference transformer of one profile. Weights are drawn from the profile's seed in a
    fixed order, so every process with the same profile computes the same function."""
    _shared: dict[Profile, Model] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def get(cls, profile: Profile) -> Model:
        """The process's one instance for this profile (weights are drawn once)."""
        with cls._shared_lock:
            m = cls._shared.get(profile)
            if m is None:
                m = cls._shared[profile] = cls(profile)
            return m

    def __init__(self, profile: Profile):
        profile.check()
        p = self.profile = profile
        self.mla = p.attention == "MLA"
        self.num_layers = p.num_layers
        self.q_heads = p.query_heads
        self.head_dim = p.head_dim
        self.d_model = self.q_heads * p.head_dim
        if self.mla:
            assert p.latent_dim is not None
            self.num_tensors, self.kv_heads, self.kv_dim = p.num_layers, 1, p.latent_dim
        else:
            self.num_tensors, self.kv_heads, self.kv_dim = 2 * p.num_layers, p.num_kv_heads, p.head_dim
        self.storage = storage_dtype(p.dtype)
        self.max_seq = p.max_seq
        self._scale = np.float32(1.0 / math.sqrt(p.head_dim))

        d, hd, hq = self.d_model, p.head_dim, self.q_heads
        rng = np.random.default_rng(p.seed)
        self.weights: dict[str, np.ndarray] = {}

        def draw(name: str, shape: tuple[int, ...], fan_in: int, gain: float = 1.0) -> np.ndarray:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / math.sqrt(fan_in))
            self.weights[name] = w
            return w

        emb = draw("embed", (VOCAB, d), 1)
        in_scale = np.float32(_EMBED_GAIN / math.sqrt(d))
        self._embed_in = emb * in_scale
        self._lm_head = np.ascontiguousarray(emb.T * np.float32(_LOGIT_STD / math.sqrt(d)))
        self._layers: list[_Layer] = []
        for i in range(p.num_layers):
            ly = _Layer()
            ly.wq = draw(f"{i}.wq", (d, hq * hd), d, _QUERY_GAIN)
            if self.mla:
                lat = self.kv_dim
                ly.wdkv = draw(f"{i}.wdkv", (d, lat), d)
                wuk = draw(f"{i}.wuk", (hq, lat, hd), lat)
                ly.wuk_t = [np.ascontiguousarray(wuk[h].T) for h in range(hq)]
                wuv = draw(f"{i}.wuv", (hq, lat, hd), lat)
                ly.wuv = [np.ascontiguousarray(wuv[h]) for h in range(hq)]
            else:
                ly.wk = draw(f"{i}.wk", (d, self.kv_heads * hd), d)
                ly.wv = draw(f"{i}.wv", (d, self.kv_heads * hd), d)
            # each block's output at 1/sqrt(2 x layers), and the MLP's columns centred (GELU's
            # positive mean would add the same vector whatever the input): deep profiles do not
            # collapse to one repeated token
            out_gain = 1.0 / math.sqrt(2 * p.num_layers)
            ly.wo = draw(f"{i}.wo", (hq * hd, d), hq * hd, out_gain)
            ly.w1 = draw(f"{i}.w1", (d, 4 * d), d)
            w2 = draw(f"{i}.w2", (4 * d, d), 4 * d, out_gain)
            ly.w2 = self.weights[f"{i}.w2"] = w2 - w2.mean(axis=0, keepdims=True)
            self._layers.append(ly)
        pos = np.arange(p.max_seq, dtype=np.float64)[:, None]
        freq = 10000.0 ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        table = np.zeros((p.max_seq, d), dtype=np.float64)
        table[:, 0::2] = np.sin(pos * freq)
        table[:, 1::2] = np.cos(pos * freq)[:, : d // 2]
        self._pos = (table * float(in_scale)).astype(np.float32)

    # -- storage ----------------------------------------------------------------------------------
    def to_storage(self, x: np.ndarray) -> np.ndarray:
        return to_storage(x, self.storage)

    def _round(self, x: np.ndarray) -> np.ndarray:
        return from_storage(to_storage(x, self.storage))

    def _logits(self, x: np.ndarray) -> np.ndarray:
        return _rmsnorm(x) @ self._lm_head

    # -- prefill ----------------------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One prompt: (its KV [num_tensors, n, kv_heads, kv_dim] in the storage dtype, the last
        position's logits float32 [VOCAB])."""
        rows = np.asarray(token_ids, dtype=np.int64).reshape(-1) % VOCAB
        n = len(rows)
        if n < 1:
            raise ValueError("the prompt is empty")
        if n >= self.max_seq:
            raise ValueError(f"a prompt of {n} tokens leaves no room for output within maxSeqLen {self.max_seq}")
        hq, hd, d = self.q_heads, self.head_dim, self.d_model
        kv = np.empty((self.num_tensors, n, self.kv_heads, self.kv_dim), dtype=self.storage)
        future = np.triu(np.ones((n, n), dtype=bool), 1)
        x = self._embed_in[rows] + self._pos[:n]
        with np.errstate(over="ignore", invalid="ignore"):
            for i, ly in enumerate(self._layers):
                h = _rmsnorm(x)
                q = h @ ly.wq
                attn = np.empty((n, d), dtype=np.float32)
                if self.mla:
                    kv[i] = self.to_storage(h @ ly.wdkv).reshape(n, 1, self.kv_dim)
                    c = from_storage(kv[i, :, 0, :])
                    for j in range(hq):
                        s = ((q[:, j * hd:(j + 1) * hd] @ ly.wuk_t[j]) @ c.T) * self._scale
                        s[future] = -np.inf
                        attn[:, j * hd:(j + 1) * hd] = (_softmax(s) @ c) @ ly.wuv[j]
                else:
                    shape = (n, self.kv_heads, hd)
                    kv[2 * i] = self.to_storage(h @ ly.wk).reshape(shape)
                    kv[2 * i + 1] = self.to_storage(h @ ly.wv).reshape(shape)
                    k = np.ascontiguousarray(from_storage(kv[2 * i]).transpose(1, 0, 2))
                    v = np.ascontiguousarray(from_storage(kv[2 * i + 1]).transpose(1, 0, 2))
                    for j in range(hq):
                        s = (q[:, j * hd:(j + 1) * hd] @ k[j // 2].T) * self._scale
                        s[future] = -np.inf
                        attn[:, j * hd:(j + 1) * hd] = _softmax(s) @ v[j // 2]
                x = x + attn @ ly.wo
                x = x + _gelu(_rmsnorm(x) @ ly.w1) @ ly.w2
            return kv, self._logits(x[-1])

    # -- the shards and a decoder's state ---------------------------------------------------------
    def shard(self, kv: np.ndarray, rank: int, tp: int) -> np.ndarray:
        """What prefill rank `rank` of `tp` holds: GQA its heads, MLA the whole latent (a copy)."""
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is not one of tensor parallel {tp}")
        if self.mla:
            return kv.copy()
        if self.kv_heads % tp:
            raise ValueError(f"tensor parallel {tp} does not divide numKvHeads {self.kv_heads}")
        per = self.kv_heads // tp
        return np.ascontiguousarray(kv[:, :, rank * per:(rank + 1) * per, :])

    def state(self, shards: Sequence[np.ndarray], n: int, reserve: int | None = None) -> State:
        """A decoder's working cache from the shards its ranks pulled, in decoder rank order; n is
        the prompt's length. reserve: positions allocated up front (default maxSeqLen; the state
        grows as needed, which changes no result)."""
        r = len(shards)
        if r < 1:
            raise ValueError("no shards")
        if not 1 <= n <= self.max_seq:
            raise ValueError(f"prompt length {n} is not in [1, maxSeqLen {self.max_seq}]")
        if self.mla:
            per = 1
        elif self.kv_heads % r:
            raise ValueError(f"{r} shards do not divide numKvHeads {self.kv_heads}")
        else:
            per = self.kv_heads // r
        for i, s in enumerate(shards):
            want = (self.num_tensors, per, self.kv_dim)
            if s.ndim != 4 or (s.shape[0], s.shape[2], s.shape[3]) != want or s.shape[1] < n:
                raise ValueError(f"shard {i} of shape {s.shape}: [{want[0]}, >={n}, {want[1]}, {want[2]}] expected")
            if s.dtype != self.storage:
                raise ValueError(f"shard {i} is {s.dtype}, the cache stores {self.storage}")
        cap = self.max_seq if reserve is None else min(self.max_seq, max(n, reserve))
        bufs: list[list[np.ndarray]] = []
        for t in range(self.num_tensors):
            if self.mla:
                copies = []
                for s in shards:
                    b = np.zeros((1, cap, self.kv_dim), dtype=np.float32)
                    b[0, :n] = from_storage(s[t, :n, 0, :])
                    copies.append(b)
            else:
                b = np.zeros((self.kv_heads, cap, self.kv_dim), dtype=np.float32)
                for i, s in enumerate(shards):
                    b[i * per:(i + 1) * per, :n] = from_storage(s[t, :n]).transpose(1, 0, 2)
                copies = [b]
            bufs.append(copies)
        return State(n, cap, bufs)

    # -- decoding ---------------------------------------------------------------------------------
    def step(self, st: State, token_id: int) -> np.ndarray:
        """Feed one token at position st.n; its KV is rounded through storage and appended. The
        logits (float32 [VOCAB]) choose the next token."""
        p = st.n
        if p >= self.max_seq:
            raise ValueError(f"position {p} is past maxSeqLen {self.max_seq}")
        if p >= st.cap:
            st._grow(min(self.max_seq, max(2 * st.cap, 64)))
        hq, hd = self.q_heads, self.head_dim
        x = self._embed_in[int(token_id) % VOCAB] + self._pos[p]
        with np.errstate(over="ignore", invalid="ignore"):
            for i, ly in enumerate(self._layers):
                h = _rmsnorm(x)
                q = h @ ly.wq
                attn = np.empty(self.d_model, dtype=np.float32)
                if self.mla:
                    c = self._round(h @ ly.wdkv)
                    copies = st.bufs[i]
                    for b in copies:
                        b[0, p] = c
                    r = len(copies)
                    for j in range(hq):
                        cb = copies[min(j * r // hq, r - 1)][0, :p + 1]
                        s = (cb @ (q[j * hd:(j + 1) * hd] @ ly.wuk_t[j])) * self._scale
                        attn[j * hd:(j + 1) * hd] = (_softmax(s) @ cb) @ ly.wuv[j]
                else:
                    kb, vb = st.bufs[2 * i][0], st.bufs[2 * i + 1][0]
                    kb[:, p] = self._round(h @ ly.wk).reshape(self.kv_heads, hd)
                    vb[:, p] = self._round(h @ ly.wv).reshape(self.kv_heads, hd)
                    for j in range(hq):
                        s = (kb[j // 2, :p + 1] @ q[j * hd:(j + 1) * hd]) * self._scale
                        attn[j * hd:(j + 1) * hd] = _softmax(s) @ vb[j // 2, :p + 1]
                x = x + attn @ ly.wo
                x = x + _gelu(_rmsnorm(x) @ ly.w1) @ ly.w2
            st.n = p + 1
            return self._logits(x)

    @staticmethod
    def sample(logits: np.ndarray, temperature: float, top_p: float, seed: int, position: int) -> int:
        """The output id at output position `position`: greedy at temperature 0, else nucleus
        sampling drawn with a generator seeded by (seed, position), so whichever engine samples a
        position draws the same. NaN logits (a corrupted cache) never win."""
        x = np.asarray(logits, dtype=np.float32)
        x = np.where(np.isnan(x), np.float32(-np.inf), x)
        top = float(x.max())
        if temperature <= 0 or not math.isfinite(top):
            return OUT_BASE + int(np.argmax(x))
        p = np.exp((x.astype(np.float64) - top) / float(temperature))
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        k = min(len(cum), int(np.searchsorted(cum, float(top_p) * cum[-1], side="left")) + 1)
        u = np.random.default_rng([int(seed), int(position)]).random() * cum[k - 1]
        i = min(k - 1, int(np.searchsorted(cum[:k], u, side="right")))
        return OUT_BASE + int(order[i])

    def continue_(self, st: State, first_token: int, max_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0) -> Iterator[int]:
        """The decoder's side: first_token (the prefill's), then a token per step until max_tokens
        or until prompt and output fill maxSeqLen."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens {max_tokens} must be at least 1")
        prompt = st.n
        tok = int(first_token)
        yield tok
        for i in range(1, max_tokens):
            if prompt + i >= self.max_seq:
                return
            tok = self.sample(self.step(st, tok), temperature, top_p, seed, i)
            yield tok

    def generate(self, token_ids: Sequence[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[int]:
        """The single engine: prefill, sample the first token, decode the rest from its own KV."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens {max_tokens} must be at least 1")
        kv, logits = self.prefill(token_ids)
        first = self.sample(logits, temperature, top_p, seed, 0)
        n = kv.shape[1]
        st = self.state([kv], n, reserve=n + max_tokens)
        return list(self.continue_(st, first, max_tokens, temperature, top_p, seed))
