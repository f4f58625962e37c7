"""Redzones on a GPU (skipped without one, failed under --require-gpu): planted kernels store one
past a buffer, one before it, one past a buffer that ends inside a word, and one past a CUDA
graph's own copy; each is named by the real check kernel with its buffer, side, offset and
kernel. A read past the end sees the poison; a correct kernel, and every read after a named
write, passes; a whole gate run fails the planted gate at its end, and --no-redzones turns it
off there. The bookkeeping with no GPU: tests/test_redzones.py."""

import numpy as np
import pytest

from harness.library import buffers, redzones
from harness.library.dtypes import bf16
from harness.library.graphs import GraphReplay
from harness.library.redzones import RedzoneWritten, check_redzones

PLANTED_CU = """
extern "C" __global__ void one_past(float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) y[i] = 2.0f;  // i == n: one past the end
}
extern "C" __global__ void one_before(float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i - 1] = 2.0f;  // i == 0: one before the start
}
extern "C" __global__ void one_past_u16(unsigned short* y, int n) {
  if (blockIdx.x == 0 && threadIdx.x == 0) y[n] = 0x3f80;
}
extern "C" __global__ void shifted_copy(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i + 1];  // reads one past x for the last element
}
extern "C" __global__ void scale(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.0f * x[i];
}
"""

N = 64


@pytest.fixture(autouse=True)
def redzones_on(settings_in_effect):
    """Redzones are opt-in (--redzones) until proven on a GPU: these tests run with them on (the
    child gate runs below pass --redzones themselves)."""
    from dataclasses import replace

    from harness.core.settings import in_effect

    settings_in_effect(replace(in_effect(), redzones=True))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from harness.compiling.compile import compile_file
    from harness.library import kernels

    root = tmp_path_factory.mktemp("planted")
    (root / "planted.cu").write_text(PLANTED_CU)
    return kernels.load(compile_file("planted.cu", kernel_root=root, cache_dir=root / "cache"))


def lines_of(excinfo) -> list[str]:
    return str(excinfo.value).splitlines()


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_planted_store_one_past_is_named_with_its_buffer_offset_and_kernel(planted):
    y = buffers.filled((N,), np.float32, 0, label="y")
    assert y.data.ptr % 256 == 0
    planted.get("one_past")((1,), (128,), (y, np.int32(N)))
    with pytest.raises(RedzoneWritten) as info:
        check_redzones()
    assert lines_of(info)[:5] == [
        "redzone written: y (float32 (64,), 256 bytes), after its end",
        "  nearest changed byte: +0 past its end, in element [64] (its last is [63])",
        "  changed: 4 of the 4096 guard bytes after it, +0 to +3",
        "  first changed guard bytes, +0 to +15: 00 00 00 40 8d 8d 8d 7f 8d 8d 8d 7f 8d 8d 8d 7f  "
        "(the pattern: 8d 8d 8d 7f)",
        "  kernel launched last: planted.cu:one_past",
    ]
    check_redzones()  # the guard was filled again: the next read, and the gate's own end, find nothing


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_planted_store_one_before_is_named_from_the_start_on_another_stream(planted):
    import cupy

    y = buffers.to_device(np.zeros(N, np.float32), label="y")
    with cupy.cuda.Stream(non_blocking=True):
        planted.get("one_before")((1,), (128,), (y, np.int32(N)))
    with pytest.raises(RedzoneWritten) as info:
        buffers.to_host(y)
    assert lines_of(info)[:2] == ["redzone written: y (float32 (64,), 256 bytes), before its start",
                                  "  nearest changed byte: -1 before its start, in element [-1] (its first is [0])"]
    assert "  kernel launched last: planted.cu:one_before" in lines_of(info)
    assert "  read at: to_host" in lines_of(info)


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_store_one_past_a_buffer_that_ends_inside_a_word_is_named(planted):
    x = buffers.to_device(np.ones(3, bf16), bits=True)
    planted.get("one_past_u16")((1,), (32,), (x, np.int32(3)))
    with pytest.raises(RedzoneWritten) as info:
        check_redzones()
    text = lines_of(info)
    assert text[0].startswith("redzone written: to_device at tests/test_redzones_gpu.py:")
    assert text[0].endswith("(bfloat16 (3,), 6 bytes), after its end")
    assert text[1:3] == ["  nearest changed byte: +0 past its end, in element [3] (its last is [2])",
                         "  changed: 2 of the 4346 guard bytes after it, +0 to +1"]


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_read_past_the_end_sees_the_poison_and_a_right_kernel_passes(planted):
    x = buffers.to_device(np.arange(N, dtype=np.float32))
    y = buffers.filled((N,), np.float32, 0)
    planted.get("scale")((1,), (128,), (x, y, np.int32(N)))
    assert (buffers.to_host(y) == 2 * np.arange(N, dtype=np.float32)).all()
    planted.get("shifted_copy")((1,), (128,), (x, y, np.int32(N)))
    got = buffers.to_host(y)
    assert (got[:-1] == np.arange(1, N, dtype=np.float32)).all()
    assert np.isnan(got[-1]) and int(got[-1:].view(np.uint32)[0]) & ~(1 << 22) == redzones.pattern_bits(np.float32)


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_store_past_a_cuda_graphs_own_copy_is_named_after_its_replay(planted):
    fn = planted.get("one_past")
    replay = GraphReplay("planted")
    y = buffers.filled((N,), np.float32, 0, label="y")

    def launch(y):
        fn((1,), (128,), (y, np.int32(N)))

    with pytest.raises(RedzoneWritten, match="kernel launched last: planted.cu:one_past"):
        replay("graph", 0, launch, y=y)  # the eager launch before the capture wrote too
        check_redzones()
    replay("graph", 0, launch, y=y)  # the replay alone
    with pytest.raises(RedzoneWritten) as info:
        check_redzones()
    text = lines_of(info)
    assert text[0] == "redzone written: planted: the graph's y (float32 (64,), 256 bytes), after its end"
    assert "  kernel launched last: planted: CUDA-graph replay of key 0" in text
    assert not any(line.startswith("redzone written: y ") for line in text), "the caller's y was never passed"


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_buffer_goes_back_to_the_pool_when_its_last_view_dies(planted):
    import cupy

    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    for _ in range(300):
        x = buffers.to_device(np.ones(16, np.float32))
        planted.get("scale")((1,), (32,), (x, x, np.int32(16)))
    found = redzones.registry()
    assert len(found.allocations) == 1
    del x
    assert found.allocations == {} and pool.used_bytes() == before  # a warm worker's reset needs it


CHILD_GATES = """
import numpy as np
import pytest
from harness.library import buffers, kernels

N = 64


def planted(name):
    return kernels.module("planted.cu").get(name)


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_planted_store_one_past():
    y = buffers.filled((N,), np.float32, 0, label="y")
    planted("one_past")((1,), (128,), (y, np.int32(N)))


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.no_redzones(reason="stores one past its output on purpose")
def test_the_same_store_marked_no_redzones():
    y = buffers.filled((N,), np.float32, 0, label="y")
    planted("one_past")((1,), (128,), (y, np.int32(N)))


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_right_kernel_after_them():
    x = buffers.to_device(np.arange(N, dtype=np.float32))
    y = buffers.filled((N,), np.float32, 0)
    planted("scale")((1,), (128,), (x, y, np.int32(N)))
    assert (buffers.to_host(y) == 2 * np.arange(N, dtype=np.float32)).all()
"""


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.deadline(600)  # two child runs, each starting its own pool on the GPU
def test_a_planted_store_fails_its_gate_in_a_gate_run_and_no_redzones_turns_it_off(pytester, monkeypatch):
    """A whole gate run on the GPU (the pool's workers): the planted store one past fails its gate
    at the end of the gate, naming the buffer, the offset and the kernel; the same store in a gate
    marked no_redzones passes, and so does the right kernel after it. Under --no-redzones,
    which the workers receive from the run, all pass."""
    from tests._machine import use_child_env

    use_child_env(monkeypatch, {"CUDA_VISIBLE_DEVICES": None})
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(pytester.path / "cache"))
    pytester.makeini("[pytest]\nkernel_root = .\nharness_lanes = 1\n")
    pytester.makeconftest("import sys\npytest_plugins = [] if 'harness.plugin' in sys.modules else ['harness.plugin']\n")
    (pytester.path / "planted.cu").write_text(PLANTED_CU)
    pytester.makepyfile(test_planted=CHILD_GATES)
    result = pytester.runpytest_subprocess("--require-gpu", "-p", "no:xdist", "-rA", "--redzones")
    result.assert_outcomes(passed=3, failed=1)  # the compile gate of planted.cu among the passed
    result.stdout.fnmatch_lines([
        "*RedzoneWritten: redzone written: y (float32 (64,), 256 bytes), after its end",
        "*nearest changed byte: +0 past its end, in element ?64? (its last is ?63?)",
        "*kernel launched last: planted.cu:one_past",
        "*read at: the end of the gate",
    ])
    assert "FAILED test_planted.py::test_a_planted_store_one_past" in result.stdout.str()
    off = pytester.runpytest_subprocess("--require-gpu", "-p", "no:xdist", "--redzones", "--no-redzones")
    off.assert_outcomes(passed=4)
