"""What a user installs: Django and asgiref, extras with real minimums, errors that name them.

The install itself, in fresh venvs from the built wheel, is proven by ``scripts/check_install.py``
(the test command's ``install`` session); these tests hold the declarations to it.
"""

from __future__ import annotations

import importlib
import re
import sys
from configparser import ConfigParser
from pathlib import Path

import pytest

from django_idempotency.extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent


def setup_cfg() -> ConfigParser:
    config = ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def requirement_names(text: str) -> set[str]:
    return {re.split(r"[\[<>=;\s]", line.strip())[0] for line in text.splitlines() if line.strip()}


def import_without(monkeypatch: pytest.MonkeyPatch, module: str, dependency: str) -> ImportError:
    """Import ``module`` afresh as if ``dependency`` were not installed; return the error."""
    # A None entry in sys.modules makes an import raise ImportError, as when it is absent; the
    # already imported submodules must go too, or ``from celery.app.task import ...`` finds them.
    for name in [n for n in sys.modules if n == dependency or n.startswith(dependency + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, dependency, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as raised:
        importlib.import_module(module)
    return raised.value


def test_install_requires_only_django_and_asgiref() -> None:
    assert requirement_names(setup_cfg()["options"]["install_requires"]) == {"Django", "asgiref"}


def test_every_extra_named_in_errors_is_declared() -> None:
    declared = set(setup_cfg()["options.extras_require"])
    assert set(EXTRAS) <= declared


def test_redis_extra_brings_celerys_redis_transport() -> None:
    redis = setup_cfg()["options.extras_require"]["redis"].split()
    assert redis == ["celery[redis]>=5.7"]


def test_lowest_job_pins_every_runtime_dependency_to_its_minimum() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        noxfile = importlib.import_module("noxfile")
    finally:
        sys.path.remove(str(ROOT))
    pins = noxfile.lowest_constraints()
    assert "django==5.2" in pins
    assert "celery==5.7" in pins
    assert "psycopg==3.2.1" in pins and "psycopg-binary==3.2.1" in pins
    assert {pin.split("==")[0] for pin in pins} >= {"asgiref", "mysqlclient", "confluent-kafka"}


@pytest.mark.parametrize(
    ("module", "dependency", "extra"),
    [
        ("django_idempotency.events.celery", "celery", "celery"),
        ("django_idempotency.tasks", "celery", "celery"),
    ],
)
def test_missing_dependency_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, dependency: str, extra: str
) -> None:
    raised = import_without(monkeypatch, module, dependency)
    assert str(raised) == (
        f"{module} needs {EXTRAS[extra]}, which is not installed: "
        f"pip install 'django-idempotency[{extra}]'"
    )


def test_installation_docs_show_the_real_error(monkeypatch: pytest.MonkeyPatch) -> None:
    documented = [
        line.removeprefix("ImportError: ")
        for line in (ROOT / "docs" / "installation.md").read_text().splitlines()
        if line.startswith("ImportError: ")
    ]
    raised = import_without(monkeypatch, "django_idempotency.events.celery", "celery")
    assert documented == [str(raised)]
