"""The warp-structure gates (gates/test_warp_structure.py) on small sources: green on the
canonical forms, red by their own assertion, naming file:line, on every other form."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import gates.test_warp_structure as gate
from gates._warp_structure import Constants, Unevaluable, _expression, evaluate, warp_calls

REPO = Path(__file__).resolve().parents[1]
SUM = "for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync({mask}, v, m);"


def kernel(body: str, head: str = "") -> str:
    return (f"{head}\n__device__ __forceinline__ float warp_sum(float v)\n{{\n#pragma unroll\n"
            f"    {body}\n    return v;\n}}\n")


def body_line(text: str) -> int:
    """The line of kernel()'s body, the one before `return v;`."""
    return text.splitlines().index("    return v;")


def run(tmp_path, text: str, name: str = "k.cu", files: dict | None = None) -> dict:
    """{gate: None when green, else its failure message}; `properties` holds what was recorded."""
    (tmp_path / name).write_text(text)
    for other, content in (files or {}).items():
        (tmp_path / other).write_text(content)
    properties = {}
    out = {"properties": properties}
    request = SimpleNamespace(node=SimpleNamespace(user_properties=[]))
    for label, check in (("mask", lambda: gate.test_warp_primitives_name_the_full_warp(tmp_path, name, request)),
                         ("butterfly", lambda: gate.test_butterflies_run_over_16_8_4_2_1(tmp_path, name))):
        try:
            check()
            out[label] = None
        except AssertionError as exc:
            out[label] = str(exc)
        finally:
            properties.update(request.node.user_properties)
    return out


@pytest.mark.parametrize("mask", ["0xffffffffu", "0xffffffff", "0xFFFFFFFFU", "FULL", "kFull"])
def test_full_masks_and_named_constants_are_green(tmp_path, mask):
    head = "#define FULL 0xffffffffu  // every lane\nnamespace ns { constexpr unsigned kFull = 0xffffffffu; }\n" \
           "constexpr unsigned kFull = FULL;"
    result = run(tmp_path, kernel(SUM.format(mask=mask), head))
    assert result["mask"] is None and result["butterfly"] is None, result


@pytest.mark.parametrize("mask", ["0x7fffffffu", "0xfffffffeu", "0u", "0x100000000u", "~0u", "__activemask()", "HALF"])
def test_partial_or_computed_masks_are_red_naming_file_line_and_mask(tmp_path, mask):
    text = kernel(SUM.format(mask=mask), "#define HALF 0x0000ffffu")
    result = run(tmp_path, text)
    assert result["mask"] is not None, result
    first = result["mask"].splitlines()[0]
    assert first.startswith(f"k.cu:{body_line(text)}: __shfl_xor_sync(") and f"mask `{mask}`" in first, first
    assert result["butterfly"] is None


@pytest.mark.parametrize("call", ["__ballot_sync(0x7fffffffu, p)", "__any_sync(0xffffu, p)", "__all_sync(1u, p)",
                                  "__reduce_add_sync(0x7fffffffu, 1u)", "__syncwarp(0x7fffffffu)",
                                  "__match_any_sync(0u, 1u)", "__shfl_sync(0x7fffffffu, v, 0)"])
def test_every_warp_primitive_is_checked(tmp_path, call):
    result = run(tmp_path, kernel(f"const bool p = v > 0.f; (void){call};"))
    assert result["mask"] is not None and call.split("(")[0] in result["mask"], result


def test_bare_syncwarp_is_recorded_not_required(tmp_path):
    text = kernel("__syncwarp();")
    result = run(tmp_path, text)
    assert result["mask"] is None and result["properties"]["bare_syncwarp"] == f"k.cu:{body_line(text)} in warp_sum"
    assert run(tmp_path, kernel("v += 1.f;"))["properties"]["bare_syncwarp"] == "none"


@pytest.mark.parametrize("width, green", [("32", True), ("warpSize", True), ("16", False), ("(32 / 2)", False)])
def test_a_shuffle_width_is_the_whole_warp(tmp_path, width, green):
    body = f"for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m, {width});"
    result = run(tmp_path, kernel(body))
    assert (result["mask"] is None) == green, result


@pytest.mark.parametrize("loop", [
    "for (int m = 16; m > 0; m >>= 1)",
    "for (int o = LANES / 2; o > 0; o /= 2)",
    "for (int o = kWarp >> 1; o >= 1; o = o / 2)",
    "for (int o = HALF_WARP; 0 < o; o >>= 1)",
])
def test_canonical_butterflies_are_green(tmp_path, loop):
    var = loop.split("int ")[1].split()[0]
    head = '#include "warp.cuh"\nconstexpr int LANES = 32;\nnamespace k { constexpr int kWarp = LANES; }'
    text = kernel(f"{loop} v += __shfl_xor_sync(0xffffffffu, v, {var});", head)
    result = run(tmp_path, text, files={"warp.cuh": "#define HALF_WARP (32 / 2)  // half\n"})
    assert result["butterfly"] is None, result


@pytest.mark.parametrize("loop, offset, found", [
    ("for (int m = 17; m > 0; m >>= 1)", "m", "[17, 8, 4, 2, 1]"),
    ("for (int m = 8; m > 0; m >>= 1)", "m", "[8, 4, 2, 1]"),
    ("for (int m = 1; m < 32; m <<= 1)", "m", "[1, 2, 4, 8, 16]"),
    ("for (int m = 16; m > 1; m >>= 1)", "m", "[16, 8, 4, 2]"),
    ("for (int m = 16; m > 0; m >>= 2)", "m", "[16, 4, 1]"),
    ("for (int m = 16; m > 0; m >>= 1)", "(m + 1)", "offset `(m + 1)` is not the bare loop variable `m`"),
    ("for (int m = 16; m > 0; m >>= 1)", "(m - 1)", "offset `(m - 1)` is not the bare loop variable `m`"),
    ("for (int m = 16; m >= 0; m >>= 1)", "m", "does not end within 64 steps"),
    ("for (int m = 16; m > 0; m >>= SHIFT)", "m", "`SHIFT` is neither a loop variable nor"),
])
def test_other_butterflies_are_red_naming_file_line_and_offsets(tmp_path, loop, offset, found):
    text = kernel(f"{loop} v += __shfl_xor_sync(0xffffffffu, v, {offset});")
    result = run(tmp_path, text)
    assert result["butterfly"] is not None and found in result["butterfly"], result
    assert result["butterfly"].startswith(f"k.cu:{body_line(text)}: "), result["butterfly"]


@pytest.mark.parametrize("offset, green", [("1", True), ("16", True), ("(8 >> 1)", True), ("0", False),
                                           ("3", False), ("32", False), ("lane", False)])
def test_a_shift_outside_a_loop_is_a_power_of_two_below_32(tmp_path, offset, green):
    result = run(tmp_path, kernel(f"const int lane = 3; v += __shfl_down_sync(0xffffffffu, v, {offset});"))
    assert (result["butterfly"] is None) == green, result


def test_a_butterfly_outside_a_for_loop_is_red(tmp_path):
    body = "int m = 16; while (m > 0) { v += __shfl_xor_sync(0xffffffffu, v, m); m >>= 1; }"
    result = run(tmp_path, kernel(body))
    assert "offset `m` is neither a butterfly loop's variable nor a constant" in result["butterfly"], result


def test_a_listed_sub_warp_butterfly_is_green_and_only_at_its_width(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "SUB_WARP_BUTTERFLIES", {("k.cu", "warp_sum"): (16, "a half-warp block")})
    half = kernel("for (int m = 8; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);")
    assert run(tmp_path, half)["butterfly"] is None
    assert "expected [8, 4, 2, 1]" in run(tmp_path, kernel(SUM.format(mask="0xffffffffu")))["butterfly"]
    stale = run(tmp_path, kernel("v += 1.f;"))["butterfly"]
    assert "SUB_WARP_BUTTERFLIES lists warp_sum (16 lanes) but it holds no butterfly loop" in stale


def test_a_primitive_the_parser_cannot_see_is_red(tmp_path):
    text = "#define WARP_SUM(v) v += __shfl_xor_sync(0x7fffffffu, v, 16)\n" + kernel("WARP_SUM(v);")
    result = run(tmp_path, text)
    assert "k.cu: line 1: `__shfl_xor_sync(` is not a call the parser sees" in result["mask"], result
    assert "not a call the parser sees" in result["butterfly"]


def test_comments_and_strings_are_not_calls(tmp_path):
    text = kernel("// __shfl_xor_sync(0u, v, 17)\n    /* __syncwarp(0u) */ v += 1.f;")
    result = run(tmp_path, text)
    assert result["mask"] is None and result["butterfly"] is None
    calls, unseen = warp_calls(text)
    assert calls == [] and unseen == []


def test_the_evaluator_follows_c():
    consts = Constants("#define A (7)\nconstexpr int B = -A / 2;\nconstexpr int C = -A % 2;\n"
                       "#define D A\n#define D 8\n")
    assert consts.value("B") == -3 and consts.value("C") == -1
    with pytest.raises(Unevaluable, match="defined 2 times with different values"):
        consts.value("D")
    assert evaluate(_expression("1 << 4 | 1"), {}, consts) == 17
    assert evaluate(_expression("m > 0 && m < 32"), {"m": 16}, consts) == 1
    with pytest.raises(Unevaluable, match="is not an integer"):
        evaluate(_expression("1.5f"), {}, consts)
    with pytest.raises(Unevaluable, match="not an integer constant expression this gate reads"):
        evaluate(_expression("f(2)"), {}, consts)


@pytest.mark.parametrize("source, function, shuffle", [
    ("fp8_gemv.cu", "fp8_gemv_warp_sum", "__shfl_down_sync"), ("lm_head.cu", "lm_head_warp_sum", "__shfl_down_sync"),
    ("lm_head.cu", "lm_head_warp_best", "__shfl_down_sync"), ("nvfp4_dot.cuh", "nvfp4_warp_sum", "__shfl_down_sync"),
    ("moe_decode.cu", "moe_block_max", "__shfl_down_sync"), ("moe_decode.cu", "moe_quant16", "__shfl_xor_sync"),
    ("moe_decode.cu", "moe_topk_softmax", "__shfl_xor_sync"), ("paged_attention.cu", "warp_sum", "__shfl_xor_sync"),
    ("qk_rope.cu", "warp_sum", "__shfl_xor_sync"),
])
def test_the_gate_sees_the_butterflies_of_todays_kernels(source, function, shuffle):
    """The per-file gates are green on today's kernels because they read these loops, not
    because they found nothing: each family's warp reduction is seen as a loop over offsets,
    an xor butterfly where every lane needs the result, a shift-down tree where lane 0 alone
    stores it."""
    calls, unseen = warp_calls((REPO / "kernels_cu" / source).read_text())
    assert unseen == []
    assert any(c.function == function and c.loops and c.name == shuffle for c in calls), \
        f"{source}: no {shuffle} loop found in {function}"
