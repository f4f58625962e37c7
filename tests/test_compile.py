"""NVRTC compile path, no GPU needed: compile-only, the cache key's closure, resource
usage, errors, and the `python -m harness compile` command."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.compiling.arch import ArchError
from harness.compiling.compile import CompileError, compile_file
from harness.compiling.options import recorded_options
from harness.compiling.includes import source_closure
from harness.compiling.modsettings import LauncherError
from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]

KERNEL = """
#include <cuda_bf16.h>
#include "scale.cuh"
template <int N>
__global__ void tiled(float* out, const float* x) {
    __shared__ float s[N];
    s[threadIdx.x % N] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % N] * SCALE;
}
extern "C" __global__ void plain(__nv_bfloat16* out) { out[threadIdx.x] = __float2bfloat16(SCALE); }
"""


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "kernels"
    root.mkdir()
    (root / "k.cu").write_text(KERNEL)
    (root / "scale.cuh").write_text('#include "nested/depth.cuh"\n#define SCALE (2.0f * DEPTH)\n')
    (root / "nested").mkdir()
    (root / "nested" / "depth.cuh").write_text("#define DEPTH 1.0f\n")
    (root / "unrelated.cuh").write_text("#define UNUSED 1\n")
    return root


def build(root, cache, **kw):
    return compile_file("k.cu", kernel_root=root, arch="sm_90", cache_dir=cache, **kw)


def test_compiles_to_a_cubin_with_no_gpu_and_maps_name_expressions(tree, tmp_path):
    mod = build(tree, tmp_path / "cache", name_expressions=("tiled<32>",))
    assert mod.cubin[:4] == b"\x7fELF"
    assert mod.symbol_mapping["tiled<32>"] == "_Z5tiledILi32EEvPfPKf"
    assert not mod.cache_hit


def test_options_are_explicit_and_recorded():
    opts = recorded_options("sm_90")  # NVRTC's own option list (cuda.core's spelling), folders as labels
    for o in ("-arch=sm_90", "--std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true",
              "--include-path=$ROOT"):
        assert o in opts
    assert not any("use_fast_math" in o for o in opts)
    changed = recorded_options("sm_90", {"X": 3}, fmad=False)
    assert "--define-macro=X=3" in changed and "--fmad=false" in changed


def test_ptxas_resource_usage_is_parsed_per_kernel(tree, tmp_path):
    mod = build(tree, tmp_path / "cache", name_expressions=("tiled<32>",))
    by_kernel = {r.kernel: r for r in mod.resources}
    assert set(by_kernel) == {"tiled<32>", "plain"}
    assert by_kernel["tiled<32>"].shared_bytes == 32 * 4
    assert by_kernel["plain"].shared_bytes == 0
    assert all(r.registers > 0 and r.spill_bytes == 0 for r in mod.resources)


def test_an_unchanged_tree_hits_the_cache(tree, tmp_path):
    first = build(tree, tmp_path / "cache")
    again = build(tree, tmp_path / "cache")
    assert (first.cache_hit, again.cache_hit) == (False, True)
    assert again.cubin == first.cubin and again.resources == first.resources


def test_a_changed_header_misses_even_two_includes_deep(tree, tmp_path):
    first = build(tree, tmp_path / "cache")
    (tree / "nested" / "depth.cuh").write_text("#define DEPTH 3.0f\n")
    changed = build(tree, tmp_path / "cache")
    assert not changed.cache_hit
    assert changed.key != first.key and changed.cubin != first.cubin


def test_a_header_the_source_does_not_include_is_not_in_the_key(tree, tmp_path):
    first = build(tree, tmp_path / "cache")
    (tree / "unrelated.cuh").write_text("#define UNUSED 2\n")
    assert build(tree, tmp_path / "cache").cache_hit
    assert [rel for rel, _ in source_closure(tree / "k.cu", tree)] == ["k.cu", "nested/depth.cuh", "scale.cuh"]
    assert first.key == build(tree, tmp_path / "cache").key


def test_a_copied_tree_hits_the_same_cubin(tree, tmp_path):
    import shutil

    first = build(tree, tmp_path / "cache")
    copy = tmp_path / "sandbox"
    shutil.copytree(tree, copy)
    assert build(copy, tmp_path / "cache").cache_hit
    assert build(copy, tmp_path / "cache").key == first.key


def test_options_arch_and_name_expressions_are_in_the_key(tree, tmp_path):
    base = build(tree, tmp_path / "cache")
    assert build(tree, tmp_path / "cache", defines={"EXTRA": 1}).key != base.key
    assert build(tree, tmp_path / "cache", fmad=False).key != base.key
    assert build(tree, tmp_path / "cache", name_expressions=("tiled<8>",)).key != base.key
    assert compile_file("k.cu", kernel_root=tree, arch="sm_80", cache_dir=tmp_path / "cache").key != base.key


def test_a_compile_error_shows_the_nvrtc_log_with_file_and_line_and_the_options(tree, tmp_path):
    (tree / "bad.cu").write_text('extern "C" __global__ void k(float* o) {\n    o[0] = undefined_name;\n}\n')
    with pytest.raises(CompileError) as info:
        compile_file("bad.cu", kernel_root=tree, arch="sm_90", cache_dir=tmp_path / "cache")
    text = str(info.value)
    assert text.splitlines()[0] == (f"NVRTC could not compile {tree / 'bad.cu'}: line 2: "
                                    'identifier "undefined_name" is undefined')
    assert f"{tree / 'bad.cu'}(2): error: identifier \"undefined_name\" is undefined" in text
    assert text.splitlines()[-1] == "options: " + " ".join(recorded_options("sm_90"))


def test_an_unknown_arch_is_refused_naming_the_known_ones(tree, tmp_path):
    with pytest.raises(ArchError, match=r"unknown --arch 'sm_999': NVRTC \S+ targets .*sm_90.*; pass one of them"):
        compile_file("k.cu", kernel_root=tree, arch="sm_999", cache_dir=tmp_path / "cache")


def test_a_missing_kernel_root_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist or is not a folder: pass --kernel-root DIR"):
        compile_file("k.cu", kernel_root=tmp_path / "nope", arch="sm_90")


def run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          env=child_env())


def test_the_compile_command_prints_a_table_and_hits_on_the_second_run(tree, tmp_path):
    first = run_cli("compile", "--kernel-root", str(tree), "--arch", "sm_90", "--cache-dir", str(tmp_path / "c"))
    assert first.returncode == 0, first.stderr
    assert "plain" in first.stdout and "miss" in first.stdout
    assert "1 of 1 modules compiled" in first.stdout
    second = run_cli("compile", "--kernel-root", str(tree), "--arch", "sm_90", "--cache-dir", str(tmp_path / "c"))
    assert "hit" in second.stdout


def test_the_compile_command_fails_on_a_bad_module_and_names_it(tree, tmp_path):
    (tree / "bad.cu").write_text('extern "C" __global__ void k(float* o) { o[0] = nope; }\n')
    result = run_cli("compile", "--kernel-root", str(tree), "--arch", "sm_90", "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 1
    assert "bad.cu(1): error" in result.stderr
    assert "1 of 2 modules compiled" in result.stdout


def test_the_compile_command_refuses_a_missing_root_and_an_unknown_arch(tmp_path):
    missing = run_cli("compile", "--kernel-root", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    arch = run_cli("compile", "--arch", "sm_1")
    assert arch.returncode == 2 and "unknown --arch 'sm_1'" in arch.stderr


def test_the_compile_command_instantiates_the_launchers_name_expressions(tree, tmp_path):
    (tree / "k.py").write_text('SIZES = (8, 32)\nNAME_EXPRESSIONS = tuple(f"tiled<{n}>" for n in SIZES)\n')
    result = run_cli("compile", "--kernel-root", str(tree), "--arch", "sm_90", "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 0, result.stderr
    assert "tiled<8>" in result.stdout and "tiled<32>" in result.stdout


def test_a_launcher_declaring_something_other_than_strings_is_refused(tree):
    from harness.compiling.compile import declared_name_expressions

    (tree / "k.py").write_text("NAME_EXPRESSIONS = 'tiled<8>'\n")
    with pytest.raises(LauncherError, match="NAME_EXPRESSIONS must be a tuple of C\\+\\+ name expressions"):
        declared_name_expressions(tree / "k.cu")


def test_kernels_module_memo_serves_an_unchanged_closure_and_sees_a_changed_header(tree, tmp_path, monkeypatch,
                                                                                  settings_in_effect):
    # harness.library.kernels.module() asks for its module at every launch; the memo answers without
    # compile_file while every file the compile read is unchanged, and compiles again (to
    # another key) once a header two includes deep changes, or after forget_loaded.
    from harness.core import settings as _settings
    from harness.library import kernels

    settings_in_effect(_settings.Settings(kernel_root=tree, arch="sm_90",
                                                                  cache_dir=tmp_path / "cache"))
    kernels.forget_loaded()
    calls = []
    real = kernels.compile_file
    monkeypatch.setattr(kernels, "compile_file", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    first = kernels._compiled_module("k.cu", ("tiled<4>",), None, None)
    assert {p.name for p, _ in first.files} == {"k.cu", "scale.cuh", "depth.cuh"}
    assert kernels._compiled_module("k.cu", ("tiled<4>",), None, None) is first
    assert len(calls) == 1
    other = kernels._compiled_module("k.cu", ("tiled<4>",), {"EXTRA": 1}, None)
    assert other.key != first.key and len(calls) == 2  # other defines: their own entry
    (tree / "nested" / "depth.cuh").write_text("#define DEPTH 4.0f  /* changed */\n")
    changed = kernels._compiled_module("k.cu", ("tiled<4>",), None, None)
    assert len(calls) == 3 and changed.key != first.key
    kernels.forget_loaded()
    assert kernels._compiled_module("k.cu", ("tiled<4>",), None, None).key == changed.key
    assert len(calls) == 4
    kernels.forget_loaded()


def test_kernels_module_memo_checks_the_bytes_of_a_file_changed_within_the_timestamp_granularity(
        tree, tmp_path, monkeypatch, settings_in_effect):
    # A file written just before its compile could be written again with the same size and
    # mtime (a campaign's sandbox file): with its mtime frozen, a same-size edit is seen.
    import os

    from harness.core import settings as _settings
    from harness.library import kernels

    settings_in_effect(_settings.Settings(kernel_root=tree, arch="sm_90",
                                                                  cache_dir=tmp_path / "cache"))
    kernels.forget_loaded()
    depth = tree / "nested" / "depth.cuh"
    frozen = os.stat(depth).st_mtime_ns
    monkeypatch.setattr(kernels, "RACY_NS", 3600 * 10**9)  # every file counts as written just now
    first = kernels._compiled_module("k.cu", ("tiled<4>",), None, None)
    assert kernels._compiled_module("k.cu", ("tiled<4>",), None, None) is first
    depth.write_text(depth.read_text().replace("1.0f", "3.0f"))  # the same size
    os.utime(depth, ns=(frozen, frozen))  # and the same mtime
    changed = kernels._compiled_module("k.cu", ("tiled<4>",), None, None)
    assert changed.key != first.key
    monkeypatch.setattr(kernels, "RACY_NS", 0)  # kept as racy when compiled: still served, bytes unchanged
    assert kernels._compiled_module("k.cu", ("tiled<4>",), None, None) is changed
    kernels.forget_loaded()


def test_cuda_core_is_imported_only_by_a_process_that_compiles(tree, tmp_path):
    # A fake device's pool server or a pytest over gates that compile nothing imports the
    # harness's launchers and plugin but never NVRTC: cuda.core (0.2 s a process) waits for
    # the first compile. The first compiles, from several threads at once, share one import.
    code = ("import sys, threading\n"
            "import harness.library.kernels, harness.plugin, harness.compiling.compile\n"
            "print('before', 'cuda.core' in sys.modules)\n"
            "from harness.compiling.compile import compile_file\n"
            "from pathlib import Path\n"
            "out = []\n"
            "def one():\n"
            f"    out.append(compile_file('k.cu', kernel_root=Path({str(tree)!r}), arch='sm_90',\n"
            f"                            cache_dir=Path({str(tmp_path / 'cache')!r}), use_cache=False).cubin[:4])\n"
            "threads = [threading.Thread(target=one) for _ in range(4)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "print('after', 'cuda.core' in sys.modules, out)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert "before False" in proc.stdout, proc.stdout
    assert "after True [b'\\x7fELF', b'\\x7fELF', b'\\x7fELF', b'\\x7fELF']" in proc.stdout, proc.stdout


def test_a_compile_whose_cubin_is_cached_never_imports_cuda_core(tree, tmp_path):
    # cuda.core only spells NVRTC's options (0.1 CPU-s of import in every compiling process);
    # the spelling is kept beside the cubins, so a cache hit needs nothing of it. NVRTC's
    # version (in the key) and its arches (the arch's check) come from its library directly:
    # cuda.bindings' NVRTC module pulls in the driver bindings (another 0.1 CPU-s).
    cache = tmp_path / "cache"
    code = ("import sys\nfrom pathlib import Path\nfrom harness.compiling.compile import compile_file\n"
            f"m = compile_file('k.cu', kernel_root=Path({str(tree)!r}), arch='sm_90', cache_dir=Path({str(cache)!r}))\n"
            "print(m.cache_hit, 'cuda.core' in sys.modules, m.key, ' '.join(m.options))\n"
            "print(sorted(n for n in ('cuda.bindings.nvrtc', 'cuda.bindings.driver') if n in sys.modules))\n")

    def run(bindings="[]"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 0, proc.stderr
        line, imported_bindings = proc.stdout.strip().splitlines()
        if bindings is not None:
            assert imported_bindings == bindings
        hit, imported, key, options = line.split(" ", 3)
        return hit, imported, key, options

    first, second = run(bindings=None), run()
    assert first[:2] == ("False", "True") and second[:2] == ("True", "False")
    assert second[2:] == first[2:] and "--fmad=true" in first[3]
    (spelling,) = (cache / "nvrtc-options").iterdir()
    spelling.write_text("{not json")  # unreadable: spelled again by cuda.core, and kept again
    third = run(bindings=None)
    assert third == ("True", "True", *first[2:])
    assert json.loads(spelling.read_text())["spelled"][0] == "-arch=sm_90"


def test_a_sandbox_is_another_include_folder_never_another_spelling(tree, tmp_path, monkeypatch):
    # a campaign compiles each mutant in a sandbox of its own: one spelling serves them all
    import shutil

    from harness.compiling import options as compile_options

    monkeypatch.setattr(compile_options, "_SPELLED", {})  # this process's own: spelled afresh, so kept on disk
    cache = tmp_path / "cache"
    first = build(tree, cache)
    copy = tmp_path / "sandbox"
    shutil.copytree(tree, copy)
    (copy / "nested" / "depth.cuh").write_text("#define DEPTH 2.0f\n")  # a miss: NVRTC reads the copy's headers
    second = build(copy, cache)
    assert not second.cache_hit and second.key != first.key and second.options == first.options
    assert len(list((cache / "nvrtc-options").iterdir())) == 1
    from harness.compiling.options import nvrtc_options
    from harness.compiling.includes import include_path
    from harness.compiling.modsettings import ModuleSettings

    inc = include_path(copy / "k.cu", copy, ())
    assert f"--include-path={copy}" in nvrtc_options("sm_90", ModuleSettings(), inc, cache)


def test_another_cuda_core_version_or_other_options_are_spelled_again(tmp_path, monkeypatch):
    from harness.compiling import options as compile_options

    monkeypatch.setattr(compile_options, "_SPELLED", {})
    opts = dict(arch="sm_90", std="c++17", fma=True)
    first = compile_options.spelled_for_nvrtc(tmp_path, opts)
    assert "--fmad=true" in first and len(list((tmp_path / "nvrtc-options").iterdir())) == 1
    assert compile_options.spelled_for_nvrtc(tmp_path, dict(opts, fma=False)) != first
    monkeypatch.setattr(compile_options, "_cuda_core_version", lambda: "0.0-another")
    assert compile_options.spelled_for_nvrtc(tmp_path, opts) == first
    assert len(list((tmp_path / "nvrtc-options").iterdir())) == 3
    monkeypatch.setattr(compile_options, "_cuda_core_version", lambda: None)  # unknown: nothing kept
    compile_options.spelled_for_nvrtc(tmp_path, dict(opts, arch="sm_80"))
    assert len(list((tmp_path / "nvrtc-options").iterdir())) == 3


def test_threads_spelling_the_same_options_at_once_leave_one_whole_entry(tmp_path, monkeypatch):
    import threading

    from harness.compiling import options as compile_options

    monkeypatch.setattr(compile_options, "_SPELLED", {})
    opts = dict(arch="sm_90", std="c++17", fma=False)
    got, go = [], threading.Barrier(8)

    def one():
        go.wait()
        got.append(compile_options.spelled_for_nvrtc(tmp_path, opts))

    threads = [threading.Thread(target=one) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    (entry,) = (tmp_path / "nvrtc-options").iterdir()  # no temporary file left beside it
    assert len(set(got)) == 1 and json.loads(entry.read_text())["spelled"] == list(got[0])


def test_a_cuda_core_that_cannot_be_imported_is_not_reported_as_an_arch_nvrtc_cannot_target(monkeypatch):
    # the arch variant check compiles an empty kernel and takes any failure as "not this
    # arch": a missing cuda.core must surface as itself, not as an ArchError about sm_90a
    from harness.compiling import arch

    def missing():
        raise ImportError("No module named 'cuda.core'")

    monkeypatch.setattr(arch, "cuda_core", missing)
    arch._nvrtc_compiles_for.cache_clear()
    try:
        with pytest.raises(ImportError, match="cuda.core"):
            arch.check_arch("sm_90a")
    finally:
        arch._nvrtc_compiles_for.cache_clear()


def test_nvrtcs_version_and_arches_from_its_library_are_the_bindings_and_a_library_not_loaded_falls_back(
        monkeypatch):
    # the library route (ctypes, no cuda.bindings import) answers what cuda.bindings answers;
    # where the library cannot be loaded so, cuda.bindings answers (or raises its own error)
    from cuda.bindings import nvrtc

    from harness.compiling import toolchain

    err, major, minor = nvrtc.nvrtcVersion()
    err2, arches = nvrtc.nvrtcGetSupportedArchs()
    assert int(err) == int(err2) == 0
    for cached in (toolchain._nvrtc_library, toolchain.nvrtc_version, toolchain.nvrtc_supported_arches):
        cached.cache_clear()
    try:
        assert toolchain._nvrtc_library() is not None
        assert (toolchain.nvrtc_version(), toolchain.nvrtc_supported_arches()) == (f"{major}.{minor}", tuple(arches))
        toolchain.nvrtc_version.cache_clear()
        toolchain.nvrtc_supported_arches.cache_clear()
        monkeypatch.setattr(toolchain, "_nvrtc_library", lambda: None)
        assert (toolchain.nvrtc_version(), toolchain.nvrtc_supported_arches()) == (f"{major}.{minor}", tuple(arches))
    finally:
        monkeypatch.undo()
        for cached in (toolchain._nvrtc_library, toolchain.nvrtc_version, toolchain.nvrtc_supported_arches):
            cached.cache_clear()


def test_nvrtcs_log_and_cubin_are_read_into_buffers_of_their_own_never_a_shared_bytes_object():
    # cuda-bindings 13.3 writes a log or a cubin into the very buffer it is handed. An empty
    # log is one byte (its NUL), and `b" " * 1` is CPython's one shared b" ": on the H100
    # (cuda-bindings 13.3.1) a compile turned every later print's separator into a NUL. The
    # child wraps the bindings so that they write in place, as 13.3 does, whatever is installed.
    code = textwrap.dedent('''
        import ctypes
        from pathlib import Path
        from cuda.bindings import nvrtc
        from harness.compiling.backends import _compile_nvrtc

        def in_place(real):
            def call(prog, buf):
                mine = bytearray(len(buf))
                result = real(prog, mine)
                if isinstance(buf, bytes):  # what a C binding does with the bytes it is given
                    ctypes.memmove(ctypes.c_char_p(buf), bytes(mine), len(buf))
                else:
                    buf[:] = mine
                return result
            return call

        nvrtc.nvrtcGetProgramLog = in_place(nvrtc.nvrtcGetProgramLog)
        nvrtc.nvrtcGetCUBIN = in_place(nvrtc.nvrtcGetCUBIN)
        cubin, _, log = _compile_nvrtc(Path("k.cu"), 'extern "C" __global__ void k() {}', ["-arch=sm_90"], [])
        print(repr(log), cubin[:4] == b"\\x7fELF", b" "[0], "a", "b")
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "'' True 32 a b\n", repr(proc.stdout)


# ------------------------------------------------------------------ an upstream build's nvcc flags

# A torch extension's setup.py passes these to nvcc (causal-conv1d's and fast-hadamard-transform's;
# their --use_fast_math is the launcher's FAST_MATH = True).
UPSTREAM_NVCC_FLAGS = ("-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                       "--expt-relaxed-constexpr", "--expt-extended-lambda", "--ptxas-options=-v", "-lineinfo",
                       "--threads", "4")
RELAXED_CONSTEXPR = textwrap.dedent("""\
    constexpr int twice(int n) { return 2 * n; }
    template <int N> struct Traits { static constexpr int kSmem = twice(N); };
    extern "C" __global__ void k(float* out) { out[threadIdx.x] = Traits<64>::kSmem + twice(threadIdx.x); }
    """)


def test_an_upstream_builds_nvcc_flags_are_taken_by_nvrtc_as_nvrtc_spells_them(tmp_path):
    (tmp_path / "k.cu").write_text(RELAXED_CONSTEXPR)
    (tmp_path / "k.py").write_text(f"FAST_MATH = True\nEXTRA_FLAGS = {UPSTREAM_NVCC_FLAGS!r}\n")
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert mod.backend == "nvrtc" and [r.kernel for r in mod.resources] == ["k"]
    extra = mod.options[mod.options.index("--std=c++17") + 1:]
    assert extra == ("-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-default-device",
                     "--ptxas-options=-v", "-lineinfo"), extra


def test_nvcc_gets_an_upstream_builds_flags_verbatim(tmp_path):
    from harness.compiling import toolchain

    if toolchain.find_nvcc() is None:
        pytest.skip("nvcc is not installed here")
    (tmp_path / "k.cu").write_text(RELAXED_CONSTEXPR)
    (tmp_path / "k.py").write_text(f"COMPILER = 'nvcc'\nEXTRA_FLAGS = {UPSTREAM_NVCC_FLAGS!r}\n")
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert mod.backend == "nvcc" and mod.options[-len(UPSTREAM_NVCC_FLAGS):] == UPSTREAM_NVCC_FLAGS


# ------------------------------------------------------------------ what the device view set aside, grouped

INSTANTIATED = textwrap.dedent("""\
    #include <vector>
    template <typename T> __global__ void k(T* x) { x[threadIdx.x] += T(1); }
    template <typename T> void launch(T* x, int n) { k<T><<<1, n>>>(x); }
    template <typename T> void launch2(T* x, int n) { k<T><<<2, n>>>(x); }
    template void launch<float>(float*, int);
    template void launch<double>(double*, int);
    template void launch<int>(int*, int);
    template void launch<short>(short*, int);

    template void launch2<float>(float*, int);
    template void launch2<double>(double*, int);
    template void launch<unsigned>(unsigned*, int);
    """)


def test_explicit_instantiations_set_aside_are_one_line_per_template_in_the_command_and_the_item(tmp_path):
    root = tmp_path / "kernels"
    root.mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\nkernel_root = kernels\n")
    (root / "k.cu").write_text(INSTANTIATED)
    (root / "k.py").write_text('NAME_EXPRESSIONS = ("k<float>",)\n')
    cmd = subprocess.run([sys.executable, "-m", "harness", "compile", "--cache-dir", str(tmp_path / "c")], cwd=tmp_path,
                         env=child_env(), capture_output=True, text=True, timeout=300)
    assert cmd.returncode == 0, cmd.stderr
    (detail,) = [line for line in cmd.stdout.splitlines() if line.startswith("k.cu: compiled by")]
    assert detail.endswith(
        "device view set aside: line 1: #include <vector> (a host-only library header); line 3: function launch (host "
        "code: no __global__ or __device__, and no kept code names it); line 4: function launch2 (host code: no "
        "__global__ or __device__, and no kept code names it); lines 5-8, 12: 5 instantiations of launch (host code: "
        "no __global__ or __device__, and no kept code names it); lines 10-11: 2 instantiations of launch2 (host "
        "code: no __global__ or __device__, and no kept code names it)"), detail
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA"], cwd=tmp_path,
                         env=child_env({"HARNESS_CACHE_DIR": str(tmp_path / "c")}), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout
    assert "  lines 5-8, 12: 5 instantiations of launch (host code" in run.stdout
    assert "line 5: instantiation" not in run.stdout
