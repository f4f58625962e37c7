"""harness.library.redzones with no GPU: the layout and the poison, the check's bookkeeping and its
failure text (line by line), the buffers nothing refers to let go, the opt-outs, the setting
that turns them off for a run and the plugin's end-of-gate read. A stand-in device
(tests/redzone_standin.py) holds the memory in numpy arrays and checks the guards by address
as the kernel does; the kernel itself is compiled here with NVRTC, and run on a GPU by
tests/test_redzones_gpu.py."""

from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from harness.core.child import ChildPytest
from harness.core.errors import CheckFailed
from harness.core.settings import in_effect
from harness.library import buffers, redzones
from harness.library.bits import BitsMismatch
from harness.library.dtypes import bf16
from harness.library.redzones import (ALIGN, GUARD_RECORD, REDZONE_BYTES, ROW_CAP, Layout, RedzoneWritten,
                                      Redzones, guard_bytes, pattern_bits)
from tests._machine import use_child_env
from tests.redzone_standin import StandInDevice, plant

F32_ZEROS = np.zeros(8, np.uint32)


@pytest.fixture(autouse=True)
def redzones_on(settings_in_effect):
    """Redzones are opt-in (--redzones) until proven on a GPU: these tests run with them on."""
    settings_in_effect(replace(in_effect(), redzones=True))


@pytest.fixture
def zones(monkeypatch):
    """This process's redzones on the stand-in device, as device 0 (undone after the test)."""
    found = Redzones(StandInDevice())
    monkeypatch.setitem(redzones._registries, 0, found)
    monkeypatch.setattr(redzones, "registry", lambda: found)
    return found


def y8(zones, label="y"):
    return zones.allocate(8, np.float32, guard=REDZONE_BYTES, name=label, what="float32 (8,)", contents=F32_ZEROS)


def message(excinfo) -> list[str]:
    return str(excinfo.value).splitlines()


# ------------------------------------------------------------------ layout and poison


def test_a_guard_is_at_least_4_kib_and_a_row_up_to_the_cap_in_multiples_of_256():
    assert guard_bytes((1000,), np.float32) == REDZONE_BYTES  # a 1-D buffer: the least guard
    assert guard_bytes((4, 3000), np.float32) == 12032  # one row of 12000 bytes, rounded up to 256
    assert guard_bytes((2, 1 << 20), np.float32) == ROW_CAP  # a row of 4 MiB: the cap
    assert guard_bytes((8,), np.uint8, minimum=5000) == 5120  # a caller's least, rounded up
    assert guard_bytes(7, bf16) == REDZONE_BYTES


@pytest.mark.parametrize("nbytes", [0, 1, 6, 32, 255, 256, 4097])
def test_the_view_starts_256_aligned_and_the_allocation_ends_on_a_multiple_of_256(nbytes):
    lay = Layout.of(nbytes, 4096)
    assert lay.before == 4096 and lay.before % ALIGN == 0  # the view's offset keeps the allocation's alignment
    assert lay.total % ALIGN == 0 and lay.after >= 4096 and lay.after - 4096 < ALIGN
    assert lay.total == lay.before + nbytes + lay.after
    with pytest.raises(ValueError, match="give a positive multiple of 256"):
        Layout.of(nbytes, 100)


@pytest.mark.parametrize("dtype,quiet_bit", [(bf16, 1 << 6), (np.float16, 1 << 9), (np.float32, 1 << 22),
                                             (np.float64, 1 << 51)], ids=["bf16", "f16", "f32", "f64"])
def test_the_pattern_of_a_float_type_is_a_signalling_nan(dtype, quiet_bit):
    bits = pattern_bits(dtype)
    value = np.array([bits], np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")).view(dtype)
    with np.errstate(invalid="ignore"):  # a signalling NaN cast: the point of it
        assert np.isnan(value.astype(np.float64)[0]) and not bits & quiet_bit
    assert bits not in (buffers.nan_bits(dtype), buffers.BF16_SENTINEL)  # not the harness's own fills


def test_the_pattern_of_a_byte_is_a_nan_in_both_fp8_types_and_integers_share_their_sizes_bits():
    assert pattern_bits(np.uint8) == 0x7F
    for fp8 in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        assert np.isnan(np.array([0x7F], np.uint8).view(fp8).astype(np.float32)[0])
    assert [pattern_bits(d) for d in (np.uint16, np.int32, np.int64)] == \
        [pattern_bits(bf16), pattern_bits(np.float32), pattern_bits(np.float64)]
    with pytest.raises(TypeError, match="no redzone pattern for complex128 .* pass redzone=False"):
        pattern_bits(np.complex128)


def test_the_guard_record_is_the_kernels_struct():
    assert GUARD_RECORD.itemsize == 32  # three 8-byte fields, two 4-byte ones: struct Guard
    source = redzones.CHECK_SOURCE.read_text()
    body = source.split("struct Guard {")[1].split("};")[0]
    fields = [line.split("//")[0].split()[-1].rstrip(";") for line in body.splitlines() if ";" in line]
    assert tuple(fields) == GUARD_RECORD.names


def test_the_check_kernel_compiles_with_nvrtc(tmp_path, settings_in_effect):
    settings_in_effect(replace(in_effect(), cache_dir=tmp_path, arch=None))
    compiled = redzones.compile_check()
    assert compiled.backend == "nvrtc" and compiled.cubin
    assert [r.kernel for r in compiled.resources] == [redzones.CHECK_KERNEL]
    assert not any(r.spill_stores or r.stack_bytes for r in compiled.resources)


# ------------------------------------------------------------------ allocating


def test_a_buffer_lies_between_guards_of_its_pattern_in_an_allocation_of_its_own(zones):
    view = zones.allocate(3, bf16, guard=REDZONE_BYTES, name="x", what="bfloat16 (3,)",
                          contents=np.array([1, 2, 3], np.uint16))
    (a,) = zones.allocations.values()
    whole = a.ref()
    assert view.base is whole and view.dtype == np.uint16 and list(view) == [1, 2, 3]
    assert a.layout == Layout(4096, 6, 4346) and a.address == whole.__array_interface__["data"][0]
    assert (whole[:2048] == 0x7F8D).all() and (whole[2051:] == 0x7F8D).all()
    filled = zones.allocate(4, np.float32, guard=REDZONE_BYTES, name="f", what="float32 (4,)", fill_bits=0x7FC00000)
    assert (filled == 0x7FC00000).all() and (filled.base[:1024] == pattern_bits(np.float32)).all()


def test_each_buffer_helper_hands_out_a_view_between_redzones(zones):
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    dev = buffers.to_device(host, label="x")
    assert dev.dtype == np.float32 and dev.shape == (2, 3) and (dev == host).all()
    raw = buffers.to_device(host.astype(bf16), bits=True)
    assert raw.dtype == np.uint16
    out = buffers.filled((2, 3), bf16, buffers.BF16_SENTINEL)
    nan = buffers.nan_filled((5,), np.float32)
    fenced = buffers.fenced(host, 0x7FC00000)
    view, whole = buffers.guarded((4,), np.float32, 0x7FA00000, guard=16)
    assert whole.size == 4 + 2 * 16 and (whole[:16] == 0x7FA00000).all()  # the gate's own guards, inside
    made = list(zones.allocations.values())
    names = [a.name for a in made]
    assert names[0] == "x"
    assert names[1].startswith("to_device at tests/test_redzones.py:") and names[1].endswith(
        "in test_each_buffer_helper_hands_out_a_view_between_redzones")
    assert [n.split(" at ")[0] for n in names[2:]] == ["filled", "filled", "fenced", "guarded"]
    assert [a.what for a in made] == ["float32 (2, 3)", "bfloat16 (2, 3)", "bfloat16 (2, 3)",
                                                   "float32 (5,)", "float32 (2, 3)", "float32 (4,)"]
    for a, v in zip(made, (dev, raw, out, nan, fenced, whole)):
        assert v.base is a.ref()  # a view into its own guarded allocation


def test_redzone_false_or_a_run_with_none_leaves_the_helpers_as_they_were(zones, settings_in_effect, monkeypatch):
    calls = []
    import cupy

    monkeypatch.setattr(cupy, "asarray", lambda a: calls.append(a) or np.asarray(a))
    buffers.to_device(np.ones(3, np.float32), redzone=False)
    assert calls and not zones.allocations
    settings_in_effect(replace(in_effect(), redzones=False))
    assert redzones.allocate(3, np.float32, shape=(3,), helper="to_device") is None
    buffers.to_device(np.ones(3, np.float32))
    assert len(calls) == 2 and not zones.allocations


def test_a_stand_in_cupy_whose_arrays_are_host_arrays_gets_no_registry(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(asarray=np.asarray, cuda=None))
    assert redzones.registry() is None


# ------------------------------------------------------------------ the check and its message


def test_a_store_one_past_a_buffer_is_named_with_its_offset_bytes_and_kernel(zones):
    y = y8(zones)
    redzones.after_launch("planted.cu:clean", device=0)
    plant(y, 32, np.float32(2.0).tobytes())  # y[8] = 2.0f
    redzones.after_launch("planted.cu:one_past", device=0)
    with pytest.raises(RedzoneWritten) as info:
        redzones.check_redzones()
    assert message(info) == [
        "redzone written: y (float32 (8,), 32 bytes), after its end",
        "  nearest changed byte: +0 past its end, in element [8] (its last is [7])",
        "  changed: 4 of the 4320 guard bytes after it, +0 to +3",
        "  first changed guard bytes, +0 to +15: 00 00 00 40 8d 8d 8d 7f 8d 8d 8d 7f 8d 8d 8d 7f  "
        "(the pattern: 8d 8d 8d 7f)",
        "  kernel launched last: planted.cu:one_past",
        "  read at: check_redzones()",
        redzones.OPT_OUT,
    ]
    assert isinstance(info.value, BitsMismatch) and isinstance(info.value, CheckFailed)
    assert isinstance(info.value, AssertionError)
    assert (y.base[1032:] == pattern_bits(np.float32)).all(), "the guard is filled again"
    redzones.check_redzones()  # and the next read finds nothing


def test_a_store_before_a_buffer_is_named_from_its_start(zones):
    y = y8(zones)
    plant(y, -6, b"\x00\x00")  # two bytes, 6 and 5 before the first element
    redzones.after_launch("planted.cu:minus_two", device=0)
    with pytest.raises(RedzoneWritten) as info:
        redzones.check_redzones("to_host")
    assert message(info)[:6] == [
        "redzone written: y (float32 (8,), 32 bytes), before its start",
        "  nearest changed byte: -5 before its start, in element [-2] (its first is [0])",
        "  changed: 2 of the 4096 guard bytes before it, -5 to -6",
        "  first changed guard bytes, -20 to -5: 8d 8d 8d 7f 8d 8d 8d 7f 8d 8d 8d 7f 8d 8d 00 00  "
        "(the pattern: 8d 8d 8d 7f)",
        "  kernel launched last: planted.cu:minus_two",
        "  read at: to_host",
    ]


def test_a_store_one_past_a_buffer_that_ends_inside_a_word_is_seen(zones):
    x = zones.allocate(3, bf16, guard=REDZONE_BYTES, name="x", what="bfloat16 (3,)", contents=np.zeros(3, np.uint16))
    plant(x, 6, b"\x80\x3f")  # x[3] = 1.0, at a byte that is not 8-aligned
    plant(x, 4, b"\x11\x11")  # x[2] itself: the view's own bytes in the guard's first word
    redzones.after_launch("k", device=0)
    with pytest.raises(RedzoneWritten) as info:
        redzones.check_redzones()
    assert message(info)[1:3] == ["  nearest changed byte: +0 past its end, in element [3] (its last is [2])",
                                  "  changed: 2 of the 4346 guard bytes after it, +0 to +1"]


def test_the_first_check_that_saw_a_write_names_the_kernel_and_every_written_buffer_is_listed(zones):
    a, b = y8(zones, "a"), y8(zones, "b")
    redzones.after_launch("first", device=0)
    plant(b, 40, b"\x01")
    redzones.after_launch("second", device=0)
    plant(a, 32, b"\x01")
    plant(b, 32, b"\x01")  # nearer b's end, but seen one check later than its store at +8
    redzones.after_launch("third", device=0)
    with pytest.raises(RedzoneWritten) as info:
        redzones.check_redzones()
    text = message(info)
    assert [line for line in text if line.startswith("redzone written")] == [
        "redzone written: a (float32 (8,), 32 bytes), after its end",
        "redzone written: b (float32 (8,), 32 bytes), after its end"]
    assert [line for line in text if "kernel launched last" in line] == ["  kernel launched last: third",
                                                                          "  kernel launched last: second"]
    assert "  nearest changed byte: +8 past its end, in element [10] (its last is [7])" in text


def test_a_write_no_harness_launch_came_before_says_so_and_names_the_last_that_did(zones):
    y = y8(zones)
    redzones.after_launch("demo.cu:scale", device=0)
    plant(y, 33, b"\x01")  # by torch, a CuPy kernel or a copy: no harness launch after it
    with pytest.raises(RedzoneWritten) as info:
        redzones.check_redzones("the end of the gate")
    assert message(info)[4:6] == [
        "  kernel launched last: none through the harness since the check before (a kernel launched otherwise, "
        "torch or CuPy, or a copy, wrote it); the last launched through it: demo.cu:scale",
        "  read at: the end of the gate"]


def test_no_check_is_queued_on_a_stream_being_captured(zones):
    y = y8(zones)
    zones.device.capturing = True
    redzones.after_launch("captured", device=0)
    redzones.check_redzones()  # nothing can wait inside a capture: the read waits for the replay's
    assert zones.device.checks == 0 and zones.device.syncs == 0
    zones.device.capturing = False
    redzones.after_launch("replayed", device=0)
    assert zones.device.checks == 1 and y is not None


def test_a_run_or_gate_with_no_redzones_queues_no_check(zones, settings_in_effect):
    y = y8(zones)
    settings_in_effect(replace(in_effect(), redzones=False))
    plant(y, 32, b"\x01")
    redzones.after_launch("k", device=0)
    redzones.check_redzones()
    assert zones.device.checks == 0
    redzones.rearm()  # a gate with none ended: its writes are forgotten, the guards filled again
    assert (y.base[1032:] == pattern_bits(np.float32)).all()


def test_nothing_is_queued_where_no_buffer_is_guarded(zones):
    redzones.after_launch("k", device=0)
    redzones.check_redzones()
    assert zones.device.checks == zones.device.syncs == 0


# ------------------------------------------------------------------ lifetime


def test_a_buffer_is_let_go_when_its_last_view_dies_and_the_registry_holds_nothing_after_the_last(zones):
    y = y8(zones)
    part = y[2:4].view(np.uint8)  # a view of the view: it refers to the allocation too
    redzones.check_redzones()
    del y
    assert len(zones.allocations) == 1
    del part
    assert zones.allocations == {} and zones._results is None  # no device memory held for no buffer
    assert zones.device.waits == 0  # nothing since the read point: nothing to wait for or read


def test_a_write_into_a_buffer_that_dies_before_the_read_is_named_with_its_bytes(zones):
    y = y8(zones)
    keep = y8(zones, "kept")
    plant(y, 32, np.float32(2.0).tobytes())
    redzones.after_launch("planted.cu:one_past", device=0)
    del y  # its guards are read as it dies, after every check in flight
    assert zones.device.waits == 1 and len(zones.allocations) == 1
    again = y8(zones, "reuses its index")
    redzones.after_launch("clean.cu:k", device=0)
    with pytest.raises(RedzoneWritten) as info:
        redzones.check_redzones()
    text = message(info)
    assert text[:5] == [
        "redzone written: y (float32 (8,), 32 bytes), after its end",
        "  nearest changed byte: +0 past its end, in element [8] (its last is [7])",
        "  changed: 4 of the 4320 guard bytes after it, +0 to +3",
        "  first changed guard bytes, +0 to +15: 00 00 00 40 8d 8d 8d 7f 8d 8d 8d 7f 8d 8d 8d 7f  "
        "(the pattern: 8d 8d 8d 7f)",
        "  kernel launched last: planted.cu:one_past"]
    assert [line for line in text if line.startswith("redzone written")] == [text[0]]
    assert keep is not None and again is not None


def test_a_buffer_that_dies_inside_the_registrys_own_work_is_let_go_after_it(zones):
    y = y8(zones)
    with zones._working():
        del y
        assert len(zones.allocations) == 1  # not under a table being built from it
    assert zones.allocations == {}


def test_a_write_found_when_the_slots_run_out_is_raised_at_that_allocation(zones, monkeypatch):
    monkeypatch.setattr(redzones, "FIRST_CAPACITY", 2)
    a, b = y8(zones, "a"), y8(zones, "b")
    plant(b, 32, b"\x01")
    redzones.after_launch("k", device=0)
    with pytest.raises(RedzoneWritten, match=r"(?s)redzone written: b .*read at: a new buffer's allocation"):
        y8(zones)
    assert a is not None


def test_the_result_slots_grow_after_a_read(zones, monkeypatch):
    monkeypatch.setattr(redzones, "FIRST_CAPACITY", 2)
    kept = [y8(zones, f"b{i}") for i in range(5)]
    assert zones._capacity == 8 and len(zones._results) == 16 and zones.device.syncs == 2
    plant(kept[4], 32, b"\x01")
    redzones.after_launch("k", device=0)
    with pytest.raises(RedzoneWritten, match="redzone written: b4"):
        redzones.check_redzones()


# ------------------------------------------------------------------ the setting and the plugin


def test_redzones_reach_a_child_as_its_option():
    assert "--redzones" in ChildPytest.over(["g"], replace(in_effect(), redzones=True)).args()
    assert "--redzones" not in ChildPytest.over(["g"], replace(in_effect(), redzones=False)).args()


class _Marked:
    nodeid = "gates/test_x.py::test_tile"

    def __init__(self, **markers):
        self.markers = markers

    def get_closest_marker(self, name):
        return self.markers.get(name)


def test_a_gate_policy_is_off_with_a_reason_or_for_a_trap_gate_and_a_marker_needs_its_reason():
    from harness.plugin.redzones import TRAP_REASON, Policy, policy_of

    assert policy_of(_Marked()) == Policy(True)
    assert policy_of(_Marked(no_redzones=pytest.mark.no_redzones(reason="a tile past").mark)) == \
        Policy(False, "a tile past")
    assert policy_of(_Marked(trap=pytest.mark.trap.mark)) == Policy(False, TRAP_REASON)
    with pytest.raises(pytest.UsageError, match=r"gates/test_x.py::test_tile: @pytest.mark.no_redzones needs a "
                                                r"reason: write e\.g\. @pytest.mark.no_redzones\(reason="):
        policy_of(_Marked(no_redzones=pytest.mark.no_redzones.mark))


CHILD_CONFTEST = """
import sys
pytest_plugins = [] if "harness.plugin" in sys.modules else ["harness.plugin"]

from harness.library import redzones
from redzone_standin import StandInDevice

_zones = redzones.Redzones(StandInDevice())
redzones._registries[0] = _zones
redzones.registry = lambda: _zones
"""

CHILD_GATES = """
import numpy as np
import pytest
from harness.library import redzones
from redzone_standin import plant


def make(label):
    return redzones.allocate(8, np.float32, shape=(8,), helper="make", label=label, contents=np.zeros(8, np.uint32))


@pytest.fixture(scope="module")
def shared():
    return make("shared")


@pytest.mark.anchor
def test_a_store_one_past(shared):
    y = make("y")
    plant(y, 32, b"\\x00\\x00\\x00\\x40")
    redzones.after_launch("planted.cu:one_past", device=0)


@pytest.mark.anchor
@pytest.mark.no_redzones(reason="stores a tile past its view on purpose")
def test_with_no_redzones(shared):
    assert make("unguarded") is None
    plant(shared, 32, b"\\x01")
    redzones.after_launch("tiled.cu:past", device=0)


@pytest.mark.anchor
def test_after_it(shared):
    redzones.after_launch("clean.cu:k", device=0)


@pytest.mark.anchor
def test_failing_and_writing(shared):
    plant(shared, -1, b"\\x01")
    redzones.after_launch("planted.cu:minus_one", device=0)
    assert 1 == 2, "the gate's own assertion"


class CUDARuntimeError(RuntimeError):
    pass


@pytest.mark.anchor
def test_expecting_a_fault(shared):
    fault = CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    redzones._registries[0].device.fault = fault  # the context faulted, as the gate meant it to
    redzones.after_launch("faulting.cu:k", device=0)
"""


def test_the_end_of_each_gate_reads_its_guards_and_a_gate_with_none_blames_no_later_one(pytester, monkeypatch):
    """In a child pytest over the stand-in device: a store one past fails its gate at the end of
    the call; a gate marked no_redzones writes past a shared buffer and passes, and the next
    gate is not blamed; a gate that fails and wrote gets both, the write caused by its failure;
    a gate whose context faulted, as it meant to, passes."""
    use_child_env(monkeypatch)
    pytester.makeini("[pytest]\nkernel_root = .\nharness_lanes = 1\n")
    pytester.makeconftest(CHILD_CONFTEST)
    pytester.makepyfile(redzone_standin=(Path(__file__).parent / "redzone_standin.py").read_text())
    pytester.makepyfile(test_gates=CHILD_GATES)
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-rA", "--redzones")
    result.assert_outcomes(passed=3, failed=2)
    out = result.stdout.str()
    assert "PASSED test_gates.py::test_with_no_redzones" in out and "PASSED test_gates.py::test_after_it" in out
    assert "PASSED test_gates.py::test_expecting_a_fault" in out  # a device error the read meets is the gate's
    result.stdout.fnmatch_lines([
        "*RedzoneWritten: redzone written: y (float32 (8,), 32 bytes), after its end",
        "*kernel launched last: planted.cu:one_past",
        "*read at: the end of the gate",
    ])
    result.stdout.fnmatch_lines([
        "*AssertionError: the gate's own assertion*",
        "*The above exception was the direct cause of the following exception*",
        "*RedzoneWritten: redzone written: shared (float32 (8,), 32 bytes), before its start",
    ])
    # the run's line: the gates with them (the module's shared buffer counted in the first's
    # setup, y in its call), a check after each launch, and the gate without them and why
    result.stdout.fnmatch_lines([
        "redzones: 4 gate(s) ran with them: 2 buffer(s) guarded, 4 check(s) after launches; a written guard "
        "fails its gate; without them: 1 (stores a tile past its view on purpose)"])
