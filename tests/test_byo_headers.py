"""Kernel-root headers are compiled as their device-only view: the fixture tree whose headers
carry host code (tests/fixtures/headers) compiles through NVRTC unedited with no launcher
setting and names what it set aside in each header; then the edges (a header included
twice, a header including another, guards, a header's device code that needs host code,
a header outside the root, a symlink leading outside it, nvcc, the trap shadow) and the
rules the headers needed (types, macros, names used across files)."""

import hashlib
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from harness.core import settings as _settings
from harness.compiling.compile import CompileError, compile_file
from harness.compiling.deviceview import Unit, device_views
from harness.compiling.modsettings import ModuleSettings, declared_settings
from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "tests" / "fixtures" / "headers"
KERNELS = TREE / "kernels"

KERNEL = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = twice(x[threadIdx.x]); }\n'
HOST_HEADER = """\
#pragma once
#include <cstdlib>
#include <cublas_v2.h>
static cublasHandle_t g_handle;
inline void die(const char* why) { exit(1); }
__device__ inline float twice(float x) { return 2.0f * x; }
"""


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def write(folder: Path, files: dict) -> Path:
    for name, text in files.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return folder


def env(tmp_path) -> dict:
    return child_env({"HARNESS_CACHE_DIR": str(tmp_path / "cache"), "HARNESS_KERNEL_ROOT": None})


def run(args, cwd, tmp_path, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


def digests() -> dict[str, str]:
    return {p.relative_to(TREE).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(TREE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def line_of(path: Path, line: int) -> str:
    return path.read_text().splitlines()[line - 1]


# ------------------------------------------------------------------ the fixture tree

HEADER_ITEMS = {  # (header, what) -> the text its line starts with
    ("bench_common.cuh", "#include <stdlib.h>"): "#include <stdlib.h>",
    ("bench_common.cuh", "#include <cublas_v2.h>"): "#include <cublas_v2.h>",
    ("bench_common.cuh", "declaration g_cublas"): "static cublasHandle_t g_cublas;",
    ("bench_common.cuh", "declaration g_repeats"): "int g_repeats = 20;",
    ("bench_common.cuh", "function check_cuda"): "inline void check_cuda(",
    ("bench_common.cuh", "function cublas"): "inline cublasHandle_t cublas()",
    ("bench_common.cuh", "function random_matrix"): "inline std::vector<float> random_matrix(",
    ("bench_common.cuh", "type GpuTimer"): "struct GpuTimer {",
    ("reduce/block_reduce.cuh", "#include <numeric>"): "#include <numeric>",
    ("reduce/block_reduce.cuh", "function host_sum"): "inline float host_sum(",
}


def test_a_tree_whose_headers_carry_host_code_compiles_through_nvrtc_with_no_launcher_setting(cache):
    assert declared_settings(KERNELS / "row_norm.cu") == ModuleSettings()  # nothing declared
    mod = compile_file("row_norm.cu", kernel_root=KERNELS, arch="sm_90", cache_dir=cache)
    assert (mod.backend, mod.backend_reason) == ("nvrtc", "auto")
    assert [r.kernel for r in mod.resources] == ["row_l2_norm"]
    found = {(s.file, s.what): s for s in mod.set_aside}
    for (header, what), starts in HEADER_ITEMS.items():
        item = found.get((header, what))
        assert item is not None, f"{header}: {what} not set aside; set aside: {sorted(found)}"
        assert line_of(KERNELS / header, item.line).startswith(starts), (header, item)
    assert ("", "function main") in found  # the .cu's own, with no file
    kept = {s.what for s in mod.set_aside}
    assert not any(w.endswith(("warp_sum", "block_sum", "square")) for w in kept)  # device code stays
    assert "--include-path=$VIEW" in mod.options and not any(tempfile.gettempdir() in o for o in mod.options)


def test_the_compile_command_lists_each_headers_set_aside_items(tmp_path):
    before = digests()
    proc = run(["-m", "harness", "compile", "--kernel-root", str(KERNELS)], REPO, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "1 of 1 modules compiled" in out and "in 2 headers" in out
    for header, what in HEADER_ITEMS:
        assert f"{header} line " in out and f": {what} (" in out, f"{header} {what} missing:\n{proc.stdout}"
    assert digests() == before, "compiling changed a file of the tree"


def test_the_trees_own_run_reports_each_headers_items_in_the_compile_item(tmp_path):
    proc = run(["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"], TREE, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "PASSED kernels/row_norm.cu::compile" in out
    assert "PASSED gates/hdr_row_norm.py::test_launcher_threads_equal_the_headers_constexpr" in out
    assert "1 skipped" in out  # the GPU anchor, on this machine
    section = out[out.index("set aside in row_norm.cu:"):]
    assert section.index("set aside in bench_common.cuh:") < section.index("set aside in reduce/block_reduce.cuh:")
    assert "line 10: #include <cublas_v2.h> (a host-only library header)" in section
    assert "line 40: type GpuTimer" in section


def test_static_controls_that_edit_headers_apply_and_compile(tmp_path):
    proc = run(["-m", "harness", "controls", "--static", "--report", str(tmp_path / "rep")], TREE, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 of 2 controls as expected" in proc.stdout


def test_a_header_edit_is_caught_by_the_structural_gate(tmp_path):
    proc = run(["-m", "harness", "controls", "threads_moved_in_header_only", "--no-require-gpu",
                "--report", str(tmp_path / "rep")], TREE, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "proven" in proc.stdout and "1 of 1 controls as expected" in proc.stdout


# ------------------------------------------------------------------ edges


def test_a_header_included_twice_by_two_spellings_is_one_guarded_file(tmp_path, cache):
    write(tmp_path, {"h.cuh": HOST_HEADER, "sub/g.cuh": """\
        #ifndef SUB_G_CUH
        #define SUB_G_CUH
        #include <vector>
        #include "../h.cuh"
        inline std::vector<int> host_sizes() { return {1, 2}; }
        __device__ inline float thrice(float x) { return twice(x) + x; }
        #endif
        """, "k.cu": '#include "h.cuh"\n#include "./h.cuh"\n#include "sub/g.cuh"\n#include "sub/../sub/g.cuh"\n'
                     + KERNEL.replace("twice(x", "thrice(x")})
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    aside = [(s.file, s.what) for s in mod.set_aside]
    assert aside.count(("h.cuh", "function die")) == 1 and ("sub/g.cuh", "function host_sizes") in aside
    assert ("sub/g.cuh", "#include <vector>") in aside


def test_a_header_whose_device_code_needs_host_code_names_the_header_and_line(tmp_path, cache):
    write(tmp_path, {"h.cuh": HOST_HEADER + "int g_scale = 2;\n__device__ float scaled(float x) { return x * g_scale; }\n"
                              "__device__ float handle_bits(cublasHandle_t h) { return 0.f; }\n",
                     "k.cu": '#include "h.cuh"\n' + KERNEL})
    with pytest.raises(CompileError) as err:
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    path, line = err.value.location
    assert path == (tmp_path / "h.cuh").resolve() and line_of(tmp_path / "h.cuh", line) == "int g_scale = 2;"
    text = str(err.value)
    assert text.splitlines()[0].startswith(f"NVRTC could not compile {(tmp_path / 'k.cu').resolve()}: "
                                           f"{(tmp_path / 'h.cuh').resolve()} line {line}: ")
    assert f"{(tmp_path / 'h.cuh').resolve()}(9): error: identifier \"cublasHandle_t\" is undefined" in text
    assert "h.cuh line 3: #include <cublas_v2.h> (a host-only library header)" in text
    assert "kept although host-only, because kept code names them" in text
    assert (f"h.cuh line {line}: declaration g_scale (host-only, kept: kept code names it; device code cannot read "
            "a host variable: make it constexpr, or __device__ or __constant__)") in text
    assert "harness-view-" not in text  # no temporary folder named: the user's own files


def test_a_header_the_view_cannot_separate_names_the_header_and_line(tmp_path, cache):
    write(tmp_path, {"h.cuh": "#pragma once\n__device__ inline float twice(float x) { return 2.0f * x; }\n"
                              "#ifdef WIDE\nvoid launch(double* x)\n#else\nvoid launch(float* x)\n#endif\n{ }\n"
                              "REGISTER_OPS(norm)\n",
                     "k.cu": '#include "h.cuh"\n' + KERNEL})
    with pytest.raises(CompileError) as err:
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    text = str(err.value)
    assert text.startswith(f"could not derive the device view of {(tmp_path / 'k.cu').resolve()}")
    assert f"{(tmp_path / 'h.cuh').resolve()}:3: the device view cannot separate `#ifdef WIDE ...`" in text
    assert "DEVICE_VIEW = False" in text


def test_a_header_outside_the_kernel_root_is_compiled_as_it_is(tmp_path, cache, settings_in_effect):
    """Its host function reaches NVRTC, which refuses host functions in JIT mode."""
    write(tmp_path, {"inc/ext.cuh": "#pragma once\ninline int host_helper() { return 3; }\n"
                                    "__device__ inline float twice(float x) { return 2.0f * x; }\n",
                     "kernels/h.cuh": HOST_HEADER.replace("twice", "unused"),
                     "kernels/k.cu": '#include "h.cuh"\n#include <ext.cuh>\n' + KERNEL})
    settings_in_effect(replace(_settings.in_effect(), include_dirs=((tmp_path / "inc").resolve(),)))
    with pytest.raises(CompileError) as err:
        compile_file("k.cu", kernel_root=tmp_path / "kernels", arch="sm_90", cache_dir=cache)
    assert err.value.location == ((tmp_path / "inc" / "ext.cuh").resolve(), 2)
    assert "\n  h.cuh line 5: function die" in str(err.value) and "\n  ext.cuh" not in str(err.value)


def test_device_only_headers_are_compiled_from_the_kernel_root_itself(tmp_path, cache):
    write(tmp_path, {"h.cuh": "#pragma once\n__device__ inline float twice(float x) { return 2.0f * x; }\n",
                     "k.cu": '#include "h.cuh"\nint main() { return 0; }\n' + KERNEL})
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    assert [s.what for s in mod.set_aside] == ["function main"]
    assert "--include-path=$ROOT" in mod.options and not any("$VIEW" in o for o in mod.options)


def test_the_view_folder_exists_only_during_a_compile_that_misses(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    write(tmp_path, {"k/h.cuh": HOST_HEADER, "k/k.cu": '#include "h.cuh"\n' + KERNEL,
                     "bad/h.cuh": HOST_HEADER + "__device__ int bad() { return g_handle != 0; }\n",
                     "bad/k.cu": '#include "h.cuh"\n' + KERNEL})
    seen = []
    from harness.compiling import closureview

    real_write = closureview.ClosureView.write

    def spy(self, folder, preamble=""):
        out = real_write(self, folder, preamble)
        seen.append(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")))
        return out

    monkeypatch.setattr(closureview.ClosureView, "write", spy)
    first = compile_file("k.cu", kernel_root=tmp_path / "k", arch="sm_90", cache_dir=cache)
    assert not first.cache_hit and seen == [["h.cuh", "k.cu"]]
    assert compile_file("k.cu", kernel_root=tmp_path / "k", arch="sm_90", cache_dir=cache).cache_hit
    assert len(seen) == 1  # a hit writes nothing
    with pytest.raises(CompileError):
        compile_file("k.cu", kernel_root=tmp_path / "bad", arch="sm_90", cache_dir=cache)
    assert list((tmp_path / "tmp").iterdir()) == []  # removed after a success and after a failure


def test_a_header_reached_through_a_symlink_leading_outside_is_linked_not_viewed(tmp_path, cache):
    write(tmp_path, {"outside/lib/ext.cuh": '#pragma once\n#include "ext_detail.cuh"\n',
                     "outside/lib/ext_detail.cuh": "#pragma once\n"
                                                   "__device__ inline float ext_twice(float x) { return 2.f * x; }\n",
                     "kernels/h.cuh": HOST_HEADER, "kernels/k.cu": '#include "h.cuh"\n#include "lib/ext.cuh"\n'
                                                                  + KERNEL.replace("twice(x", "ext_twice(x")})
    (tmp_path / "kernels" / "lib").symlink_to(tmp_path / "outside" / "lib")
    mod = compile_file("k.cu", kernel_root=tmp_path / "kernels", arch="sm_90", cache_dir=cache)
    assert {s.file for s in mod.set_aside} == {"h.cuh"} and "--include-path=$VIEW" in mod.options


@pytest.mark.usefixtures("nvcc")
def test_nvcc_compiles_the_headers_views_too(tmp_path, cache):
    write(tmp_path, {"h.cuh": HOST_HEADER.replace("<cublas_v2.h>", "<torch/extension.h>").replace(
                         "cublasHandle_t", "torch::Tensor"),
                     "k.cu": '#include "h.cuh"\n' + KERNEL, "k.py": 'COMPILER = "nvcc"\n'})
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    assert mod.backend == "nvcc" and [r.kernel for r in mod.resources] == ["k"]
    assert ("h.cuh", "#include <torch/extension.h>") in {(s.file, s.what) for s in mod.set_aside}
    assert "-I$VIEW" in mod.options


def test_the_trap_shadow_compiles_over_the_headers_views(tmp_path, cache):
    write(tmp_path, {"h.cuh": HOST_HEADER, "k.cu": '#include "h.cuh"\n' + KERNEL.replace("{ x", "{ if (!x) __trap(); x")})
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache, trap_shadow=True)
    assert mod.trap_shadow and "harness_trap_shadow_hits" in mod.cubin.decode("latin-1")


# ------------------------------------------------------------------ the rules headers need


def resolve_found(name, quoted):
    return Path(name)


def views(*texts):
    units = [Unit(t, f"f{i}", resolve_found, "" if i == 0 else f"h{i}.cuh") for i, t in enumerate(texts)]
    return device_views(units)


def test_a_host_helper_only_a_host_macro_calls_is_set_aside_until_kept_code_expands_the_macro():
    header = ('#define CHECK(x) check((x), __LINE__)\ninline void check(int e, int line) { if (e) exit(1); }\n'
              "__device__ inline float twice(float x) { return 2.0f * x; }\n")
    host_only = views("int main() { CHECK(0); return 0; }\n", header)[1]
    assert [s.what for s in host_only.set_aside] == ["function check"]
    expanded = views('__global__ void k(int* e) { CHECK(*e); }\n', header)[1]
    assert expanded.set_aside == () and [s.what for s in expanded.kept_host] == ["function check"]


def test_a_host_type_is_set_aside_unless_kept_code_names_it_or_it_has_device_members():
    header = ("struct Timer { cudaEvent_t e; void start() { cudaEventRecord(e); } };\n"
              "struct Params { float* x; int n; };\n"
              "struct Op { __device__ float operator()(float a) const { return a; } };\n")
    view = views("__global__ void k(Params p) { p.x[0] = 1.f; }\n", header)[1]
    assert [(s.line, s.what) for s in view.set_aside] == [(1, "type Timer")]
    assert view.text.splitlines()[0].strip() == "" and view.text.splitlines()[1:] == header.splitlines()[1:]


def test_a_headers_host_alias_that_the_cu_names_is_kept_and_not_called_host_only():
    header = "using index_t = int;\ntypedef float acc_t;\n"
    view = views("__global__ void k(acc_t* x) { x[0] = 1.f; }\n", header)[1]
    assert [s.what for s in view.set_aside] == ["alias index_t"] and view.kept_host == ()


def test_a_plain_data_struct_a_kernel_takes_is_kept_and_not_called_host_only():
    """A parameter struct (data members, a nested alias, no member function) is as much device
    code as host code: kept, and not listed with host code device code cannot use."""
    header = ("struct ConvParams {\n    using index_t = uint32_t;\n    int batch, dim;\n    index_t stride;\n"
              "    void *__restrict__ x_ptr;\n    static constexpr int kMax = 4;\n};\n"
              "struct Timer { int t; void start() { t = 0; } };\n"
              "constexpr int twice(int n) { return 2 * n; }\n")
    view = views("__global__ void k(ConvParams p, Timer* t) { p.batch = twice(p.dim); }\n", header)[1]
    assert view.set_aside == ()
    assert [(s.what, s.reason.split("; ", 1)[1]) for s in view.kept_host] == [
        ("type Timer", "its member functions are host code: give those device code calls __host__ __device__"),
        ("function twice", "a constexpr function: declare the upstream build's --expt-relaxed-constexpr in "
                           "EXTRA_FLAGS (NVRTC: -default-device), or give it __host__ __device__")]
