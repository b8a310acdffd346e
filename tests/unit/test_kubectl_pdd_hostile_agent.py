"""`kubectl pdd status` prints what agents report; agents are the tenant's code. Their strings reach
the admin's terminal escaped (no escape sequence is sent raw), and a report a rank without a number
(or with any field of the wrong type) is printed, not a crash."""
from __future__ import annotations

from pd_operator.kubectl_pdd import format_ranks, printable


def test_control_characters_are_escaped():
    assert printable("ok \x1b[2J\x1b]0;pwned\x07 done") == "ok \\x1b[2J\\x1b]0;pwned\\x07 done"
    assert printable("tab\tnew\nline \u009b31m") == "tab\\tnew\\nline \\x9b31m"
    assert printable("é ✓ 漢字") == "é ✓ 漢字"


def test_ranks_without_a_number_or_of_the_wrong_shape_are_printed():
    st = {"tensor_parallel": 2, "device_ips": "\x1b[31mannotation",
          "ranks": [{"cluster_id": 1, "initialized": True}, {"rank": "x", "cluster_id": None, "port": "p"},
                    {"rank": 1, "cluster_id": 2, "last_error": "\x1b[2J"}, "not a rank"],
          "device_error": "\x1b]0;title\x07"}
    lines = format_ranks(st, None, "")
    text = "\n".join(lines)
    assert "\x1b" not in text and "\x07" not in text
    assert "rank ?" in text and "rank 1" in text and "\\x1b[2J" in text


async def test_status_escapes_what_the_agent_reports(monkeypatch):
    """The whole `kubectl pdd status` over a fake API and an agent whose answers carry escape
    sequences and wrong types: every line printable, our own line breaks kept, no crash."""
    from pd_operator import kubectl_pdd

    class Kube:
        async def get(self, *a):
            return {"status": {"phase": "Ready", "prefill": 1, "decoder": 1, "linksSummary": "1/1", "members": [
                {"pod": "p-0", "group": "prefill", "role": "prefill", "ip": "10.0.0.1", "ready": True,
                 "lastError": "\x1b[31mred"}], "lastSwitch": {"pod": "p-0"}}}

    class Proxy:
        def __init__(self, *a):
            pass

        async def call(self, *a, **kw):
            return 200, {"load": {"in_flight": "\x1b[2J", "kv_used_bytes": "lots"}, "draining": "\x07",
                         "tensor_parallel": 2, "ranks": [{"rank": None}]}

        async def close(self):
            pass

    async def secret(*a):
        return {}
    monkeypatch.setattr(kubectl_pdd, "Proxy", Proxy)
    monkeypatch.setattr(kubectl_pdd, "_secret", secret)
    lines: list[str] = []
    assert await kubectl_pdd.status(Kube(), "ns", "d", out=lines.append) == 0
    text = "\n".join(lines)
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text and "\nlast switch" in text
