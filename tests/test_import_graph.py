"""The import drawing of runner/ and stages/: no circles, each room of runner/ imports only the
rooms below it, the engine never imports or names a stage, and no stage imports another.

The engine (runner/) runs whatever stages it is handed; the one place that knows both is the
composition root, runner/composition.py, which builds the registry (stages/__init__.py) and passes
it in (the entry point, runner/__main__.py, and the commands that need the schema call it; nothing
imports the entry point). A helper two stages share lives in a room of runner/ below both. Read
from the source with ast, so a lazy import inside a function counts as much as one at the top
(it is an arrow all the same, and cycles hidden in functions are still cycles).
Run `python -m tests.test_import_graph` to print the drawing's circles.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("runner", "stages")
# The composition root: it alone imports both the engine and the stages.
COMPOSITION_ROOT = "runner.composition"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            found[module_name(path)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module an import names (`runner.core.store.fmt_bytes` -> `runner.core.store`)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from runner import endpoint` is an arrow to runner.serving.endpoint; `from stages.x
            # import
            # f` to stages.x; `from runner import x` (no module x) to the package itself.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for n in names:
            target = _resolve(n, known)
            if target and target != mod:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = circles(graph())
    assert not found, f"import circles: {found}"


def test_the_engine_imports_no_stage():
    arrows = [
        (m, t)
        for m, targets in graph().items()
        if m.startswith("runner") and m != COMPOSITION_ROOT
        for t in targets
        if t.startswith("stages")
    ]
    assert not arrows, f"runner/ imports stages/: {arrows}"


# Each room of runner/ and the rooms it may import (its own always): the rules its docstring
# states. A room not listed here fails the test until its rule is written down.
ROOMS = {
    "runner.core": set(),
    "runner.processes": {"runner.core"},
    "runner.assets": {"runner.core"},
    "runner.integrations": {"runner.core", "runner.assets"},
    "runner.serving": {"runner.core", "runner.assets", "runner.processes", "runner.integrations"},
    "runner.tracking": {"runner.core", "runner.serving", "runner.integrations"},
    "runner.engine": {
        "runner.core",
        "runner.assets",
        "runner.processes",
        "runner.serving",
        "runner.tracking",
        "runner.integrations",
    },
    "runner.commands": {
        "runner.composition",
        "runner.core",
        "runner.assets",
        "runner.processes",
        "runner.serving",
        "runner.tracking",
        "runner.integrations",
        "runner.engine",
    },
}


def room(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def test_each_room_imports_only_the_rooms_below_it():
    g = graph()
    loose = sorted(m for m in g if m.startswith("runner.") and room(m) not in ROOMS)
    assert loose == ["runner.__main__", "runner.composition"], (
        f"modules outside a room of runner/: {loose}"
    )
    arrows = [
        (m, t)
        for m, targets in g.items()
        if room(m) in ROOMS
        for t in targets
        if room(t) != room(m) and room(t) not in ROOMS[room(m)] and t != "runner"
    ]
    assert not arrows, f"imports that break a room's rule: {arrows}"


def test_no_stage_imports_another_stage():
    arrows = [
        (m, t)
        for m, targets in graph().items()
        if m.startswith("stages.")
        for t in targets
        if t.startswith("stages") and room(t) != room(m)
    ]
    assert not arrows, f"stages importing other stages: {arrows}"


def _stage_names() -> set[str]:
    return {p.name for p in (REPO / "stages").iterdir() if (p / "__init__.py").is_file()}


def test_the_engine_names_no_stage():
    """No string in the engine's code (docstrings aside) is a stage's name: what a stage does
    reaches the engine through its declaration (runner/engine/stage.py), never by name."""
    names = _stage_names()
    found = []
    for mod, path in modules().items():
        if room(mod) not in {"runner.engine", "runner.tracking", "runner.serving"}:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in names
                and id(node) not in docstrings
            ):
                found.append(f"{mod}:{node.lineno} {node.value!r}")
    assert not found, f"the engine names stages: {found}"


def test_the_composition_root_builds_the_registry():
    assert "stages" in graph()[COMPOSITION_ROOT]


def test_nothing_imports_the_entry_point():
    """The entry point loads the commands by name (runner/commands/cli.py): a command importing
    it back would be a circle that no drawing of imports shows."""
    g = graph()
    assert not [m for m, targets in g.items() if "runner.__main__" in targets]


if __name__ == "__main__":
    g = graph()
    cs = circles(g)
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} arrows, {len(cs)} circle(s)")
    for c in cs:
        print(f"  circle of {len(c)}: {', '.join(c)}")
    up = sorted(
        (m, t)
        for m, ts in g.items()
        if m.startswith("runner")
        for t in ts
        if t.startswith("stages")
    )
    print(f"runner -> stages arrows: {up}")
