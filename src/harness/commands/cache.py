"""`python -m harness cache {info|prune|clear}`: what the harness keeps on disk, and how to
make it keep less."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

KEEPS = ("the cubins the real tree compiles to (its modules, for every source state still used), the cubins "
         "compiled in sandboxes (mutants' and controls': the screen compiles every mutant once, a later run "
         "finds it), the verdict store (each mutant's verdict under a digest of what it rests on: --since "
         "reuses it), the host cache (float64 references and other costly host data, the last three "
         "source states) and cuda.core's spellings of NVRTC's options (a few hundred bytes each: a compile "
         "whose cubin is cached then never imports cuda.core)")


# Its actions, each with what it does; the command's help and `python -m harness --help` read them.
ACTIONS = {"info": "where it is and what it holds", "prune": "down to the bound now", "clear": "remove it all"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness cache",
        description="The harness's disk cache: " + KEEPS + ". The cubins and verdicts together stay under "
                    "HARNESS_CACHE_MAX (default 256M; 0 for no bound): past it, the least recently used go "
                    "first, the sandboxes' before the real tree's. Everything in it is made again when missing.")
    p.add_argument("action", choices=tuple(ACTIONS), help="; ".join(f"{k}: {v}" for k, v in ACTIONS.items()))
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="the cache (default: HARNESS_CACHE_DIR, else ini harness_cache_dir, else "
                        "$XDG_CACHE_HOME/harness/cubin)")
    p.add_argument("--rootdir", default=None, metavar="DIR", help="the project whose ini is read (default: found "
                                                                  "from the working folder up)")
    return p


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f} MB"


def main(argv: list[str]) -> int:
    from harness.compiling.cubin_cache import (CACHE_MAX_ENV, PRUNED_FOLDERS, SANDBOX_FOLDER, cache_max_problem,
                                               limit_bytes, prune, usage)
    from harness.compiling.options import OPTIONS_FOLDER
    from harness.core import settings as _settings
    from harness.core.usage import ExitStatus, folder_problem, rootdir_problem

    args = parser().parse_args(argv)
    if rootdir_problem(args.rootdir):
        print(f"error: {rootdir_problem(args.rootdir)}", file=sys.stderr)
        return ExitStatus.USAGE
    project = _settings.resolve(cache_dir=args.cache_dir, rootdir=args.rootdir)
    cache = project.settings.cache_dir
    source = "the cache folder" if project.cache_source == "the default" else project.cache_source
    problem = folder_problem(cache, source, "the harness's disk cache") or cache_max_problem(os.environ.get(CACHE_MAX_ENV))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return ExitStatus.USAGE
    limit = limit_bytes()
    bound = _mb(limit) if limit else "none (HARNESS_CACHE_MAX=0)"
    if args.action == "info":
        u = usage(cache)
        print(f"cache: {cache} (from {project.cache_source})")
        print(f"bound on cubins and verdicts: {bound}; holding {_mb(u.bounded)}")
        print(f"  real tree's cubins:  {u.cubins[1]:6d} entries, {_mb(u.cubins[0])}")
        print(f"  sandboxes' cubins:   {u.sandbox[1]:6d} entries, {_mb(u.sandbox[0])} (mutants', controls'; "
              "pruned first)")
        print(f"  verdict store:       {u.verdicts[1]:6d} entries, {_mb(u.verdicts[0])}")
        print(f"  host cache:          {_mb(u.host)} (its own bound: the last three source states)")
        print("clear it all: python -m harness cache clear; down to the bound: python -m harness cache prune")
        return ExitStatus.OK
    if args.action == "prune":
        done = prune(cache, limit)
        print(f"{cache}: removed {done.removed} entries ({_mb(done.freed)}), {_mb(done.kept)} kept (bound {bound})")
        return ExitStatus.OK
    removed = []
    if cache.is_dir():  # only what the harness writes there: a cache folder shared with anything else keeps the rest
        for entry in cache.iterdir():
            ours = entry.is_dir() and (entry.name in (SANDBOX_FOLDER, "host", OPTIONS_FOLDER, *PRUNED_FOLDERS)
                                       or (len(entry.name) == 2 and all(c in "0123456789abcdef" for c in entry.name)))
            if ours:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    print(f"{cache}: cleared ({len(removed)} folder(s) removed); every cubin compiles again when next needed")
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
