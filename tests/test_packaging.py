"""What a user installs: Django and asgiref, extras with real minimums, errors that name them.

The install itself, in fresh venvs from the built wheel, is proven by ``scripts/check_install.py``
(the test command's ``install`` session); these tests hold the declarations to it.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tarfile
from configparser import ConfigParser
from pathlib import Path
from typing import Any

import pytest
import yaml

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


def load_script(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


@pytest.mark.sqlite  # builds from the checkout: once, not in every database pass
def test_the_sdist_ships_no_tests(tmp_path: Path) -> None:
    """Issue 35 item 18: the sdist shipped ``tests/`` without ``conftest.py`` or
    ``testproject/``, so its tests could not run. It leaves them out (MANIFEST.in)."""
    egg_info = ROOT / "django_idempotency.egg-info"
    left_by_us = not egg_info.exists()
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tmp_path), "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if left_by_us:
        shutil.rmtree(egg_info, ignore_errors=True)  # setuptools writes it into the checkout
    assert built.returncode == 0, built.stdout + built.stderr
    (sdist,) = tmp_path.glob("django_idempotency-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert not [name for name in names if name.startswith("tests/")]
    assert load_script("check_release").check_sdist(sdist) == []


def test_the_readme_links_only_to_absolute_addresses_on_the_docs_site() -> None:
    """Issue 35 item 18: the package index page shows README.md, where a relative link
    (``docs/installation.md``) leads nowhere. Each link is absolute, and each one into the docs
    site names a page that the site has."""
    site_url = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))[
        "site_url"
    ]
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert links
    assert [link for link in links if not link.startswith("https://")] == []
    for link in links:
        if link.startswith(site_url):
            page = link.removeprefix(site_url).split("#")[0].strip("/") or "index"
            assert (ROOT / "docs" / f"{page}.md").exists(), link
    assert any(link.startswith(site_url) for link in links)
