"""The structural shape-space gates can fail: each family's "every preset and boundary is a shape
the launcher accepts" gate, run on the host against a launcher that caps one dimension below
a production preset (the launcher a kernel author tightens without updating the space), fails
by assertion (`ShapeRefused`), naming the first refused shape: a preset, with its model and
source, and the launcher's own words. The controls engine perturbs kernel sources only (gates
import Python from the repo), so these stand in for controls of the structural gates."""

from __future__ import annotations

from pathlib import Path

import pytest

from gates import test_attention_sweep as attention
from gates import test_fp8_gemv as fp8
from gates import test_lm_head as lm
from gates import test_moe_sweep as moe_sweep
from gates import test_nvfp4_gemv as nvfp4
from gates import test_qk_rope_sweep as qk_gate
from harness.library.launch import Refusal
from harness.library.sweep import Dim, Preset, ShapeRefused, ShapeSpace, assert_named_shapes_accepted, named_shapes
from kernels_cu import fp8_gemv, lm_head, moe_decode, nvfp4_gemv, paged_attention, qk_rope

KERNEL_ROOT = Path(fp8.__file__).resolve().parents[1] / "kernels_cu"


def capped(monkeypatch, module, name, too_big):
    """The launcher's check `module.name` as it was, then a Refusal where `too_big(its result)`
    says so: the cap a launcher gains when someone tightens it."""
    real = getattr(module, name)

    def check(*args, **kwargs):
        got = real(*args, **kwargs)
        why = too_big(got)
        if why:
            raise Refusal(f"{name}: {why}")
        return got

    monkeypatch.setattr(module, name, check)


CASES = {
    "fp8": (lambda: fp8.test_every_preset_and_boundary_of_the_fp8_shape_space_is_a_shape_the_launcher_accepts(),
            fp8_gemv, "check_fp8_gemv_args", lambda got: got[1] > 4000 and f"K={got[1]} is past 4000",
            "Llama-3 8B decode, q_proj"),
    "nvfp4": (lambda: nvfp4.test_every_preset_and_boundary_of_the_nvfp4_shape_space_is_a_shape_the_launcher_accepts(
                  KERNEL_ROOT),
              nvfp4_gemv, "check_nvfp4_gemv_args", lambda got: got[1] > 4000 and f"K={got[1]} is past 4000",
              "Llama-3 8B decode, q_proj"),
    "lm_head": (lambda: lm.test_every_preset_and_boundary_of_the_lm_head_shape_space_is_a_shape_the_launcher_accepts(),
                lm_head, "check_lm_head_args", lambda got: got[1] > 131072 and f"V={got[1]} is past 131072",
                "Qwen2.5 7B decode, batch of 8"),
    "moe": (lambda: moe_sweep.test_every_preset_and_boundary_of_the_moe_shape_space_is_a_shape_the_launchers_accept(),
            moe_decode, "check_glu", lambda sz: sz.i > 8192 and f"I={sz.i} is past 8192", "Mixtral-8x7B decode"),
    "attention": (
        lambda: attention.test_every_preset_and_boundary_of_the_attention_shape_spaces_is_a_shape_the_launcher_accepts(),
        paged_attention, "check_decode_args", lambda got: got[3] > 256 and f"head size {got[3]} is past 256",
        "Gemma 4 26B-A4B global layer: 2 sequences at 4096"),
    "qk_rope": (
        lambda: qk_gate.test_every_preset_and_boundary_of_the_qk_rope_shape_space_is_a_shape_the_launcher_accepts(),
        qk_rope, "check_flat", lambda got: int(got[1].max()) > 16383 and f"position {int(got[1].max())} is past 16383",
        "Gemma 4 E2B global layer: 32 tokens at 32768"),
}


@pytest.mark.parametrize("family", list(CASES))
def test_each_familys_shape_space_gate_passes_its_launcher_as_it_is(family):
    CASES[family][0]()


@pytest.mark.parametrize("family", list(CASES))
def test_each_familys_shape_space_gate_fails_by_assertion_naming_the_preset_a_tightened_launcher_refuses(
        family, monkeypatch):
    gate, module, name, too_big, preset = CASES[family]
    capped(monkeypatch, module, name, too_big)
    with pytest.raises(ShapeRefused) as info:
        gate()
    assert isinstance(info.value, AssertionError)  # a failure by assertion, as a control's gate must show
    text = str(info.value)
    assert f"preset {preset!r} (" in text, text
    assert f"{name}: " in text and "is a shape the space promises, and its check failed" in text, text


SPACE = ShapeSpace("toy", (Dim("N", 1, 64), Dim("K", 16, 4096, multiple_of=16)),
                   presets=(Preset("a model", {"N": 8, "K": 2048}, "its config.json"),))


def test_named_shapes_are_the_presets_then_the_boundaries_then_the_extras():
    shapes = named_shapes(SPACE, {"the big one": {"N": 64, "K": 4096}})
    assert shapes[0] == ("preset 'a model' (its config.json)", {"N": 8, "K": 2048})
    assert [label for label, _ in shapes[1:-1]] == [f"boundary case {i}" for i in range(1, len(shapes) - 1)]
    assert [s for _, s in shapes[1:-1]] == SPACE.boundary_cases()
    assert shapes[-1] == ("the big one", {"N": 64, "K": 4096})
    assert assert_named_shapes_accepted(SPACE, lambda shape: None, extra={"x": {"N": 1, "K": 16}}) == len(shapes)


def test_a_refused_boundary_is_named_with_its_shape_and_the_checks_words():
    def check(shape):
        if shape["K"] == 4096:
            raise Refusal(f"toy: K={shape['K']} needs more shared memory than 48 KiB")

    with pytest.raises(ShapeRefused, match=r"toy: boundary case \d+ \(N=1, K=4096\) is a shape the space promises, "
                                           r"and its check failed: toy: K=4096 needs more shared memory"):
        assert_named_shapes_accepted(SPACE, check)
