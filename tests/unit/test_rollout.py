"""Revisions: an engine pod's revision from its images, never a link or a routed pair across two,
condition RevisionSkew, and the partitions that roll prefill and decoder together (maxSkew)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pd_contract.revisions import pairable, revision_of
from pd_operator import links, rollout
from pd_operator.api import parse_spec
from tests.unit.test_operator_pure import SPEC, eng, up

OLD, NEW = "rev-old", "rev-new"


def test_a_revision_follows_the_images_only():
    spec = {"containers": [{"name": "agent", "image": "a:1", "env": [{"name": "X", "value": "1"}]}]}
    assert revision_of(spec) == revision_of({**spec, "containers": [{"name": "agent", "image": "a:1"}]})
    assert revision_of(spec) != revision_of({"containers": [{"name": "agent", "image": "a:2"}]})
    assert revision_of({"containers": [{"name": "e", "image": "v:1"}, {"name": "agent", "image": "a:1"}]}) == \
        revision_of({"containers": [{"name": "agent", "image": "a:1"}, {"name": "e", "image": "v:1"}]})
    assert revision_of(None) == "" and pairable("", "x") and pairable("x", "x") and not pairable("x", "y")


def test_no_link_across_revisions_and_the_old_links_go():
    p_old, p_new = replace(eng("p0", "prefill", 0), revision=OLD), replace(eng("p1", "prefill", 1), revision=NEW)
    d_old, d_new = replace(eng("d0", "decoder", 1000), revision=OLD), replace(eng("d1", "decoder", 1001),
                                                                              revision=NEW)
    want = links.desired([p_old, p_new, d_old, d_new])
    assert {d: [p.pod for p in ps] for d, ps in want.items()} == {"d0": ["p0"], "d1": ["p1"]}
    # d1 was linked to p0 before it rolled: that link is dropped
    [plan] = links.plan([p_old, p_new, d_old, d_new], {"d0": [up(p_old)], "d1": [up(p_old)]})
    assert plan.decoder.pod == "d1" and plan.unlink == [up(p_old)] and [e.pod for e in plan.link] == ["p1"]


def test_the_router_never_pairs_across_revisions():
    from pd_router.routing import Fleet

    def entry(url, cid, rev, links_to=()):
        return {"url": url, "cluster_id": cid, "revision": rev, "links": [{"cluster_id": c} for c in links_to],
                "load": {"running": 0, "queue_depth": 0, "kv_used_bytes": 0, "queued_prompt_tokens": 0}}
    fleet = Fleet(None, None, lambda: [])   # type: ignore[arg-type]
    fleet.prefills = [entry("p-old", 0, OLD), entry("p-new", 1, NEW)]
    fleet.decoders = [entry("d-new", 1000, NEW, links_to=(0, 1))]   # a stale link to the old prefill
    assert all(fleet.pick_prefill(set(), 10)["url"] == "p-new" for _ in range(5))
    assert fleet.pick_decoder(fleet.prefills[0], set()) is None


def test_revision_skew_is_present_while_two_revisions_serve():
    es = [replace(eng("p0", "prefill", 0), revision=OLD), replace(eng("d0", "decoder", 1000), revision=OLD)]
    assert rollout.revision_skew(es) is None
    v = rollout.revision_skew(es + [replace(eng("p1", "prefill", 1), revision=NEW)])
    assert v is not None and v[:2] == (True, "RevisionsCoexist")
    assert f"{NEW}: 1 prefill, 0 decoder" in v[2] and f"{OLD}: 1 prefill, 1 decoder" in v[2]


def observed(*objs: dict) -> dict:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def sts(group: str, replicas: int, update: str = "u", gen: int = 2, observed: int = 2) -> dict:
    return {"kind": "StatefulSet", "metadata": {"name": f"llm-{group}", "generation": gen},
            "spec": {"replicas": replicas}, "status": {"updateRevision": f"{group}-{update}",
                                                       "observedGeneration": observed}}


def pods(group: str, revs: list[str]) -> list[dict]:
    return [{"metadata": {"name": f"llm-{group}-{i}", "labels": {"pdoperator.io/group": group,
                                                                 "controller-revision-hash": f"{group}-{r}"}}}
            for i, r in enumerate(revs)]


SKEWED = parse_spec({**SPEC, "rollout": {"maxSkew": 1}})


@pytest.mark.parametrize("p_revs,d_revs,parts", [
    (["u", "u"], ["u", "u"], {"prefill": 2, "decoder": 2}),          # nothing to roll: held
    (["o", "o"], ["o", "o"], {"prefill": 1, "decoder": 1}),          # a new template: one step each
    (["o", "u"], ["o", "o"], {"prefill": 1, "decoder": 1}),          # the decoder catches up
    (["o", "u"], ["o", "u"], {"prefill": 0, "decoder": 1}),          # the prefills first: the old
    (["u", "u"], ["o", "u"], {"prefill": 2, "decoder": 0}),          # revision's last decoder waits
    (["u", "u"], ["o", "u"], {"prefill": 2, "decoder": 0}),          # prefill done: the decoder rolls freely
])
def test_partitions_keep_the_groups_within_max_skew(p_revs, d_revs, parts):
    children = observed(sts("prefill", 2), sts("decoder", 2))
    assert rollout.partitions("llm", SKEWED, children, pods("prefill", p_revs) + pods("decoder", d_revs)) == parts


def test_partitions_hold_a_stale_status_and_are_absent_without_rollout():
    children = observed(sts("prefill", 2, observed=1), sts("decoder", 3))
    live = pods("prefill", ["o", "o"]) + pods("decoder", ["o", "o", "o"])
    assert rollout.partitions("llm", SKEWED, children, live) == {"prefill": 2, "decoder": 3}
    assert rollout.partitions("llm", parse_spec(SPEC), children, live) == {}


def test_unequal_groups_never_skew_by_more_than_max_skew_while_both_roll():
    spec = parse_spec({**SPEC, "rollout": {"maxSkew": 2}})
    p, d = ["o"] * 2, ["o"] * 6
    worst = 0
    for _ in range(20):   # the StatefulSet controller: the released ordinals roll, highest first
        parts = rollout.partitions("llm", spec, observed(sts("prefill", 2), sts("decoder", 6)),
                                   pods("prefill", p) + pods("decoder", d))
        for revs, g in ((p, "prefill"), (d, "decoder")):
            for i in reversed(range(len(revs))):
                if i >= parts[g] and revs[i] == "o":
                    revs[i] = "u"
                    break
        if "o" in p and "o" in d:
            worst = max(worst, abs(p.count("u") - d.count("u")))
        if "o" in p:
            assert "o" in d, "the old revision kept a decoder while it had prefills"
    assert p == ["u"] * 2 and d == ["u"] * 6 and worst <= 2


def test_with_partitions_sets_only_the_statefulsets():
    desired = [{"kind": "Service", "metadata": {"name": "llm-prefill"}}, sts("prefill", 2)]
    out = rollout.with_partitions(desired, "llm", {"prefill": 1})
    assert out[0] == desired[0] and "updateStrategy" not in desired[1]["spec"]
    assert out[1]["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}
    assert rollout.with_partitions(desired, "llm", {}) == desired
