"""The import rule (docs/architecture.md), checked on the source with ``ast``:

    remp/        shared by every process: topology, planner math, the switch table, errors,
                 auth, logging, metrics, gRPC plumbing, generated code. Imports none of ours.
    controller/  node_agent/  policy/  dashboard/      the services: import ``remp`` only
    devstack/    launchers (``remp up``, test process launchers, the tiny model): + services
    ops/         the ``remp`` command line: + services, devstack
    bench/       anything public (no ``_private`` names from another package)

Imports under ``if TYPE_CHECKING:`` are annotations, not arrows, and are not counted. A
package's modules must not import each other in a cycle (function-local imports count:
they are how a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"controller", "node_agent", "policy", "dashboard"}
ALLOWED: dict[str, set[str]] = {
    "remp": set(),
    **{s: {"remp"} for s in SERVICES},
    "devstack": {"remp", *SERVICES},
    "ops": {"remp", *SERVICES, "devstack"},
    "bench": {"remp", *SERVICES, "devstack", "ops"},
}
OURS = set(ALLOWED)
GENERATED = ("remp/common/", "remp/controller/", "remp/node_agent/", "remp/policy/")


def sources(pkg: str):
    for f in sorted((ROOT / pkg).rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if not rel.startswith(GENERATED):
            yield rel, ast.parse(f.read_text(), rel)


def _type_checking_only(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                ids.update(id(n) for n in ast.walk(sub))
    return ids


def imports(tree: ast.AST):
    """(imported module, imported names, line) for every absolute import of ours."""
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [a.name for a in node.names], node.lineno


def violations() -> list[str]:
    bad = []
    for pkg, allowed in ALLOWED.items():
        for rel, tree in sources(pkg):
            for mod, names, line in imports(tree):
                top = mod.split(".")[0]
                if top not in OURS or top == pkg:
                    continue
                if top not in allowed:
                    bad.append(f"{rel}:{line} imports {mod} ({pkg} → {top} is not allowed)")
                private = [n for n in names if n.startswith("_")]
                private += [p for p in mod.split(".") if p.startswith("_") and p != "__init__"]
                if private:
                    bad.append(f"{rel}:{line} imports private {mod}:{','.join(private)}")
    return bad


def test_every_import_follows_the_allowed_arrows():
    assert violations() == []


def module_graph(pkg: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    mods = {rel[:-3].replace("/", ".").removesuffix(".__init__"): tree
            for rel, tree in sources(pkg)}
    for name, tree in mods.items():
        deps = graph.setdefault(name, set())
        for mod, names, _ in imports(tree):
            if mod in mods and mod != name:
                deps.add(mod)
            for n in names:  # from node_agent import agent
                if f"{mod}.{n}" in mods:
                    deps.add(f"{mod}.{n}")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_no_import_cycles_inside_a_package(pkg):
    assert cycles(module_graph(pkg)) == []


def test_the_checker_sees_a_violation():
    tree = ast.parse("from controller.core import Core\nimport node_agent.agent\n"
                     "from remp.topology import _private\n")
    found = [(m, n) for m, n, _ in imports(tree)]
    assert ("controller.core", ["Core"]) in found and ("node_agent.agent", []) in found
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]
