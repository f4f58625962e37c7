"""The device-only view, the backend rule, include directories and CCCL, one
declaration of compile settings, the options recorded = the options the compiler receives,
and the bad-input table (missing include dir, a header in two dirs, an inseparable host
section, nvcc absent)."""

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from harness.compiling import compile as hc
from harness.core import settings as _settings
from harness.compiling.compile import CompileError, compile_file
from harness.compiling.options import normalise_options
from harness.compiling.deviceview import DeviceViewError, device_view
from harness.compiling.includes import include_path
from harness.compiling.modsettings import LauncherError, ModuleSettings
from harness.compiling.toolchain import NvccNotFound
from harness.core.settings import IncludeDirError
from tests._machine import child_env


KERNEL = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n'


def write(folder: Path, files: dict) -> Path:
    for name, text in files.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return folder


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


# ------------------------------------------------------------------ the device-only view

MIXED = """\
#include <torch/extension.h>
#include <cuda/std/cstdint>
#define DEVICE_INLINE __device__ __forceinline__
using torch::Tensor;
namespace ops {
DEVICE_INLINE float twice(float x) { return 2.0f * x; }
constexpr int kBlock = 128;
template <int N>
__global__ void scale(float* x) { x[threadIdx.x] = twice(x[threadIdx.x]) * N; }
int host_counter = 0;
}
static cublasHandle_t handle;
Tensor run(Tensor x) {
  ops::scale<4><<<1, ops::kBlock>>>(x.data_ptr<float>());
  return x;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
__host__ __device__ inline int both() { return ops::kBlock; }
int main() { return 0; }
"""


def resolve_none(name, quoted):
    return None if name.startswith("torch/") else Path(name)


def test_the_view_sets_aside_host_code_and_keeps_device_code_line_for_line():
    view = device_view(MIXED, "mixed.cu", resolve_none)
    aside = {s.what: s.line for s in view.set_aside}
    assert aside == {"#include <torch/extension.h>": 1, "alias Tensor": 4, "declaration host_counter": 10,
                     "declaration handle": 12, "function run": 13, "function PYBIND11_MODULE": 17,
                     "function main": 19}
    original, viewed = MIXED.split("\n"), view.text.split("\n")
    assert len(viewed) == len(original)  # compiler messages keep the file's own line numbers
    assert viewed[0] == "#include <harness_set_aside.h>"  # what device code got through the host header stays
    for i, line in enumerate(original, 1):
        if i in (4, 10, 12, 13, 14, 15, 16, 17, 19):
            assert viewed[i - 1].strip() == ""
        elif i == 1:
            continue
        else:
            assert viewed[i - 1] == line, f"line {i} changed"


def test_the_view_of_a_device_only_file_is_the_file():
    assert device_view(KERNEL, "k.cu", resolve_none).text == KERNEL
    assert not device_view(KERNEL, "k.cu", resolve_none).set_aside


def test_a_host_function_that_device_code_names_is_kept():
    text = "constexpr int f() { return 3; }\n__global__ void k(int* x) { *x = f(); }\n"
    assert device_view(text, "k.cu", resolve_none).text == text


def test_a_section_the_view_cannot_separate_names_the_line_and_the_text():
    text = KERNEL + "#ifdef WIDE\nvoid launch(double* x)\n#else\nvoid launch(float* x)\n#endif\n{ }\n" \
                    "REGISTER_EXTENSION(my_ops)\n"
    with pytest.raises(DeviceViewError) as err:
        device_view(text, "k.cu", resolve_none)
    msg = str(err.value)
    assert "k.cu:" in msg and "cannot separate" in msg and "DEVICE_VIEW = False" in msg


def test_device_code_that_needs_a_set_aside_header_fails_with_the_list(tmp_path, cache):
    write(tmp_path, {"k.cu": """\
        #include <torch/extension.h>
        __global__ void k(at::Half* x) { }
        """})
    with pytest.raises(CompileError) as err:
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    text = str(err.value)
    assert "line 2" in text and "the device view set aside" in text and "#include <torch/extension.h>" in text


# ------------------------------------------------------------------ CCCL and the backends


def test_cccl_and_cooperative_groups_compile_with_nvrtc(tmp_path, cache):
    write(tmp_path, {"k.cu": """\
        #include <cooperative_groups.h>
        #include <cub/block/block_reduce.cuh>
        #include <cuda/std/cstdint>
        #include <cstdint>
        #include <cfloat>
        namespace cg = cooperative_groups;
        extern "C" __global__ void k(const float* x, float* out, std::uint32_t n) {
          using R = cub::BlockReduce<float, 128>;
          __shared__ typename R::TempStorage t;
          cg::this_thread_block().sync();
          float v = R(t).Sum(threadIdx.x < n ? x[threadIdx.x] : -FLT_MAX);
          if (threadIdx.x == 0) *out = v;
        }
        """})
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    assert mod.backend == "nvrtc" and [r.kernel for r in mod.resources] == ["k"]
    assert any(o.startswith("--include-path=@cccl(") for o in mod.options)


def test_cccl_is_looked_for_first_under_cuda_home(tmp_path, monkeypatch):
    from harness.compiling import toolchain

    (tmp_path / "include" / "cccl" / "cuda").mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    toolchain.cccl_dirs.cache_clear()
    try:
        dirs, where = toolchain.cccl_dirs()
        assert dirs == ((tmp_path / "include" / "cccl").resolve(),) and where == "$CUDA_HOME/include/cccl"
    finally:
        toolchain.cccl_dirs.cache_clear()
        toolchain.cccl_version.cache_clear()


def test_cupys_bundled_cccl_is_found_without_importing_cupy():
    # The last place looked for CCCL; an import of CuPy there cost every compiling process
    # of a machine without the toolkit about 0.15 CPU-s.
    code = ("import sys\nfrom harness.compiling.toolchain import cupy_bundled_cccl\np = cupy_bundled_cccl()\n"
            "print('cupy' in sys.modules)\nimport cupy, pathlib\n"
            "print(p == pathlib.Path(cupy.__file__).resolve().parent / '_core' / 'include' / 'cupy' / '_cccl')\n"
            "print((p / 'libcudacxx' / 'cuda').is_dir())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr


@pytest.mark.usefixtures("nvcc")
def test_the_backend_rule_nvcc_for_cub_cuh_and_name_expressions_map_back(tmp_path, cache):
    write(tmp_path, {"k.cu": """\
        #include <cub/cub.cuh>
        template <int N> __global__ void scale(float* x) { x[threadIdx.x] *= N; }
        """, "k.py": 'NAME_EXPRESSIONS = ("scale<4>",)\n'})
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    assert mod.backend == "nvcc" and "cub/cub.cuh" in mod.backend_reason
    assert mod.symbol_mapping == {"scale<4>": "_Z5scaleILi4EEvPf"}
    assert mod.options[0] == "-arch=sm_90" and "-I$ROOT" in mod.options


def test_compiler_nvrtc_forced_on_cub_cuh_fails_in_nvrtc(tmp_path, cache):
    write(tmp_path, {"k.cu": "#include <cub/cub.cuh>\n" + KERNEL, "k.py": 'COMPILER = "nvrtc"\n'})
    with pytest.raises(CompileError, match="NVRTC could not compile"):
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)


def test_nvcc_requested_but_absent_is_one_clear_error(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("HARNESS_NVCC", str(tmp_path / "no-nvcc"))
    write(tmp_path, {"k.cu": KERNEL, "k.py": 'COMPILER = "nvcc"\n'})
    with pytest.raises(NvccNotFound) as err:
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    msg = str(err.value)
    assert "COMPILER = 'nvcc'" in msg and "HARNESS_NVCC=" in msg and "pip install nvidia-cuda-nvcc" in msg
    env = child_env({"HARNESS_NVCC": str(tmp_path / "no-nvcc"), "HARNESS_CACHE_DIR": str(cache)})
    proc = subprocess.run([sys.executable, "-m", "harness", "compile", "--kernel-root", str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "nvcc not found" in proc.stdout and "pip install nvidia-cuda-nvcc" in proc.stderr


# ------------------------------------------------------------------ include directories


CONFTEST = 'import sys\nif "harness.plugin" not in sys.modules:\n    pytest_plugins = ["harness.plugin"]\n'


def test_an_include_dir_that_does_not_exist_is_a_usage_error(tmp_path):
    write(tmp_path / "kernels", {"k.cu": KERNEL})
    env = child_env({"HARNESS_CACHE_DIR": str(tmp_path / "c")})
    proc = subprocess.run([sys.executable, "-m", "harness", "compile", "--kernel-root", "kernels", "--include-dir",
                           "nowhere"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: include directory nowhere (--include-dir) does not exist")
    assert len(proc.stderr.strip().splitlines()) == 1
    write(tmp_path, {"pytest.ini": "[pytest]\nkernel_root = kernels\nharness_include_dirs = missing/inc\n",
                     "conftest.py": CONFTEST})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 4 and "include directory" in proc.stderr and "ini harness_include_dirs" in proc.stderr


def test_ini_include_dirs_are_searched_hashed_by_content_and_never_copied(tmp_path, cache, settings_in_effect):
    from harness.runs.sandbox import sandbox

    write(tmp_path, {"third_party/inc/scale.cuh": "#define SCALE 2.0f\n",
                     "kernels/k.cu": '#include "scale.cuh"\n'
                                     'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= SCALE; }\n',
                     "pytest.ini": "[pytest]\nkernel_root = kernels\nharness_include_dirs =\n    third_party/inc\n"})
    _, st = _settings.project_settings(rootdir=tmp_path)
    assert st.include_dirs == ((tmp_path / "third_party" / "inc").resolve(),)
    settings_in_effect(replace(_settings.in_effect(), include_dirs=st.include_dirs))
    first = compile_file("k.cu", kernel_root=tmp_path / "kernels", arch="sm_90", cache_dir=cache)
    assert "--include-path=@include0" in first.options and not any(str(tmp_path) in o for o in first.options)
    with sandbox(tmp_path / "kernels") as copy:
        assert sorted(p.name for p in copy.rglob("*")) == ["k.cu"]
        assert compile_file("k.cu", kernel_root=copy, arch="sm_90", cache_dir=cache).cache_hit  # same key
    (tmp_path / "third_party" / "inc" / "scale.cuh").write_text("#define SCALE 3.0f\n")
    again = compile_file("k.cu", kernel_root=tmp_path / "kernels", arch="sm_90", cache_dir=cache)
    assert again.key != first.key and not again.cache_hit


def test_a_header_in_two_include_dirs_names_both_and_which_wins(tmp_path, cache, settings_in_effect):
    write(tmp_path, {"a/common.cuh": "#define V 1\n", "b/common.cuh": "#define V 2\n",
                     "kernels/k.cu": '#include <common.cuh>\n' + KERNEL})
    settings_in_effect(replace(_settings.in_effect(), include_dirs=(tmp_path / "a", tmp_path / "b")))
    with pytest.raises(IncludeDirError) as err:
        compile_file("k.cu", kernel_root=tmp_path / "kernels", arch="sm_90", cache_dir=cache)
    msg = str(err.value)
    assert f"{tmp_path / 'a' / 'common.cuh'} (wins: it comes first in the search order)" in msg
    assert str(tmp_path / "b" / "common.cuh") in msg and "rename or remove one copy" in msg


def test_a_symlink_leading_outside_the_root_is_linked_not_copied(tmp_path):
    from harness.runs.sandbox import sandbox

    write(tmp_path, {"outside/big/h.cuh": "#define X 1\n", "kernels/k.cu": KERNEL})
    (tmp_path / "kernels" / "big").symlink_to(tmp_path / "outside" / "big")
    with sandbox(tmp_path / "kernels") as copy:
        assert (copy / "big").is_symlink() and (copy / "big").resolve() == (tmp_path / "outside" / "big").resolve()


# ------------------------------------------------------------------ one declaration; options = what the compiler got

LAUNCHER = """\
NAME_EXPRESSIONS = ("tiled<2>",)
DEFINES = {"SCALE": 3}
FAST_MATH = True
FMAD = False
EXTRA_FLAGS = ("--maxrregcount=32",)
"""
TEMPLATED = ('template <int N> __global__ void tiled(float* x) { x[threadIdx.x] *= SCALE * N; }\n')


def test_the_declared_settings_are_what_nvrtc_receives_and_what_is_recorded(tmp_path, cache, monkeypatch):
    write(tmp_path, {"k.cu": TEMPLATED, "k.py": LAUNCHER})
    received = {}
    real = hc._compile_nvrtc

    def spy(path, text, options, names):
        received["options"] = list(options)
        return real(path, text, options, names)

    monkeypatch.setattr(hc, "_compile_nvrtc", spy)
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    inc = include_path(tmp_path / "k.cu", tmp_path)
    assert mod.options == normalise_options(received["options"], inc)
    for o in ("--use_fast_math", "--ftz=true", "--fmad=false", "--define-macro=SCALE=3", "--maxrregcount=32"):
        assert o in mod.options
    assert mod.symbol_mapping == {"tiled<2>": "_Z5tiledILi2EEvPf"}
    assert not any(str(tmp_path) in o for o in mod.options)  # folders are labels


def test_every_tool_compiles_the_same_cubin_from_the_one_declaration(tmp_path, cache):
    write(tmp_path, {"k.cu": TEMPLATED, "k.py": LAUNCHER})
    env = child_env({"HARNESS_CACHE_DIR": str(cache)})
    proc = subprocess.run([sys.executable, "-m", "harness", "compile", "--kernel-root", str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache).cache_hit  # gates' path
    from harness.runs.compilecheck import compile_perturbed, declared_names

    check = compile_perturbed(tmp_path, ("k.cu",), arch="sm_90", cache_dir=cache, names=declared_names(tmp_path))
    assert check.ok and check.compiled == 0  # the controls' compile check hit the same cubin


def test_loading_with_settings_that_contradict_the_declaration_is_refused(tmp_path, cache):
    write(tmp_path, {"k.cu": TEMPLATED, "k.py": LAUNCHER})
    with pytest.raises(LauncherError, match="declares DEFINES"):
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache, defines={"SCALE": 4})
    with pytest.raises(LauncherError, match="add every name expression to NAME_EXPRESSIONS"):
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache, name_expressions=("tiled<8>",))
    assert compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache, defines={"SCALE": 3},
                        name_expressions=("tiled<2>",)).symbol_mapping  # repeating it is fine


@pytest.mark.parametrize("change", [
    {"defines": (("SCALE", "4"),)}, {"defines": (("SCALE", "3"), ("EXTRA", None))}, {"fast_math": True},
    {"ftz": True}, {"fmad": False}, {"extra_flags": ("--maxrregcount=64",)}, {"name_expressions": ("tiled<3>",)},
    {"device_view": False}, {"include_dirs": "EXTRA_DIR"},
])
def test_the_cache_key_changes_when_any_setting_changes(tmp_path, cache, change):
    from dataclasses import replace

    write(tmp_path, {"k.cu": "#ifndef SCALE\n#define SCALE 3\n#endif\n" + TEMPLATED, "extra/x.cuh": "\n"})
    base = ModuleSettings(name_expressions=("tiled<2>",), defines=(("SCALE", "3"),))
    if change.get("include_dirs") == "EXTRA_DIR":
        change = {"include_dirs": ((tmp_path / "extra").resolve(),)}
    a = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache, settings=base)
    b = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache, settings=replace(base, **change))
    assert a.key != b.key and not b.cache_hit


def test_a_bad_declaration_is_one_line_naming_the_constant(tmp_path, cache):
    write(tmp_path, {"k.cu": KERNEL, "k.py": "FAST_MATH = 'yes'\n"})
    with pytest.raises(LauncherError, match=r"k.py: FAST_MATH must be True or False, got 'yes'"):
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    write(tmp_path, {"k.py": "INCLUDE_DIRS = ('nope',)\n"})
    sys.modules.pop(next((m for m in sys.modules if m.startswith("_harness_launcher_") and
                          str(tmp_path) in str(getattr(sys.modules[m], "__file__", ""))), ""), None)
    with pytest.raises(LauncherError, match="include directory .*nope .*INCLUDE_DIRS in .*does not exist"):
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)


def test_without_tree_sitter_a_file_compiles_as_it_is_and_host_code_fails_saying_why(tmp_path, cache, monkeypatch):
    from harness.compiling import deviceview

    monkeypatch.setattr(deviceview, "available", lambda: False)
    write(tmp_path, {"k.cu": KERNEL, "h.cu": "#include <torch/extension.h>\n" + KERNEL})
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)
    assert mod.set_aside == () and "no device view" in mod.backend_reason
    with pytest.raises(CompileError, match="pip install tree-sitter tree-sitter-cuda"):
        compile_file("h.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=cache)


def test_gates_json_records_the_options_each_gates_module_was_compiled_with(tmp_path):
    write(tmp_path, {"kernels/k.cu": TEMPLATED, "kernels/k.py": LAUNCHER, "conftest.py": CONFTEST,
                     "pytest.ini": "[pytest]\nkernel_root = kernels\ntestpaths = gates\n",
                     "gates/test_k.py": """\
                         import pytest
                         from harness.library import kernels

                         @pytest.mark.structural
                         def test_loads_k(monkeypatch):
                             monkeypatch.setattr(kernels, "load", lambda compiled: compiled)  # no GPU here
                             assert kernels.module("k.cu").symbol_mapping
                         """})
    env = child_env({"HARNESS_CACHE_DIR": str(tmp_path / "c")})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "gates",
                           "--harness-report", str(tmp_path / "rep")], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    gate = json.loads((tmp_path / "rep" / "gates.json").read_text())["gates"][0]
    opts = gate["compile_options"]
    assert "--define-macro=SCALE=3" in opts and "--use_fast_math" in opts and "--include-path=$ROOT" in opts
    assert not any(str(tmp_path) in o for o in opts)
