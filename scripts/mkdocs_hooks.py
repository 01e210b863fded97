"""MkDocs hooks: versions from setup.cfg, and the docstrings' Sphinx roles as plain code.

* ``{{ requires.NAME }}`` in a page becomes the lowest version of ``NAME`` that ``setup.cfg``
  accepts (``python`` from ``python_requires``, the others from ``install_requires`` and the
  extras), so the documented requirements cannot drift from the packaged ones. An unknown name
  fails the build.
* The package's docstrings use Sphinx roles (``:class:`~django_idempotency.http.core.Command```),
  which read well in the source and in IDEs. mkdocstrings renders them as Markdown, leaving the
  role name in front of the code span; a hook drops it, and shortens a ``~``-prefixed path to its
  last part as Sphinx does.
"""

from __future__ import annotations

import configparser
import functools
import re
from pathlib import Path
from typing import Any

SETUP_CFG = Path(__file__).resolve().parent.parent / "setup.cfg"
REQUIRES = re.compile(r"\{\{\s*requires\.([A-Za-z0-9_.-]+)\s*\}\}")
MINIMUM = re.compile(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(?:>=|==|~=)\s*([0-9][0-9.]*)")


@functools.cache
def minimum_versions(path: Path = SETUP_CFG) -> dict[str, str]:
    """``{lower-cased name: lowest accepted version}`` from setup.cfg's requirements."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(path)
    lines = config.get("options", "install_requires").splitlines()
    for name in config.options("options.extras_require"):
        lines += config.get("options.extras_require", name).splitlines()
    versions: dict[str, str] = {}
    for line in lines:
        match = MINIMUM.match(line)
        if match:
            versions.setdefault(match.group(1).lower(), match.group(2))
    python = re.search(r">=\s*([0-9.]+)", config.get("options", "python_requires"))
    if python:
        versions["python"] = python.group(1)
    return versions


def fill_versions(markdown: str) -> str:
    versions = minimum_versions()

    def version(match: re.Match[str]) -> str:
        name = match.group(1).lower()
        if name not in versions:
            raise KeyError(
                f"{{{{ requires.{name} }}}}: setup.cfg has no minimum version of {name}"
            )
        return versions[name]

    return REQUIRES.sub(version, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return fill_versions(markdown)


ROLE = re.compile(r":(?:class|func|meth|data|exc|mod|attr|obj|const):<code>(~?)([^<]+)</code>")


def _plain(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_plain, html)
