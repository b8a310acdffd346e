"""No import cycles between the project's modules.

Every module of every package is parsed (never imported) with `ast`; every import of another
project module counts, at module level or inside a function (a deferred import hides a cycle,
it does not remove it). The modules and their imports make a graph; a strongly connected
component of more than one module is a cycle, reported with the import lines that close it.

What an import names: `import a.b` and `from a import b` (b a module) name a.b; `from a.b import
name` names a.b. The parent packages an import initialises on the way are not counted: a
submodule's package has always run before the submodule, so that edge closes no cycle that
matters (an explicit `from pkg import name` inside pkg's own submodule does count)."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {   # package -> the folder that holds it
    "pd_operator": "operator",
    "pd_agent": "agent",
    "llm_datadist_sim": "simulator",
    "pd_gateway": "gateway",
    "pd_contract": "contract",
    "pd_router": "router",
    "pd_engine": "engines",
    "pd_localcluster": "localcluster",
}

# Known cycles that are someone else's to break, each with why it is tolerated for now: the set
# of modules of the strongly connected component, exactly. Empty: there are none.
ALLOWED: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str   # path:line
    line: str    # the import statement


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        base = ROOT / folder
        for path in sorted((base / pkg).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The most specific project module `name` (a dotted path) lies in, if any."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in known:
            return cand
        parts.pop()
    return None


def imports(mod: str, path: Path, known: dict[str, Path], root: Path = ROOT) -> list[Edge]:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    package = mod if _is_package(path) else mod.rpartition(".")[0]
    rel = path.relative_to(root)
    out: list[Edge] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from a import b`: the module a.b if there is one, else a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        statement = " ".join((ast.get_source_segment(source, node) or "").split())
        for dst in dict.fromkeys(_resolve(t, known) for t in targets):   # one edge a statement and module
            if dst is not None and dst != mod:
                out.append(Edge(mod, dst, f"{rel}:{node.lineno}", statement))
    return out


def graph() -> tuple[dict[str, set[str]], list[Edge]]:
    known = modules()
    edges = [e for mod, path in known.items() for e in imports(mod, path, known)]
    adj: dict[str, set[str]] = {m: set() for m in known}
    for e in edges:
        adj[e.src].add(e.dst)
    return adj, edges


def cycles(adj: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components (iterative), those of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def describe(comp: frozenset[str], edges: list[Edge]) -> str:
    inside = sorted((e for e in edges if e.src in comp and e.dst in comp), key=lambda e: (e.src, e.where))
    return "cycle among " + ", ".join(sorted(comp)) + ":\n" + "\n".join(
        f"    {e.src} -> {e.dst}   ({e.where}: {e.line})" for e in inside)


def test_every_package_is_found():
    known = modules()
    for pkg in PACKAGES:
        assert pkg in known, f"{pkg} not found under {PACKAGES[pkg]}/"
    assert len(known) > 50


def test_the_checker_finds_a_cycle_and_its_lines():
    adj = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(adj) == [frozenset({"a", "b", "c"})]
    edges = [Edge("a", "b", "a.py:3", "from . import b"), Edge("b", "c", "b.py:9", "from .c import f"),
             Edge("c", "a", "c.py:1", "import a"), Edge("d", "a", "d.py:1", "import a")]
    text = describe(frozenset({"a", "b", "c"}), edges)
    assert "c.py:1: import a" in text and "d.py" not in text


def test_relative_and_deferred_imports_are_edges(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("from . import a\nfrom p import c\nimport p.c as cc\nimport os\n")
    (pkg / "c.py").write_text("from p import VERSION\n")
    (pkg / "q").mkdir()
    (pkg / "q" / "__init__.py").write_text("from .. import c\n")
    known = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.b": pkg / "b.py", "p.c": pkg / "c.py",
             "p.q": pkg / "q" / "__init__.py"}
    got = {(e.src, e.dst) for m, path in known.items() for e in imports(m, path, known, root=tmp_path)}
    assert got == {("p.a", "p.b"), ("p.b", "p.a"), ("p.b", "p.c"), ("p.c", "p"), ("p.q", "p.c")}


def test_no_import_cycles():
    adj, edges = graph()
    found = cycles(adj)
    stale = [sorted(c) for c in ALLOWED if c not in found]
    assert not stale, f"allowed cycles that no longer exist (drop them from ALLOWED): {stale}"
    bad = [c for c in found if c not in ALLOWED]
    assert not bad, "import cycles:\n" + "\n".join(describe(c, edges) for c in sorted(bad, key=sorted))


def test_the_agent_apis_scopes_are_pinned():
    """Who may call what: a change to a route's scope or control-only fields is a change to the
    trust model (docs/security.md), so it is made here on purpose, not by a refactor."""
    from pd_agent.routes import ROUTES
    scopes = {(r.method, r.path): (r.scope, r.control_fields, r.control_scopes) for r in ROUTES}
    assert {k for k, v in scopes.items() if v[0] == "open"} == {
        ("GET", "/healthz"), ("GET", "/livez"), ("GET", "/metrics"), ("*", "/r/{rank}/{tail:.*}")}
    assert {k for k, v in scopes.items() if v[0] == "data"} == {
        ("GET", "/v1/status"), ("POST", "/v1/prefill"), ("POST", "/v1/decode")}
    assert {k for k, v in scopes.items() if v[0] == "peer"} == {("POST", "/v1/notify")}
    assert scopes[("POST", "/v1/prefill")][1] == ("admitted",)
    assert scopes[("POST", "/v1/decode")][1] == ("admitted", "kv_pulled_ms")
    assert scopes[("POST", "/v1/notify")][1:] == (("released",), ("control", "peer"))
    assert all(v[0] == "control" for k, v in scopes.items() if k[1].startswith(("/v1/admin", "/v1/link",
                                                                               "/v1/switch_role", "/v1/pull")))
