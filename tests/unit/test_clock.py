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


def clock_reads(tree: ast.AST) -> list[int]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        base = f.value.attr if isinstance(f.value, ast.Attribute) else getattr(f.value, "id", "")
        if (base, f.attr) in CLOCKS or (f.attr in ("gmtime", "localtime") and not node.args and base == "time"):
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
