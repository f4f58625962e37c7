"""`--compare-timing`: each kernel launch of a gate counted, repeated between CUDA events on
the same inputs, and put back as the gate expects it; the two sides' times compared. CuPy's
streams, events and copies are played by a numpy-backed stand-in (a launch "takes" a set
time on a fake clock), so this runs with no GPU."""

import sys
import types

import numpy as np
import pytest

from harness.library import kernels, timing
from harness.plugin.compare.arms import GateComparison, compare_timing
from harness.plugin.compare.report import nothing_compared, table


class Clock:
    now = 0.0


class FakeEvent:
    def record(self, stream=None):
        self.t = Clock.now


class FakeStream:
    capturing = False

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_cupy(monkeypatch):
    stream = FakeStream()
    cuda = types.SimpleNamespace(Event=FakeEvent, get_current_stream=lambda: stream,
                                 get_elapsed_time=lambda a, b: b.t - a.t)
    mod = types.SimpleNamespace(ndarray=np.ndarray, copyto=np.copyto, cuda=cuda, uint8=np.uint8, uint16=np.uint16,
                                uint32=np.uint32, uint64=np.uint64)
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setattr(kernels, "note_launch", lambda name: None)
    yield stream
    timing.end()


class Accumulate:
    """y += x, taking `ms` on the fake clock: a kernel whose output depends on how often it ran."""

    def __init__(self, ms):
        self.ms, self.calls = ms, 0

    def __call__(self, grid, block, args, *rest, **kwargs):
        y, x = args
        y += x
        self.calls += 1
        Clock.now += self.ms


def test_a_timed_launch_leaves_the_gate_its_inputs_as_they_were(fake_cupy):
    fn = Accumulate(2.0)
    launch = kernels.Launch(fn, "acc.cu:acc")
    y, x = np.zeros(4, np.float32), np.arange(4, dtype=np.float32)
    timing.begin(repeat=7, warmup=3)
    launch((1, 1, 1), (32, 1, 1), (y, x))
    got = timing.end()
    assert y.tolist() == x.tolist(), "the gate's own launch saw an output the timing launches had written"
    assert fn.calls == 3 + 7 + 1  # warm-up, timed, the gate's own
    assert got["launches"] == {"acc.cu:acc": 1}
    assert got["timed"]["acc.cu:acc#0"] == {"grid": [1, 1, 1], "block": [32, 1, 1], "ms": [2.0] * 7}


def test_launches_past_the_cap_are_counted_and_a_graph_capture_is_not_timed(fake_cupy):
    fn = Accumulate(1.0)
    launch = kernels.Launch(fn, "acc.cu:acc")
    y, x = np.zeros(2, np.float32), np.ones(2, np.float32)
    timing.begin(repeat=2, warmup=1)
    for _ in range(timing.MAX_TIMED + 3):
        launch(1, 32, (y, x))
    fake_cupy.capturing = True
    other = kernels.Launch(Accumulate(1.0), "acc.cu:other")
    other(1, 32, (y, x))
    got = timing.end()
    assert got["launches"] == {"acc.cu:acc": timing.MAX_TIMED + 3, "acc.cu:other": 1}
    assert sorted(got["timed"]) == sorted(f"acc.cu:acc#{i}" for i in range(timing.MAX_TIMED))
    assert got["notes"] == ["acc.cu:other#0: launched during a graph capture, not timed"]
    assert y.tolist() == [timing.MAX_TIMED + 4] * 2  # each launch of the gate counted once


def test_nothing_is_counted_or_timed_unless_armed(fake_cupy):
    fn = Accumulate(1.0)
    kernels.Launch(fn, "acc.cu:acc")(1, 32, (np.zeros(1), np.ones(1)))
    assert fn.calls == 1 and timing.end() == {"launches": {}, "timed": {}, "notes": []}


def times(*ms_lists):
    return {f"k.cu:k#{i}": {"ms": list(ms)} for i, ms in enumerate(ms_lists)}


def test_faster_slower_and_within_the_spread():
    slow, fast = [0.010, 0.011, 0.010, 0.012, 0.010], [0.004, 0.005, 0.004, 0.004, 0.006]
    (t,), notes = compare_timing(times(slow, slow), times(fast, fast))
    assert t.speed == "faster" and t.launches == 2 and t.repeat == 5 and notes == []
    assert t.ref_us == pytest.approx(20.0) and t.today_us == pytest.approx(8.0) and t.ratio == pytest.approx(2.5)
    (t,), _ = compare_timing(times(fast), times(slow))
    assert t.speed == "slower"
    (t,), _ = compare_timing(times([0.010, 0.011, 0.012, 0.013]), times([0.0105, 0.0115, 0.0125, 0.0135]))
    assert t.speed == "same speed"  # the middle halves overlap
    _, notes = compare_timing(times(slow, slow), times(fast))
    assert notes == ["k.cu:k#1: timed in REF only"]


def test_the_table_says_faster_same_bits_and_what_a_gate_without_arms_should_do():
    gate = GateComparison("g.py::t", "passed", "passed")
    gate.timing, _ = compare_timing(times([0.010] * 4), times([0.004] * 4))
    gate.launches = {"ref": {"k.cu:k": 1}, "today": {"k.cu:k": 1}}
    lines = table("main", [gate])
    assert "timing: 1 kernel(s) in 1 gate(s): 1 faster, 0 slower, 0 same speed" in lines
    assert any(line.startswith("  time k.cu:k: REF 10.00 us, today 4.00 us") and line.endswith("2.50x, faster, same bits")
               for line in lines), lines
    assert "record one with harness.record(label, array)" in nothing_compared(gate)
    assert "no kernel launched on either side" in nothing_compared(GateComparison("g.py::h", "passed", "passed"))
    trap = GateComparison("g.py::t", "passed", "passed", kind="trap")
    trap.launches = gate.launches
    assert nothing_compared(trap) == "no arm output: trap gates give their verdict by a fault or a refusal, not by a value"
    skipped = GateComparison("g.py::s", "skipped", "skipped")
    assert nothing_compared(skipped) == "no arm output: skipped on both sides"
    assert table("main", [skipped, skipped])[-1] == "2 gate(s) with no arm output: skipped on both sides: g.py::s, g.py::s"


def test_an_arms_status_and_a_kernels_speed_are_enums_that_compare_json_writes_as_their_words(tmp_path):
    import json

    from harness.plugin.compare.arms import ArmStatus, Speed, compare_sides
    from harness.plugin.compare.report import write_reports

    ref = {"same": np.ones(3, np.float32), "moved": np.ones(3, np.float32), "shape": np.ones(3), "gone": np.ones(1)}
    now = {"same": np.ones(3, np.float32), "moved": np.zeros(3, np.float32), "shape": np.ones(4), "new": np.ones(1)}
    gate = compare_sides("g.py::t", ref, now, "passed", "passed")
    gate.timing, _ = compare_timing(times([0.010] * 4), times([0.004] * 4))
    assert [a.status for a in gate.arms] == [ArmStatus.SAME_BITS, ArmStatus.DIFFERS, ArmStatus.NOT_COMPARABLE,
                                             ArmStatus.ONLY_IN_REF, ArmStatus.ONLY_TODAY]
    assert gate.timing[0].speed is Speed.FASTER
    json_path, _ = write_reports(tmp_path, "main", [gate])
    written = json.loads(json_path.read_text())["gates"][0]
    assert [a["status"] for a in written["arms"]] == ["same bits", "differs", "not comparable", "only in REF",
                                                      "only today"]
    assert written["timing"][0]["speed"] == "faster"
