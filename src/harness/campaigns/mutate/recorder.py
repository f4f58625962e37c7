"""A pytest plugin that writes which modules and sources each gate touched.

Loaded into a campaign's baseline run through `PYTEST_PLUGINS=harness.campaigns.mutate.recorder`
with `HARNESS_COVERAGE_DIR` set; every process of the run (xdist workers and the
isolated-gate children included) writes `coverage-<pid>.json` there at its end:
`{nodeid: {"modules_loaded": [...], "sources_read": [...]}}`. Once the plugin writes
these fields into gates.json itself, the campaign reads them there and this file is a
fallback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.core.child import COVERAGE_DIR_CHANNEL
from harness.library import coverage

_collected: list[str] = []


def pytest_collection_modifyitems(session, config, items) -> None:
    _collected.extend(item.nodeid for item in items)


def pytest_runtest_logstart(nodeid, location) -> None:
    coverage.begin(nodeid)  # before setup: what a fixture loads counts for the gate


def pytest_sessionfinish(session) -> None:
    folder = os.environ.get(COVERAGE_DIR_CHANNEL)
    if not folder:
        return
    data = {nodeid: {"modules_loaded": sorted(rec.modules), "sources_read": sorted(rec.sources),
                     "kernels_launched": sorted(rec.kernels)}
            for nodeid, rec in coverage.recorded().items() if nodeid is not None}
    for nodeid in _collected:  # a gate that loaded and read nothing (or was skipped) is recorded too
        data.setdefault(nodeid, {"modules_loaded": [], "sources_read": [], "kernels_launched": []})
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"coverage-{os.getpid()}.json").write_text(json.dumps(data, indent=1))


def read_folder(folder: Path) -> dict[str, dict[str, set[str]]]:
    """Every process's file merged: {nodeid: {"modules_loaded": set, "sources_read": set}}, and
    "kernels_launched" where a file recorded it."""
    out: dict[str, dict[str, set[str]]] = {}
    for path in sorted(Path(folder).glob("coverage-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for nodeid, rec in data.items():
            slot = out.setdefault(nodeid, {"modules_loaded": set(), "sources_read": set()})
            for key in ("modules_loaded", "sources_read"):
                slot[key].update(rec.get(key, ()))
            if "kernels_launched" in rec:  # absent from older files: not recorded, which is not "none"
                slot.setdefault("kernels_launched", set()).update(rec["kernels_launched"])
    return out
