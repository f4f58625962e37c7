"""A setting's value read from text (an option, an ini key, a marker's argument): the value,
or one `UsageError` line naming where it was given and the fix."""

from __future__ import annotations

import math

from harness.core.errors import UsageError


def positive_seconds(text: str, option: str, example: str, also: str = "", fix: str | None = None) -> float:
    """A positive, finite number of seconds given as `option`; `also` names what else the
    option takes, `fix` says what to do (default: pass e.g. `option example`). Raises UsageError."""
    fix = fix or f"pass e.g. {option} {example}"
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"{option} {text!r} is not a number of seconds{also}; {fix}") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{option} must be a positive, finite number of seconds (got {text}); {fix}")
    return value


def positive_int(text: str, option: str, example: str) -> int:
    """A whole number of at least 1 given as `option`. Raises UsageError."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise UsageError(f"{option} {text!r} is not a whole number; pass e.g. {option} {example}") from None
    if value < 1:
        raise UsageError(f"{option} must be at least 1 (got {value}); pass e.g. {option} {example}")
    return value
