"""Applying a control's edits to source text: each edit must match exactly once.

Pure functions over `{relpath: text}`; the sandbox writes their result, validation only
reads. One function serves both, so a control that validates is the control that runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.core.errors import HarnessError


@dataclass(frozen=True)
class Edit:
    """Replace one occurrence of `find` in `file` (relative to the kernel root)."""

    file: str
    find: str
    replace: str
    occurrence: int | None = None  # 1-based; required when `find` matches more than once
    regex: bool = False


class EditError(HarnessError, ValueError):
    """An edit that does not apply exactly once. `key` names the control key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.index = 0  # which edit of the control, set by `apply`
        super().__init__(message)


@dataclass(frozen=True)
class Match:
    start: int
    end: int
    replacement: str
    line: int  # 1-based line of the match's start


def _matches(edit: Edit, text: str) -> list[Match]:
    out: list[Match] = []
    if edit.regex:
        try:
            pattern = re.compile(edit.find, re.MULTILINE)
        except re.error as exc:
            raise EditError("find", f"{edit.find!r} is not a valid regex ({exc}); fix it, or drop regex = true to match exact text") from None
        for m in pattern.finditer(text):
            if m.end() == m.start():
                raise EditError("find", f"the regex {edit.find!r} matches the empty string; make it match some text")
            try:
                replacement = m.expand(edit.replace)
            except (re.error, IndexError) as exc:
                raise EditError("replace", f"{edit.replace!r} is not a valid replacement for the regex ({exc}); escape backslashes as \\\\ or name an existing group") from None
            out.append(Match(m.start(), m.end(), replacement, text.count("\n", 0, m.start()) + 1))
        return out
    start = text.find(edit.find)
    while start != -1:
        end = start + len(edit.find)
        out.append(Match(start, end, edit.replace, text.count("\n", 0, start) + 1))
        start = text.find(edit.find, end)
    return out


def locate(edit: Edit, text: str) -> Match:
    """The one match the edit names, or an EditError saying how to name it."""
    if not edit.find:
        raise EditError("find", "find is empty; give the exact text to replace")
    shown = _show(edit.find)
    matches = _matches(edit, text)
    what = "regex" if edit.regex else "text"
    if not matches:
        raise EditError(
            "find",
            f"the {what} {shown} does not occur in {edit.file}; copy the exact text from the file "
            "(whitespace counts), or update the control if the kernel changed",
        )
    if edit.occurrence is None:
        if len(matches) > 1:
            lines = ", ".join(str(m.line) for m in matches[:10])
            raise EditError(
                "find",
                f"the {what} {shown} occurs {len(matches)} times in {edit.file} (lines {lines}); "
                f"add occurrence = N (1..{len(matches)}) to pick one, or lengthen find until it is unique",
            )
        return matches[0]
    if not 1 <= edit.occurrence <= len(matches):
        raise EditError(
            "occurrence",
            f"occurrence = {edit.occurrence} but the {what} {shown} occurs {len(matches)} "
            f"time{'s' if len(matches) != 1 else ''} in {edit.file}; use a value in 1..{len(matches)}",
        )
    return matches[edit.occurrence - 1]


def apply(edits: tuple[Edit, ...], texts: dict[str, str]) -> dict[str, str]:
    """Apply the edits in order to a copy of `texts` ({relpath: text}); returns the copy.

    Each edit is located in the text as the edits before it left it. An edit that changes
    nothing is an error: a perturbation that perturbs nothing proves nothing.
    Raises EditError with `.index` set to the edit's position.
    """
    out = dict(texts)
    for index, edit in enumerate(edits):
        try:
            if edit.file not in out:
                raise EditError("file", f"{edit.file} was not read; this is a bug in the caller")
            text = out[edit.file]
            m = locate(edit, text)
            new = text[: m.start] + m.replacement + text[m.end :]
            if new == text:
                raise EditError(
                    "replace",
                    f"replacing {_show(text[m.start:m.end])} with {_show(m.replacement)} changes nothing; "
                    "a control must perturb the source",
                )
            out[edit.file] = new
        except EditError as exc:
            exc.index = index
            raise
    return out


def _show(text: str, limit: int = 60) -> str:
    shown = text if len(text) <= limit else text[: limit - 3] + "..."
    return repr(shown)
