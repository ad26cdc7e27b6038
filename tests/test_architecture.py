"""Structure of the package: no import cycles (lazy imports included), and the app layer changes the engine only
through its methods."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"dsv3lite": ROOT / "dsv3lite", "dsv3lite.kernels": ROOT / "kernels", "dsv3lite.quant": ROOT / "quant",
            "dsv3lite.app": ROOT / "app"}


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            name = ".".join([pkg] + (parts[:-1] if is_pkg else parts))
            mods[name] = (f, is_pkg)
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (function-level imports included)."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        base = name if is_pkg else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    anchor = base
                    for _ in range(node.level - 1):
                        anchor = anchor.rsplit(".", 1)[0]
                    target = anchor + ("." + node.module if node.module else "")
                for a in node.names:
                    if f"{target}.{a.name}" in mods:
                        deps.add(f"{target}.{a.name}")
                    elif target in mods:
                        deps.add(target)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}           # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (cycle := visit(w)):
                return cycle
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (cycle := visit(v)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "dsv3lite.generate" in graph["dsv3lite.builder"]     # the graph is read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_app_layer_writes_no_engine_fields():
    assign = re.compile(r"\bengine\.[a-z_]+(\.[a-z_]+)*\s*(=|\+=|-=)(?!=)")
    assert assign.search("engine.mtp_enabled = on") and assign.search("runner.engine.speculator.valid = 0")
    assert not assign.search("engine.configure_mtp(enabled=on)") and not assign.search("if engine.x == 1:")
    offenders = [f"{f.name}:{i}: {line.strip()}" for f in (ROOT / "app").glob("*.py")
                 for i, line in enumerate(f.read_text().splitlines(), 1) if assign.search(line)]
    assert offenders == []
