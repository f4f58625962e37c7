"""C++ source read as text: comments and literals blanked out (offsets and line numbers kept),
and an offset's line. The compile path (the device view, a kernel file's checks) and the gate
author's structural readers (`harness.library.source`) share them."""

from __future__ import annotations

import functools
import re

_IDENT_CHAR = re.compile(r"\w")


def _blank(chars: list[str], start: int, end: int) -> None:
    for i in range(start, end):
        if chars[i] != "\n":
            chars[i] = " "


def _starts_numeric_token(text: str, quote: int) -> bool:
    """True when the `'` at `quote` is a C++14 digit separator (inside `1'000`)."""
    i = quote
    while i > 0 and (_IDENT_CHAR.match(text[i - 1]) or text[i - 1] == "'"):
        i -= 1
    return i < quote and text[i].isdigit()


_RAW_PREFIXES = frozenset({"R", "u8R", "uR", "UR", "LR"})


def _prefix_before(text: str, quote: int) -> str:
    """The identifier characters directly before `quote` (a literal's prefix, if any)."""
    i = quote
    while i > 0 and _IDENT_CHAR.match(text[i - 1]):
        i -= 1
    return text[i:quote]


@functools.lru_cache(maxsize=64)
def strip_comments_and_literals(text: str) -> str:
    """`text` with comments and literal contents replaced by spaces.

    Newlines survive (so line numbers do) and the result has the same length (so
    offsets do). Quotes stay, their contents go: `f("a{")` becomes `f("  ")`. Raw
    strings `R"d(...)d"` are handled; a `'` inside a number (`1'000`) is a digit
    separator, not a character literal. Idempotent. Kept for the last texts asked for: the
    structural gates of one mutant each strip the same file.
    """
    chars = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            _blank(chars, i, end)
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            _blank(chars, i, end)
            i = end
        elif c == '"' and _prefix_before(text, i) in _RAW_PREFIXES:
            open_paren = text.find("(", i)
            delim = text[i + 1 : open_paren]
            close = text.find(")" + delim + '"', open_paren)
            end = n if close < 0 else close + len(delim) + 2
            _blank(chars, i + 1, end - 1)
            i = end
        elif c == '"' or (c == "'" and not _starts_numeric_token(text, i)):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            end = min(j + 1, n)
            _blank(chars, i + 1, min(j, n))
            i = end
        else:
            i += 1
    return "".join(chars)


def line_of(text: str, offset: int) -> int:
    """1-based line number of `offset` in `text`."""
    return text.count("\n", 0, offset) + 1
