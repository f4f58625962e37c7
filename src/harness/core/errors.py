"""The harness's errors: one root, `HarnessError`, and its groups, each named by what a caller
does with one (as Hypothesis's `errors.py`).

- `UsageError`: bad input (an option, a variable, an ini key, a file named by the user);
  nothing ran. Its message is one line naming what was wrong and the fix. A command prints
  it and exits 2 (`harness.core.usage.ExitStatus.USAGE`); the pytest plugin raises it as pytest's
  own, through `as_pytest_usage` (or `usage_errors` around a hook), the one place that
  writes the `harness: ` prefix.
- `SetupError`: the machine lacks what the run needs (a tool, a cluster, a process that
  would not start); the message names what to install or start.
- `DeviceLost`: the device stopped answering mid-run; nothing run after it is a verdict, so
  the caller keeps what it has and stops (exit 4, `ExitStatus.DEVICE_LOST`).
- `CheckFailed`: a gate's check found the kernel wrong. Also an `AssertionError`, so pytest
  reports it as a failed assertion and the verdict's route is `assertion`.
- `HarnessWarning`: the root of the harness's warnings.

Every other error descends from `HarnessError` directly. Each keeps the builtin it has always
had (`ValueError`, `LookupError`, `RuntimeError`, `TypeError`), so an `except` that caught it
before catches it still. A class stays in the module that raises it, where its qualified name
(shown in every traceback) has always been; this module holds the root, the groups and the
classes several modules share.

A few private exceptions stay outside the tree: they carry control flow inside one module
(or one wire) and never reach a user. `PRIVATE` names each, with why.
"""

from __future__ import annotations

import contextlib


class HarnessError(Exception):
    """The root of every error the harness raises on purpose."""


class UsageError(HarnessError, ValueError):
    """Bad input found before any work: one line naming the input and the fix."""


class SetupError(HarnessError):
    """What the run needs is not there (a tool, a cluster, a server or a worker that would
    not start): the message names what to install, start or set."""


class DeviceLost(HarnessError, RuntimeError):
    """The device stopped answering (a fresh worker could not start on a device that served
    gates before: a driver reset, an Xid, a GPU off the bus), or a campaign stopped because
    it did; nothing run from then on is a verdict, and the results so far are kept."""


class CheckFailed(HarnessError, AssertionError):
    """A gate's check found the kernel wrong: pytest reports it as a failed assertion."""


class HarnessWarning(HarnessError, Warning):
    """The root of the harness's warnings."""


# Exceptions that are not HarnessErrors, by qualified name: each carries control flow inside
# its module (or the pool's wire) and is caught there; none reaches a user.
PRIVATE = {
    "harness.compiling.backends._Failed":
        "a compiler's failure with its log, from either backend; compile_file makes it a CompileError",
    "harness.library.caching._NotKept":
        "an argument the disk key cannot name; the host cache then keeps nothing on disk for the call",
    "harness.campaigns.mutate.screen._Stop":
        "ends the CPU screen early from its callback; the screen's loop catches it",
    "harness.library.sweep._Fault":
        "carries a device fault out of a sweep's shrinkers; sweep raises it as a ShapeFaulted",
    "harness.pool.channel.Timeout": "a wire event: no frame within the wait; every reader of a channel handles it",
    "harness.pool.channel.ChannelClosed": "a wire event: the other end closed; every reader of a channel handles it",
}

PREFIX = "harness: "


def as_pytest_usage(error: BaseException | str):
    """pytest's `UsageError` for a harness usage error (or its message): the one line, with
    `harness: ` before it once (a message that starts with it already keeps it as it is)."""
    import pytest

    text = str(error)
    return pytest.UsageError(text if text.startswith(PREFIX) else PREFIX + text)


@contextlib.contextmanager
def usage_errors(*also: type[BaseException]):
    """Inside it, a `UsageError` (and any of the classes in `also`) leaves as pytest's
    (`as_pytest_usage`), its traceback dropped. A context manager, and a decorator of a plain
    hook (a hook wrapper's generator needs the `with` inside it)."""
    try:
        yield
    except (UsageError, *also) as exc:
        raise as_pytest_usage(exc) from None
