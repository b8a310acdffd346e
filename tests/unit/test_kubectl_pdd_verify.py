"""kubectl pdd verify's orchestration (parallel calls under a deadline, progress, the key billed)
and `kubectl pdd switch` (what the abort wait concludes), without a cluster."""
from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import pytest

from pd_operator import switch as sw_
from pd_operator.builders import token_secret_name
from pd_operator.kubectl_pdd import (
    ANNOTATION_ABORT,
    Failed,
    Progress,
    TimedOut,
    VerifyOptions,
    abort_outcome,
    abort_verdict,
    build_parser,
    call_timeout,
    choose_key,
    format_switches,
    gateway_ready,
    run_bounded,
    switch_abort,
    verify,
)

# ---- run_bounded ------------------------------------------------------------------------------


async def test_run_bounded_keeps_to_the_concurrency_bound_and_the_jobs_order():
    active = peak = 0

    def job(i: int):
        async def call(t: float) -> int:
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.005 * (i % 3))
            active -= 1
            return i
        return call
    keys = [f"p{i}" for i in range(40)]
    got = await run_bounded([(k, job(i)) for i, k in enumerate(keys)], time.monotonic() + 10, 5, limit=5)
    assert peak == 5
    assert list(got) == keys and list(got.values()) == list(range(40))


async def test_the_deadline_turns_what_did_not_finish_into_timed_out_entries():
    async def hang(t: float) -> None:
        await asyncio.sleep(30)

    async def quick(t: float) -> str:
        return "ok"
    jobs = [("fast", quick)] + [(f"slow{i}", hang) for i in range(5)]
    t0 = time.monotonic()
    got = await run_bounded(jobs, t0 + 0.2, per_call=10, limit=2)
    assert time.monotonic() - t0 < 2, "the deadline bounds the whole run"
    assert got["fast"] == "ok"
    slow = [got[f"slow{i}"] for i in range(5)]
    assert all(isinstance(r, TimedOut) for r in slow)
    started = [r for r in slow if r.after_s is not None]
    assert len(started) == 2, "two ran (the bound) and were cut; the rest never got their turn"
    assert str(slow[-1]) == "timed out (not started before the deadline)"
    assert str(started[0]).startswith("timed out (no answer within")


async def test_a_call_is_cut_at_its_own_timeout_and_errors_are_entries_not_tracebacks():
    async def hang(t: float) -> None:
        await asyncio.sleep(30)

    async def boom(t: float) -> None:
        raise httpx.ConnectError("refused")

    async def http_timeout(t: float) -> None:
        raise httpx.ReadTimeout("read")

    async def quick(t: float) -> float:
        return t
    got = await run_bounded([("hang", hang), ("boom", boom), ("rt", http_timeout), ("quick", quick)],
                            time.monotonic() + 30, per_call=0.1)
    assert got["hang"] == TimedOut(0.1)
    assert got["boom"] == Failed("ConnectError: refused")
    assert isinstance(got["rt"], TimedOut)
    assert got["quick"] == pytest.approx(0.1), "a call is given its timeout"


async def test_progress_counts_every_call_and_ticks_while_they_hang():
    seen: list[tuple[int, int]] = []

    def job(delay: float):
        async def call(t: float) -> None:
            await asyncio.sleep(delay)
        return call
    await run_bounded([("a", job(0)), ("b", job(0.01)), ("c", job(0.5))], time.monotonic() + 5, 5,
                      progress=lambda d, n: seen.append((d, n)), tick=0.05)
    done = [d for d, _ in seen]
    assert {n for _, n in seen} == {3} and done == sorted(done)
    assert seen[0] == (1, 3) and seen[-1] == (3, 3)
    assert seen.count((2, 3)) >= 3, "ticks repeat the count while the last call hangs"


def test_call_timeout_is_a_quarter_of_the_deadline_within_bounds():
    assert call_timeout(60) == 15
    assert call_timeout(2) == 1
    assert call_timeout(600) == 30


# ---- Progress ---------------------------------------------------------------------------------


def test_progress_on_a_terminal_rewrites_one_line_and_clears_it():
    buf = io.StringIO()
    p = Progress(buf, tty=True)
    p("verified 12/64 KV paths...")
    p("verified 9/9 agents...")
    p.clear()
    assert buf.getvalue() == ("\rverified 12/64 KV paths..." + "\rverified 9/9 agents...    " + "\r" + " " * 22 + "\r")
    p.clear()   # nothing on the line: nothing written
    assert buf.getvalue().endswith(" " * 22 + "\r")


def test_progress_elsewhere_prints_a_line_every_few_seconds():
    now = [100.0]
    buf = io.StringIO()
    p = Progress(buf, tty=False, every=5, clock=lambda: now[0])
    p("checked 1/64 agents...")          # a quick run prints nothing
    now[0] = 104.9
    p("checked 2/64 agents...")
    assert buf.getvalue() == ""
    now[0] = 105.0
    p("checked 3/64 agents...")
    now[0] = 107.0
    p("checked 4/64 agents...")
    now[0] = 110.5
    p("checked 5/64 agents...")
    p.clear()
    assert buf.getvalue() == "checked 3/64 agents...\nchecked 5/64 agents...\n"


# ---- the key, the gateway without a completion -------------------------------------------------


def test_the_key_is_the_named_one_else_the_first_as_connect_chooses():
    keys = {"team-b": "sk-b\n", "team-a": "sk-a"}
    assert choose_key(keys, None, "keys") == ("team-a", "sk-a")
    assert choose_key(keys, "team-b", "keys") == ("team-b", "sk-b")
    with pytest.raises(LookupError, match="no key named 'team-c' \\(it has team-a, team-b\\)"):
        choose_key(keys, "team-c", "keys")
    with pytest.raises(LookupError, match="--no-completion"):
        choose_key({}, None, "keys")


def test_no_completion_reports_the_gateway_pods_readiness():
    def pod(n: str, ready: str) -> dict:
        return {"metadata": {"name": n}, "status": {"conditions": [{"type": "Ready", "status": ready}]}}
    assert gateway_ready([pod("g-1", "True")], "x") == (0, 0, ["  ok  g-1: ready"])
    assert gateway_ready([pod("g-1", "True"), pod("g-2", "False")], "x")[:2] == (1, 0)
    assert gateway_ready([], "x") == (1, 0, ["  FAIL no x-gateway pod"])
    assert gateway_ready(None, "x")[:2] == (1, 1)


# ---- verify end to end, with a fake API server -------------------------------------------------

NS, NAME = "ns", "x"
PREFILLS = [f"x-prefill-{i}" for i in range(2)]
DECODERS = [f"x-decoder-{i}" for i in range(3)]
CID = {p: 1 + i for i, p in enumerate(PREFILLS)} | {d: 100 + i for i, d in enumerate(DECODERS)}


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


class FakeKube:
    """The calls verify makes: get/list, and the pod proxy through `_http` (a mock transport)."""

    def __init__(self, hang: set[str] = frozenset(), gateway: bool = True):
        self.hang = hang
        self.requests: list[httpx.Request] = []
        self.active = self.peak = 0
        members = [{"pod": p, "role": "prefill", "clusterId": CID[p], "ip": f"10.0.0.{CID[p]}", "port": 26000}
                   for p in PREFILLS]
        members += [{"pod": d, "role": "decoder", "clusterId": CID[d], "ip": f"10.0.1.{CID[d]}", "port": 26000}
                    for d in DECODERS]
        self.pdd = {"metadata": {"name": NAME, "namespace": NS},
                    "spec": {"model": {"name": "m", "modelId": 7},
                             "gateway": {"enabled": gateway, "apiKeysSecret": "x-keys"}},
                    "status": {"phase": "Ready", "linksSummary": "6/6", "members": members}}
        self._http = httpx.AsyncClient(transport=httpx.MockTransport(self.handle), base_url="http://api")

    async def get(self, api_version: str, kind: str, ns: str, name: str) -> dict | None:
        if kind == "PDDeployment":
            return self.pdd
        if kind == "Secret" and name == token_secret_name(NAME):
            return {"data": {"token": _b64("t0ken")}}
        if kind == "Secret" and name == "x-keys":
            return {"data": {"team-a": _b64("sk-a"), "team-b": _b64("sk-b")}}
        if kind == "Pod":
            return {"status": {"podIP": f"10.9.9.{CID.get(name, 0)}"}}
        return None

    async def list(self, api_version: str, kind: str, ns: str, selector: str = "") -> list[dict]:
        return [{"metadata": {"name": "x-gateway-abc"},
                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]

    async def handle(self, req: httpx.Request) -> httpx.Response:
        self.requests.append(req)
        pod = req.url.path.split("/pods/")[1].split(":")[0]
        path = req.url.path.split("/proxy", 1)[1]
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(0.01)
            if pod in self.hang:
                await asyncio.sleep(30)
            if path == "/v1/status":
                if pod in PREFILLS:
                    return httpx.Response(200, json={"role": "prompt", "cluster_id": CID[pod]})
                return httpx.Response(200, json={"role": "decoder", "cluster_id": CID[pod], "links": [
                    {"cluster_id": CID[p], "code": "LLM_SUCCESS", "healthy": True} for p in PREFILLS]})
            if path == "/v1/verify":
                return httpx.Response(200, json={"ok": True, "bytes": 4096, "pull_ms": 1.25})
            if path == "/v1/chat/completions":
                return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}}],
                                                 "usage": {"completion_tokens": 8}})
            return httpx.Response(404)
        finally:
            self.active -= 1


async def run_verify(kube: FakeKube, opts: VerifyOptions) -> tuple[int, list[str], str]:
    lines: list[str] = []
    err = io.StringIO()
    try:
        rc = await verify(kube, NS, NAME, opts, out=lines.append, progress=Progress(err, tty=True))  # type: ignore[arg-type]
    finally:
        await kube._http.aclose()
    return rc, lines, err.getvalue()


async def test_verify_runs_the_calls_in_parallel_and_bills_the_named_key():
    kube = FakeKube()
    rc, lines, err = await run_verify(kube, VerifyOptions(key_name="team-b", via="proxy"))
    text = "\n".join(lines)
    assert rc == 0, text
    assert sum(line.startswith("  ok  x-decoder-") for line in lines) == 3 * 2 + 3, "6 links and 3 probes"
    assert "      using the key named 'team-b' from Secret x-keys" in lines
    assert "model m, 8 tokens" in text and lines[-1] == "\nall checks passed"
    completion = [r for r in kube.requests if r.url.path.endswith("/v1/chat/completions")]
    assert [r.headers["x-api-key"] for r in completion] == ["sk-b"]
    assert all(r.headers["X-PD-Agent-Token"] == "t0ken" for r in kube.requests if "/v1/" in r.url.path
               and "chat" not in r.url.path)
    assert kube.peak >= 3, "the agents were asked at once, not one after another"
    assert "\rchecked 5/5 agents..." in err and "verified 3/3 KV paths..." in err and "sent 1/1 completion" in err
    assert err.endswith("\r"), "the progress line is cleared before the report"


async def test_verify_reports_what_missed_the_deadline_as_timed_out_and_fails():
    kube = FakeKube(hang={"x-decoder-2"})
    t0 = time.monotonic()
    rc, lines, _ = await run_verify(kube, VerifyOptions(timeout=2, via="proxy"))
    assert time.monotonic() - t0 < 5
    assert rc == 1
    assert "  FAIL x-decoder-2: agent status timed out (no answer within 1s)" in lines
    assert "  -   x-decoder-2: no probe (its agent did not answer)" in lines
    assert sum(line.startswith("  ok  x-decoder-") for line in lines) == 2 * 2 + 2
    assert lines[-1] == "\n1 check(s) failed, 1 timed out (--timeout 2s)"


async def test_verify_without_completion_sends_nothing_through_the_gateway():
    kube = FakeKube()
    rc, lines, _ = await run_verify(kube, VerifyOptions(completion=False, via="proxy"))
    assert rc == 0
    assert "\ngateway (--no-completion: nothing sent):" in lines
    assert "  ok  x-gateway-abc: ready" in lines
    assert not [r for r in kube.requests if "gateway" in r.url.path or "chat" in r.url.path]
    assert not any("using the key" in line for line in lines)


def test_the_help_names_the_new_flags():
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "command").choices
    assert {"--timeout", "--no-completion", "--key-name", "--api-key"} <= set(sub["verify"]._option_string_actions)
    switch = next(a for a in sub["switch"]._actions if a.dest == "switch_command").choices
    assert {"--timeout", "--no-wait"} <= set(switch["abort"]._option_string_actions)
    assert "--timeout" in sub["switch"].format_help() and "--no-wait" in sub["switch"].format_help()
    args = ap.parse_args(["-n", "a", "switch", "abort", "x", "x-decoder-1", "--no-wait"])
    assert (args.namespace, args.name, args.pod, args.no_wait, args.timeout) == ("a", "x", "x-decoder-1", True, 120)
    assert ap.parse_args(["verify", "x", "-n", "b"]).namespace == "b"
    with pytest.raises(SystemExit):
        ap.parse_args(["verify", "x", "--timeout", "0"])


# ---- switch abort: what the wait concludes ---------------------------------------------------

POD = "x-decoder-1"
T = 1_700_000_000.0


def switch(step: str, pod: str = POD) -> sw_.Switch:
    """A decoder -> prefill switch of `pod`, in `step` since T + 5 (Drain: since T)."""
    s = sw_.Switch(pod=pod, uid="u", from_="decoder", to="prefill", step="Drain", started=T, step_started=T,
                   reason="policy")
    return s if step == "Drain" else s.at(step, T + 5)


def pdd(switches: list[sw_.Switch] | tuple = (), asked: str | None = POD, last: dict | None = None,
        refused: str | None = None) -> dict:
    st: dict = {"switches": [s.to_status() for s in switches]}
    if last is not None:
        st["lastSwitch"] = last
    if refused is not None:
        st["conditions"] = [{"type": "Rebalancing", "status": "True", "reason": "AbortRefused", "message": refused}]
    return {"metadata": {"name": NAME, "annotations": {ANNOTATION_ABORT: asked} if asked else {}}, "status": st}


def aborted_record(pod: str = POD, at: float = T + 9) -> dict:
    sw, _ = sw_.abort_on_request(switch("Drain", pod), T + 8)
    return sw_.Outcome("Aborted", sw, sw.message, at).record()


def test_an_abort_the_operator_carries_out_reports_the_old_role():
    seen = [pdd([switch("Drain")]),
            pdd([sw_.abort_on_request(switch("Drain"), T + 8)[0]]),
            pdd([sw_.abort_on_request(switch("Drain"), T + 8)[0]], asked=None),   # annotation gone, status behind
            pdd([], asked=None, last=aborted_record())]
    assert [abort_verdict(POD, o, None) for o in seen[:3]] == [None, None, None]
    v = abort_outcome(POD, seen, None, 3, T + 10)
    assert (v.message, v.code) == (f"the switch of {POD} was aborted; it serves as decoder again", 0)


def test_an_abort_past_switch_role_prints_the_refusal_and_fails():
    _, why = sw_.abort_on_request(switch("Relink"), T + 8)
    assert why is not None and POD in why
    seen = [pdd([switch("Relink")]), pdd([switch("Relink")], refused=why)]
    v = abort_outcome(POD, seen, None, 2, T + 10)
    assert (v.message, v.code) == (why, 1)


def test_a_refusal_naming_another_pod_is_not_this_ones():
    _, other = sw_.abort_on_request(switch("Relink", pod="x-decoder-10"), T + 8)
    assert abort_verdict(POD, pdd([switch("Relink")], refused=other), None) is None


def test_no_switch_to_abort_once_the_operator_removed_the_annotation():
    stale = aborted_record(at=T - 600)   # an earlier abort of the same pod is not this one's answer
    seen = [pdd([], last=stale), pdd([], asked=None, last=stale)]
    assert abort_verdict(POD, seen[0], stale) is None
    v = abort_outcome(POD, seen, stale, 2, T + 10)
    assert (v.message, v.code) == (f"there was no switch of {POD} to abort", 1)


def test_a_switch_that_completed_first_is_not_an_abort():
    sw = switch("Undrain")
    last = sw_.Outcome("Completed", sw.at("Undrain", T + 20), "", T + 20).record()
    v = abort_outcome(POD, [pdd([sw]), pdd([], asked=None, last=last)], None, 2, T + 30)
    assert v.code == 1 and v.message.startswith(f"the switch of {POD} ended before it could be aborted: Completed")


def test_a_replaced_request_stops_the_wait():
    v = abort_verdict(POD, pdd([switch("Drain")], asked="x-decoder-0"), None)
    assert v is not None and v.code == 1 and "now names x-decoder-0" in v.message


def test_the_timeout_says_what_the_status_shows():
    sw = switch("Verify")
    v = abort_outcome(POD, [pdd([sw]), pdd([sw])], None, 120, T + 65)
    assert v.code == 1
    assert v.message == (f"timed out after 120s: the status shows {POD}: decoder -> prefill, step Verify since "
                         f"{sw_.iso(T + 5)} (60s ago); the request ({ANNOTATION_ABORT}) is still pending")
    v = abort_outcome(POD, [pdd([])], None, 120, T)
    assert "no switch of x-decoder-1 is in flight, and the operator has not removed" in v.message


class SwitchKube:
    def __init__(self, seen: list[dict]):
        self.seen = seen
        self.first = {**seen[0], "metadata": {"name": NAME, "annotations": {}}}
        self.patches: list[tuple] = []
        self.gets = 0

    async def get(self, api_version: str, kind: str, ns: str, name: str) -> dict | None:
        self.gets += 1
        if self.gets == 1:
            return self.first
        return self.seen[min(self.gets - 1, len(self.seen) - 1)]

    async def patch(self, api_version: str, kind: str, ns: str, name: str, body: dict) -> dict:
        self.patches.append((api_version, kind, ns, name, body))
        return self.seen[0]


async def test_switch_abort_sets_the_annotation_by_merge_patch_and_waits():
    kube = SwitchKube([pdd([switch("Drain")]), pdd([switch("Drain")]), pdd([], asked=None, last=aborted_record())])
    out: list[str] = []
    notes: list[str] = []
    rc = await switch_abort(kube, NS, NAME, POD, timeout=5, poll=0, out=out.append, err=notes.append)  # type: ignore[arg-type]
    assert kube.patches == [("pdoperator.io/v1alpha1", "PDDeployment", NS, NAME,
                             {"metadata": {"annotations": {"pdoperator.io/switch-abort": POD}}})]
    assert rc == 0 and out == [f"the switch of {POD} was aborted; it serves as decoder again"]
    assert notes == [f"waiting: {POD} is at step Drain"]


async def test_switch_abort_no_wait_returns_at_once_and_times_out_otherwise():
    kube = SwitchKube([pdd([switch("Drain")])])
    out: list[str] = []
    assert await switch_abort(kube, NS, NAME, POD, wait=False, out=out.append, err=lambda _: None) == 0  # type: ignore[arg-type]
    assert kube.gets == 1 and "switch status x" in out[0]
    kube = SwitchKube([pdd([switch("Relink")])])
    out = []
    rc = await switch_abort(kube, NS, NAME, POD, timeout=0.05, poll=0.01, out=out.append, err=lambda _: None)  # type: ignore[arg-type]
    assert rc == 1 and out[0].startswith("timed out after 0s: the status shows x-decoder-1: decoder -> prefill, "
                                         "step Relink")


def test_switch_status_lists_the_switches_in_flight():
    sw = switch("Unlink")
    obj = pdd([sw, switch("Drain", pod="x-prefill-1")], last=aborted_record(pod="x-decoder-0"))
    lines = format_switches(obj, T + 35)
    assert lines[0].split() == ["POD", "FROM", "->", "TO", "STEP", "SINCE"]
    assert lines[1].split() == [POD, "decoder", "->", "prefill", "Unlink", sw_.iso(T + 5), "(30s", "ago)"]
    assert lines[2].split()[0] == "x-prefill-1"
    assert f"abort requested: {POD} ({ANNOTATION_ABORT})" in lines
    assert any(line.startswith("last switch: x-decoder-0 decoder -> prefill: Aborted") for line in lines)
    assert format_switches(pdd([], asked=None), T) == ["no switch in flight"]
