"""Bad input gets one clear error: what was wrong and what to do, a non-zero exit, no
traceback. One test per kind of bad input (the device probe and the child timeout are
tested with the worker pool, in tests/test_workers.py). No GPU needed."""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from harness.compiling.arch import ArchError, check_arch
from harness.compiling.compile import CompileError, compile_file, declared_name_expressions
from harness.compiling.cubin_cache import CacheNotWritable, _warned_caches
from harness.compiling.modsettings import LauncherError
from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]
SUITE = Path(__file__).parent / "fixtures" / "controls_suite"

KERNEL = 'extern "C" __global__ void plain(float* out) { out[threadIdx.x] = 2.0f; }\n'


def run_harness(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          env=child_env(env), timeout=300)


def run_pytest(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          capture_output=True, text=True, env=child_env(env), timeout=300)


def one_clear_line(result, *needles: str) -> str:
    """The run failed with no traceback, and one stderr line holds every needle."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if all(n in line for n in needles)]
    assert len(lines) == 1, (needles, result.stderr)
    return lines[0]


@pytest.fixture
def tree(tmp_path):
    """A project: pytest.ini naming the kernel root, a package of kernels with a launcher."""
    project = tmp_path / "project"
    root = project / "kernels"
    root.mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\nkernel_root = kernels\n")
    (root / "__init__.py").write_text("")
    (root / "k.cu").write_text(KERNEL)
    return root


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


# ------------------------------------------------------------------ the launcher beside a .cu


def test_a_launcher_that_raises_on_import_is_one_line_naming_it_and_its_line(tree, cache):
    (tree / "k.py").write_text("SIZES = (1, 2)\nraise RuntimeError('launcher exploded')\n")
    result = run_harness("compile", "--kernel-root", str(tree), "--cache-dir", str(cache), cwd=tree.parent)
    assert result.returncode == 1
    one_clear_line(result, f"{tree / 'k.py'}: importing the launcher to read NAME_EXPRESSIONS failed (line 2)",
                   "RuntimeError: launcher exploded", "fix the launcher")


def test_name_expressions_as_a_string_is_one_line_showing_the_tuple_to_write(tree, cache):
    (tree / "k.py").write_text('NAME_EXPRESSIONS = "k"\n')
    result = run_harness("compile", "--kernel-root", str(tree), "--cache-dir", str(cache), cwd=tree.parent)
    assert result.returncode == 1
    one_clear_line(result, "NAME_EXPRESSIONS must be a tuple of C++ name expressions (strings), got 'k'",
                   "(note the trailing comma)")
    with pytest.raises(LauncherError):
        declared_name_expressions(tree / "k.cu")


# ------------------------------------------------------------------ folders that are files


def test_a_cache_dir_that_is_a_file_is_refused_before_compiling(tree, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_harness("compile", "--kernel-root", str(tree), "--cache-dir", str(blocker), cwd=tree.parent)
    assert result.returncode == 2
    one_clear_line(result, f"--cache-dir {blocker} is a file, not a folder", "pass a folder")


def test_a_harness_report_that_is_a_file_is_a_usage_error_before_the_run(tree, tmp_path):
    project = tree.parent
    (project / "test_x.py").write_text("import pytest\n\n@pytest.mark.structural\ndef test_x():\n    pass\n")
    (project / "rep").write_text("")
    result = run_pytest("test_x.py", "--harness-report", "rep", cwd=project)
    assert result.returncode == 4  # pytest's usage error
    one_clear_line(result, "harness: --harness-report rep is a file, not a folder")
    assert "passed" not in result.stdout


# ------------------------------------------------------------------ the cubin cache


@pytest.mark.parametrize("meta", ["[]", '{"cubin_sha256": "x", "log": ""}', '{"symbol_mapping": [], "log": 3}'])
def test_a_cache_entry_of_the_wrong_shape_is_a_miss_recompiled_and_overwritten(tree, cache, meta):
    first = compile_file("k.cu", kernel_root=tree, arch="sm_90", cache_dir=cache)
    meta_path = first.cubin_path.with_suffix(".json")
    meta_path.write_text(meta)
    again = compile_file("k.cu", kernel_root=tree, arch="sm_90", cache_dir=cache)
    assert not again.cache_hit and again.cubin == first.cubin
    assert isinstance(json.loads(meta_path.read_text())["symbol_mapping"], dict)  # overwritten
    assert compile_file("k.cu", kernel_root=tree, arch="sm_90", cache_dir=cache).cache_hit


def test_a_cache_that_cannot_be_written_compiles_without_caching_and_says_so_once(tree, tmp_path):
    """CI runs as root, where a read-only folder is still writable, so the cache here is a
    path that cannot be created at all: a folder under a regular file."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    unwritable = blocker / "cache"
    (tree / "second.cu").write_text(KERNEL.replace("plain", "second"))
    _warned_caches.discard(str(unwritable))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = compile_file("k.cu", kernel_root=tree, arch="sm_90", cache_dir=unwritable)
        b = compile_file("second.cu", kernel_root=tree, arch="sm_90", cache_dir=unwritable)
    assert a.cubin and b.cubin and not a.cache_hit and not b.cache_hit
    said = [w for w in caught if issubclass(w.category, CacheNotWritable)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert f"the cubin cache {unwritable} cannot be written" in str(said[0].message)
    assert "compiling without caching" in str(said[0].message)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode; the test above covers it")
def test_a_read_only_empty_cache_folder_compiles_without_caching(tree, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.warns(CacheNotWritable):
            assert compile_file("k.cu", kernel_root=tree, arch="sm_90", cache_dir=ro).cubin
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------ the kernel root


def test_gates_pointed_at_an_empty_kernel_root_is_one_usage_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_pytest("gates", "--kernel-root", str(empty), cwd=REPO)
    assert result.returncode == 4
    one_clear_line(result, f"harness: kernel root {empty} holds no .cu file", "pass --kernel-root DIR")
    assert "FileNotFoundError" not in result.stdout + result.stderr


def test_compile_works_from_another_folder_with_absolute_paths(tree, cache, tmp_path):
    """The launcher imports a module of its own package: the command puts the package's
    parent on the import path, whatever the working folder."""
    (tree / "sizes.py").write_text("SIZES = (8,)\n")
    (tree / "k.py").write_text("from kernels.sizes import SIZES\nNAME_EXPRESSIONS = ()\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_harness("compile", "--kernel-root", str(tree), "--cache-dir", str(cache), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert "1 of 1 modules compiled" in result.stdout


def test_compile_from_a_subfolder_reads_the_projects_ini(tree, cache):
    sub = tree.parent / "docs" / "deep"
    sub.mkdir(parents=True)
    result = run_harness("compile", "--cache-dir", str(cache), cwd=sub)
    assert result.returncode == 0, result.stderr
    assert f"kernel root {tree}" in " ".join(result.stdout.split())


def test_controls_static_from_a_subfolder_and_from_another_folder(tmp_path):
    suite = tmp_path / "suite"
    shutil.copytree(SUITE, suite)
    args = ("controls", "--static", "value_changed", "--cache-dir", str(tmp_path / "c"),
            "--report", str(tmp_path / "report"))
    inside = run_harness(*args, cwd=suite / "gates")
    assert inside.returncode == 0, inside.stderr
    assert "1 of 1 controls as expected" in inside.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = run_harness(*args, "--rootdir", str(suite), "--kernel-root", str(suite / "kernels"), cwd=elsewhere)
    assert outside.returncode == 0, outside.stderr


# ------------------------------------------------------------------ sources and arches


def test_a_non_utf8_byte_names_the_file_line_and_fix_not_nvrtc(tree, cache):
    (tree / "latin1.cu").write_bytes(b"// ok\n// caf\xe9\n" + KERNEL.encode())
    with pytest.raises(CompileError) as info:
        compile_file("latin1.cu", kernel_root=tree, arch="sm_90", cache_dir=cache)
    text = str(info.value)
    assert text.splitlines()[0].startswith(f"could not read {tree / 'latin1.cu'}: line 2:")
    assert "byte 0xe9 at column 7 is not UTF-8" in text and "save the file as UTF-8" in text
    assert "NVRTC could not compile" not in text


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_arch_specific_variants_nvrtc_accepts_are_accepted_and_compile(tree, cache, arch):
    assert check_arch(arch) == arch
    mod = compile_file("k.cu", kernel_root=tree, arch=arch, cache_dir=cache)
    assert mod.arch == arch and mod.cubin and f"-arch={arch}" in mod.options


def test_a_variant_of_an_arch_nvrtc_does_not_target_is_refused():
    with pytest.raises(ArchError, match=r"unknown --arch 'sm_91a': NVRTC \S+ targets .*sm_90"):
        check_arch("sm_91a")


def test_a_bad_harness_arch_names_the_variable_in_the_command_and_in_pytest(tree, cache):
    env = {"HARNESS_ARCH": "banana"}
    result = run_harness("compile", "--kernel-root", str(tree), "--cache-dir", str(cache), cwd=tree.parent, env=env)
    assert result.returncode == 2
    one_clear_line(result, "unknown HARNESS_ARCH 'banana'", "set HARNESS_ARCH to one of them, or unset it")
    (tree.parent / "test_x.py").write_text("import pytest\n\n@pytest.mark.structural\ndef test_x():\n    pass\n")
    run = run_pytest("test_x.py", cwd=tree.parent, env=env)
    assert run.returncode == 4
    one_clear_line(run, "harness: unknown HARNESS_ARCH 'banana'")


# ------------------------------------------------------------------ the controls command


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_controls_refuse_a_deadline_that_is_not_a_positive_finite_number(value, tmp_path):
    result = run_harness("controls", "--static", "--deadline", value, "--rootdir", str(SUITE),
                         "--report", str(tmp_path / "r"), cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, f"--deadline must be a positive, finite number of seconds (got {value}); pass e.g. "
                           "--deadline 300")


def test_controls_without_static_on_a_machine_with_no_gpu_say_so_and_what_to_run(tmp_path):
    """run_harness hides every device (child_env), so this holds on the GPU machine too."""
    result = run_harness("controls", "value_changed", "--rootdir", str(SUITE), "--report", str(tmp_path / "r"),
                         cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, "controls run their gates on a CUDA device, and this machine has none usable",
                   "run `python -m harness controls --static` here")
    assert not (tmp_path / "r").exists()


def test_a_harness_cache_dir_that_is_a_file_is_a_usage_error_in_pytest(tree, tmp_path):
    project = tree.parent
    (project / "test_x.py").write_text("import pytest\n\n@pytest.mark.structural\ndef test_x():\n    pass\n")
    blocker = tmp_path / "cache_file"
    blocker.write_text("")
    result = run_pytest("test_x.py", "--harness-cache-dir", str(blocker), cwd=project)
    assert result.returncode == 4
    one_clear_line(result, f"harness: --harness-cache-dir {blocker} is a file, not a folder")


# ------------------------------------------------------------------ one set of settings


def test_commands_resolve_settings_by_the_rules_pytest_uses(tmp_path, monkeypatch):
    from harness.core import settings as _settings

    project = tmp_path / "p"
    (project / "src" / "k").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\nkernel_root = "src/k"\nharness_cache_dir = ".cubins"\n')
    for var in (_settings.KERNEL_ROOT_ENV, _settings.CACHE_ENV, _settings.ARCH_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(project / "src")
    root, s = _settings.project_settings()
    assert root == project and s.kernel_root == project / "src" / "k" and s.cache_dir == project / ".cubins"
    assert s.arch is None
    monkeypatch.setenv(_settings.KERNEL_ROOT_ENV, str(tmp_path / "env_k"))
    monkeypatch.setenv(_settings.CACHE_ENV, str(tmp_path / "env_cache"))
    monkeypatch.setenv(_settings.ARCH_ENV, "sm_80")
    _, s = _settings.project_settings()
    assert s.kernel_root == tmp_path / "env_k"  # the variable beats the ini key, as in the plugin
    assert s.cache_dir == tmp_path / "env_cache"  # for every setting: option, variable, ini key, default
    assert (s.arch, s.arch_source) == ("sm_80", "HARNESS_ARCH")
    _, s = _settings.project_settings(kernel_root="k2", cache_dir="c2", arch="sm_90")
    assert s.kernel_root == project / "src" / "k2" and s.cache_dir == project / "src" / "c2"
    assert (s.arch, s.arch_source) == ("sm_90", "--arch")


def test_pytest_reads_harness_arch_too(tree):
    project = tree.parent
    (project / "test_x.py").write_text(
        "import pytest\nfrom harness.core import settings as _settings\nfrom harness.compiling.arch import resolve_arch\n\n"
        "@pytest.mark.structural\ndef test_x():\n    assert _settings.in_effect().arch == 'sm_80'\n"
        "    assert resolve_arch() == 'sm_80'\n")
    result = run_pytest("test_x.py", cwd=project, env={"HARNESS_ARCH": "sm_80"})
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ report merge, and report folders that are files


def shard_report(folder: Path, text: str | None = None) -> Path:
    """A --harness-report folder whose gates.json holds `text` (default: one passed gate)."""
    folder.mkdir(parents=True, exist_ok=True)
    if text is None:
        text = json.dumps({"version": 1, "arch": "sm_90", "gates": [{"nodeid": "t.py::test_a", "outcome": "passed"}]})
    (folder / "gates.json").write_text(text)
    return folder


@pytest.mark.parametrize("text, needle", [
    ('{"version": 1, "gates": [', "is not JSON (Expecting value: line 1 column 26)"),
    ("{}", "holds no gates list"),
    ('{"version": 1, "gates": [{"outcome": "passed"}]}', "gates[0] has no nodeid"),
    ('{"version": 1, "gates": [{"nodeid": "t.py::a", "outcome": "green"}]}', "gates[0] has outcome 'green'"),
    ('{"version": 1, "shard": "one", "gates": []}', "shard 'one' is not K/N"),
    ("[1, 2]", "holds no gates list"),
], ids=["truncated", "empty-object", "gate-without-nodeid", "unknown-outcome", "bad-shard", "a-list"])
def test_report_merge_of_a_gates_json_that_is_not_one_names_the_file_and_what_it_must_hold(tmp_path, text, needle):
    bad = shard_report(tmp_path / "bad", text)
    result = run_harness("report", "merge", str(bad), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    line = one_clear_line(result, f"{bad / 'gates.json'}", needle)
    assert line.startswith("error: ") and "pytest --harness-report" in line
    assert not (tmp_path / "out").exists()


def test_report_merge_of_reports_holding_no_gate_is_refused(tmp_path):
    empty = shard_report(tmp_path / "empty", '{"version": 1, "gates": []}')
    result = run_harness("report", "merge", str(empty), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, "the reports hold no gate", "nothing to merge")


def test_report_merge_out_that_is_a_file_is_one_usage_error_before_the_merge(tmp_path):
    good = shard_report(tmp_path / "good")
    blocker = tmp_path / "out"
    blocker.write_text("")
    result = run_harness("report", "merge", str(good), "--out", str(blocker), cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, f"--out {blocker} is a file, not a folder", "pass a folder")


def test_mutate_report_that_is_a_file_is_one_usage_error_before_the_campaign(tmp_path):
    suite = tmp_path / "suite"
    shutil.copytree(Path(__file__).parent / "fixtures" / "mutate_suite", suite)
    blocker = tmp_path / "rep"
    blocker.write_text("")
    result = run_harness("mutate", "--static", "--report", str(blocker), "--cache-dir", str(tmp_path / "c"),
                         cwd=suite)
    assert result.returncode == 2
    one_clear_line(result, f"--report {blocker} is a file, not a folder", "pass a folder")


# ------------------------------------------------------------------ an ini kernel root that holds no .cu


@pytest.mark.parametrize("command", [("mutate", "--static"), ("controls", "--static")], ids=["mutate", "controls"])
def test_an_ini_kernel_root_holding_no_cu_is_one_line_naming_the_ini_key(tmp_path, command):
    project = tmp_path / "p"
    (project / "kern").mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\nkernel_root = kern\n")
    result = run_harness(*command, "--cache-dir", str(tmp_path / "c"), cwd=project,
                         env={"HARNESS_KERNEL_ROOT": ""})
    assert result.returncode == 2
    one_clear_line(result, f"kernel root {project / 'kern'} holds no .cu file: set the ini key kernel_root")
    assert not (project / "harness-report").exists()


@pytest.mark.parametrize("command", [("mutate", "--static"), ("controls", "--static"), ("cache", "info")],
                         ids=["mutate", "controls", "cache"])
def test_an_ini_include_dir_that_does_not_exist_is_one_usage_line_from_every_command(tmp_path, command):
    """An IncludeDirError is a UsageError (harness.core.errors): the commands' one place that turns
    bad input into its line says it, where a command does not catch it itself."""
    project = tmp_path / "p"
    (project / "kernels_cu").mkdir(parents=True)
    (project / "kernels_cu" / "k.cu").write_text(KERNEL)
    (project / "pytest.ini").write_text("[pytest]\nharness_include_dirs = missing/inc\n")
    result = run_harness(*command, cwd=project, env={"HARNESS_CACHE_DIR": str(tmp_path / "c")})
    assert result.returncode == 2
    one_clear_line(result, f"include directory {project / 'missing' / 'inc'} (ini harness_include_dirs in {project}) "
                           "does not exist or is not a folder")


# ------------------------------------------------------------------ more bad input to the commands (issue 49)


@pytest.mark.parametrize("args, words", [
    (["--static", "--naive"], "--static runs no gate: drop --naive"),
    (["--static", "--executor", "fresh"], "--static runs no gate: drop --executor"),
    (["--static", "--ray"], "--static runs no gate: drop --ray"),
    (["--naive", "--executor", "warm"], "--naive runs a fresh pytest over the whole gates folder per control: drop "
                                        "--executor"),
], ids=["static-naive", "static-executor", "static-ray", "naive-executor"])
def test_controls_refuse_options_that_contradict_each_other(tmp_path, args, words):
    result = run_harness("controls", *args, "--no-require-gpu", "--rootdir", str(SUITE), "--report",
                         str(tmp_path / "r"), "value_changed", cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, words)
    assert not (tmp_path / "r").exists()


UNMAKEABLE = "/proc/harness-no-folder-can-be-made-here"


@pytest.mark.parametrize("command", [
    ("controls", "--static", "--rootdir", str(SUITE), "value_changed", "--report"),
    ("mutate", "--static", "--rootdir", str(SUITE.parent / "mutate_suite"), "--report"),
    ("report", "merge", "{good}", "--out"),
    ("bench", "startup", "--out"),
    ("bench", "fresh", "--out"),
    ("bench", "mutate", "--rootdir", str(SUITE.parent / "mutate_suite"), "--out"),
    ("bench", "gates", "--before", str(REPO), "--out"),
], ids=["controls", "mutate", "report-merge", "bench-startup", "bench-fresh", "bench-mutate", "bench-gates"])
def test_an_output_folder_that_cannot_be_made_is_one_usage_error_before_anything_runs(tmp_path, command):
    good = shard_report(tmp_path / "good")
    args = [a.replace("{good}", str(good)) for a in command]
    result = run_harness(*args, UNMAKEABLE, cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    option = args[-1]
    one_clear_line(result, f"{option} {UNMAKEABLE} cannot be made (", "pass a folder you can write")


def test_a_folder_named_like_a_control_file_is_a_problem_named_with_the_fix(tmp_path):
    suite = tmp_path / "suite"
    shutil.copytree(SUITE, suite)
    (suite / "controls" / "stray.toml").mkdir()
    result = run_harness("controls", "--static", "--rootdir", str(suite), "--report", str(tmp_path / "r"),
                         cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, "stray.toml: is a folder, not a control file; move it out of the controls folder")


def test_mutate_gates_naming_nothing_is_one_usage_error_before_the_baseline(tmp_path):
    suite = tmp_path / "suite"
    shutil.copytree(SUITE.parent / "mutate_suite", suite)
    result = run_harness("mutate", "--static", "--gates", "nowhere", "--cache-dir", str(tmp_path / "c"), cwd=suite)
    assert result.returncode == 2
    one_clear_line(result, f"--gates nowhere: no file or folder {suite / 'nowhere'}",
                   "pass gate paths relative to the rootdir")
    assert not (suite / "harness-report").exists()


def test_report_only_over_a_results_file_of_corrupt_lines_is_one_line(tmp_path):
    suite = tmp_path / "suite"
    shutil.copytree(SUITE.parent / "mutate_suite", suite)
    report = suite / "report"
    report.mkdir()
    (report / "mutants.jsonl").write_text('[1, 2]\n{"version": 1, "mutant": 3}\n"text"\n{"id": "torn\n')
    result = run_harness("mutate", "--report-only", "--report", str(report), cwd=suite)
    assert result.returncode == 2
    one_clear_line(result, "mutants.jsonl holds no result for the mutants these arguments generate")


def test_report_merge_refuses_to_write_over_a_report_it_merges(tmp_path):
    good = shard_report(tmp_path / "good")
    before = (good / "gates.json").read_text()
    result = run_harness("report", "merge", str(good), "--out", str(good), cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, f"--out {good} is one of the reports merged", "pass another folder")
    assert (good / "gates.json").read_text() == before and not (good / "summary.md").exists()


@pytest.mark.parametrize("action", ["info", "prune", "clear"])
def test_cache_commands_refuse_a_cache_dir_that_is_a_file(tmp_path, action):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_harness("cache", action, "--cache-dir", str(blocker), cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, f"--cache-dir {blocker} is a file, not a folder")


@pytest.mark.parametrize("command", [("controls", "--static"), ("mutate", "--static"), ("cache", "info")],
                         ids=["controls", "mutate", "cache"])
def test_a_rootdir_that_is_not_a_folder_is_one_usage_error_naming_it(tmp_path, command):
    result = run_harness(*command, "--rootdir", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert result.returncode == 2
    one_clear_line(result, f"--rootdir {tmp_path / 'nowhere'} is not a folder",
                   "pass the folder of the project's pytest configuration")
