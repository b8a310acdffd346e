"""The operator reads as small steps: no function over 60 lines, the Controller that wires a pass
within 150 (observe -> decide -> record -> act live in their own modules)."""
from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "pd_operator"


def test_no_function_in_the_operator_is_over_60_lines():
    long = []
    for path in sorted(OPERATOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_the_controller_is_wiring_not_logic():
    tree = ast.parse((OPERATOR / "reconcile.py").read_text())
    ctl = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Controller")
    assert ctl.end_lineno - ctl.lineno + 1 <= 150
