"""One error tree (`harness.core.errors`): every exception class the harness defines descends from
`HarnessError`, or is a private one named in `harness.core.errors.PRIVATE` with why; each group
keeps the builtin a caller catches; and a usage error becomes pytest's in one place, with
the `harness: ` prefix once."""

from __future__ import annotations

import importlib
import inspect

import pytest

from harness.core import errors
from harness.core.errors import CheckFailed, DeviceLost, HarnessError, UsageError, as_pytest_usage, usage_errors
from tests._machine import PACKAGE

MODULES = sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
                 for p in PACKAGE.rglob("*.py"))



def exception_classes(module: str) -> dict[str, type]:
    """{qualified name: class} of the exception classes `module` itself defines."""
    mod = importlib.import_module(module)
    return {f"{module}.{obj.__qualname__}": obj for obj in vars(mod).values()
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module}


def every_exception_class() -> dict[str, type]:
    return {name: cls for module in MODULES for name, cls in exception_classes(module).items()}


@pytest.mark.parametrize("module", MODULES)
def test_every_exception_class_a_module_defines_is_a_harness_error_or_private_with_its_reason(module):
    found = exception_classes(module)
    outside = sorted(name for name, cls in found.items()
                     if not issubclass(cls, HarnessError) and name not in errors.PRIVATE)
    assert not outside, (f"{', '.join(outside)} descend(s) from no HarnessError: re-root it on its group in "
                         "harness.core.errors, or name it in harness.core.errors.PRIVATE with why it never reaches a user")


def test_each_private_exception_exists_is_outside_the_tree_and_says_why():
    found = every_exception_class()
    for name, why in errors.PRIVATE.items():
        assert name in found, f"{name} is named private but no module defines it: drop it from PRIVATE"
        assert not issubclass(found[name], HarnessError), f"{name} is a HarnessError: drop it from PRIVATE"
        assert why.strip(), f"{name}: PRIVATE says no reason"


def test_usage_errors_are_value_errors_and_checks_that_fail_are_assertion_errors():
    found = every_exception_class()
    usage = [cls for cls in found.values() if issubclass(cls, UsageError)]
    checks = [cls for cls in found.values() if issubclass(cls, CheckFailed)]
    assert {c.__name__ for c in usage} >= {"ArchError", "IncludeDirError", "CacheLimitError", "MergeError",
                                           "ControlSpecError", "PathError", "SinceError", "UnknownOperator"}
    assert all(issubclass(cls, ValueError) for cls in usage)
    assert {c.__name__ for c in checks} >= {"BitsMismatch", "NotClose", "NotBatchInvariant", "NotDeterministic"}
    assert all(issubclass(cls, AssertionError) for cls in checks), "pytest reports them as failed assertions"


def test_the_commands_usage_error_is_the_trees():
    from harness.core import usage

    assert usage.UsageError is UsageError


def test_a_lost_device_is_one_class_for_the_pool_and_the_campaigns():
    from harness.campaigns.mutate import campaign
    from harness.pool import controller

    assert controller.DeviceLost is DeviceLost and issubclass(DeviceLost, RuntimeError)
    assert not hasattr(campaign, "DeviceLostError")


def test_a_usage_error_becomes_pytests_with_the_prefix_once():
    converted = as_pytest_usage(UsageError("--arch 'sm_1' is unknown: pass e.g. --arch sm_90"))
    assert isinstance(converted, pytest.UsageError)
    assert str(converted) == "harness: --arch 'sm_1' is unknown: pass e.g. --arch sm_90"
    assert str(as_pytest_usage("harness: the temp dir is too deep")) == "harness: the temp dir is too deep"
    assert str(as_pytest_usage(as_pytest_usage("x"))) == "harness: x"


def test_usage_errors_converts_around_a_block_and_as_a_decorator_and_lets_the_rest_through():
    with pytest.raises(pytest.UsageError, match="^harness: bad input; fix it$") as caught:
        with usage_errors():
            raise UsageError("bad input; fix it")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__

    @usage_errors(LookupError)
    def hook():
        raise KeyError("gate")

    with pytest.raises(pytest.UsageError, match="^harness: 'gate'$"):
        hook()
    with pytest.raises(RuntimeError, match="not bad input"):
        with usage_errors():
            raise RuntimeError("not bad input")
