"""The package's modules import one another without a circle.

Module-level imports, those under ``if TYPE_CHECKING:`` included, must form no cycle. An import
inside a function (the managers' lazy use of the partitioning, a re-export through a module
``__getattr__``) runs only when called and is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "django_idempotency"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """Package modules imported by the module's body (not inside functions or classes)."""
    found: set[str] = set()
    pending: list[ast.stmt] = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.If, ast.Try)):
            pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "django_idempotency":
                found.update(f"django_idempotency.{alias.name}" for alias in node.names)
            elif node.module.startswith("django_idempotency."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("django_idempotency."))
    return found


def test_the_module_imports_form_no_cycle() -> None:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: top_level_imports(path) & set(modules) for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            assert state.get(target) != "open", " -> ".join([*trail, name, target])
            if target not in state:
                visit(target, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_models_import_the_managers_and_the_partitioning_imports_the_models() -> None:
    assert "django_idempotency.managers" in top_level_imports(PACKAGE / "models.py")
    assert "django_idempotency.models" in top_level_imports(PACKAGE / "partitioning.py")
    assert "django_idempotency.partitioning" not in top_level_imports(PACKAGE / "managers.py")
