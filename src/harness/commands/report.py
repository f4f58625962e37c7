"""`python -m harness report NAME`: commands over the reports gate runs wrote (`REPORTS`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.commands import Command, Commands
from harness.core.usage import ExitStatus


def merge_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness report merge",
                                     description="Merge the gates.json of the N shards of one gate run "
                                                 "(pytest --shard K/N --harness-report DIR on each host) into "
                                                 "one gates.json and summary.md.")
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="each shard's --harness-report folder")
    parser.add_argument("--out", default="harness-report", metavar="DIR",
                        help="where the merged gates.json and summary.md go (default harness-report)")
    return parser


def merge_main(argv: list[str]) -> int:
    from harness.core.usage import output_folder_problem
    from harness.plugin.report import MergeError, merge, write_reports

    def error(text: str) -> int:
        print(f"error: {text}", file=sys.stderr)
        return ExitStatus.USAGE

    ns = merge_parser().parse_args(argv)
    problem = output_folder_problem(ns.out, "--out", "the merged gates.json and summary.md")
    if problem:
        return error(problem)
    if Path(ns.out).resolve() in {Path(d).resolve() for d in ns.dirs}:
        return error(f"--out {ns.out} is one of the reports merged: the merged gates.json would replace that shard's; "
                     "pass another folder")
    try:
        records, facts = merge([Path(d) for d in ns.dirs])
    except MergeError as exc:
        return error(str(exc))
    try:
        json_path, md_path = write_reports(Path(ns.out), records, facts)
    except OSError as exc:
        return error(f"cannot write the merged report in --out {ns.out}: {exc.strerror or exc}; pass a folder you "
                     "can write")
    print(f"{len(records)} gates from {len(ns.dirs)} report(s): {json_path}, {md_path}")
    return ExitStatus.FINDINGS if any(r.red for r in records) else ExitStatus.OK


REPORTS = Commands(
    prog="python -m harness report", what="report command",
    intro="Commands over the reports gate runs write (pytest --harness-report DIR: gates.json and summary.md).",
    table=(
        Command("merge", "the gates.json of the N shards of one `pytest --shard K/N` run as one gates.json and "
                         "summary.md (--out DIR)", merge_main),
    ),
)


def main(argv: list[str]) -> int:
    return REPORTS.dispatch(argv)
