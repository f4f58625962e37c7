"""Redzones in a gate run (`harness.library.redzones`): each gate's policy, read from its markers at
collection; a gate with none runs with the run's settings less the redzones; and every gate's
guards read at the end of its call, so a write past a buffer fails the gate that made it.

In lifecycle order: the policy (`policy_of`, a frozen record per gate in its stash), the runtest
hooks. The check itself is the library's; this module only says when.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, replace

import pytest

from harness.core import device, settings as _settings
from harness.core.errors import as_pytest_usage
from harness.core.kinds import owned
from harness.plugin.state import Role

LIBRARY = "harness.library.redzones"
TRAP_REASON = "a trap gate: its fault is the verdict, and nothing can be read after it"
PROPERTY = "redzones"  # a gate's report, in a run with redzones: "N buffer(s) guarded, M check(s)", or "off: why"
TALLY = "harness-redzone-tally"
_COUNTS = re.compile(r"(\d+) buffer\(s\) guarded, (\d+) check\(s\)")


@dataclass(frozen=True)
class Policy:
    """Whether a gate's buffers carry redzones, and why not."""

    on: bool
    why_off: str | None = None


policy_key = pytest.StashKey[Policy]()
_token_key = pytest.StashKey[object]()  # the binding of a gate's settings with no redzones
_before_key = pytest.StashKey[tuple]()  # the process's tally as the gate's setup began


def policy_of(item: pytest.Item) -> Policy:
    """The gate's policy: off with its `no_redzones(reason=...)` marker (a reason is required) or
    for a trap gate; on otherwise (the run's `--no-redzones` is read where buffers are made)."""
    marker = item.get_closest_marker("no_redzones")
    if marker is not None:
        reason = marker.kwargs.get("reason", marker.args[0] if marker.args else None)
        if not isinstance(reason, str) or not reason.strip():
            raise as_pytest_usage(f"{item.nodeid}: @pytest.mark.no_redzones needs a reason: write e.g. "
                                  "@pytest.mark.no_redzones(reason=\"the kernel stores a whole tile past the output\")")
        return Policy(False, reason.strip())
    if item.get_closest_marker("trap") is not None:
        return Policy(False, TRAP_REASON)
    return Policy(True)


@pytest.hookimpl(trylast=True)  # after the plugin's own, which marks the gates (gate_key)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if owned(item):
            item.stash[policy_key] = policy_of(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    policy = item.stash.get(policy_key, None)
    if policy is not None and policy.on:
        item.stash[_before_key] = _tally()  # its fixtures' buffers are its own too
    if policy is not None and not policy.on:
        if _settings.in_effect().redzones:
            item.user_properties.append((PROPERTY, f"off: {policy.why_off}"))
        item.stash[_token_key] = _settings.bind(replace(_settings.in_effect(), redzones=False))


def _faulted(exc: BaseException | None) -> bool:
    """A device error in `exc` or what caused it: the context may not answer any more."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if device.is_cuda_error(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _read_guards(failure: BaseException | None) -> None:
    """The guards read at the end of a gate's call; a written one raised, with the gate's own
    failure as its cause. After a device error nothing is read (the context may not answer), and
    a device error the read meets is the gate's own business, as it was before the read (a gate
    that expects a fault and catches it passes)."""
    library = sys.modules.get(LIBRARY)  # not imported: no buffer was guarded in this process
    if library is None:
        return
    if failure is None:
        try:
            library.check_redzones("the end of the gate")
        except Exception as exc:
            if _faulted(exc):
                return
            raise
        return
    if _faulted(failure):
        return
    try:
        library.check_redzones("the end of the gate")
    except library.RedzoneWritten as found:
        raise found from failure
    except Exception:  # noqa: BLE001 - the device cannot be read after the failure: it stands alone
        pass


_NOT_A_VERDICT = (pytest.skip.Exception, pytest.xfail.Exception)


def _tally() -> tuple[int, int]:
    library = sys.modules.get(LIBRARY)
    return library.tally() if library is not None else (0, 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """After the gate's own call, its guards read (`check_redzones`): a written one fails the gate
    by assertion. A gate that skips leaves its guards filled again, unreported, for the next.
    In a run with redzones, each gate's report says what they did in it (`PROPERTY`)."""
    policy = item.stash.get(policy_key, None)
    if policy is None or not policy.on:
        return (yield)
    before = item.stash.get(_before_key, None) or _tally()
    try:
        result = yield
    except _NOT_A_VERDICT:
        _rearm()
        raise
    except (Exception, pytest.fail.Exception) as failure:
        _note(item, before)
        _read_guards(failure)
        raise
    _note(item, before)
    _read_guards(None)
    return result


def _note(item: pytest.Item, before: tuple[int, int]) -> None:
    if not _settings.in_effect().redzones:
        return
    guarded, checks = (now - then for now, then in zip(_tally(), before))
    item.user_properties.append((PROPERTY, f"{guarded} buffer(s) guarded, {checks} check(s)"))


def _rearm() -> None:
    library = sys.modules.get(LIBRARY)
    if library is not None:
        try:
            library.rearm()
        except Exception:  # noqa: BLE001 - a faulted context: a fresh worker comes after it
            pass


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem) -> None:
    token = item.stash.get(_token_key, None)
    if token is None:
        return
    del item.stash[_token_key]
    _settings.unbind(token)
    _rearm()  # its kernels may have written past their views on purpose: no later gate is blamed


# ---------------------------------------------------------------- the run's line


def pytest_configure(config: pytest.Config) -> None:
    if Role.of(config).reports:  # the process that prints the summary
        config.pluginmanager.register(RedzoneTally(), TALLY)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.pluginmanager.has_plugin(TALLY):
        config.pluginmanager.unregister(name=TALLY)


class RedzoneTally:
    """What the redzones did over a run, from each gate's `PROPERTY`: one line at its end, so a
    run with them shows they were on (a run without prints none)."""

    def __init__(self):
        self.gates: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        said = dict(getattr(report, "user_properties", ()) or ()).get(PROPERTY)
        if said is not None:
            self.gates[report.nodeid] = str(said)

    def line(self) -> str | None:
        if not self.gates:
            return None
        counts = [_COUNTS.fullmatch(v) for v in self.gates.values()]
        on = [m for m in counts if m]
        off = Counter(v.removeprefix("off: ") for v in self.gates.values() if v.startswith("off: "))
        text = (f"redzones: {len(on)} gate(s) ran with them: {sum(int(m.group(1)) for m in on)} buffer(s) guarded, "
                f"{sum(int(m.group(2)) for m in on)} check(s) after launches; a written guard fails its gate")
        if off:
            text += "; without them: " + "; ".join(f"{n} ({why})" for why, n in sorted(off.items()))
        return text

    def pytest_terminal_summary(self, terminalreporter) -> None:
        line = self.line()
        if line:
            terminalreporter.write_line(line)
