"""A command that names a subcommand first (`python -m harness COMMAND`, `bench NAME`): one
way to print the usage and refuse an unknown name."""

from __future__ import annotations

import sys
from typing import Callable


def dispatch(argv: list[str], table: dict[str, Callable[[list[str]], int]], usage: str, what: str) -> int:
    """Run `table[argv[0]](argv[1:])`; `-h`/`--help` prints `usage` on stdout (status 0), nothing
    or an unknown name prints it on stderr (status 2), the unknown name said first."""
    if argv and argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if not argv or argv[0] not in table:
        if argv:
            print(f"error: unknown {what} {argv[0]!r}: use one of {', '.join(table)}", file=sys.stderr)
        print(usage, file=sys.stderr)
        return 2
    return table[argv[0]](argv[1:])
