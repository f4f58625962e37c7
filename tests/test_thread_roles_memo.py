"""The structural gates' memo (gates/_thread_roles.py: `reachable_text`, `analysed`): a check of
some functions sees only the text they can reach, and is computed again exactly when that
text changes. A mutation campaign's warm worker keeps it from mutant to mutant."""

from __future__ import annotations

import pytest

from gates._thread_roles import analysed, defined, reachable_text
from harness.library import caching


@pytest.fixture(autouse=True)
def own_disk_cache(tmp_path, monkeypatch):
    """A disk cache of this test's own: `analysed` keeps its answers on disk between runs
    (`host_cache(disk="source")`), and these tests count what is computed, not read back
    from an earlier run's cache."""
    monkeypatch.setenv(caching.HOST_CACHE_ENV, str(tmp_path / "host"))

SOURCE = """#define CALL_HELPER(x) macro_helper(x)
constexpr int N = 4;
__device__ int helper(int x) { return x + N; }
__device__ int macro_helper(int x) { return x * 2; }
__device__ int unrelated(int x) {
    return x - 1;
}
__global__ void __launch_bounds__(64) k(int* out) {
    out[threadIdx.x] = helper(threadIdx.x) + CALL_HELPER(1);
}
__global__ void __launch_bounds__(64) other(int* out) { out[0] = unrelated(1); }
"""


def test_the_reachable_text_keeps_what_a_function_reaches_and_blanks_the_rest():
    text = reachable_text(SOURCE, ("k",))
    assert text.count("\n") == SOURCE.count("\n")  # every line keeps its number
    assert text.splitlines().index("__global__ void __launch_bounds__(64) k(int* out) {") == 7
    assert "return x + N;" in text  # called by k
    assert "return x * 2;" in text  # named by a macro
    assert "return x - 1;" not in text and "out[0] = unrelated(1);" not in text  # unreached bodies
    assert "__device__ int unrelated(int x) {" in text  # its signature stays
    assert "constexpr int N = 4;" in text
    # from `other`, unrelated is reached and k's body is not
    other = reachable_text(SOURCE, ("other",))
    assert "return x - 1;" in other and "helper(threadIdx.x)" not in other


def _names_and_lines(consts, tree, file, name):
    _names_and_lines.calls += 1
    fn = defined(tree, file, name)
    return fn.start_point[0] + 1, consts.value("N")


_names_and_lines.calls = 0  # each test that counts sets it to 0 first; xdist may run any of them alone


def test_a_check_is_computed_again_only_when_what_it_reads_changes(tmp_path):
    root = tmp_path / "k"
    root.mkdir()
    (root / "k.cu").write_text(SOURCE)
    _names_and_lines.calls = 0
    assert analysed(root, "k.cu", ("k",), _names_and_lines, "k") == (8, 4)
    (root / "k.cu").write_text(SOURCE.replace("return x - 1;", "return (x - 1) - 1;"))  # another function's mutant
    assert analysed(root, "k.cu", ("k",), _names_and_lines, "k") == (8, 4)
    assert _names_and_lines.calls == 1
    (root / "k.cu").write_text(SOURCE.replace("return x + N;", "return x + N + 1;"))  # a callee's
    analysed(root, "k.cu", ("k",), _names_and_lines, "k")
    (root / "k.cu").write_text(SOURCE.replace("constexpr int N = 4;", "constexpr int N = 5;"))  # a constant
    assert analysed(root, "k.cu", ("k",), _names_and_lines, "k") == (8, 5)
    assert _names_and_lines.calls == 3


def test_an_included_header_is_part_of_what_a_check_reads(tmp_path):
    root = tmp_path / "k"
    root.mkdir()
    (root / "k.cu").write_text('#include "n.cuh"\n' + SOURCE.replace("constexpr int N = 4;\n", ""))
    (root / "n.cuh").write_text("constexpr int N = 7;\n")
    assert analysed(root, "k.cu", ("k",), _names_and_lines, "k")[1] == 7
    (root / "n.cuh").write_text("constexpr int N = 9;\n")
    assert analysed(root, "k.cu", ("k",), _names_and_lines, "k")[1] == 9
    # a header's functions are not read (only its constants): a mutant of one finds the answer again
    _names_and_lines.calls = 0
    (root / "n.cuh").write_text("constexpr int N = 9;\n__device__ int h(int x) { return x; }\n")
    analysed(root, "k.cu", ("k",), _names_and_lines, "k")
    (root / "n.cuh").write_text("constexpr int N = 9;\n__device__ int h(int x) { return x + 1; }\n")
    analysed(root, "k.cu", ("k",), _names_and_lines, "k")
    assert _names_and_lines.calls == 1
