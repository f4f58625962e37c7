"""Torch tensors through the launch helpers with no GPU: the launcher checks read torch
dtypes and layouts, and a kernel argument that is a torch tensor is refused in one line when
it is on the CPU or another GPU, not contiguous, or of a dtype the harness does not know.
(The launch itself, without a copy and on torch's stream, is a GPU gate:
tests/test_torch_gpu.py.)"""

import numpy as np
import pytest

from harness.library.dtypes import bf16
from harness.library.kernels import Launch
from harness.library.launch import (BF16_DTYPES, E4M3_DTYPES, Refusal, check_aligned, check_array, check_int32_vector,
                                    kernel_arg, kernel_args)


def test_launcher_checks_accept_torch_dtypes_as_their_numpy_names(torch):
    check_array("op", "x", torch.zeros(2, 8, dtype=torch.bfloat16), (2, 8), BF16_DTYPES)
    check_array("op", "q", torch.zeros(4, dtype=torch.float8_e4m3fn), (4,), E4M3_DTYPES)
    check_array("op", "w", torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), (4,), (np.uint8,))
    check_int32_vector("op", "idx", torch.zeros(3, dtype=torch.int32), 3)
    check_aligned("op", "x", torch.zeros(3), 16)  # host memory: not checked, as for numpy
    assert np.dtype(bf16) in BF16_DTYPES


def test_launcher_checks_refuse_torch_tensors_in_one_line(torch):
    with pytest.raises(Refusal, match=r"^op: x has dtype torch.float16, expected bfloat16 or uint16: convert it first$"):
        check_array("op", "x", torch.zeros(2, 8, dtype=torch.float16), (2, 8), BF16_DTYPES)
    with pytest.raises(Refusal, match=r"^op: x is not C-contiguous: pass \.contiguous\(\)$"):
        check_array("op", "x", torch.zeros(8, 2, dtype=torch.bfloat16).t(), (2, 8), BF16_DTYPES)
    with pytest.raises(Refusal, match=r"^op: x is a torch.complex64 tensor, a dtype the harness does not know"):
        check_array("op", "x", torch.zeros(2, dtype=torch.complex64), (2,), BF16_DTYPES)
    with pytest.raises(Refusal, match="must be a contiguous 1-D int32 array"):
        check_int32_vector("op", "idx", torch.zeros(3, dtype=torch.int64))


def fake_cuda_tensor(index: int, contiguous: bool = True):
    """A stand-in for a torch CUDA tensor (none exists without a GPU): torch's type name and
    module, a device, a layout and a dtype."""
    cls = type("Tensor", (), {"__module__": "torch"})
    t = cls()
    t.device = type("device", (), {"type": "cuda", "index": index, "__str__": lambda self: f"cuda:{index}"})()
    t.dtype = "torch.float32"
    t.shape = (4,)
    t.is_contiguous = lambda: contiguous
    t.stride = lambda: (1,) if contiguous else (2,)
    return t


def test_a_kernel_argument_on_the_cpu_is_refused(torch):
    with pytest.raises(Refusal, match=r"^k\.cu:k: argument 1 is a torch tensor on cpu, but a kernel reads device "
                                      r"memory: move it to the kernel's GPU \(\.to\('cuda'\)\)$"):
        kernel_args("k.cu:k", (np.int32(4), torch.zeros(4)), device=0)


def test_a_non_contiguous_kernel_argument_is_refused_before_its_device_is_read(torch):
    with pytest.raises(Refusal, match=r"argument 0 is a non-contiguous torch tensor \(shape \(4, 2\), strides "
                                      r"\(1, 4\)\): .* pass \.contiguous\(\)$"):
        kernel_arg("k.cu:k", 0, torch.zeros(2, 4).t(), device=0)


def test_a_kernel_argument_of_an_unknown_dtype_is_refused(torch):
    with pytest.raises(Refusal, match=r"argument 2 is a torch.complex64 tensor, a dtype the harness does not know"):
        kernel_arg("k.cu:k", 2, torch.zeros(4, dtype=torch.complex64), device=0)


def test_a_kernel_argument_on_another_gpu_is_refused_naming_both_devices():
    with pytest.raises(Refusal) as info:
        kernel_arg("k.cu:k", 0, fake_cuda_tensor(index=1), device=0)
    assert str(info.value) == (
        "k.cu:k: argument 0 is a torch tensor on cuda:1, but the kernel is loaded on cuda:0: move it with "
        ".to('cuda:0'), or make cuda:1 current before loading and launching the kernel (cupy.cuda.Device(1).use())")


def test_arguments_with_no_tensor_pass_through_untouched():
    args = (np.int32(1), np.float32(2.0))
    assert kernel_args("k.cu:k", args, device=0) is args


def test_a_refused_argument_stops_the_launch_before_the_kernel_runs(torch):
    calls = []
    launch = Launch(lambda *a, **k: calls.append(a), "k.cu:k", device=0)
    with pytest.raises(Refusal, match="on cpu"):
        launch((1,), (32,), (torch.zeros(4),))
    assert calls == []


def test_an_unknown_stream_name_is_refused():
    launch = Launch(lambda *a, **k: None, "k.cu:k", device=0)
    with pytest.raises(ValueError, match=r"stream='cupy': pass 'torch'"):
        launch((1,), (32,), (), stream="cupy")
