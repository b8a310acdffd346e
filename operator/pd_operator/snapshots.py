"""A pass's Snapshot as JSON, and back: record what a pass saw (`PD_OPERATOR_RECORD_DIR`, or a
test) and replay `decide` on it elsewhere, byte for byte the same Plan. Only the types the
operator's and the contract's modules define are rebuilt from a recording, looked up by name (and
`random.random`, a backoff's jitter): loading one imports nothing and runs no code of the file's
choosing. A recording holds no token (the control token is written as REDACTED) and is its
owner's only (mode 0600)."""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .decide import Snapshot

FORMAT = 1
_MODULES = ("pd_operator.", "pd_contract.")
_FUNCTIONS = {"random:random": random.random}


def _qual(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def recordable() -> dict[str, type]:
    """The types a recording may name: the classes the operator's and the contract's modules define
    (each named `module:qualname` by the module that defines it, nested classes too), from the
    modules loaded now. Names are looked up here, never resolved by walking attributes, so nothing
    a module merely imports (another library's type, whose construction or __del__ acts) is
    reachable from a recording."""
    out: dict[str, type] = {}

    def add(cls: type) -> None:
        out[_qual(cls)] = cls
        for v in vars(cls).values():
            if isinstance(v, type) and v.__module__ == cls.__module__ and v.__qualname__.startswith(cls.__qualname__):
                add(v)
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(_MODULES):
            continue
        for v in list(vars(mod).values()):
            if isinstance(v, type) and v.__module__ == name:
                add(v)
    return out


_registry: tuple[int, dict[str, type]] = (-1, {})


def _class(qual: str) -> type:
    global _registry
    mod, _, name = qual.partition(":")
    if not mod.startswith(_MODULES):
        raise ValueError(f"a recording may name only the operator's types, not {qual}")
    if _registry[0] != len(sys.modules):   # built again only when modules were loaded since
        _registry = (len(sys.modules), recordable())
    cls = _registry[1].get(qual)
    if cls is None:
        raise ValueError(f"{qual} is not a type the operator's or the contract's modules define")
    return cls


def encode(x: Any) -> Any:
    """JSON-able form of `x`, tagged where JSON would lose the type."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, tuple):
        return {"__tuple": [encode(v) for v in x]}
    if isinstance(x, (set, frozenset)):
        tag = "__frozenset" if isinstance(x, frozenset) else "__set"
        return {tag: sorted((encode(v) for v in x), key=json.dumps)}
    if isinstance(x, collections.deque):
        return {"__deque": [encode(v) for v in x], "maxlen": x.maxlen}
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: encode(v) for k, v in x.items()}
        return {"__map": [[encode(k), encode(v)] for k, v in x.items()]}
    if isinstance(x, BaseModel):
        return {"__model": _qual(type(x)), "v": x.model_dump(mode="json", by_alias=True)}
    if isinstance(x, Exception):
        return {"__error": _qual(type(x)), "args": encode(list(x.args)), "d": encode(vars(x))}
    if callable(x) and not isinstance(x, type):
        name = next((k for k, f in _FUNCTIONS.items() if f is x), None)
        if name is None:
            raise TypeError(f"cannot record the function {x!r}")
        return {"__function": name}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__dataclass": _qual(type(x)),
                "f": {f.name: encode(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if hasattr(x, "__dict__") and type(x).__module__.startswith(_MODULES):
        return {"__object": _qual(type(x)), "d": encode(vars(x))}
    raise TypeError(f"cannot record {type(x).__name__}")


def decode(x: Any) -> Any:
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tuple" in x:
        return tuple(decode(v) for v in x["__tuple"])
    if "__set" in x:
        return {decode(v) for v in x["__set"]}
    if "__frozenset" in x:
        return frozenset(decode(v) for v in x["__frozenset"])
    if "__deque" in x:
        return collections.deque((decode(v) for v in x["__deque"]), maxlen=x["maxlen"])
    if "__map" in x:
        return {decode(k): decode(v) for k, v in x["__map"]}
    if "__model" in x:
        model = _class(x["__model"])
        assert issubclass(model, BaseModel)
        return model.model_validate(x["v"])
    if "__function" in x:
        return _FUNCTIONS[x["__function"]]
    if "__error" in x:
        cls = _class(x["__error"])
        if not issubclass(cls, Exception):
            raise ValueError(f"{x['__error']} is not an error")
        err: Any = Exception.__new__(cls)
        err.args = tuple(decode(x["args"]))
        err.__dict__.update(decode(x["d"]))
        return err
    if "__dataclass" in x or "__object" in x:
        cls = _class(x.get("__dataclass") or x["__object"])
        obj: Any = object.__new__(cls)
        for k, v in decode(x.get("f") or x["d"]).items():
            object.__setattr__(obj, k, v)   # frozen dataclasses too: this is their construction
        for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
            if not hasattr(obj, f.name):    # a field newer than the recording: its default
                if f.default_factory is not dataclasses.MISSING:
                    object.__setattr__(obj, f.name, f.default_factory())
                elif f.default is not dataclasses.MISSING:
                    object.__setattr__(obj, f.name, f.default)
        return obj
    return {k: decode(v) for k, v in x.items()}


REDACTED = "redacted"   # a recording's token: decide reads only whether there is one


def dumps(snap: Snapshot) -> str:
    """The Snapshot as JSON without the deployment's control token (decide asks only whether there
    is one, so the Plan is the same)."""
    if snap.token:
        snap = dataclasses.replace(snap, token=REDACTED)
    # keys in their order: decide iterates dicts, and the same order gives the same Plan
    return json.dumps({"format": FORMAT, "snapshot": encode(snap)})


def loads(text: str) -> Snapshot:
    doc = json.loads(text)
    if doc.get("format") != FORMAT:
        raise ValueError(f"a recording of format {doc.get('format')}; this operator reads format {FORMAT}")
    snap = decode(doc["snapshot"])
    if not isinstance(snap, Snapshot):
        raise ValueError("not a recorded Snapshot")
    return snap


def record(directory: str, snap: Snapshot) -> None:
    """The pass's Snapshot as `<directory>/<namespace>_<name>.json` (the last pass's, replaced
    whole: a reader never sees half a file)."""
    path = Path(directory) / f"{snap.key[0]}_{snap.key[1]}.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)   # the cluster's state: its owner's only
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(dumps(snap))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    """`python -m pd_operator.snapshots FILE`: what decide does on a recorded pass, as JSON."""
    ap = argparse.ArgumentParser(prog="python -m pd_operator.snapshots", description=main.__doc__)
    ap.add_argument("file", help="a recording (PD_OPERATOR_RECORD_DIR/<namespace>_<name>.json)")
    args = ap.parse_args(argv)
    from .decide import decide
    plan = decide(loads(Path(args.file).read_text()))
    fields = ("status", "to_apply", "links", "verify", "switch_intents", "started", "outcomes", "events", "decisions")
    print(json.dumps({f: encode(getattr(plan, f)) for f in fields}, indent=1))


if __name__ == "__main__":
    main()
