"""No function or method in runner/ or stages/ is longer than a screen (80 lines, its docstring
and decorators included): a longer one is split into named phases, as the recipes are
(stages/evaluate/__init__.py `run`). Read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 80


def long_functions(roots: tuple[Path, ...] = (REPO / "runner", REPO / "stages")) -> list[str]:
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    length = (node.end_lineno or node.lineno) - first + 1
                    if length > LIMIT:
                        where = f"{path.relative_to(root.parent)}:{node.lineno}"
                        found.append(f"{where} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_a_screen():
    assert not long_functions(), "split these into named parts:\n" + "\n".join(long_functions())


def test_the_rule_sees_a_nested_async_method_over_the_limit(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"            x{i} = {i}" for i in range(LIMIT))
    (pkg / "m.py").write_text(f"def outer():\n    class A:\n        async def m(self):\n{body}\n")
    (pkg / "short.py").write_text("def f():\n    return 1\n")
    assert sorted(long_functions((pkg,))) == [
        f"pkg/m.py:1 outer ({LIMIT + 3} lines)",
        f"pkg/m.py:3 m ({LIMIT + 1} lines)",
    ]
