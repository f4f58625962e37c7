"""harness.library.launch: refusals name the argument, what it holds and what to do; only a
`Refusal` is routed `refusal`. Host arrays only: no GPU needed."""

import numpy as np
import pytest

from harness.library.dtypes import bf16
from harness.library.launch import (BF16_DTYPES, NULL, Refusal, check_aligned, check_array, check_dtype, check_int32_vector,
                                    check_shape, ptr_or_null, require)
from harness.plugin.report import Route, classify_route


def test_a_refusal_is_a_value_error_and_only_a_refusal_is_routed_refusal():
    assert issubclass(Refusal, ValueError)
    assert classify_route(Refusal("x")) is Route.REFUSAL
    assert classify_route(ValueError("operands could not be broadcast together")) is Route.ERROR
    with pytest.raises(ValueError) as info:  # numpy's own ValueError, raised inside a launcher by accident
        np.zeros(3) + np.zeros(4)
    assert classify_route(info.value) is Route.ERROR


def test_check_array_names_shape_then_dtype_then_layout():
    a = np.zeros((2, 3), np.float32)
    check_array("op", "x", a, (2, 3), (np.float32,), "f32 [2, 3]")
    with pytest.raises(Refusal, match=r"^op: x has shape \(2, 3\), expected \(3, 2\) \(f32 \[3, 2\]\)$"):
        check_array("op", "x", a, (3, 2), (np.float32,), "f32 [3, 2]")
    with pytest.raises(Refusal, match=r"^op: x has dtype float32, expected bfloat16 or uint16 \(bf16\)$"):
        check_array("op", "x", a, (2, 3), BF16_DTYPES, "bf16")
    with pytest.raises(Refusal, match=r"^op: x is not C-contiguous: pass a contiguous copy"):
        check_array("op", "x", np.zeros((3, 2), np.float32).T, (2, 3), (np.float32,))


def test_without_an_op_or_a_description_the_message_still_says_what_to_do():
    with pytest.raises(Refusal, match=r"^w has shape \(4,\), expected \(5,\): allocate it with that shape$"):
        check_shape("", "w", np.zeros(4, bf16), (5,))
    with pytest.raises(Refusal, match=r"^w has dtype float32, expected bfloat16: convert it first$"):
        check_dtype("", "w", np.zeros(4, np.float32), bf16)


def test_int32_vectors_refuse_other_dtypes_ranks_and_lengths():
    check_int32_vector("op", "idx", np.arange(3, dtype=np.int32), 3)
    with pytest.raises(Refusal, match=r"op: idx must be a contiguous 1-D int32 array \(rows\), got int64 of shape \(3,\)"):
        check_int32_vector("op", "idx", np.arange(3), 3, "rows")
    with pytest.raises(Refusal, match=r"got int32 of shape \(1, 3\)"):
        check_int32_vector("op", "idx", np.zeros((1, 3), np.int32))
    with pytest.raises(Refusal, match=r"^op: idx has 3 entries, expected 4 \(rows\)$"):
        check_int32_vector("op", "idx", np.zeros(3, np.int32), 4, "rows")


class _DeviceLike:
    """What check_aligned reads of a CuPy array: `.data.ptr`."""

    def __init__(self, ptr):
        self.data = type("Mem", (), {"ptr": ptr})()


def test_alignment_is_checked_on_device_addresses_only():
    check_aligned("op", "x", _DeviceLike(0x1000), 16)
    check_aligned("op", "x", np.zeros(3), 16)  # host arrays are never launched
    with pytest.raises(Refusal, match=r"op: x starts at 0x1004, not 16-byte aligned: pass a fresh allocation"):
        check_aligned("op", "x", _DeviceLike(0x1004), 16)


def test_require_and_the_null_pointer():
    require(True, "never")
    with pytest.raises(Refusal, match="^the message$"):
        require(False, "the message")
    assert NULL == 0 and NULL.dtype == np.uint64
    a = object()
    assert ptr_or_null(a) is a and ptr_or_null(None) is NULL


def test_launchers_import_their_checks_from_the_harness_not_from_each_other():
    import ast
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[1] / "kernels_cu").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("kernels_cu"), f"{path.name} imports {node.module}"


def test_a_gate_that_fails_on_purpose_over_a_caught_fault_fails_by_assertion():
    import pytest as _pytest

    class CUDARuntimeError(RuntimeError):
        pass

    fault = CUDARuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
    try:
        try:
            raise fault
        except CUDARuntimeError:
            _pytest.fail("the expert guard fired on valid ids")
    except BaseException as exc:  # noqa: BLE001 - pytest's Failed
        failed = exc
    assert classify_route(failed) is Route.ASSERTION
    try:
        try:
            raise fault
        except CUDARuntimeError:
            raise ValueError("a host copy after the fault")
    except ValueError as exc:
        chained = exc
    assert classify_route(chained) is Route.TRAP  # the fault's, not the copy's
    assert classify_route(fault) is Route.TRAP


def test_guard_must_not_fire_turns_a_fault_into_an_assertion_naming_the_claim():
    import pytest as _pytest

    from harness.core.device import guard_must_not_fire, is_sticky_error

    class CUDARuntimeError(RuntimeError):
        pass

    with _pytest.raises(AssertionError) as info:
        with guard_must_not_fire("in-bounds indices never trip the gather guard"):
            raise CUDARuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
    assert str(info.value).startswith("in-bounds indices never trip the gather guard: the device faulted instead")
    assert "cudaErrorLaunchFailure" in str(info.value)
    assert classify_route(info.value) is Route.ASSERTION
    assert is_sticky_error(info.value)  # chained: the plugin still replaces the poisoned worker
    with _pytest.raises(ValueError, match="not a device error"):  # anything else passes through
        with guard_must_not_fire("claim"):
            raise ValueError("not a device error")
    with guard_must_not_fire("claim"):
        pass


def test_each_launch_is_recorded_for_the_gate_that_made_it():
    # gates.json's kernels_launched: harness.library.kernels' launch wrapper notes "file.cu:name" on the
    # gate being recorded (harness.library.coverage), beside the watchdog's last-launch note
    from harness.library import coverage
    from harness.library.kernels import Launch

    calls = []
    coverage.reset()
    try:
        coverage.begin("gates/test_x.py::test_a")
        Launch(lambda *a, **k: calls.append(a), "k.cu:first")((1,), (32,), ())
        Launch(lambda *a, **k: calls.append(a), "k.cu:second")((1,), (32,), ())
        coverage.begin("gates/test_x.py::test_b")
        Launch(lambda *a, **k: calls.append(a), "k.cu:second")((2,), (64,), ())
        got = {n: sorted(r.kernels) for n, r in coverage.recorded().items() if n}
    finally:
        coverage.reset()
    assert len(calls) == 3, "every launch still reaches the kernel"
    assert got == {"gates/test_x.py::test_a": ["k.cu:first", "k.cu:second"], "gates/test_x.py::test_b": ["k.cu:second"]}
