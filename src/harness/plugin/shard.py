"""`--shard K/N`: this run takes the K-th of N balanced groups of the collected items, so N CI
hosts run one gate suite between them, and `python -m harness report merge` makes their N
reports one.

Balanced by recorded durations: each gate's `duration` in the gates.json of an earlier run
(`--harness-report DIR` writes it; a merged report of the N shards serves as well), read
from `--shard-durations FILE`, else ini `harness_shard_durations`, else
harness-report/gates.json in the rootdir when there is one. An item with no recorded
duration counts as the median of those recorded (1 s when none is). Trap gates each take a
fresh worker of their own, whatever their duration says, so they are dealt out first,
evenly by count (longest first); then every other item goes to the group with the least
time so far (longest first). The split is a function of the node ids and the durations
alone: every host computes the same groups, and xdist workers the same as their controller.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.core.errors import as_pytest_usage

DURATIONS_INI = "harness_shard_durations"
DEFAULT_DURATIONS = "harness-report/gates.json"


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, as written: K of K/N
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """'K/N' with 1 <= K <= N; a bad value is one line naming the fix."""
    import argparse

    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r} is not K/N: pass e.g. --shard 2/4 for the second of "
                                         "four groups") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--shard {text}: K must be between 1 and N: pass e.g. --shard 1/{max(n, 1)}")
    return Shard(k, n)


def read_durations(path: Path) -> dict[str, float]:
    """{nodeid: seconds} from a gates.json (one gate's setup, call and teardown together)."""
    data = json.loads(Path(path).read_text())
    return {g["nodeid"]: float(g.get("duration") or 0.0) for g in data.get("gates", [])}


def split(items: list[tuple[str, bool]], durations: dict[str, float], count: int) -> list[int]:
    """The group (0-based) of each (nodeid, is a trap gate) item: trap gates dealt evenly by
    count, the rest by least time so far, each longest first."""
    known = [durations[n] for n, _ in items if n in durations]
    default = statistics.median(known) if known else 1.0
    cost = [durations.get(n, default) for n, _ in items]
    group = [0] * len(items)
    time = [0.0] * count
    traps = sorted((i for i, (_, trap) in enumerate(items) if trap), key=lambda i: (-cost[i], items[i][0]))
    for turn, i in enumerate(traps):
        group[i] = turn % count
        time[group[i]] += cost[i]
    rest = sorted((i for i, (_, trap) in enumerate(items) if not trap), key=lambda i: (-cost[i], items[i][0]))
    for i in rest:
        group[i] = min(range(count), key=lambda g: (time[g], g))
        time[group[i]] += cost[i]
    return group


# ------------------------------------------------------------------ the plugin side


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness")
    group.addoption("--shard", type=parse_shard, default=None, metavar="K/N",
                    help="run the K-th of N groups of the collected items, balanced by the durations a gates.json "
                         "recorded (trap gates spread evenly); merge the N reports with "
                         "`python -m harness report merge DIR...` (docs/scaling.md)")
    group.addoption("--shard-durations", default=None, metavar="FILE",
                    help=f"the gates.json whose durations balance --shard (ini {DURATIONS_INI}; default "
                         f"{DEFAULT_DURATIONS} in the rootdir when there is one)")
    parser.addini(DURATIONS_INI, "a gates.json whose durations balance --shard, relative to the rootdir", default="")


def durations_file(config: pytest.Config) -> Path | None:
    given = config.option.shard_durations or config.getini(DURATIONS_INI)
    if given:
        path = Path(given)
        path = path if path.is_absolute() else (Path.cwd() if config.option.shard_durations else config.rootpath) / path
        if not path.is_file():
            raise as_pytest_usage(f"--shard-durations {path} is not a file: pass the gates.json of an "
                                    "earlier run (--harness-report DIR writes DIR/gates.json)")
        return path
    default = config.rootpath / DEFAULT_DURATIONS
    return default if default.is_file() else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep this shard's items, before the harness starts a pool for them."""
    shard = config.option.shard
    if shard is None or shard.count == 1:
        return
    path = durations_file(config)
    try:
        durations = read_durations(path) if path is not None else {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise as_pytest_usage(f"{path} holds no gate durations ({exc}): pass the gates.json of an earlier "
                                "run with --shard-durations") from None
    groups = split([(it.nodeid, it.get_closest_marker("trap") is not None) for it in items], durations, shard.count)
    kept = [it for it, g in zip(items, groups) if g == shard.index - 1]
    dropped = [it for it, g in zip(items, groups) if g != shard.index - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
    config.stash[shard_key] = (shard, path, len(kept), len(kept) + len(dropped))


shard_key = pytest.StashKey[tuple]()



def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    got = config.stash.get(shard_key, None)
    if got is None:
        return
    shard, path, kept, total = got
    source = f"durations from {path}" if path else "no recorded durations (each item counted alike)"
    terminalreporter.write_line(f"harness: shard {shard}: {kept} of {total} collected items ({source})")
