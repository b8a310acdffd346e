"""Every package reads as small parts: no class over 200 lines, no function over 60, no more than
8 parameters, no clock read outside an injected clock, and no cycle between the packages. What
breaks a rule today is listed in shape_allowlist.json with its size; the list may only shrink: a
part over its listed size fails, and so does an entry whose part now keeps the rule (delete it)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

from tests.unit.test_clock import clock_reads

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"pd_operator": "operator/pd_operator", "pd_agent": "agent/pd_agent",
            "llm_datadist_sim": "simulator/llm_datadist_sim", "pd_gateway": "gateway/pd_gateway",
            "pd_engine": "engines/pd_engine", "pd_contract": "contract/pd_contract",
            "pd_router": "router/pd_router"}
MAX_CLASS, MAX_FUNCTION, MAX_PARAMS = 200, 60, 8
ALLOWLIST = Path(__file__).with_name("shape_allowlist.json")
# what reads the real clock on purpose: the clock objects themselves
CLOCK_HOMES = {"pd_operator/runtime.py"}


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return len([n for n in names if n not in ("self", "cls")]) + (a.vararg is not None) + (a.kwarg is not None)


def measure() -> dict[str, int]:
    """`<package>/<file>:<qualified name>:<rule>` -> the size that breaks the rule."""
    found: dict[str, int] = {}
    for pkg, where in PACKAGES.items():
        for path in sorted((REPO / where).rglob("*.py")):
            rel = f"{pkg}/{path.relative_to(REPO / where)}"
            tree = ast.parse(path.read_text())

            def walk(node: ast.AST, prefix: str) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.ClassDef):
                        n = child.end_lineno - child.lineno + 1
                        if n > MAX_CLASS:
                            found[f"{rel}:{prefix}{child.name}:class-lines"] = n
                        walk(child, f"{prefix}{child.name}.")
                    elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        n = child.end_lineno - child.lineno + 1
                        if n > MAX_FUNCTION:
                            found[f"{rel}:{prefix}{child.name}:function-lines"] = n
                        if _params(child) > MAX_PARAMS:
                            found[f"{rel}:{prefix}{child.name}:params"] = _params(child)
                        walk(child, f"{prefix}{child.name}.")
                    else:
                        walk(child, prefix)
            walk(tree, "")
            reads = clock_reads(tree)
            if reads and rel not in CLOCK_HOMES:
                found[f"{rel}:<module>:clock-reads"] = len(reads)
    return found


def package_imports() -> dict[str, set[str]]:
    """Package -> the other packages of the project it imports (at any depth, lazily too)."""
    out: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for pkg, where in PACKAGES.items():
        for path in (REPO / where).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                out[pkg] |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES} - {pkg}
    return out


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each edge that lies on a cycle, as `a -> b`."""
    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            n = todo.pop()
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                todo += graph[n]
        return False
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if reaches(b, a))


def test_every_package_keeps_the_shape_or_is_listed_no_larger():
    allowed = json.loads(ALLOWLIST.read_text())["shape"]
    found = measure()
    grown = [f"{k}: {v} (listed {allowed[k]})" for k, v in sorted(found.items()) if k in allowed and v > allowed[k]]
    new = [f"{k}: {v}" for k, v in sorted(found.items()) if k not in allowed]
    stale = [k for k in sorted(allowed) if k not in found or found[k] < allowed[k]]
    assert not new, "split these (or hand the clock in); the allow-list only shrinks:\n" + "\n".join(new)
    assert not grown, "these grew past their listed size:\n" + "\n".join(grown)
    assert not stale, "these shrank: lower or delete their entries in shape_allowlist.json:\n" + "\n".join(stale)


def test_no_cycle_between_packages_but_those_listed():
    allowed = set(json.loads(ALLOWLIST.read_text())["cycles"])
    found = set(cycles(package_imports()))
    assert not found - allowed, f"new import cycles between packages: {sorted(found - allowed)}"
    assert not allowed - found, f"cycles no longer there: delete them from shape_allowlist.json: " \
                                f"{sorted(allowed - found)}"


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == ["a -> b", "b -> a"]
    assert cycles({"a": {"b"}, "b": set()}) == []
