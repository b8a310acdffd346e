"""An engine pod's revision: what its KV layout and transfer protocol depend on beyond the
CacheDesc, i.e. its images (the engine, its CANN and its connector ship in them). A decoder and a
prefill of different revisions are never linked (the operator) nor paired (the routers). Pure."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any


def revision(images: Iterable[tuple[str, str]]) -> str:
    """A short digest of (container name, image) pairs."""
    return hashlib.sha256(json.dumps(sorted(images)).encode()).hexdigest()[:10]


def revision_of(pod_spec: Mapping[str, Any] | None) -> str:
    """The revision of a pod from its spec (containers and init containers); "" without one."""
    spec = pod_spec or {}
    cs = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    return revision((str(c.get("name", "")), str(c.get("image", ""))) for c in cs) if cs else ""


def pairable(a: str, b: str) -> bool:
    """Two engines may move KV between them: same revision, or one not known."""
    return not a or not b or a == b
