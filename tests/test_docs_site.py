"""The built documentation site, checked for what ``mkdocs build --strict`` lets through.

Strict mode fails on a broken Markdown link, but not on an include that was mistyped (the
snippet marker is then printed as text, ``--8 < --"file"``), a ``{{ ... }}`` placeholder that no
hook filled, a table broken by a blank line (its rows become paragraphs of pipes), a link
written in HTML, or a code block indented as a whole (a section included from inside a function
without ``dedent_subsections``). :func:`site_problems` reads every built page for those, and for
any link to a page or an anchor that does not exist. The second test plants each kind of error
in a small site built with the same configuration, and checks that each one is reported.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = [sys.executable, "-m", "mkdocs"]
TAG = re.compile(r"<[^>]+>")
SNIPPET = re.compile(r"-{1,2}\s*8\s*<\s*-{1,2}")
PLACEHOLDER = re.compile(r"\{\{[^{}]*\}\}|\{%[^{}]*%\}")
PIPE_PARAGRAPH = re.compile(r"<p>\s*\|")
PRE = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.S)
HREF = re.compile(r"""<a\s[^>]*?href="([^"]*)\"""")
ID = re.compile(r"""\sid="([^"]+)\"""")
#: Pages mkdocs and its theme write themselves.
SKIPPED = {"404.html"}


def text_of(page: str) -> str:
    """The page's text as a reader sees it: tags (the highlighter's spans too) removed."""
    return html.unescape(TAG.sub("", page))


def page_problems(site: Path, path: Path, ids: dict[Path, set[str]]) -> list[str]:
    name = path.relative_to(site).as_posix()
    page = path.read_text()
    main = page.split('<div class="md-content"', 1)[-1]
    problems = []
    text = text_of(main)
    for match in SNIPPET.finditer(text):
        shown = text[match.start() : match.end() + 60]
        problems.append(f"{name}: a raw include marker: {shown!r}")
    for match in PLACEHOLDER.finditer(text):
        problems.append(f"{name}: a raw placeholder: {match.group()!r}")
    for match in PIPE_PARAGRAPH.finditer(main):
        line = text_of(main[match.start() : match.start() + 200]).splitlines()[0]
        problems.append(f"{name}: a table row rendered as text: {line!r}")
    for block in PRE.findall(main):
        lines = [line for line in text_of(block).splitlines() if line.strip()]
        if lines and all(line[0] in " \t" for line in lines):
            problems.append(f"{name}: a code block indented as a whole: {lines[0]!r}")
    for href in HREF.findall(main):
        problems += link_problems(site, path, html.unescape(href), ids)
    return problems


def link_problems(site: Path, page: Path, href: str, ids: dict[Path, set[str]]) -> list[str]:
    parts = urlsplit(href)
    if parts.scheme or parts.netloc or href.startswith("//"):
        return []
    name = page.relative_to(site).as_posix()
    if parts.path:
        target = (page.parent / unquote(parts.path)).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.exists() or site.resolve() not in target.parents:
            return [f"{name}: a link to a page that does not exist: {href}"]
    else:
        target = page.resolve()
    if parts.fragment and target.suffix == ".html":
        known = ids.setdefault(target, set(ID.findall(target.read_text())))
        if unquote(parts.fragment) not in known:
            return [f"{name}: a link to an anchor that does not exist: {href}"]
    return []


def site_problems(site: Path) -> list[str]:
    ids: dict[Path, set[str]] = {}
    problems: list[str] = []
    for path in sorted(site.rglob("*.html")):
        if path.name in SKIPPED or path.relative_to(site).parts[0] in {"assets", "search"}:
            continue
        problems += page_problems(site, path, ids)
    return problems


def build(config: Path, site: Path, strict: bool = True) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    args = [*MKDOCS, "build", "--config-file", str(config), "--site-dir", str(site)]
    done = subprocess.run(
        [*args, "--strict"] if strict else args,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.sqlite  # the site does not depend on the database: built once
def test_the_built_site_has_no_raw_markup_and_no_broken_link(tmp_path: Path) -> None:
    build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert (tmp_path / "site/outbox/index.html").exists()
    assert site_problems(tmp_path / "site") == []


PLANTED = {
    "index.md": """# Home

[a good link](other.md#a-section), [a missing page](missing.md),
[a missing anchor](other.md#nowhere), <a href="other/#nor-here">an HTML link</a>.

```python
--8 < --"testproject/shop/orders.py:outbox"
```

Version {{ version }}.

```python
    indented = "as a whole"
    like = "a section cut from a function"
```

| key | default |
| --- | --- |
| `A` | `1` |

| `B` | `2` |
""",
    "other.md": "# Other\n\n## A section\n\nText.\n",
}


@pytest.mark.slow
@pytest.mark.sqlite
def test_each_planted_error_is_found(tmp_path: Path) -> None:
    """A site with one error of each kind: each is reported, and the good link is not."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in PLANTED.items():
        (docs / name).write_text(text)
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))
    config.update(
        docs_dir=str(docs),
        nav=["index.md", "other.md"],
        strict=False,
        plugins=["search"],
        hooks=[str(ROOT / "scripts/mkdocs_hooks.py")],
    )
    config["validation"] = {"links": {"not_found": "info", "anchors": "info"}}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    build(tmp_path / "mkdocs.yml", tmp_path / "site", strict=False)
    found = "\n".join(site_problems(tmp_path / "site"))
    assert "a raw include marker" in found
    assert "a raw placeholder: '{{ version }}'" in found
    assert "a table row rendered as text: '| B | 2 |'" in found
    assert "a page that does not exist: missing.md" in found
    assert "an anchor that does not exist: other/#nowhere" in found
    assert "an anchor that does not exist: other/#nor-here" in found
    assert "a code block indented as a whole: '    indented = \"as a whole\"'" in found
    assert "#a-section" not in found
    assert len(found.splitlines()) == 7, found


def test_no_include_sits_in_a_block_that_ruff_formats() -> None:
    """``ruff format`` formats ```` ```python ```` blocks in Markdown, and turns an include line
    into ``--8 < --"file"``, which the site then shows as text. Includes go in ```` ```{.python}
    ```` blocks, which it leaves alone."""
    fence = re.compile(r"^```(python|py)\b[^\n]*\n(.*?)^```$", re.M | re.S)
    for path in (ROOT / "docs").glob("*.md"):
        for match in fence.finditer(path.read_text()):
            assert "--8<--" not in match[2], f"{path.name}: an include in a ```python block"
            assert not SNIPPET.search(match[2]), f"{path.name}: a mangled include"
