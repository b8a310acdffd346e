"""`method: Replace` (pure): change the ratio the way peers do, for engines that cannot switch
roles. A move of k replicas between the groups takes two steps: the growing group gets k new pods
(the fleet has k engines more for a while), and once they are Ready and linked the other group
shrinks by k, whose pods drain and go (SIGTERM drain). k is the whole move, up to
maxConcurrentSwitches. The decided sizes are recorded in status.rebalance.groupSizes before they
are applied, so the StatefulSets' sizes stay a pure function of the spec and that record (drift
repair keeps the decision)."""
from __future__ import annotations

from .switch import Decision, Limits, iso

OTHER = {"prefill": "decoder", "decoder": "prefill"}


def plan(sizes: dict, target: int | None, limits: Limits, now: float, unsettled: str | None,
         reason: str, total: int) -> tuple[dict | None, Decision]:
    """(the new recorded sizes or None to keep them, the decision for the Rebalancing condition).
    `total`: the engines the spec asks for (a move in flight has more, by the pods it added)."""
    p, d = sizes["prefill"], sizes["decoder"]
    growing = sizes.get("growing")
    base = dict(target=target, current=p)
    if growing:
        k = sizes.get("moving") or 1
        shrink = OTHER[growing]
        pods = f"{k} new {growing} pods are" if k > 1 else f"a new {growing} pod is"
        if unsettled:
            return None, Decision("Replacing", f"{pods} starting; {k} {shrink}(s) go once they are Ready and "
                                               f"linked ({unsettled})", **base)
        # never below the shrinking group's floor, whatever the record says
        floor = max(1, limits.min_prefill if shrink == "prefill" else limits.min_decoder)
        k = max(0, min(k, (p if shrink == "prefill" else d) - floor))
        new = {"prefill": p - k * (shrink == "prefill"), "decoder": d - k * (shrink == "decoder")}
        return new, Decision("Replacing", f"the new {growing} pods serve; removing {k} {shrink}(s) "
                                          f"(they drain first) ({reason})", **base)
    if target is None:
        return None, Decision("NoPolicy", "no rebalancing policy sets a prefill count", current=p)
    if p == target:
        return None, Decision("AtTarget", f"{p} prefill pods, as wanted", **base)
    if now < limits.cooldown_until:
        return None, Decision("Cooldown", f"want {target} prefills, have {p}; next replacement after "
                                          f"{iso(limits.cooldown_until)} (cooldownSeconds)", **base)
    if unsettled:
        return None, Decision("WaitingForFleet", f"want {target} prefills, have {p}; waiting: {unsettled}", **base)
    grow = "prefill" if target > p else "decoder"
    other = d if grow == "prefill" else p
    floor = max(1, limits.min_decoder if grow == "prefill" else limits.min_prefill)
    k = min(abs(target - p), limits.max_in_flight, other - floor)
    if k < 1:
        return None, Decision("MinCount", f"want {target} prefills, have {p}; one fewer {OTHER[grow]} would leave "
                                          f"{other - 1}, below {floor}", **base)
    new = {"prefill": p + k * (grow == "prefill"), "decoder": d + k * (grow == "decoder"), "growing": grow,
           "moving": k}
    what = f"a new {grow} pod; one {OTHER[grow]} goes once it serves" if k == 1 else \
        f"{k} new {grow} pods; {k} {OTHER[grow]}s go once they serve"
    return new, Decision("Replacing", f"starting {what} ({reason})", **base)
