"""Structural gates: every warp primitive in the kernel sources has its canonical full-warp form.

One case a source file (`.cu` and `.cuh` under the ACTIVE kernel root, read through
harness.library.source, so a mutation campaign knows these gates read them); no GPU, they run in CI.

Why no numeric gate can see these: on sm_90 a partial mask in converged code is undefined
behaviour the hardware happens to tolerate, and a butterfly over offsets {17, 8, 4, 2, 1}
still reaches every lane; for the exact designed inputs the sums do not depend on the order,
so every link stays bitwise green. They are still defects: the undefined behaviour is real,
and a different reduction order changes the bits of every non-exact sum the links rely on.

- Every `__shfl*_sync`, `__ballot_sync`, `__any_sync`, `__all_sync`, `__uni_sync`,
  `__match_*_sync`, `__reduce_*_sync` and `__syncwarp(mask)` passes the full-warp mask, the
  literal `0xffffffffu` / `0xffffffff` or a constant defined to it; a shuffle's width, when
  given, is 32.
- Every butterfly or shift-down tree (a `for` loop whose body shuffles with an offset naming
  the loop variable) runs that variable over exactly 16, 8, 4, 2, 1 (evaluated from the loop's init,
  condition and step) and passes the bare variable as the offset; a shuffle offset outside
  such a loop is a literal power of two below 32. A designed sub-warp butterfly is listed
  in SUB_WARP_BUTTERFLIES with its width and reason.
- `__syncwarp()` with no argument is the full mask by definition: its calls are recorded
  (property `bare_syncwarp`), never required. A dropped `__syncwarp()` is invisible here
  and numerically on sm_90 (the warp is converged where they stand, and shared-memory
  accesses of one converged warp are ordered); only `--sanitize racecheck` on the device
  can report the intra-warp hazard it leaves. Where a barrier is part of a claim, the
  family's structural gate requires it: the NVFP4 table stage's `__syncwarp()` is required
  by `gates/test_gemv_structure.py` (a staged table is published before it is read), and
  QK-RoPE's staging-row `__syncwarp()`s by `gates/test_qk_rope_structure.py`.
"""

from __future__ import annotations

import pytest

from gates._warp_structure import (
    FULL_MASK,
    FULL_MASK_LITERAL,
    OFFSET_SHUFFLES,
    SHUFFLES,
    Constants,
    Unevaluable,
    evaluate,
    identifiers,
    line_of,
    loop_values,
    loop_variable,
    text_of,
    warp_calls,
)
from harness.library.kernels import kernel_root as active_kernel_root
from harness.library.source import read_source

pytestmark = pytest.mark.structural

WARP = 32
SOURCE_SUFFIXES = (".cu", ".cuh")

# (file, function) -> (lanes its butterflies span, why) where that is not the whole warp.
SUB_WARP_BUTTERFLIES = {
    ("moe_decode.cu", "moe_quant16"): (16, "one NVFP4 block of 16 is held by an aligned half-warp: its amax "
                                           "butterfly (offsets 8, 4, 2, 1) stays inside each half"),
}


def kernel_sources(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.suffix in SOURCE_SUFFIXES and p.is_file())


def pytest_generate_tests(metafunc):
    if "source" in metafunc.fixturenames:
        files = kernel_sources(active_kernel_root())
        metafunc.parametrize("source", files, ids=files)


def read(kernel_root, source: str):
    """(calls, problems so far, constants) of one source, read through harness.library.source."""
    path = kernel_root / source
    text = read_source(path)

    def load(name: str) -> str | None:
        included = path.parent / name
        return read_source(included) if included.is_file() else None

    calls, unseen = warp_calls(text)
    return calls, [f"{source}: {u}" for u in unseen], Constants(text, load)


def assert_no_problems(problems: list[str], fix: str) -> None:
    """Fail with every problem; the first is the message's first line (what reports show)."""
    assert not problems, "\n".join([*problems, f"  {fix}"])


def full_mask(node, consts: Constants) -> bool:
    if FULL_MASK_LITERAL.fullmatch(text_of(node)):
        return True
    if node.type != "identifier":
        return False
    try:
        return consts.value(text_of(node)) == FULL_MASK
    except Unevaluable:
        return False


def test_warp_primitives_name_the_full_warp(kernel_root, source, request):
    calls, problems, consts = read(kernel_root, source)
    bare = []
    for call in calls:
        where = f"{source}:{call.line}: {call.spelling} in {call.function}"
        if call.name == "__syncwarp" and not call.args:
            bare.append(f"{source}:{call.line} in {call.function}")
            continue
        if not call.args:
            problems.append(f"{where}: no mask argument")
            continue
        mask = call.args[0]
        if not full_mask(mask, consts):
            try:
                bits = evaluate(mask, {}, consts) & FULL_MASK  # what the 32-bit mask parameter receives
            except Unevaluable:
                bits = None
            problems.append(f"{where}: mask `{text_of(mask)}` " + (
                "is the full warp only by computation: spell it 0xffffffffu" if bits == FULL_MASK else
                f"({bits:#010x} as a 32-bit mask) is not the full warp 0xffffffffu" if bits is not None else
                "is not the full warp 0xffffffffu"))
        if call.name in SHUFFLES and len(call.args) >= 4:
            try:
                width = evaluate(call.args[3], {"warpSize": WARP}, consts)
            except Unevaluable as exc:
                width = exc
            if width != WARP:
                problems.append(f"{where}: width `{text_of(call.args[3])}` ({width}) is not the whole warp, 32")
    # on the item, as pytest's record_property does, without its warning under JUnit's xunit2
    # (whose schema has no test-case properties; the harness's reports carry it)
    request.node.user_properties.append(("bare_syncwarp", "; ".join(bare) or "none"))
    assert_no_problems(problems, "every lane of the warp calls these primitives: pass the literal 0xffffffffu "
                                 "(a partial mask in converged code is undefined behaviour) and no width but 32")


def test_butterflies_run_over_16_8_4_2_1(kernel_root, source):
    calls, problems, consts = read(kernel_root, source)
    loops = {}  # start byte -> (loop node, function)
    for call in calls:
        if call.name not in OFFSET_SHUFFLES or len(call.args) < 3:
            continue
        where = f"{source}:{call.line}: {call.spelling} in {call.function}"
        offset = call.args[2]
        named = identifiers(offset)
        loop = next((lp for lp in call.loops if (loop_variable(lp) or ("",))[0] in named), None)
        if loop is not None:
            loops.setdefault(loop.start_byte, (loop, call.function))
            var = loop_variable(loop)[0]
            if text_of(offset) != var:
                problems.append(f"{where}: offset `{text_of(offset)}` is not the bare loop variable `{var}`")
            continue
        try:
            value = evaluate(offset, {}, consts)
        except Unevaluable as exc:
            problems.append(f"{where}: offset `{text_of(offset)}` is neither a butterfly loop's variable nor a "
                            f"constant: {exc}")
            continue
        if value not in (1, 2, 4, 8, 16):
            problems.append(f"{where}: offset `{text_of(offset)}` = {value} is not a power of two below 32")
    butterfly_functions = set()
    for loop, function in loops.values():
        butterfly_functions.add(function)
        lanes, _ = SUB_WARP_BUTTERFLIES.get((source, function), (WARP, ""))
        expected = [lanes >> k for k in range(1, lanes.bit_length())]  # 32: 16, 8, 4, 2, 1
        body = loop.child_by_field_name("body")
        header = " ".join(loop.text[: body.start_byte - loop.start_byte].decode(errors="replace").split())
        where = f"{source}:{line_of(loop)}: the butterfly `{header}` in {function}"
        try:
            found = loop_values(loop, consts)
        except Unevaluable as exc:
            problems.append(f"{where} cannot be evaluated: {exc}; expected offsets {expected}")
            continue
        if found != expected:
            problems.append(f"{where} runs over offsets {found}; expected {expected}")
    for (file, function), (lanes, _) in SUB_WARP_BUTTERFLIES.items():
        if file == source and function not in butterfly_functions:
            problems.append(f"{source}: SUB_WARP_BUTTERFLIES lists {function} ({lanes} lanes) but it holds no "
                            "butterfly loop: remove the entry or restore the loop")
    assert_no_problems(problems, "a warp reduction is `for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync("
                                 "0xffffffffu, v, m);` (or __shfl_down_sync where lane 0 alone uses the result): "
                                 "any other offsets change the summation order (the bits of every non-exact sum) "
                                 "or skip lanes")
