"""results.fold: what acting did becomes the memory the next pass decides from."""
from __future__ import annotations

from pd_operator.diagnosis import Diagnosis
from pd_operator.results import LinkAttempt, Results, StepResult, fold, fold_seen
from pd_operator.state import Memory, Seen

DIAG = Diagnosis("EndpointUnreachable", "d0 -> p1: refused")


def test_link_attempts_fail_with_backoff_and_succeed_clearing_it():
    mem = Memory()
    fold(mem, Results(links=[LinkAttempt("d0", 1, "LLM_LINK_FAILED", DIAG), LinkAttempt("d0", 0, "LLM_SUCCESS")]),
         now=100.0)
    assert mem.failures == {("d0", 1): ("LLM_LINK_FAILED", DIAG)}
    assert not mem.link_backoff.due(("d0", 1), 100.0) and mem.link_backoff.due(("d0", 0), 100.0)
    fold(mem, Results(links=[LinkAttempt("d0", 1, "LLM_SUCCESS")]), now=200.0)
    assert mem.failures == {} and mem.link_backoff.due(("d0", 1), 200.0)


def test_links_failing_counts_what_the_fold_would_leave():
    before = {("d0", 1): ("LLM_LINK_FAILED", DIAG)}
    assert not Results(links=[LinkAttempt("d0", 1, "LLM_SUCCESS")]).links_failing(before)
    assert Results(links=[LinkAttempt("d0", 0, "LLM_SUCCESS")]).links_failing(before), "d0 -> 1 still failing"
    assert Results(links=[LinkAttempt("d0", 0, "LLM_LINK_FAILED", DIAG)]).links_failing({})


def test_a_failed_switch_step_is_counted_backed_off_and_a_refusal_remembered():
    mem = Memory()
    fold(mem, Results(steps=[StepResult("p1", "switch_role: LLM_FEATURE_NOT_ENABLED: no", "no")]), now=10.0)
    assert mem.switch_fails == {"p1": 1} and mem.switch_refused == {"p1": "no"}
    assert mem.switch_errors["p1"].startswith("switch_role") and not mem.switch_backoff.due("p1", 10.0)
    fold(mem, Results(steps=[StepResult("p1")]), now=11.0)
    assert "p1" not in mem.switch_errors and mem.switch_backoff.due("p1", 11.0)
    assert mem.switch_fails == {"p1": 1}, "a switch's failed actions are counted until it ends (decide forgets them)"


def test_a_verification_round_and_created_tokens():
    mem, seen = Memory(), Seen(token_create={"control": "c", "data": "d"})
    r = {"decoder": "d0", "prefill": "p0", "ok": True, "code": "OK"}
    res = Results(verified=[r], verified_at="2026-12-05T00:00:00Z", next_verify=70.0,
                  verified_links=frozenset({("d0", 0)}), tokens_created={"control": "c"},
                  tokens_taken=["data"], switch_verified=[(("p1", "b"), ("d0", "p1"))])
    fold(mem, res, now=10.0)
    fold_seen(seen, res, now=10.0)
    assert mem.verify == {"d0": r} and mem.verify_round == 1 and mem.next_verify == 70.0
    assert mem.verified_links == frozenset({("d0", 0)}) and mem.verified_at == "2026-12-05T00:00:00Z"
    assert seen.token == "c" and seen.token_create == {"data": "d"}
    assert seen.token_read_at == 0.0, "a Secret someone else made is read again at once"
    assert mem.switch_verified == {("p1", "b"): {("d0", "p1")}}
