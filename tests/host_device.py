"""A numpy stand-in for the device in host tests of memory-safety gates: CuPy's copies to the
device become host arrays, so a gate's fenced inputs and guarded outputs (`harness.library.buffers`,
unchanged) are numpy views into one allocation each, and an emulated kernel writes through
the same views."""

import sys
import types

import numpy as np
import pytest


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
    """`harness.library.buffers` as it is, over a CuPy whose device copies are numpy arrays."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(asarray=np.asarray))
