"""The package's modules import one another without a circle.

Module-level imports, those under ``if TYPE_CHECKING:`` included, must form no cycle. An import
inside a function runs only when called, and is allowed elsewhere (a re-export through a module
``__getattr__``); between the managers, the models and the partitioning there is none at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "django_idempotency"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST) -> set[str]:
    """The package modules an import statement names; none for any other node."""
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module == "django_idempotency":
            return {f"django_idempotency.{alias.name}" for alias in node.names}
        if node.module.startswith("django_idempotency."):
            return {node.module}
    elif isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("django_idempotency.")}
    return set()


def top_level_imports(path: Path) -> set[str]:
    """Package modules imported by the module's body (not inside functions or classes)."""
    found: set[str] = set()
    pending: list[ast.stmt] = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.If, ast.Try)):
            pending.extend(node.body + node.orelse)
        found |= imported(node)
    return found


def all_imports(path: Path) -> set[str]:
    """Package modules the module imports anywhere, inside functions too."""
    return set().union(*(imported(node) for node in ast.walk(ast.parse(path.read_text()))))


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
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


def test_the_module_imports_form_no_cycle() -> None:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    assert_no_cycle(
        {name: top_level_imports(path) & set(modules) for name, path in modules.items()}
    )


def test_the_managers_models_and_partitioning_import_no_circle_even_inside_functions() -> None:
    """The models import the managers; the managers import the partitioning (for the
    partitioned purge); the partitioning takes the model from the app registry, and imports
    neither."""
    trio = {f"django_idempotency.{name}" for name in ("managers", "models", "partitioning")}
    graph = {name: all_imports(PACKAGE / f"{name.rpartition('.')[2]}.py") & trio for name in trio}
    assert graph == {
        "django_idempotency.models": {"django_idempotency.managers"},
        "django_idempotency.managers": {"django_idempotency.partitioning"},
        "django_idempotency.partitioning": set(),
    }
    assert_no_cycle(graph)


def test_the_stores_sit_below_their_cores_and_read_no_setting() -> None:
    """``store.py`` and ``event_store.py`` are how the HTTP core and the event core reach the
    database: neither imports a core (or an adapter above it), and neither reads a setting, so
    each decision stays in its core."""
    above = {
        f"django_idempotency.{name}"
        for name in (
            "conf",
            "core",
            "http",
            "decorators",
            "middleware",
            "drf",
            "events",
            "consumers",
            "celery",
            "django_tasks",
            "kafka",
        )
    }
    for store in ("store", "event_store"):
        assert all_imports(PACKAGE / f"{store}.py") & above == set(), store


def test_the_event_adapters_go_through_the_event_core() -> None:
    """The consumer adapters call :mod:`django_idempotency.events`, never its store."""
    for adapter in ("consumers", "celery", "django_tasks", "kafka"):
        imports = all_imports(PACKAGE / f"{adapter}.py")
        assert "django_idempotency.event_store" not in imports, adapter
