"""Launch helpers a real kernel needs (dynamic shared memory above 48 KiB, the null
pointer), the plugin both installed and passed with -p, and harness.library.source reading
constexpr integers and taking #if branches by their defines."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness.library import kernels
from harness.library.launch import DEFAULT_DYNAMIC_SHARED_LIMIT, NULL, Refusal, check_dynamic_shared
from harness.library.source import SourceError, active_text, constexpr_int, define_int
from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ dynamic shared memory


class FakeFunction:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, *rest, **kwargs):
        self.calls.append((grid, block, args, rest, kwargs))


@pytest.fixture
def raised(monkeypatch):
    seen = []
    monkeypatch.setattr(kernels, "allow_dynamic_shared", lambda fn, n: seen.append((fn.name, n)))
    # the function attribute a kernel with no static shared memory starts with
    monkeypatch.setattr(kernels, "dynamic_shared_allowed", lambda fn: getattr(fn, "allowed", DEFAULT_DYNAMIC_SHARED_LIMIT))
    noted = []
    monkeypatch.setattr(kernels, "note_launch", noted.append)
    return seen, noted


def test_a_launch_above_48_kib_raises_the_attribute_once_per_size(raised):
    seen, noted = raised
    fn = kernels.Launch(FakeFunction(), "row_reverse.cu:row_reverse_smem")
    fn((1, 1, 1), (256, 1, 1), (), shared_mem=DEFAULT_DYNAMIC_SHARED_LIMIT)
    assert seen == []  # 48 KiB needs no opt-in
    fn((1, 1, 1), (256, 1, 1), (), shared_mem=64 * 1024)
    fn((1, 1, 1), (256, 1, 1), (), shared_mem=64 * 1024)
    fn((1, 1, 1), (256, 1, 1), (), 80 * 1024)  # positional, as CuPy takes it
    assert seen == [("row_reverse.cu:row_reverse_smem", 64 * 1024), ("row_reverse.cu:row_reverse_smem", 80 * 1024)]
    assert noted == ["row_reverse.cu:row_reverse_smem"] * 4  # the watchdog still sees every launch
    assert len(fn.function.calls) == 4 and fn.function.calls[1][4] == {"shared_mem": 64 * 1024}


def test_a_kernel_with_static_shared_memory_raises_the_attribute_for_48_kib_of_dynamic(raised):
    # 4H bytes of dynamic shared memory at H = 12288 is 48 KiB; with a 32-byte __shared__ array
    # beside it the block needs the opt-in, or the launch fails with "invalid argument": the
    # function's own attribute, not 48 KiB, is the line
    seen, _ = raised
    inner = FakeFunction()
    inner.allowed = DEFAULT_DYNAMIC_SHARED_LIMIT - 32
    fn = kernels.Launch(inner, "moe_decode.cu:moe_post_attn")
    fn((1, 1, 1), (256, 1, 1), ())  # no dynamic shared memory: the attribute is not even read
    assert fn.shared_allowed is None
    fn((1, 1, 1), (256, 1, 1), (), shared_mem=DEFAULT_DYNAMIC_SHARED_LIMIT - 32)
    assert seen == []
    fn((1, 1, 1), (256, 1, 1), (), shared_mem=DEFAULT_DYNAMIC_SHARED_LIMIT)
    assert seen == [("moe_decode.cu:moe_post_attn", DEFAULT_DYNAMIC_SHARED_LIMIT)]


def test_dynamic_shared_memory_over_the_opt_in_limit_is_refused():
    check_dynamic_shared("op", 200 * 1024, 1024, 227 * 1024)
    with pytest.raises(Refusal, match=r"op: shared_mem=232448 bytes .* plus the kernel's 1024 static bytes exceed "
                                      r"the device's 232448 bytes per block"):
        check_dynamic_shared("op", 227 * 1024, 1024, 227 * 1024)
    with pytest.raises(Refusal, match="is negative"):
        check_dynamic_shared("op", -1, 0, 1000)


def test_the_null_pointer_is_a_64_bit_zero():
    assert NULL == 0 and np.asarray(NULL).dtype == np.uint64


# ------------------------------------------------------------------ the plugin installed and passed with -p

FILTER = textwrap.dedent("""\
    import importlib.metadata as md, sys
    keep = sys.argv.pop(1)
    original = md.distributions
    def distributions(**kw):
        for d in original(**kw):
            if (d.metadata["Name"] or "").lower() == "harness" and keep not in str(getattr(d, "_path", "")):
                continue  # hide any other install of the harness: only the fake one below counts
            yield d
    md.distributions = distributions
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
    """)


def run_installed(tmp_path, entry_name: str):
    """pytest with the harness 'installed' under `entry_name` (a fake dist-info holding this
    repo's entry point) and `-p harness.plugin` in the project's addopts."""
    site = tmp_path / f"site-{entry_name}"
    info = site / "harness-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: harness\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[pytest11]\n{entry_name} = harness.plugin\n")
    project = tmp_path / f"project-{entry_name}"
    (project / "kernels").mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\naddopts = -p harness.plugin\nkernel_root = kernels\n")
    (project / "test_x.py").write_text("import pytest\n\n@pytest.mark.structural\ndef test_x():\n    assert True\n")
    (tmp_path / "run.py").write_text(FILTER)
    env = child_env({"HARNESS_CACHE_DIR": str(tmp_path / "cache"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": None},
                    first=(site,))
    return subprocess.run([sys.executable, str(tmp_path / "run.py"), str(site), "-q", "-p", "no:cacheprovider"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=120)


def pyproject_entry_name() -> str:
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    (name,) = [k for k, v in eps.items() if v == "harness.plugin"]
    return name


def test_the_plugin_installed_and_passed_with_p_is_one_plugin(tmp_path):
    proc = run_installed(tmp_path, pyproject_entry_name())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "already registered" not in out and "1 passed" in out


def test_the_old_entry_point_name_crashed_so_the_check_can_fail(tmp_path):
    proc = run_installed(tmp_path, "harness")
    assert proc.returncode != 0 and "already registered" in proc.stdout + proc.stderr


# ------------------------------------------------------------------ constexpr integers and #if branches

SOURCE = """\
#if defined(WIDE) && WIDTH > 4
#define ROWS 16
#elif WIDTH == 2
#define ROWS 4
#else
#define ROWS 8
#endif
namespace k { static constexpr int kTile = 4 * 32; }
struct S { static constexpr unsigned kRows{16u}; };
inline constexpr std::size_t kBytes = 1 << 16;
#ifdef BIG
constexpr int kStages = 4;
#else
constexpr int kStages = 2;  // constexpr int kStages = 9; in a comment never counts
#endif
constexpr float kScale = 0.5f;
"""


def test_constexpr_integers_are_read():
    assert constexpr_int(SOURCE, "kTile") == 128
    assert constexpr_int(SOURCE, "kRows") == 16
    assert constexpr_int(SOURCE, "kBytes") == 65536


def test_a_preprocessor_branch_is_taken_by_the_defines():
    assert define_int(SOURCE, "ROWS", defines={}) == 8
    assert define_int(SOURCE, "ROWS", defines={"WIDE": None, "WIDTH": 8}) == 16
    assert define_int(SOURCE, "ROWS", defines={"WIDTH": 2}) == 4
    assert constexpr_int(SOURCE, "kStages", defines={"BIG": None}) == 4
    assert constexpr_int(SOURCE, "kStages", defines={}) == 2
    assert len(active_text(SOURCE, {}).split("\n")) == len(SOURCE.split("\n"))  # line numbers kept


def test_constexpr_errors_say_what_to_do():
    with pytest.raises(SourceError, match=r"declared 2 times \(lines 12, 14\); keep one declaration .* pass defines"):
        constexpr_int(SOURCE, "kStages")
    with pytest.raises(SourceError, match="`kScale` is initialised with `0.5f`, not an integer expression"):
        constexpr_int(SOURCE, "kScale")
    with pytest.raises(SourceError, match="no `constexpr ... kMissing"):
        constexpr_int(SOURCE, "kMissing")
    with pytest.raises(SourceError, match="appears 3 times .* pass defines"):
        define_int(SOURCE, "ROWS")
