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
    """Pods by revision: "u" the update revision (Ready), "s" the update revision starting (not
    Ready yet), "o" the old one."""
    return [{"metadata": {"name": f"llm-{group}-{i}", "labels": {
        "pdoperator.io/group": group, "controller-revision-hash": f"{group}-{'u' if r == 's' else r}"}},
             "status": {"conditions": [{"type": "Ready", "status": "False" if r == "s" else "True"}]}}
            for i, r in enumerate(revs)]


def parts_of(spec, sts_p: dict, sts_d: dict, p: list[str], d: list[str]) -> dict:
    return rollout.partitions("llm", spec, observed(sts_p, sts_d), pods("prefill", p) + pods("decoder", d),
                              {"prefill": sts_p["spec"]["replicas"], "decoder": sts_d["spec"]["replicas"]})


SKEWED = parse_spec({**SPEC, "rollout": {"maxSkew": 1}})


@pytest.mark.parametrize("p_revs,d_revs,parts", [
    (["u", "u"], ["u", "u"], {"prefill": 2, "decoder": 2}),          # nothing to roll: held
    (["o", "o"], ["o", "o"], {"prefill": 1, "decoder": 1}),          # a new template: one step each
    (["o", "u"], ["o", "o"], {"prefill": 1, "decoder": 1}),          # the decoder catches up
    (["o", "s"], ["o", "o"], {"prefill": 1, "decoder": 1}),          # ... on a prefill not Ready: no further
    (["o", "u"], ["o", "s"], {"prefill": 1, "decoder": 1}),          # nor past a decoder not Ready
    (["o", "u"], ["o", "u"], {"prefill": 0, "decoder": 1}),          # the old revision's prefills go first,
    (["u", "u"], ["o", "u"], {"prefill": 2, "decoder": 0}),          # then its last decoder
])
def test_partitions_keep_the_groups_within_max_skew(p_revs, d_revs, parts):
    assert parts_of(SKEWED, sts("prefill", 2), sts("decoder", 2), p_revs, d_revs) == parts


def test_a_stale_status_keeps_the_partition_written_and_none_without_rollout():
    released = sts("prefill", 2, observed=1)
    released["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}
    assert parts_of(SKEWED, released, sts("decoder", 3), ["o", "o"], ["o", "o", "o"]) == \
        {"prefill": 1, "decoder": 3}            # kept as written; the decoder waits for the prefill's status
    assert parts_of(SKEWED, sts("prefill", 2, observed=1), sts("decoder", 3), ["o", "o"], ["o", "o", "o"]) == \
        {"prefill": 2, "decoder": 3}            # a StatefulSet without one: held
    assert parts_of(parse_spec(SPEC), released, sts("decoder", 3), ["o", "o"], ["o", "o", "o"]) == {}


def test_a_scale_in_the_same_pass_counts_at_its_new_size():
    got = rollout.partitions("llm", SKEWED, observed(sts("prefill", 2), sts("decoder", 2)),
                             pods("prefill", ["u", "u"]) + pods("decoder", ["u", "u"]), {"prefill": 2, "decoder": 4})
    assert got == {"prefill": 2, "decoder": 0}   # 2 of 4 at the new size: the new ordinals are made new
    got = rollout.partitions("llm", SKEWED, observed(sts("prefill", 2), sts("decoder", 2)),
                             pods("prefill", ["u", "u"]) + pods("decoder", ["u", "u"]), {"prefill": 2, "decoder": 1})
    assert got == {"prefill": 2, "decoder": 1}   # scaled down: held at the new size


@pytest.mark.parametrize("n_p,n_d,skew", [(2, 6, 2), (2, 2, 1), (2, 1, 1), (4, 2, 1), (3, 1, 2), (1, 1, 1),
                                          (6, 2, 1), (5, 3, 2)])
def test_every_shape_rolls_to_the_end_the_old_revision_keeping_a_decoder_while_it_has_prefills(n_p, n_d, skew):
    spec = parse_spec({**SPEC, "rollout": {"maxSkew": skew}})
    p, d = ["o"] * n_p, ["o"] * n_d
    worst = 0
    for _ in range(4 * (n_p + n_d)):   # the StatefulSet controller: a released ordinal rolls, highest first
        parts = parts_of(spec, sts("prefill", n_p), sts("decoder", n_d), p, d)
        for revs, g in ((p, "prefill"), (d, "decoder")):
            for i in reversed(range(len(revs))):
                if i >= parts[g] and revs[i] == "o":
                    revs[i] = "u"
                    break
        assert "o" not in p or "o" in d, "the old revision kept a decoder while it had prefills"
        if "o" in p and "o" in d and d.count("u") < n_d - 1:   # the bound, outside the prefills' finish
            worst = max(worst, abs(p.count("u") - d.count("u")))
    assert p == ["u"] * n_p and d == ["u"] * n_d, (p, d)
    assert worst <= skew


def test_with_partitions_sets_only_the_statefulsets():
    desired = [{"kind": "Service", "metadata": {"name": "llm-prefill"}}, sts("prefill", 2)]
    out = rollout.with_partitions(desired, "llm", {"prefill": 1})
    assert out[0] == desired[0] and "updateStrategy" not in desired[1]["spec"]
    assert out[1]["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}
    assert rollout.with_partitions(desired, "llm", {}) == desired
