"""Leader election against a hostile Lease record (pure: a fake API for one Lease)."""
from __future__ import annotations

import copy

import pytest

from pd_operator.leader import Elector, LeaseSettings, held_for


class OneLease:
    """get/create/replace over one Lease, as the API server answers them."""

    def __init__(self, lease: dict | None):
        self.lease = lease

    async def get(self, api, kind, ns, name):
        return copy.deepcopy(self.lease)

    async def create(self, body):
        if self.lease is not None:
            return None
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": "1"}}
        return self.lease

    async def replace(self, body):
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": "2"}}
        return self.lease


@pytest.mark.parametrize("written,want", [(2147483647, 15.0), (5, 5.0), (0, 15.0), (-3, 15.0), ("soon", 15.0),
                                          (None, 15.0), (float("inf"), 15.0)])
def test_a_foreign_duration_is_bounded_by_ours(written, want):
    assert held_for(written, 15.0) == want


async def test_a_lease_held_with_a_duration_of_decades_is_taken_after_our_own_duration():
    hostile = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": "pd-operator-leader", "namespace": "pd-system", "resourceVersion": "7"},
               "spec": {"holderIdentity": "someone-else", "leaseDurationSeconds": 2147483647,
                        "renewTime": "2026-12-04T00:00:00.000000Z", "leaseTransitions": 3}}
    kube = OneLease(hostile)
    clock = [1000.0]

    class Clock:
        def monotonic(self) -> float:
            return clock[0]

        def time(self) -> float:
            return 1.8e9 + clock[0]

    async def nothing():
        return None
    e = Elector(kube, LeaseSettings(namespace="pd-system", identity="me"), nothing, nothing,   # type: ignore[arg-type]
                clock=Clock())
    assert not await e.try_acquire_or_renew()        # held, as far as it can tell
    clock[0] += 14.0
    assert not await e.try_acquire_or_renew()        # within our own 15 s
    clock[0] += 2.0
    assert await e.try_acquire_or_renew()            # not renewed for longer than we would wait: ours
    assert kube.lease["spec"]["holderIdentity"] == "me"
    assert kube.lease["spec"]["leaseDurationSeconds"] == 15
