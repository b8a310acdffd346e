"""The documentation says only what the code has: environment names, chart values, `kubectl pdd`
commands and flags, and links that resolve; the README stays a front page; the generated
reference (hack/docs/gen.py, `make docs`) is up to date."""
from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "charts" / "pd-operator" / "README.md",
        *sorted((REPO / "docs").rglob("*.md"))]
# where code names environment variables and chart values come from (not the docs, not this file)
SOURCE_DIRS = ("operator", "agent", "simulator", "gateway", "contract", "router", "localcluster", "engines", "charts",
               "hack", "bench", "tests", ".ci", ".github")
SOURCE_FILES = ("Makefile", "Dockerfile")
SOURCE_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".tpl", ".txt", ".json", ".toml", ""}

FENCE = re.compile(r"^(```|~~~)")
INLINE = re.compile(r"`([^`\n]+)`")
ENV = re.compile(r"\b(?:PD|LLM_DATADIST)_[A-Z0-9_]*")
VALUE_PATH = re.compile(r"[A-Za-z][A-Za-z0-9-]*(?:\.(?:[A-Za-z0-9-]+|\*))*")
FILE_SUFFIX = re.compile(r"\.(py|ya?ml|json|jsonl|md|sh|txt|png|toml|tpl|go|conf)$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def gen():
    spec = importlib.util.spec_from_file_location("docs_gen", REPO / "hack" / "docs" / "gen.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = gen()


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code-block lines): fenced blocks and indented blocks after a blank line."""
    prose, code_lines = [], []
    fenced, prev_blank = False, True
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            prev_blank = False
            continue
        if fenced or (line.startswith("    ") and prev_blank and not line.lstrip().startswith(("-", "*", "|"))):
            code_lines.append(line)
            continue
        prose.append(line)
        prev_blank = not line.strip()
    return prose, code_lines


def spans(text: str) -> list[str]:
    """Inline code spans of the prose."""
    prose, _ = split(text)
    return [m.group(1).strip() for line in prose for m in INLINE.finditer(line)]


@cache
def source_text() -> str:
    files = [REPO / f for f in SOURCE_FILES]
    for d in SOURCE_DIRS:
        files += [p for p in (REPO / d).rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
                  and "__pycache__" not in p.parts and p != Path(__file__).resolve()
                  and not p.is_relative_to(REPO / "bench" / "results")
                  and not p.is_relative_to(REPO / "hack" / "docs")]   # the env descriptions are docs
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())


@cache
def source_env_names() -> frozenset[str]:
    return frozenset(ENV.findall(source_text()))


# ---- (a) environment names ---------------------------------------------------------------------

def env_names_in_docs() -> list[tuple[str, str]]:
    return [(rel(d), m.group(0)) for d in DOCS for m in ENV.finditer(d.read_text())]


def test_every_env_name_in_the_docs_is_in_the_code():
    names = source_env_names()
    missing = []
    for doc, name in env_names_in_docs():
        if name in ("PD_", "LLM_DATADIST_"):
            continue   # "names starting with PD_": every name
        known = any(n.startswith(name) for n in names) if name.endswith("_") else name in names
        if not known:
            missing.append(f"{doc}: {name}")
    assert not missing, "environment names the code does not have:\n" + "\n".join(sorted(set(missing)))


def test_every_env_name_in_the_code_is_described():
    found = GEN.env_in_code()
    described = {n for s in GEN.env_descriptions() for n in s["vars"]}
    assert not sorted(set(found) - described), \
        f"describe these in hack/docs/env.yaml, then `make docs`: {sorted(set(found) - described)}"
    assert not sorted(described - set(found)), \
        f"hack/docs/env.yaml describes names the code no longer has: {sorted(described - set(found))}"


# ---- (b) chart values --------------------------------------------------------------------------

def chart_value_mentions() -> list[tuple[str, str]]:
    top = {p for p in GEN.values_paths() if "." not in p}
    out = []
    for d in DOCS:
        for span in spans(d.read_text()):
            token = span.split("=", 1)[0].strip()
            if not VALUE_PATH.fullmatch(token) or FILE_SUFFIX.search(token):
                continue
            if token.split(".", 1)[0] in top:
                out.append((rel(d), token))
    return out


def test_chart_value_check_sees_the_values_the_docs_name():
    named = {t for _, t in chart_value_mentions()}
    assert {"gateway.allowedImages", "metrics.port", "networkPolicy.metricsNamespaceSelector"} <= named


def test_every_chart_value_in_the_docs_exists():
    paths = GEN.values_paths()
    missing = []
    for doc, token in chart_value_mentions():
        if token.endswith(".*"):
            ok = any(p.startswith(token[:-1]) for p in paths)
        else:
            ok = token in paths
        if not ok:
            missing.append(f"{doc}: {token}")
    assert not missing, "chart values not in charts/pd-operator/values.yaml:\n" + "\n".join(sorted(set(missing)))


# ---- (c) kubectl pdd ---------------------------------------------------------------------------

def pdd_commands() -> list[tuple[str, str]]:
    """`kubectl pdd ...` as the docs write it: inline code spans and code-block lines."""
    out = []
    for d in DOCS:
        prose, code_lines = split(d.read_text())
        for span in (m.group(1) for line in prose for m in INLINE.finditer(line)):
            if span.strip().startswith("kubectl pdd"):
                out.append((rel(d), span.strip()))
        for line in code_lines:
            i = line.find("kubectl pdd")
            if i >= 0:
                out.append((rel(d), line[i:].split(" #", 1)[0].strip()))
    return out


def pdd_section_flags() -> list[tuple[str, str]]:
    """Flags in code spans of the sections about `kubectl pdd` (a heading that names it)."""
    out = []
    for d in DOCS:
        prose, _ = split(d.read_text())
        level_in = 0
        for line in prose:
            h = HEADING.match(line)
            if h:
                level = len(h.group(1))
                if "kubectl pdd" in h.group(2):
                    level_in = level
                elif level_in and level <= level_in:
                    level_in = 0
                continue
            if level_in:
                for m in INLINE.finditer(line):
                    first = m.group(1).split()[0] if m.group(1).split() else ""
                    if re.fullmatch(r"--[a-z][a-z0-9-]*", first):
                        out.append((rel(d), first))
    return out


def test_the_pdd_checks_see_the_commands_and_flags_the_docs_name():
    assert any(c.startswith("kubectl pdd verify") for _, c in pdd_commands())
    assert {"--client", "--key-name"} <= {f for _, f in pdd_section_flags()}


def test_every_kubectl_pdd_command_and_flag_in_the_docs_exists():
    root = GEN.pdd_parser()
    bad = []
    for doc, line in pdd_commands():
        words = [w.strip("[]{}()") for w in line.replace("`", "").split()[2:]]
        parser, flags = root, GEN.options(root)
        cmds = GEN.subcommands(parser)
        if words and re.fullmatch(r"[a-z][a-z0-9-]*", words[0]) and cmds:
            if words[0] not in cmds:
                bad.append(f"{doc}: `{line}`: no command {words[0]!r} (have {', '.join(cmds)})")
                continue
            sub = cmds[words[0]]
            while sub is not None:
                flags |= GEN.options(sub)
                words = words[1:]
                nested = GEN.subcommands(sub)
                if not (nested and words and re.fullmatch(r"[a-z][a-z0-9-]*", words[0])):
                    break
                if words[0] not in nested:
                    bad.append(f"{doc}: `{line}`: no command {words[0]!r} under {sub.prog}")
                    break
                sub = nested[words[0]]
        for w in words:
            flag = w.split("=", 1)[0].rstrip(",;:.)]")
            if re.fullmatch(r"--?[a-zA-Z][a-z0-9-]*", flag) and flag not in flags:
                bad.append(f"{doc}: `{line}`: no flag {flag}")
    every = set(GEN.options(root))
    for sub in GEN.subcommands(root).values():
        every |= GEN.options(sub) if sub is not None else set()
    bad += [f"{doc}: {flag}: not a kubectl pdd flag" for doc, flag in pdd_section_flags() if flag not in every]
    assert not bad, "\n".join(sorted(set(bad)))


# ---- (d) links ---------------------------------------------------------------------------------

def slug(heading: str) -> str:
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    prose, _ = split(path.read_text())
    for line in prose:
        h = HEADING.match(line)
        if h:
            s = slug(h.group(2))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def test_every_relative_link_resolves():
    bad = []
    for d in DOCS:
        prose, _ = split(d.read_text())
        for line in prose:
            for m in LINK.finditer(INLINE.sub("", line)):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue   # http:, https:, mailto:
                path_part, _, anchor = target.partition("#")
                dest = (d.parent / path_part).resolve() if path_part else d
                if not dest.exists():
                    bad.append(f"{rel(d)}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{rel(d)}: {target}: no heading #{anchor} in {rel(dest)}")
    assert not bad, "\n".join(bad)


# ---- (e) the README is a front page ------------------------------------------------------------

def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"


# ---- (f) the generated reference ---------------------------------------------------------------

@cache
def rendered() -> dict[Path, str]:
    return GEN.render_all()


@pytest.mark.parametrize("path", ["docs/reference/crd.md", "docs/reference/chart-values.md",
                                  "docs/reference/cli.md", "docs/reference/env.md"])
def test_generated_reference_is_up_to_date(path):
    assert set(rendered()) == {Path(p) for p in ("docs/reference/crd.md", "docs/reference/chart-values.md",
                                                 "docs/reference/cli.md", "docs/reference/env.md")}
    text = rendered()[Path(path)]
    assert (REPO / path).is_file(), f"{path} is missing; run `make docs`"
    assert (REPO / path).read_text() == text, f"{path} is stale; run `make docs`"


def test_the_chart_readme_links_work_under_helm_show_readme():
    """`helm show readme` prints the chart's README with no repository around it: every link is
    absolute, and those to the project's files name files that exist."""
    base = "https://github.com/pd-operator/pd-operator/blob/main/"
    readme = REPO / "charts" / "pd-operator" / "README.md"
    prose, _ = split(readme.read_text())
    bad = []
    for line in prose:
        for m in LINK.finditer(INLINE.sub("", line)):
            target = m.group(1)
            if target.startswith("#"):
                continue
            if not re.match(r"^https?://", target):
                bad.append(f"{target}: relative, so it leads nowhere under helm show readme")
            elif target.startswith(base) and not (REPO / target[len(base):].partition("#")[0]).exists():
                bad.append(f"{target}: no such file in the repository")
    assert not bad, "\n".join(bad)
