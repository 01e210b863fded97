"""The package's layout: one folder per concern, each a staircase, and no import circle.

Each concern's folder reads top down, as the HTTP side does: adapters at the top (what a user
decorates, subclasses or runs), then the core that decides, then the store that holds the SQL
per backend. A module may import the ones below it in its folder, and the shared modules at the
top of the package; never one above it. Module-level imports, those under ``if TYPE_CHECKING:``
included, form no cycle anywhere; imports inside functions form none either, except through the
lazy public names of a package's ``__getattr__`` (``django_idempotency.idempotent``,
``django_idempotency.outbox.publish``).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "django_idempotency"
P = "django_idempotency"

#: Each folder's modules, top (adapters) to bottom (the store). A module may import the modules
#: of its own row and of the rows below it, never those of a row above.
LAYERS: dict[str, list[set[str]]] = {
    "http": [
        {"decorators", "middleware", "drf", "ninja", "checks"},
        {"handler"},
        {"core"},
        {"keys", "owner", "fingerprint"},
        {"store"},
    ],
    "events": [
        {"consumers", "celery", "django_tasks", "dramatiq"},
        {"celery_steps"},
        {"core"},
        {"ids"},
        {"store"},
    ],
    "outbox": [
        {"relay", "celery"},
        {"core"},
        {"dramatiq"},
        {"transports", "capture"},
        {"celery_calls"},
        {"celery_redis", "celery_copies", "celery_canvas", "saferepr", "schedule", "store"},
    ],
    "kafka": [{"replay"}, {"runner", "transport"}, {"watchdog", "settings"}],
    "flows": [{"completer", "sagas"}, {"phases"}],
    "retention": [{"purge"}, {"partitioning"}, {"reports"}],
    "protection": [{"checks", "admin"}, {"core"}, {"keys"}, {"store"}],
}
#: The modules users and operators reach directly: no core or store imports one of them.
ADAPTERS = {
    f"{P}.http.decorators",
    f"{P}.http.middleware",
    f"{P}.http.drf",
    f"{P}.http.ninja",
    f"{P}.events.consumers",
    f"{P}.events.celery",
    f"{P}.events.django_tasks",
    f"{P}.events.dramatiq",
    f"{P}.outbox.celery",
    f"{P}.kafka.runner",
    f"{P}.kafka.replay",
    f"{P}.tasks",
    f"{P}.admin",
    f"{P}.protection.admin",
    f"{P}.protection.checks",
}
CORES = {f"{P}.http.core", f"{P}.events.core", f"{P}.outbox.core", f"{P}.protection.core"}
STORES = {f"{P}.http.store", f"{P}.events.store", f"{P}.outbox.store", f"{P}.protection.store"}
#: Lazy public names: a function-level import from these ``__init__`` modules is a re-export.
LAZY_EXPORTS = {P, f"{P}.outbox", f"{P}.protection"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(node: ast.AST) -> set[str]:
    """The package modules an import statement names; none for any other node."""
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module == P or node.module.startswith(f"{P}."):
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            return (subs & set(MODULES)) or {node.module}
    elif isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith(f"{P}.")}
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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                return [*trail, name, target]
            if target not in state and (cycle := visit(target, [*trail, name])):
                return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])):
            return cycle
    return None


def graph(read: Callable[[Path], set[str]]) -> dict[str, set[str]]:
    return {name: read(path) & set(MODULES) - {name} for name, path in MODULES.items()}


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_module_level_imports_form_no_cycle() -> None:
    assert find_cycle(graph(top_level_imports)) is None


def test_no_cycle_even_through_imports_inside_functions() -> None:
    full = graph(all_imports)
    for name in LAZY_EXPORTS:
        full[name] = top_level_imports(MODULES[name]) & set(MODULES)
    assert find_cycle(full) is None


def test_every_module_of_a_folder_has_its_place_on_the_staircase() -> None:
    for folder, rows in LAYERS.items():
        placed = set().union(*rows)
        found = {p.stem for p in (PACKAGE / folder).glob("*.py")} - {"__init__"}
        assert found <= placed, f"{folder}/: {sorted(found - placed)} not in LAYERS"


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_a_module_imports_nothing_above_it_in_its_folder(folder: str) -> None:
    rows = LAYERS[folder]
    for depth, row in enumerate(rows):
        above = {f"{P}.{folder}.{name}" for above_row in rows[:depth] for name in above_row}
        for name in row:
            path = PACKAGE / folder / f"{name}.py"
            if path.exists():
                assert all_imports(path) & above == set(), f"{folder}.{name}"


def test_cores_import_no_adapter_and_stores_import_no_core_nor_settings() -> None:
    for core in CORES & set(MODULES):
        assert all_imports(MODULES[core]) & ADAPTERS == set(), core
    for store in STORES & set(MODULES):
        bad = ADAPTERS | CORES | {f"{P}.conf"}
        assert all_imports(MODULES[store]) & bad == set(), store


def test_the_event_adapters_go_through_the_event_core() -> None:
    """The consumer adapters call :mod:`django_idempotency.events.core`, never its store."""
    for adapter in ("events.consumers", "events.celery", "events.django_tasks", "kafka.runner"):
        assert f"{P}.events.store" not in all_imports(MODULES[f"{P}.{adapter}"]), adapter


def test_the_shared_modules_at_the_top_import_no_concern_but_the_models_need() -> None:
    """``conf``, ``exceptions``, ``signals``, ``clock`` and ``extras`` sit below every folder;
    ``conf`` reads the Kafka consumers' setting through :mod:`~django_idempotency.kafka.settings`,
    which imports nothing of the package."""
    for name in ("exceptions", "signals", "clock", "extras"):
        assert all_imports(MODULES[f"{P}.{name}"]) <= {f"{P}.exceptions"}, name
    assert all_imports(MODULES[f"{P}.conf"]) == {f"{P}.kafka.settings"}
    assert all_imports(MODULES[f"{P}.kafka.settings"]) == set()


def test_no_module_grows_past_500_lines_without_a_reason_at_its_top() -> None:
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > 500 and ".migrations." not in name:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            assert "Why this module is long" in docstring, f"{name}: {lines} lines"
