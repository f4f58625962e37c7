"""A gate's reports as the harness writes them: the properties every gate's reports carry
(kind, module, gpu, ...: JUnit's `<properties>`, gates.json), and setup / call / teardown
reports made for a gate judged outside pytest's own protocol (a pool worker's result, a
timeout, a trap gate, a comparison)."""

from __future__ import annotations

import pytest

from harness.core.kinds import is_gpu, kind_of
from harness.core.records import MESSAGE_LIMIT, Outcome


def properties(item: pytest.Item) -> list[tuple[str, str]]:
    props = [("kind", kind_of(item) or "other"), ("module", item.nodeid.split("::")[0]),
             ("gpu", "true" if is_gpu(item) else "false")]
    if item.get_closest_marker("memory_safety") or item.get_closest_marker("trap"):
        props.append(("memory_safety", "true"))
    if item.get_closest_marker("names_faults"):
        props.append(("names_faults", "true"))
    return props


def props_of(report) -> dict:
    return {k: v for k, v in getattr(report, "user_properties", [])}


def synthetic(item: pytest.Item, outcome: str, longrepr, props: list, duration: float = 0.0,
              message: str | None = None) -> list:
    """setup / call / teardown reports for a gate judged here rather than in the worker."""
    trap = item.get_closest_marker("trap") is not None
    all_props = properties(item) + ([("isolated", "true")] if trap else []) + list(props)
    keywords = {k: 1 for k in item.keywords}
    failure = (message or str(longrepr))[:MESSAGE_LIMIT] if outcome == Outcome.FAILED else None
    return [
        pytest.TestReport(item.nodeid, item.location, keywords, outcome=o, longrepr=lr, when=when,
                          duration=d, user_properties=list(all_props), harness_failure_message=failure)
        for when, o, lr, d in (("setup", Outcome.PASSED.value, None, 0.0), ("call", outcome, longrepr, duration),
                               ("teardown", Outcome.PASSED.value, None, 0.0))
    ]
