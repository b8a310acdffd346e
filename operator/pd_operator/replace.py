"""`method: Replace` (pure): change the ratio the way peers do, for engines that cannot switch
roles. One replacement moves one replica between the groups in two steps: the growing group
gets a new pod (the fleet has one engine more for a while), and once it is Ready and linked
the other group shrinks by one, whose pod drains and goes (SIGTERM drain). The decided sizes
are recorded in status.rebalance.groupSizes before they are applied, so the StatefulSets'
sizes stay a pure function of the spec and that record (drift repair keeps the decision)."""
from __future__ import annotations

from .switch import Decision, Limits, iso

OTHER = {"prefill": "decoder", "decoder": "prefill"}


def plan(sizes: dict, target: int | None, limits: Limits, now: float, unsettled: str | None,
         reason: str) -> tuple[dict | None, Decision]:
    """(the new recorded sizes or None to keep them, the decision for the Rebalancing condition)."""
    p, d = sizes["prefill"], sizes["decoder"]
    growing = sizes.get("growing")
    base = dict(target=target, current=p)
    if growing:
        if unsettled:
            return None, Decision("Replacing", f"a new {growing} pod is starting; one {OTHER[growing]} goes once it "
                                               f"is Ready and linked ({unsettled})", **base)
        shrink = OTHER[growing]
        new = {"prefill": p - (shrink == "prefill"), "decoder": d - (shrink == "decoder")}
        return new, Decision("Replacing", f"the new {growing} pod is serving; removing one {shrink} "
                                          f"(it drains first) ({reason})", **base)
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
    left = (d if grow == "prefill" else p) - 1
    floor = max(1, limits.min_decoder if grow == "prefill" else limits.min_prefill)
    if left < floor:
        return None, Decision("MinCount", f"want {target} prefills, have {p}; one fewer {OTHER[grow]} would leave "
                                          f"{left}, below {floor}", **base)
    new = {"prefill": p + (grow == "prefill"), "decoder": d + (grow == "decoder"), "growing": grow}
    return new, Decision("Replacing", f"starting a new {grow} pod; one {OTHER[grow]} goes once it serves "
                                      f"({reason})", **base)
