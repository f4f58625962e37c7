"""The commands `python -m harness` dispatches to (`harness.__main__`): `bench` (the
benchmarks' table, `bench gates`), `startup` (`bench startup`), `cache` (`cache
info|prune|clear`), `report` (`report merge`); the campaigns' commands are theirs
(`harness.campaigns.controls.cli`, `harness.campaigns.mutate.cli`).

Here, the table of a command that names a subcommand first (`python -m harness COMMAND`,
`bench NAME`, `report NAME`): its help and its dispatch are both read from it, so the help
cannot leave out a subcommand the dispatch knows."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, what it does in one line, and its entry (argv -> exit status)."""

    name: str
    summary: str
    run: Callable[[list[str]], int]


@dataclass(frozen=True)
class Commands:
    """A command's subcommands: `prog NAME [options]`, `what` naming one of them in messages."""

    prog: str  # "python -m harness", "python -m harness bench"
    what: str  # "command", "benchmark"
    intro: str
    table: tuple[Command, ...]
    metavar: str = "NAME"  # the subcommand in the usage's last line

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.table)

    def usage(self) -> str:
        width = max(map(len, self.names))
        lines = [f"usage: {self.prog} {{{','.join(self.names)}}} [options]", "", self.intro, "", f"{self.what}s:"]
        lines += [f"  {c.name:<{width}}  {c.summary}" for c in self.table]
        lines += ["", f"{self.prog} {self.metavar} --help describes that {self.what}'s options."]
        return "\n".join(lines)

    def dispatch(self, argv: list[str]) -> int:
        """Run the named subcommand on the rest of `argv`; `-h`/`--help` prints the usage on
        stdout (status 0), nothing or an unknown name prints it on stderr (status 2), the
        unknown name said first."""
        from harness.core.usage import ExitStatus

        if argv and argv[0] in ("-h", "--help"):
            print(self.usage())
            return ExitStatus.OK
        found = {c.name: c for c in self.table}.get(argv[0]) if argv else None
        if found is None:
            if argv:
                print(f"error: unknown {self.what} {argv[0]!r}: use one of {', '.join(self.names)}", file=sys.stderr)
            print(self.usage(), file=sys.stderr)
            return ExitStatus.USAGE
        from harness.core.usage import UsageError

        try:
            return found.run(argv[1:])
        except UsageError as exc:  # bad input a subcommand found: one line, never a traceback
            print(f"error: {exc}", file=sys.stderr)
            return ExitStatus.USAGE
