"""Bad input on the compile path gets one clear line, from `python -m harness compile`, from
the `.cu` compile items under pytest and from `harness.compiling.compile.compile_file`: what was wrong,
where (file and line where there is one) and what to do. No traceback, no pytest internals,
and nothing accepted silently. No GPU needed."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from harness.compiling.compile import CompileError, compile_file
from tests._machine import child_env as machine_env

KERNEL = 'extern "C" __global__ void plain(float* out) { out[threadIdx.x] = 2.0f; }\n'


def child_env(**extra: str) -> dict:
    return machine_env({"HARNESS_KERNEL_ROOT": None, "HARNESS_CACHE_MAX": None, "HARNESS_ARCH": None, **extra})


def _without_file_permission_override():
    """In the child before exec: drop the capabilities that let root read any file, so a
    file with mode 000 is as unreadable to it as to any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: exec then grants root no more than this set


def run(args, cwd, *, env=None, unprivileged=False, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_without_file_permission_override if unprivileged else None)


def compile_cmd(root: Path, cache: Path, *extra, env=None, unprivileged=False):
    return run(["-m", "harness", "compile", "--kernel-root", str(root), "--cache-dir", str(cache), *extra],
               root.parent, env=env, unprivileged=unprivileged)


def pytest_run(project: Path, *extra, env=None, unprivileged=False):
    return run(["-m", "pytest", "-p", "no:cacheprovider", "-q", *extra], project, env=env, unprivileged=unprivileged)


def one_line(result, *needles: str, stream: str = "stderr") -> str:
    """The run failed with no traceback, and exactly one line of `stream` holds every needle."""
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "Traceback" not in out and "_pytest" not in out and "pluggy" not in out, out
    text = result.stderr if stream == "stderr" else result.stdout
    lines = [line for line in text.splitlines() if all(n in line for n in needles)]
    assert len(lines) == 1, (needles, out)
    return lines[0]


def failure_section(result, item: str) -> list[str]:
    """The lines pytest prints for `item`'s failure, between its `___ item ___` header and the
    next section."""
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("_") and f" {item} " in line)
    body = []
    for line in lines[start + 1:]:
        if line.startswith(("___", "===", "---")):
            break
        body.append(line)
    return [line for line in body if line.strip()]


@pytest.fixture
def project(tmp_path) -> Path:
    """A project whose pytest.ini names the kernel root `kernels/`, holding one plain kernel."""
    p = tmp_path / "project"
    (p / "kernels").mkdir(parents=True)
    (p / "pytest.ini").write_text("[pytest]\nkernel_root = kernels\n")
    (p / "kernels" / "k.cu").write_text(KERNEL)
    return p


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


# ------------------------------------------------------------------ HARNESS_CACHE_MAX


def test_a_cache_bound_that_is_not_a_size_is_refused_by_the_compile_command(project, cache):
    result = compile_cmd(project / "kernels", cache, env=child_env(HARNESS_CACHE_MAX="banana"))
    assert result.returncode == 2
    one_line(result, "HARNESS_CACHE_MAX='banana' is not a size", "write e.g. HARNESS_CACHE_MAX=256M")
    assert "modules compiled" not in result.stdout


def test_a_cache_bound_that_is_not_a_size_is_a_usage_error_in_pytest(project):
    result = pytest_run(project, env=child_env(HARNESS_CACHE_MAX="banana"))
    assert result.returncode == 4  # pytest's usage error: nothing ran
    one_line(result, "harness: HARNESS_CACHE_MAX='banana' is not a size", "write e.g. HARNESS_CACHE_MAX=256M")
    assert "passed" not in result.stdout


@pytest.mark.parametrize("command", [("cache", "info"), ("controls", "--static")])
def test_every_command_that_keeps_a_cache_refuses_the_same_bad_bound_in_the_same_words(project, cache, command):
    result = run(["-m", "harness", *command, "--cache-dir", str(cache)], project,
                 env=child_env(HARNESS_CACHE_MAX="banana"))
    assert result.returncode == 2
    one_line(result, "HARNESS_CACHE_MAX='banana' is not a size", "write e.g. HARNESS_CACHE_MAX=256M")


def test_a_cache_bound_that_is_a_size_is_accepted_by_compile_and_pytest(project, cache):
    env = child_env(HARNESS_CACHE_MAX="64M")
    assert compile_cmd(project / "kernels", cache, env=env).returncode == 0
    assert pytest_run(project, env=env).returncode == 0


# ------------------------------------------------------------------ a .cu or header that cannot be read


def unreadable(path: Path) -> Path:
    """`path` with mode 000, or a skip where this machine cannot make a file unreadable to a
    child (root that may not drop its capabilities)."""
    path.chmod(0)
    probe = run(["-c", f"open({str(path)!r}).read()"], path.parent, unprivileged=True)
    if probe.returncode == 0:
        pytest.skip("a file with mode 000 stays readable to a child process on this machine")
    return path


@pytest.fixture
def u_cu(project) -> Path:
    cu = project / "kernels" / "u.cu"
    cu.write_text(KERNEL)
    return cu


def test_an_unreadable_cu_is_one_line_in_the_compile_command_and_the_rest_compile(project, cache, u_cu):
    (project / "kernels" / "b.cu").write_text(KERNEL.replace("plain", "other"))
    cu = unreadable(u_cu)
    result = compile_cmd(project / "kernels", cache, unprivileged=True)
    assert result.returncode == 1
    one_line(result, f"{cu}: cannot be read (Permission denied)", "make it readable")
    assert "2 of 3 modules compiled" in result.stdout


def test_an_unreadable_cu_fails_its_compile_item_in_one_line(project, u_cu):
    unreadable(u_cu)
    result = pytest_run(project, unprivileged=True)
    assert result.returncode == 1
    assert "1 failed, 1 passed" in result.stdout, result.stdout
    (line,) = failure_section(result, "compile u.cu")
    assert line.startswith(f"{u_cu}: cannot be read (Permission denied)") and "make it readable" in line
    assert "Traceback" not in result.stdout and "_pytest" not in result.stdout


def test_an_unreadable_header_names_the_header_and_the_cu_that_includes_it(project, cache):
    (project / "kernels" / "h.cuh").write_text("#pragma once\n#define TWO 2.0f\n")
    (project / "kernels" / "k.cu").write_text('#include "h.cuh"\n' + KERNEL.replace("2.0f", "TWO"))
    header = unreadable(project / "kernels" / "h.cuh")
    result = compile_cmd(project / "kernels", cache, unprivileged=True)
    assert result.returncode == 1
    one_line(result, f"{header}: cannot be read (Permission denied)", "k.cu includes it", "make it readable")


@pytest.mark.parametrize("target", ["kernels/moved_away.cu", "elsewhere/moved_away.cu"])
def test_a_cu_that_is_a_broken_symlink_is_named_not_skipped(project, cache, target):
    link = project / "kernels" / "gone.cu"
    link.symlink_to(project / target)
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"{link}: a symlink to {project / target}, which does not exist", "fix the link or remove it")
    assert "1 of 2 modules compiled" in result.stdout
    run_ = pytest_run(project)
    assert run_.returncode == 1 and "1 failed, 1 passed" in run_.stdout, run_.stdout
    (line,) = failure_section(run_, "compile gone.cu")
    assert line.startswith(f"{link}: a symlink to {project / target}, which does not exist"), line


def test_a_folder_named_like_a_cu_file_is_named_not_skipped(project, cache):
    (project / "kernels" / "odd.cu").mkdir()
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"{project / 'kernels' / 'odd.cu'}: a folder, not a .cu file", "rename it")


def test_compile_file_raises_one_line_for_a_cu_it_cannot_read(tmp_path, monkeypatch):
    (tmp_path / "k.cu").write_text(KERNEL)
    real = Path.read_bytes

    def denied(self):
        if self.name == "k.cu":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(CompileError) as info:
        compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert str(info.value).splitlines() == [
        f"{tmp_path / 'k.cu'}: cannot be read (Permission denied): make it readable (chmod a+r "
        f"{tmp_path / 'k.cu'}), or move it out of the kernel root"]


# ------------------------------------------------------------------ quoted includes


def compile_error_head(root: Path) -> str:
    """The first line of the CompileError compiling `root`/k.cu raises."""
    with pytest.raises(CompileError) as info:
        compile_file("k.cu", kernel_root=root, arch="sm_90", use_cache=False)
    return str(info.value).splitlines()[0]


def test_a_misspelled_quoted_include_is_a_compile_error_naming_the_file_and_line(tmp_path):
    (tmp_path / "real.h").write_text("#pragma once\n#define TWO 2.0f\n")
    (tmp_path / "k.cu").write_text('// a kernel\n#include "raal.h"\n' + KERNEL)
    head = compile_error_head(tmp_path)
    assert head == f'NVRTC could not compile {tmp_path / "k.cu"}: line 2: cannot open source file "raal.h"', head


def test_a_misspelled_quoted_include_in_a_kernel_root_header_names_the_header_and_line(tmp_path):
    (tmp_path / "common.cuh").write_text('#pragma once\n\n#include "helpres.cuh"\n')
    (tmp_path / "k.cu").write_text('#include "common.cuh"\n' + KERNEL)
    head = compile_error_head(tmp_path)
    assert head.endswith(f'{tmp_path / "common.cuh"} line 3: cannot open source file "helpres.cuh"'), head


def test_a_quoted_include_the_preprocessor_skips_may_be_missing(tmp_path):
    """The view does not evaluate `#if`: a quoted include of another platform's header stays
    in the view, and the preprocessor leaves it out, as the upstream build does."""
    (tmp_path / "k.cu").write_text('#ifdef USE_ROCM\n#include "hip_compat.h"\n#endif\n' + KERNEL)
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert [r.kernel for r in mod.resources] == ["plain"] and not mod.set_aside


def test_a_quoted_include_of_a_host_library_is_still_set_aside(tmp_path):
    (tmp_path / "k.cu").write_text('#include "torch/extension.h"\n' + KERNEL)
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert [s.what for s in mod.set_aside] == ['#include "torch/extension.h"']


# ------------------------------------------------------------------ a .cu that compiles to no kernel

HOST_ONLY_CU = "#include <vector>\nint count(const std::vector<int>& v) { return (int)v.size(); }\n"
TEMPLATE_CU = ("template <int N>\n__global__ __launch_bounds__(N) void scale(float* x) { x[threadIdx.x] *= N; }\n"
               "void launch(float* x) { scale<128><<<1, 128>>>(x); }\n")


def test_a_cu_with_only_host_code_fails_the_compile_command_saying_it_holds_no_kernel(project, cache):
    (project / "kernels" / "host.cu").write_text(HOST_ONLY_CU)
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"{project / 'kernels' / 'host.cu'}: compiled to no kernel: no __global__ function in it or "
                     "the headers it includes (the device view set aside 2 host items)",
             f"declare HOST_ONLY = True in {project / 'kernels' / 'host.py'}")
    assert "1 of 2 modules compiled" in result.stdout


def test_a_cu_with_only_host_code_fails_its_compile_item_in_one_line(project):
    (project / "kernels" / "host.cu").write_text(HOST_ONLY_CU)
    result = pytest_run(project)
    assert result.returncode == 1 and "1 failed, 1 passed" in result.stdout, result.stdout
    (line,) = failure_section(result, "compile host.cu")
    assert "compiled to no kernel" in line and "HOST_ONLY = True" in line


def test_a_cu_whose_kernels_are_templates_nothing_instantiates_names_them_and_name_expressions(project, cache):
    (project / "kernels" / "tmpl.cu").write_text(TEMPLATE_CU)
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"{project / 'kernels' / 'tmpl.cu'}: compiled to no kernel: its kernels are templates that "
                     "only host code instantiated (scale, line 2), and the device view set that aside",
             f"NAME_EXPRESSIONS in {project / 'kernels' / 'tmpl.py'}", 'e.g. NAME_EXPRESSIONS = ("scale<...>",)')


def test_naming_the_instances_gives_the_kernels_and_a_green_compile(project, cache):
    (project / "kernels" / "tmpl.cu").write_text(TEMPLATE_CU)
    (project / "kernels" / "tmpl.py").write_text('NAME_EXPRESSIONS = ("scale<128>",)\n')
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 0, result.stderr
    assert "scale<128>" in " ".join(result.stdout.split()) or "_Z5scale" in result.stdout


def test_a_host_only_cu_declared_in_its_launcher_compiles_green_and_says_so(project, cache):
    (project / "kernels" / "host.cu").write_text(HOST_ONLY_CU)
    (project / "kernels" / "host.py").write_text("HOST_ONLY = True  # the extension's bindings: no kernel\n")
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 0, result.stderr
    assert "(host-only: HOST_ONLY)" in result.stdout
    run_ = pytest_run(project, "-rA")
    assert run_.returncode == 0 and "2 passed" in run_.stdout, run_.stdout
    assert "host-only (HOST_ONLY = True in" in run_.stdout


def test_host_only_declared_for_a_cu_with_kernels_fails_naming_them(project, cache):
    (project / "kernels" / "k.py").write_text("HOST_ONLY = True\n")
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"{project / 'kernels' / 'k.py'} declares HOST_ONLY = True, but",
             "compiles to kernels: plain", "remove HOST_ONLY")


def test_host_only_must_be_true_or_false(project, cache):
    (project / "kernels" / "k.py").write_text('HOST_ONLY = "yes"\n')
    result = compile_cmd(project / "kernels", cache)
    one_line(result, "HOST_ONLY must be True or False, got 'yes'")


# ------------------------------------------------------------------ launcher settings and compiler options


@pytest.mark.parametrize("flag,owner", [
    ("-arch=sm_80", "the arch is the run's"), ("--gpu-architecture=sm_80", "the arch is the run's"),
    ("-gencode=arch=compute_80,code=sm_80", "the arch is the run's"), ("--use_fast_math", "FAST_MATH = True"),
    ("--fmad=false", "FMAD = False"), ("--ftz=true", "FTZ = True"), ("--prec-div=false", "FAST_MATH = True"),
    ("-I/opt/include", "INCLUDE_DIRS"), ("--include-path=/opt/include", "INCLUDE_DIRS")])
def test_an_extra_flag_that_a_setting_owns_is_one_line_naming_the_setting(project, cache, flag, owner):
    """NVRTC takes the last of two such flags with only a warning in its log: the module would
    be built otherwise than its recorded settings say (or, for -I, with headers the cache key
    never hashes)."""
    (project / "kernels" / "k.py").write_text(f"EXTRA_FLAGS = ({flag!r},)\n")
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"{project / 'kernels' / 'k.py'}: EXTRA_FLAGS sets {flag}", owner)


@pytest.mark.parametrize("flag,said", [("--bogus", "nvrtc: unrecognized option --bogus found"),
                                       ("--pre-include=nope.h", 'cannot open source file "nope.h"')])
def test_an_option_nvrtc_refuses_is_named_on_the_first_line(project, cache, flag, said):
    (project / "kernels" / "k.py").write_text(f"EXTRA_FLAGS = ({flag!r},)\n")
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"NVRTC could not compile {project / 'kernels' / 'k.cu'}: {said}")


def test_a_define_whose_value_spans_lines_is_one_line_naming_it(project, cache):
    (project / "kernels" / "k.py").write_text('DEFINES = {"A": "1\\n2"}\n')
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, "DEFINES value of 'A' is '1\\n2', which spans lines", "a macro's value is one line")


def test_an_empty_name_expression_is_one_line(project, cache):
    (project / "kernels" / "k.py").write_text('NAME_EXPRESSIONS = ("plain", "")\n')
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, "NAME_EXPRESSIONS holds an empty string", 'write e.g. NAME_EXPRESSIONS = ("my_kernel<256>",)')


def test_a_name_expression_that_names_no_kernel_says_so_not_nvrtcs_internal_file(project, cache):
    (project / "kernels" / "k.py").write_text('NAME_EXPRESSIONS = ("plain", "nosuch<1>")\n')
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    line = one_line(result, f"NVRTC could not compile {project / 'kernels' / 'k.cu'}: NAME_EXPRESSIONS in "
                            f"{project / 'kernels' / 'k.py'} ('plain', 'nosuch<1>') names something k.cu does not "
                            'define: identifier "nosuch" is undefined')
    assert "__nv_name_map" not in line


def test_an_empty_arch_is_refused_not_read_as_the_default(project, cache):
    result = compile_cmd(project / "kernels", cache, "--arch", "")
    assert result.returncode == 2
    one_line(result, "--arch is empty", "pass e.g. --arch sm_90, or leave it out")


# ------------------------------------------------------------------ odd sources


def test_a_nul_byte_in_a_cu_names_its_line_and_column(project, cache):
    (project / "kernels" / "z.cu").write_bytes(KERNEL.encode() + b"// \x00\n")
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"could not read {project / 'kernels' / 'z.cu'}: line 2: byte 0x00 at column 4 is a NUL",
             "a source file holds text")


def test_an_empty_cu_says_it_is_empty(project, cache):
    (project / "kernels" / "e.cu").write_text("\n// nothing yet\n")
    result = compile_cmd(project / "kernels", cache)
    assert result.returncode == 1
    one_line(result, f"{project / 'kernels' / 'e.cu'}: compiled to no kernel: the file holds no code",
             "write its kernels, or remove it")


def test_a_cu_named_to_pytest_outside_the_kernel_root_fails_in_one_line_naming_the_root(project):
    outside = project / "experiments" / "o.cu"  # in the project, beside the kernel root
    outside.parent.mkdir()
    outside.write_text(KERNEL)
    result = pytest_run(project, str(outside))
    assert result.returncode == 1, result.stdout
    (line,) = failure_section(result, "compile o.cu")
    assert line == (f"{outside} is not under the kernel root {project / 'kernels'}: the compile gates compile the "
                    "kernel root's .cu files; pass --kernel-root DIR (or set the ini key kernel_root) to its folder")
