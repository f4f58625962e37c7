"""Torch CUDA tensors through the harness, on a GPU (skipped without one, failed under
--require-gpu): comparisons of CUDA bf16 / fp8 / fp4 tensors by their bits, a kernel launched
on torch tensors with no copy and on torch's stream, and each bad-input row red with its one
line. The same rows with no GPU: tests/test_tensors.py, tests/test_torch_launch.py."""

import numpy as np
import pytest

from harness import BitsMismatch, assert_bits_eq, assert_close
from harness.library.dtypes import bf16, fp8_e4m3
from harness.library.launch import Refusal
from harness.library.tensors import TorchOnlyDtype, UnknownDtype

VALUES = np.array([[0.0, -0.0, 1.0, -1.5], [0.25, 448.0, -2.0, 3.0]], np.float32)

SCALE_CU = """
extern "C" __global__ void scale(const float* x, float* y, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i];
}
"""


@pytest.fixture
def cuda(torch):
    if not torch.cuda.is_available():
        pytest.fail("torch sees no CUDA device while the harness does: install torch's CUDA build")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def scale_kernel(tmp_path, cuda):
    from harness.library import kernels
    from harness.compiling.compile import compile_file

    (tmp_path / "scale.cu").write_text(SCALE_CU)
    compiled = compile_file("scale.cu", kernel_root=tmp_path, cache_dir=tmp_path / "cache")
    return kernels.load(compiled).get("scale")


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("name,dtype", [("bfloat16", bf16), ("float8_e4m3fn", fp8_e4m3)])
def test_cuda_bf16_and_fp8_tensors_compare_by_their_bits(torch, cuda, name, dtype):
    t = torch.tensor(VALUES, device=cuda).to(getattr(torch, name))
    assert_bits_eq("x", t, VALUES.astype(dtype))
    assert_bits_eq("x", VALUES.astype(dtype), t)
    assert_bits_eq("x", t, t.clone())
    changed = t.clone()
    sign = changed.view(torch.int16 if t.element_size() == 2 else torch.int8)  # the same memory, as integers
    sign[1, 3] ^= -(1 << (8 * t.element_size() - 1))  # flip the sign bit: fp8 has no negation kernel
    with pytest.raises(BitsMismatch) as info:
        assert_bits_eq("x", changed, VALUES.astype(dtype))
    assert str(info.value).splitlines()[:2] == [f"x: 1 of 8 elements differ bitwise ({np.dtype(dtype).name})",
                                                "first difference at flat index 7, index [1, 3]:"]


@pytest.mark.gpu
@pytest.mark.anchor
def test_cuda_tensors_mix_with_cupy_and_packed_fp4_compares_as_bytes(torch, cuda):
    import cupy

    t = torch.tensor(VALUES, device=cuda).to(torch.bfloat16)
    assert_bits_eq("x", t, cupy.asarray(VALUES.astype(bf16).view(np.uint16)))
    packed = (np.arange(8, dtype=np.uint8) * 31).reshape(2, 4)
    fp4 = torch.from_numpy(packed).to(cuda).view(torch.float4_e2m1fn_x2)
    assert_bits_eq("w", fp4, packed)
    assert_close("x", t, VALUES, atol=0.0, rtol=2.0**-8)


@pytest.mark.gpu
@pytest.mark.refusal
def test_cuda_comparisons_refuse_unknown_and_torch_only_dtypes_in_one_line(torch, cuda):
    with pytest.raises(UnknownDtype, match=r"^c: got is a torch.complex64 tensor, .* t\.view\(torch\.int64\)$"):
        assert_bits_eq("c", torch.zeros(2, dtype=torch.complex64, device=cuda), np.zeros(2, np.uint64))
    fp4 = torch.zeros(2, dtype=torch.uint8, device=cuda).view(torch.float4_e2m1fn_x2)
    with pytest.raises(TorchOnlyDtype, match=r"^w: got is a torch.float4_e2m1fn_x2 tensor .*unpack_fp4"):
        assert_close("w", fp4, np.zeros(2, np.uint8), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.anchor
def test_a_kernel_writes_into_a_torch_tensor_with_no_copy(torch, cuda, scale_kernel):
    x = torch.arange(1000, dtype=torch.float32, device=cuda)
    y = torch.full((1000,), float("nan"), device=cuda)
    before = y.data_ptr()
    scale_kernel((4, 1, 1), (256, 1, 1), (x, y, np.float32(0.5), np.int32(1000)))
    assert y.data_ptr() == before
    # 0.5 * an integer below 2^24 is exact
    assert_bits_eq("y", y, np.arange(1000, dtype=np.float32) * np.float32(0.5))


@pytest.mark.gpu
@pytest.mark.anchor
def test_stream_torch_launches_on_torchs_current_stream(torch, cuda, scale_kernel):
    from harness.library.launch import torch_stream

    side = torch.cuda.Stream(device=cuda)
    with torch.cuda.stream(side):
        assert torch_stream(cuda.index).ptr == side.cuda_stream
        x = torch.arange(1 << 20, dtype=torch.float32, device=cuda) * 2  # queued on `side`
        y = torch.empty_like(x)
        scale_kernel((4096, 1, 1), (256, 1, 1), (x, y, np.float32(0.25), np.int32(1 << 20)), stream="torch")
        z = y + 0  # ordered after the kernel on the same stream
    side.synchronize()
    assert_bits_eq("z", z, np.arange(1 << 20, dtype=np.float32) * np.float32(0.5))


@pytest.mark.gpu
@pytest.mark.refusal
def test_a_non_contiguous_cuda_tensor_is_refused_with_its_strides(torch, cuda, scale_kernel):
    x = torch.zeros(64, 2, device=cuda).t()
    with pytest.raises(Refusal, match=r"argument 0 is a non-contiguous torch tensor \(shape \(2, 64\), strides "
                                      r"\(1, 2\)\): .* pass \.contiguous\(\)$"):
        scale_kernel((1, 1, 1), (128, 1, 1), (x, torch.zeros(128, device=cuda), np.float32(1), np.int32(128)))


@pytest.mark.gpu
@pytest.mark.refusal
def test_a_cpu_tensor_and_an_unknown_dtype_are_refused_as_kernel_arguments(torch, cuda, scale_kernel):
    y = torch.zeros(4, device=cuda)
    with pytest.raises(Refusal, match=r"argument 0 is a torch tensor on cpu, but a kernel reads device memory"):
        scale_kernel((1, 1, 1), (32, 1, 1), (torch.zeros(4), y, np.float32(1), np.int32(4)))
    with pytest.raises(Refusal, match=r"argument 0 is a torch.complex64 tensor, a dtype the harness does not know"):
        scale_kernel((1, 1, 1), (32, 1, 1), (torch.zeros(4, dtype=torch.complex64, device=cuda), y, np.float32(1),
                                             np.int32(4)))


@pytest.mark.gpu
@pytest.mark.refusal
def test_a_tensor_on_another_gpu_is_refused_naming_both(torch, cuda, scale_kernel):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU (nvidia-h200-x2); tests/test_torch_launch.py checks the message with none")
    other = torch.device("cuda", 1 - cuda.index if cuda.index < 2 else 0)
    with pytest.raises(Refusal, match=rf"argument 0 is a torch tensor on {other}, but the kernel is loaded on {cuda}"):
        scale_kernel((1, 1, 1), (32, 1, 1), (torch.zeros(4, device=other), torch.zeros(4, device=cuda),
                                             np.float32(1), np.int32(4)))
