"""Container resources (pure): the operator's defaults (its configuration, from the chart)
merged under what a spec says, and the Kubernetes quantities that takes."""
from __future__ import annotations

import re
from decimal import Decimal

_SUFFIX = {"": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
           "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
           "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
           "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")


def quantity(q: int | str) -> Decimal | None:
    """A quantity's value ("500m" -> 0.5, "1Gi" -> 2**30); None if it is not one."""
    m = _QUANTITY.match(str(q).strip())
    if not m:
        return None
    return Decimal(m[1]) * Decimal(10) ** int(m[2] or 0) * _SUFFIX[m[3] or ""]


def scaled(q: int | str, n: int) -> str:
    """A quantity times n, in its own unit ("100m" x 4 -> "400m", "1Gi" x 8 -> "8Gi")."""
    m = _QUANTITY.match(str(q).strip())
    if not m:
        raise ValueError(f"{q!r} is not a Kubernetes quantity")
    number = Decimal(m[1]) * Decimal(10) ** int(m[2] or 0) * n
    return f"{number.normalize():f}{m[3] or ''}"


def per_ranks(defaults: dict, ranks: int) -> dict:
    """Per-rank defaults ({requests, limits}) for a container that runs `ranks` of them."""
    return {kind: {k: scaled(v, ranks) for k, v in (amounts or {}).items()} for kind, amounts in defaults.items()}


def with_defaults(given: dict | None, defaults: dict) -> dict | None:
    """The spec's resources, each request and limit it leaves unset taken from `defaults`. A
    default never contradicts the spec: where the spec's request is above the default limit the
    limit is the request, where its limit is below the default request the request is the limit
    (the API server refuses a request above its limit)."""
    given = given or {}
    requests = {**(defaults.get("requests") or {}), **(given.get("requests") or {})}
    limits = {**(defaults.get("limits") or {}), **(given.get("limits") or {})}
    for k in set(requests) & set(limits):
        request, limit = quantity(requests[k]), quantity(limits[k])
        if request is None or limit is None or request <= limit:
            continue
        if k in (given.get("limits") or {}) and k not in (given.get("requests") or {}):
            requests[k] = limits[k]
        elif k in (given.get("requests") or {}) and k not in (given.get("limits") or {}):
            limits[k] = requests[k]
    out = {kind: amounts for kind, amounts in (("limits", limits), ("requests", requests)) if amounts}
    return out or None
