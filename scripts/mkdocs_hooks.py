"""MkDocs hooks: show the docstrings' Sphinx roles as plain code in the API reference.

The package's docstrings use Sphinx roles (``:class:`~django_idempotency.core.Command```), which
read well in the source and in IDEs. mkdocstrings renders them as Markdown, leaving the role name
in front of the code span; this hook drops it, and shortens a ``~``-prefixed path to its last
part as Sphinx does.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|data|exc|mod|attr|obj|const):<code>(~?)([^<]+)</code>")


def _plain(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_plain, html)
