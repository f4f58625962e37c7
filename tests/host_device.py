"""A numpy stand-in for the device in host tests of memory-safety gates: `harness.buffers`'
device copies become host arrays, so a gate's fenced inputs and guarded outputs are numpy
views into one allocation each, and an emulated kernel writes through the same views."""

import numpy as np
import pytest

from harness import buffers


def host_fenced(a, fill_bits, *, min_pad=256):
    """`harness.buffers.fenced` on the host."""
    a = np.ascontiguousarray(a)
    u = np.dtype(f"uint{8 * a.dtype.itemsize}")
    pad = max(a.size, min_pad)
    whole = np.concatenate([np.full(pad, fill_bits, u), a.reshape(-1).view(u), np.full(pad, fill_bits, u)])
    return whole[pad:pad + a.size].view(a.dtype).reshape(a.shape)


def whole_of(view):
    """(the 1-D allocation a host view lies in, as unsigned ints; where the view starts)."""
    flat = view.reshape(-1)
    base = flat
    while getattr(base, "base", None) is not None:
        base = base.base
    start = (flat.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // flat.itemsize
    return base.view(np.dtype(f"uint{8 * flat.itemsize}")), start


def below(view) -> int:
    """The raw bits of the element just before a view."""
    whole, start = whole_of(view)
    return int(whole[start - 1])


def store_past(view, bits=None) -> None:
    """A stray store into the element just past a view (its last element's bits by default)."""
    whole, start = whole_of(view)
    end = start + view.size
    whole[end] = whole[end - 1] if bits is None else bits


def store_before(view, bits=0) -> None:
    whole, start = whole_of(view)
    whole[start - 1] = bits


@pytest.fixture
def host_buffers(monkeypatch):
    monkeypatch.setattr(buffers, "fenced", host_fenced)
    monkeypatch.setattr(buffers, "to_device", lambda a, bits=False: np.array(a))
