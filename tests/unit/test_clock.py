"""Time is injected: no module of the operator reads a clock of its own (time.time, monotonic,
perf_counter, datetime.now, gmtime()/localtime() without an argument), so scenario tests drive
time through the controller's clock. The exceptions: runtime.SystemClock (the real clock, by
reference) and the kubectl plugin's CLI code (kubectl_pdd.py, connect.py), which is not the
controller."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {"kubectl_pdd.py", "connect.py"}
CLOCKS = {("time", "time"), ("time", "monotonic"), ("time", "perf_counter"), ("time", "time_ns"),
          ("time", "monotonic_ns"), ("datetime", "now"), ("datetime", "utcnow"), ("dt", "now")}


CLOCK_NAMES = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"}


def clock_reads(tree: ast.AST) -> list[int]:
    aliases = {"time"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                          for a in n.names if a.name == "time" and a.asname}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "time" and \
                any(a.name in CLOCK_NAMES for a in node.names):
            out.append(node.lineno)   # `from time import monotonic`: a clock of its own
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        base = f.value.attr if isinstance(f.value, ast.Attribute) else getattr(f.value, "id", "")
        if base in aliases:
            base = "time"
        loop = isinstance(f.value, ast.Call) and getattr(f.value.func, "attr", "") in (
            "get_running_loop", "get_event_loop")
        if (base, f.attr) in CLOCKS or (f.attr in ("gmtime", "localtime") and not node.args and base == "time") \
                or (loop and f.attr == "time"):
            out.append(node.lineno)
    return out


def test_the_operator_reads_time_only_through_its_injected_clock():
    found = {}
    for f in sorted((REPO / "operator" / "pd_operator").glob("*.py")):
        if f.name in ALLOWED:
            continue
        lines = clock_reads(ast.parse(f.read_text()))
        if lines:
            found[f.name] = lines
    assert not found, f"clock reads outside the injected clock (runtime.Clock): {found}"


def test_the_check_sees_a_clock_read():
    assert clock_reads(ast.parse("import time\nx = time.monotonic()\ny = dt.datetime.now(tz)\n")) == [2, 3]
    assert clock_reads(ast.parse("import time\nx = time.gmtime(t)\n")) == []
    assert clock_reads(ast.parse("from time import monotonic\n")) == [1]
    assert clock_reads(ast.parse("import time as t\nx = t.perf_counter()\n")) == [2]
    assert clock_reads(ast.parse("import asyncio\nx = asyncio.get_running_loop().time()\n")) == [2]
