"""The trap shadow a mutation campaign runs its trap gates in (harness.compiling.trap_shadow.TRAP_SHADOW_PREAMBLE),
checked where no GPU is: every subject file that has a guard compiles in it, its `__trap()`s
are gone from the code and count into the module global instead, its cache entry is its own,
and NVRTC's line numbers still name the file's own lines."""

import re
from pathlib import Path

import pytest

from harness.compiling.compile import CompileError, compile_file
from harness.compiling.trap_shadow import TRAP_SHADOW_PREAMBLE, TRAP_SHADOW_SYMBOL

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels_cu"
GUARDED = sorted(p.name for p in KERNELS.glob("*.cu") if "__trap()" in p.read_text())


def _ptx(text: str, options: list[str], name_expressions=()) -> str:
    """NVRTC's PTX for what the harness compiled (its text and options; compute_90): what the
    code does, before ptxas."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), b"k.cu", 0, [], [])
    try:
        for ne in name_expressions:  # the templates the launcher instantiates
            nvrtc.nvrtcAddNameExpression(prog, ne.encode())
        opts = [("-arch=compute_90" if o.startswith("-arch=") else o).encode() for o in options
                if not o.startswith("--ptxas-options")]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert int(err) == 0, err
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = bytearray(size)  # NVRTC writes into it (never into a bytes object: see harness/compiling/backends.py)
        nvrtc.nvrtcGetPTX(prog, buf)
        return bytes(buf).decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compiled(name: str, cache: Path, shadow: bool, monkeypatch):
    """compile_file's module, and the text and options NVRTC was given for it."""
    import harness.compiling.compile as compile_module

    seen = []
    real = compile_module._compile_nvrtc

    def spy(path, text, options, name_expressions):
        seen.append((text, list(options), tuple(name_expressions)))
        return real(path, text, options, name_expressions)

    monkeypatch.setattr(compile_module, "_compile_nvrtc", spy)
    mod = compile_file(name, kernel_root=KERNELS, arch="sm_90", cache_dir=cache, trap_shadow=shadow)
    return mod, seen[0]


def test_the_subject_files_with_guards_are_the_ones_the_trap_gates_load():
    assert GUARDED == ["demo.cu", "moe_decode.cu", "qk_rope.cu"]


@pytest.mark.parametrize("name", GUARDED)
def test_a_guarded_file_in_the_shadow_counts_where_it_trapped(name, tmp_path, monkeypatch):
    plain, (text, options, names) = _compiled(name, tmp_path, False, monkeypatch)
    shadowed, (shadow_text, shadow_options, _) = _compiled(name, tmp_path, True, monkeypatch)
    assert shadow_text == TRAP_SHADOW_PREAMBLE + text and shadow_options == options
    real, shadow = _ptx(text, options, names), _ptx(shadow_text, options, names)
    assert re.search(r"\btrap;", real), f"{name}: no trap in the real build"
    assert not re.search(r"\btrap;", shadow), f"{name}: a trap is left in the shadow build"
    assert re.search(rf"\.global \.align 4 \.u32 {TRAP_SHADOW_SYMBOL}", shadow)
    assert shadow.count("atom.global.add.u32") > real.count("atom.global.add.u32")
    # a cache entry of its own, the counter in its cubin, and found again
    assert shadowed.trap_shadow and not plain.trap_shadow and shadowed.key != plain.key
    assert TRAP_SHADOW_SYMBOL.encode() in shadowed.cubin and TRAP_SHADOW_SYMBOL.encode() not in plain.cubin
    again = compile_file(name, kernel_root=KERNELS, arch="sm_90", cache_dir=tmp_path, trap_shadow=True)
    assert again.cache_hit and again.key == shadowed.key


def test_an_error_in_the_shadow_build_names_the_files_own_line(tmp_path):
    root = tmp_path / "k"
    root.mkdir()
    (root / "bad.cu").write_text('extern "C" __global__ void k(int* p) {\n    if (*p < 0) __trap();\n'
                                 '    *p = undeclared;\n}\n')
    for shadow in (False, True):
        with pytest.raises(CompileError) as info:
            compile_file("bad.cu", kernel_root=root, arch="sm_90", cache_dir=tmp_path / "c", trap_shadow=shadow)
        assert info.value.location[1] == 3, info.value.log
