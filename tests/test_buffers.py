"""harness.library.buffers: sentinel fills, the untouched check, and bf16 through its bits on the
way to and from the device. CuPy's calls are played by a small numpy-backed stand-in, so
this runs with no GPU; the GPU gates use the real thing on every run."""

import sys
import types

import numpy as np
import pytest

from harness.library import buffers
from harness.library.bits import BitsMismatch
from harness.library.dtypes import bf16, bits_of


class FakeDeviceArray:
    """The part of a CuPy array the helpers touch: dtype, shape, view, get."""

    def __init__(self, host):
        self._host = np.array(host, copy=True)

    dtype = property(lambda self: self._host.dtype)
    shape = property(lambda self: self._host.shape)

    def view(self, dtype):
        out = FakeDeviceArray.__new__(FakeDeviceArray)
        out._host = self._host.view(dtype)
        out.base_host = getattr(self, "base_host", self._host)
        return out

    def get(self):
        return self._host.copy()

    def __getitem__(self, key):
        out = FakeDeviceArray.__new__(FakeDeviceArray)
        out._host = self._host[key]
        out.base_host = getattr(self, "base_host", self._host)
        return out

    def reshape(self, shape):
        out = self[...]
        out._host = out._host.reshape(shape)
        return out


@pytest.fixture
def fake_cupy(monkeypatch):
    syncs = []
    mod = types.SimpleNamespace(
        asarray=lambda a: FakeDeviceArray(np.ascontiguousarray(a)),
        full=lambda shape, value, dtype: FakeDeviceArray(np.full(shape, value, dtype=dtype)),
        uint16=np.uint16,
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(deviceSynchronize=lambda: syncs.append(1))),
    )
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return syncs


def test_the_sentinel_is_a_bf16_nan_no_kernel_computes():
    value = np.array([buffers.BF16_SENTINEL], np.uint16).view(bf16).astype(np.float32)[0]
    assert np.isnan(value)
    assert buffers.BF16_SENTINEL not in (0x7FC0, 0x7FFF, 0xFFC0, 0xFFFF)  # the canonical NaNs


def test_filled_holds_the_bits_in_every_element(fake_cupy):
    a = buffers.filled((2, 3), bf16, buffers.BF16_SENTINEL)
    assert a.dtype == bf16 and a.shape == (2, 3)
    assert (bits_of(a.get()) == buffers.BF16_SENTINEL).all()
    f = buffers.filled((4,), np.float32, 0x7FC00001)
    assert (f.get().view(np.uint32) == 0x7FC00001).all()


def test_fenced_puts_the_array_between_fences_a_whole_buffer_long(fake_cupy):
    a = np.arange(600, dtype=np.float32).reshape(20, 30)
    d = buffers.fenced(a, 0x7FC00000)
    assert d.dtype == np.float32 and d.shape == (20, 30) and (d.get() == a).all()
    whole = d.base_host.view(np.uint32)
    assert whole.size == 3 * 600  # a buffer length of fence on each side
    assert (whole[:600] == 0x7FC00000).all() and (whole[1200:] == 0x7FC00000).all()
    small = buffers.fenced(np.zeros(3, np.uint8), 0x7F)  # at least min_pad elements each side
    assert small.base_host.size == 3 + 2 * 256 and (small.base_host[:256] == 0x7F).all()
    h = buffers.fenced(np.array([1.0, -2.0], bf16), 0x7FC0)  # bf16 through its bits
    assert h.dtype == bf16 and (bits_of(h.get()) == bits_of(np.array([1.0, -2.0], bf16))).all()


def test_fenced_defaults_to_the_dtypes_quiet_nan_and_asks_for_bits_where_there_is_none(fake_cupy):
    f = buffers.fenced(np.ones(4, np.float32))
    assert (f.base_host.view(np.uint32)[:256] == 0x7FC00000).all()
    b = buffers.fenced(np.ones(4, bf16))
    assert (b.base_host.view(np.uint16)[-256:] == 0x7FC0).all()
    with pytest.raises(TypeError, match="uint8 has no NaN to fence with: pass fill_bits"):
        buffers.fenced(np.zeros(4, np.uint8))
    assert [buffers.nan_bits(d) for d in (bf16, np.float16, np.float32, np.float64)] == \
        [0x7FC0, 0x7E00, 0x7FC00000, 0x7FF8000000000000]


def test_guarded_puts_the_output_between_sentinel_guards_that_name_a_stray_store(fake_cupy):
    view, whole = buffers.guarded((3, 4), bf16, buffers.BF16_SENTINEL, inside_bits=0, guard=16)
    assert view.dtype == bf16 and view.shape == (3, 4) and not bits_of(view.get()).any()
    assert whole.shape == (12 + 2 * 16,) and whole.dtype == np.uint16
    buffers.assert_guards_untouched("out", whole, buffers.BF16_SENTINEL, guard=16)
    whole._host[16 + 12] = 0x3F80  # a store one element past the output
    with pytest.raises(BitsMismatch, match=r"out: the 16 elements past it.*sentinel region was written"):
        buffers.assert_guards_untouched("out", whole, buffers.BF16_SENTINEL, guard=16)
    f, fw = buffers.guarded((5,), np.float32, 0x7FC00001)  # the inside holds the guards' bits by default
    assert (f.get().view(np.uint32) == 0x7FC00001).all() and fw.shape == (5 + 2 * buffers.GUARD,)
    fw._host[buffers.GUARD - 1] = 0
    with pytest.raises(BitsMismatch, match="the 1024 elements before it"):
        buffers.assert_guards_untouched("f", fw, 0x7FC00001)


def test_nan_filled_uses_the_dtypes_quiet_nan_and_refuses_dtypes_without_one(fake_cupy):
    assert (bits_of(buffers.nan_filled((3,), bf16).get()) == 0x7FC0).all()
    assert (buffers.nan_filled((3,), np.float16).get().view(np.uint16) == 0x7E00).all()
    assert (buffers.nan_filled((3,), np.float32).get().view(np.uint32) == 0x7FC00000).all()
    with pytest.raises(TypeError, match="no NaN of int8: use filled"):
        buffers.nan_filled((3,), np.int8)


def test_assert_untouched_passes_on_sentinels_and_names_the_first_written_element():
    a = np.full(6, buffers.BF16_SENTINEL, np.uint16).view(bf16)
    buffers.assert_untouched("tail", a, buffers.BF16_SENTINEL)
    a[4] = np.float32(1.0).astype(bf16)
    with pytest.raises(BitsMismatch, match=r"tail: 1 of 6 elements differ bitwise .*\(a sentinel region was written\)"):
        buffers.assert_untouched("tail", a, buffers.BF16_SENTINEL)


def test_bf16_goes_to_the_device_as_its_bits_and_comes_back_the_same(fake_cupy):
    host = np.array([1.5, -0.0, 3.0e38, np.nan], np.float32).astype(bf16)
    dev = buffers.to_device(host)
    assert dev.dtype == bf16
    raw = buffers.to_device(host, bits=True)
    assert raw.dtype == np.uint16 and (raw.get() == bits_of(host)).all()
    back = buffers.to_host(dev)
    assert back.dtype == bf16 and (bits_of(back) == bits_of(host)).all()  # -0 and the NaN payload kept
    assert (bits_of(buffers.to_host(raw, bf16)) == bits_of(host)).all()
    assert fake_cupy, "to_host waits for the device first, so an earlier fault surfaces there"


def test_other_dtypes_pass_through_and_numpy_is_returned_as_it_is(fake_cupy):
    ints = np.arange(5, dtype=np.int32)
    assert (buffers.to_host(buffers.to_device(ints)) == ints).all()
    assert buffers.to_host(ints) is ints
    as_bf16 = buffers.to_host(bits_of(np.ones(2, bf16)), bf16)
    assert as_bf16.dtype == bf16 and (as_bf16.astype(np.float32) == 1.0).all()


class TestDeviceMemory:
    """`device_memory`: a big-index gate skips, naming the room it needs, where the device has not
    got it, and gives the pool's cached blocks back on leaving (a stand-in device: no GPU here)."""

    @pytest.fixture
    def device(self, monkeypatch):
        from harness.library import buffers

        state = {"free": 8 << 30, "released": 0}
        monkeypatch.setattr(buffers, "_free_bytes", lambda: state["free"])
        monkeypatch.setattr(buffers, "_release_cached", lambda: state.__setitem__("released", state["released"] + 1))
        return state

    def test_room_enough_runs_the_body_and_releases_before_and_after(self, device):
        from harness.library.buffers import device_memory

        ran = []
        with device_memory(5 << 30, "a KV pool past 2^31 bf16 elements"):
            ran.append(device["released"])
        assert ran == [1] and device["released"] == 2

    def test_too_little_room_skips_naming_the_bytes_and_the_purpose(self, device):
        from harness.library.buffers import device_memory

        device["free"] = 3 << 30
        with pytest.raises(pytest.skip.Exception, match=r"needs 5\.0 GiB of device memory for a KV pool past 2\^31 "
                                                        r"bf16 elements; 3\.0 GiB free on this device"):
            with device_memory(5 << 30, "a KV pool past 2^31 bf16 elements"):
                raise AssertionError("the body must not run")

    def test_a_failing_body_still_releases_and_its_error_is_the_gate_s(self, device):
        from harness.library.buffers import device_memory

        with pytest.raises(AssertionError, match="the kernel's"):
            with device_memory(1 << 30, "weights"):
                raise AssertionError("the kernel's")
        assert device["released"] == 2

    def test_no_bytes_is_a_usage_mistake(self):
        from harness.library.buffers import device_memory

        with pytest.raises(ValueError, match="nbytes is 0"):
            device_memory(0, "nothing")
