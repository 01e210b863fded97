"""A bounded JSON pretty-printer for the admin's previews of stored bodies.

``json.dumps(json.loads(text), indent=2)`` builds the whole document, then its whole indented
text, before the admin cuts it to a preview: deeply nested arrays grow about 800-fold (a 1 MB
body cost 30 s and 2.7 GB for one page view). :func:`pretty_json` reads the text token by
token, writes only until the preview is full, and elides what lies deeper than ``max_depth``
as ``[…]`` or ``{…}`` (skipping it without building it, and reading at most a budget of
characters for all such skips). No Python object is built for the document, so its memory is
the preview's; nothing recurses, so no nesting is too deep; and the text it reads is bounded
by the limit and the budget (whitespace aside), so a page view costs the same for any body.

Its output is what ``json.dumps(..., indent=2, ensure_ascii=False)`` writes for the same
document, up to the limit (strings and numbers are read and written by :mod:`json` itself),
except that deeper values are elided and a key that appears twice is shown twice.
"""

from __future__ import annotations

import json
import re

__all__ = ["pretty_json"]

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"[^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*"', re.DOTALL)
_SCALAR = re.compile(
    r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null|NaN|-?Infinity"
)
# What a skip over an elided value counts: strings (which may hold brackets), bracket runs,
# and a quote whose string does not end before the end of the window (it is not skipped into).
_SKIPPED = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[{]+|[\]}]+', re.DOTALL)
_CLOSE = {"[": "]", "{": "}"}
ELIDED = "…"


class _Invalid(ValueError):
    """The text is not JSON (as far as it was read)."""


def _scalar(token: str) -> str:
    """``token`` (a JSON string, number or literal) as ``json.dumps`` writes it."""
    try:
        text = json.dumps(json.loads(token), ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate: no page can show it (UnicodeEncodeError)
    except ValueError as exc:  # UnicodeEncodeError is a ValueError
        raise _Invalid(str(exc)) from exc
    return text


class _OutOfBudget(Exception):
    """Skipping the elided values read more than their budget."""


def _skip_value(text: str, pos: int, budget: int) -> int:
    """The end of the array or object that starts at ``pos`` (brackets balanced, strings
    skipped whole; what lies inside is not checked further), read within ``budget``
    characters."""
    window = min(len(text), pos + budget)
    depth = 0
    for match in _SKIPPED.finditer(text, pos, window):
        token = match.group()
        if token == '"':  # a string that does not end inside the window
            break
        if token[0] == '"':
            continue
        if token[0] in "[{":
            depth += len(token)
            continue
        depth -= len(token)
        if depth <= 0:
            return match.end() + depth  # closers past zero belong to the enclosing values
    if window < len(text):
        raise _OutOfBudget
    raise _Invalid("unterminated array or object")


def pretty_json(
    text: str, limit: int, max_depth: int = 20, skip_budget: int | None = None
) -> tuple[str, bool] | None:
    """``text`` as JSON indented by two spaces, cut to ``limit`` characters, and whether it
    was cut; None when it is not JSON.

    Writing stops once more than ``limit`` characters are written, and the text after that is
    not read (nor checked). Arrays and objects nested deeper than ``max_depth`` are written
    ``[…]`` or ``{…}``: they are skipped, not written, and skipping reads at most
    ``skip_budget`` characters in all (default: ``5 * limit``). Past that budget the output
    stops there too, cut: a body nested deeply all along costs what its first characters do.
    """
    out: list[str] = []
    size = 0
    budget = 5 * limit if skip_budget is None else skip_budget
    stack: list[str] = []  # the open containers, "[" or "{"
    end = len(text)

    def write(part: str) -> None:
        nonlocal size
        out.append(part)
        size += len(part)

    def skip(pos: int) -> int:
        match = _WHITESPACE.match(text, pos)
        assert match is not None  # matches the empty string
        return match.end()

    def newline() -> str:
        return "\n" + "  " * len(stack)

    def result(cut: bool) -> tuple[str, bool]:
        written = "".join(out)
        return written[:limit], cut or len(written) > limit

    try:
        pos = skip(0)
        expect_value = True
        while size <= limit:
            if expect_value:
                if pos >= end:
                    raise _Invalid("a value is missing")
                char = text[pos]
                if stack and stack[-1] == "{":  # a key, then its colon
                    key = _STRING.match(text, pos)
                    if key is None:
                        raise _Invalid("an object key is not a string")
                    write(_scalar(key.group()) + ": ")
                    pos = skip(key.end())
                    if text[pos : pos + 1] != ":":
                        raise _Invalid("a colon is missing")
                    pos = skip(pos + 1)
                    char = text[pos : pos + 1]
                if char in ("[", "{"):
                    after = skip(pos + 1)
                    if text[after : after + 1] == _CLOSE[char]:
                        write(char + _CLOSE[char])
                        pos = skip(after + 1)
                    elif len(stack) >= max_depth:
                        try:
                            closed = _skip_value(text, pos, budget)
                        except _OutOfBudget:
                            write(char + ELIDED)
                            return result(cut=True)
                        budget -= closed - pos
                        write(char + ELIDED + _CLOSE[char])
                        pos = skip(closed)
                    else:
                        stack.append(char)
                        write(char + newline())
                        pos = after
                        continue
                else:
                    token = _STRING.match(text, pos) or _SCALAR.match(text, pos)
                    if token is None:
                        raise _Invalid("not a JSON value")
                    write(_scalar(token.group()))
                    pos = skip(token.end())
                expect_value = False
                continue
            if not stack:
                if pos != end:
                    raise _Invalid("text after the value")
                return result(cut=False)
            char = text[pos : pos + 1]
            if char == ",":
                write("," + newline())
                pos = skip(pos + 1)
                expect_value = True
            elif char == _CLOSE[stack[-1]]:
                stack.pop()
                write(newline() + char)
                pos = skip(pos + 1)
            else:
                raise _Invalid("a comma or a closing bracket is missing")
    except _Invalid:
        return None
    return result(cut=True)
