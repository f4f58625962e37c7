"""Comparisons whose failure messages a person can act on.

`assert_bits_eq` compares raw bits: +0 and -0 differ, NaN payloads differ. Messages are
built as lists of lines: what was compared, how many elements differ, the first
difference with its flat and multi-dimensional index, both values as hex bits and as
numbers of the declared dtype, then a short aligned table. Whole arrays are never printed.
"""

from __future__ import annotations

import numpy as np

from harness.core.errors import CheckFailed
from harness.library import arms, coverage
from harness.library.dtypes import _host, as_dtype, bits_of

TABLE_ROWS = 8


class BitsMismatch(CheckFailed):
    """Two arrays differ bitwise (or in shape or item size)."""


class NotClose(CheckFailed):
    """Two arrays differ by more than an anchor's stated tolerance."""


def _value_text(bits_value, dtype: np.dtype) -> str:
    v = np.asarray(bits_value).view(dtype).reshape(())
    if dtype.kind in "iub":
        return str(int(v))
    with np.errstate(invalid="ignore"):  # NaN payloads cast quietly
        return repr(float(v.astype(np.float64)))


def _hex(bits_value, itemsize: int) -> str:
    return f"0x{int(bits_value):0{itemsize * 2}x}"


def _index(flat: int, shape) -> str:
    if len(shape) <= 1:
        return f"[{flat}]"
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(flat, shape)) + "]"


def _check_shapes(label: str, got: np.ndarray, expected: np.ndarray, exc) -> None:
    if got.shape != expected.shape:
        raise exc(f"{label}: shapes differ: got {got.shape}, expected {expected.shape}")
    if got.dtype.itemsize != expected.dtype.itemsize:
        raise exc(
            f"{label}: item sizes differ: got {got.dtype} ({got.dtype.itemsize} bytes), expected "
            f"{expected.dtype} ({expected.dtype.itemsize} bytes); compare arrays of one dtype "
            "(cast or .view() one side first)"
        )


def bits_mismatch_lines(label: str, got, expected, dtype=None) -> list[str] | None:
    """The message lines, or None when the bits agree."""
    got, expected = _host(got, f"{label}: got"), _host(expected, f"{label}: expected")
    _check_shapes(label, got, expected, BitsMismatch)
    dtype = as_dtype(dtype) if dtype is not None else expected.dtype
    if dtype.itemsize != expected.dtype.itemsize:
        raise ValueError(f"{label}: dtype {dtype} does not have the arrays' item size {expected.dtype.itemsize}")
    gb = np.ascontiguousarray(bits_of(got)).reshape(-1)
    eb = np.ascontiguousarray(bits_of(expected)).reshape(-1)
    diff = np.flatnonzero(gb != eb)
    if diff.size == 0:
        return None
    size = dtype.itemsize
    first = int(diff[0])
    lines = [
        f"{label}: {diff.size} of {gb.size} elements differ bitwise ({dtype})",
        f"first difference at flat index {first}, index {_index(first, expected.shape)}:",
        f"  got      {_hex(gb[first], size)}  {_value_text(gb[first], dtype)}",
        f"  expected {_hex(eb[first], size)}  {_value_text(eb[first], dtype)}",
    ]
    rows = [("flat", "index", "got", "value", "expected", "value")]
    for i in diff[:TABLE_ROWS]:
        i = int(i)
        rows.append(
            (str(i), _index(i, expected.shape), _hex(gb[i], size), _value_text(gb[i], dtype),
             _hex(eb[i], size), _value_text(eb[i], dtype))
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines.append(f"first {min(diff.size, TABLE_ROWS)} differences:")
    for r in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    if diff.size > TABLE_ROWS:
        lines.append(f"  ... and {diff.size - TABLE_ROWS} more")
    return lines


def assert_bits_eq(label: str, got, expected, *, dtype=None) -> None:
    """Raise `BitsMismatch` unless `got` and `expected` have the same shape, item size
    and bits. `dtype` names how values are shown (default: `expected`'s dtype). `got` is an
    arm output of the running gate (`harness.library.arms`)."""
    arms.note(label, got)
    coverage.note_compared(f"{label}: bitwise")
    lines = bits_mismatch_lines(label, got, expected, dtype)
    if lines:
        raise BitsMismatch("\n".join(lines))


def rel_rms(got, expected) -> float:
    """sqrt(sum((got - expected)^2) / sum(expected^2)), in float64."""
    g = _host(got, "rel_rms: got", values=True).astype(np.float64)
    e = _host(expected, "rel_rms: expected", values=True).astype(np.float64)
    if g.shape != e.shape:
        raise ValueError(f"rel_rms: shapes differ: got {g.shape}, expected {e.shape}")
    return float(np.sqrt(np.sum((g - e) ** 2) / max(float(np.sum(e * e)), 1e-30)))


def assert_close(label: str, got, expected, *, atol: float, rtol: float) -> None:
    """|got - expected| <= atol + rtol * |expected| everywhere (NaN never close).
    Anchors only, with the reason for the tolerance written beside the call. `got` is an arm
    output of the running gate (`harness.library.arms`)."""
    arms.note(label, got)
    coverage.note_compared(f"{label}: atol={atol:g}, rtol={rtol:g}")
    got, expected = _host(got, f"{label}: got", values=True), _host(expected, f"{label}: expected", values=True)
    if got.shape != expected.shape:
        raise NotClose(f"{label}: shapes differ: got {got.shape}, expected {expected.shape}")
    g = got.astype(np.float64).reshape(-1)
    e = expected.astype(np.float64).reshape(-1)
    err = np.abs(g - e)
    bad = ~(err <= atol + rtol * np.abs(e))
    count = int(bad.sum())
    if not count:
        return
    first = int(np.flatnonzero(bad)[0])
    worst = int(np.nanargmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)))
    lines = [
        f"{label}: {count} of {g.size} elements differ by more than atol={atol:g} + rtol={rtol:g} * |expected|",
        f"  first at flat index {first}, index {_index(first, expected.shape)}: got {float(g[first])!r}, "
        f"expected {float(e[first])!r}, |diff| {float(err[first])!r}",
        f"  worst at flat index {worst}, index {_index(worst, expected.shape)}: got {float(g[worst])!r}, "
        f"expected {float(e[worst])!r}, |diff| {float(err[worst])!r}",
    ]
    raise NotClose("\n".join(lines))
