"""Mutant generation: every operator, device code only, stable ids, locations that point at
the original text, reproducible samples, parse errors named and skipped, bad input refused."""

import subprocess
from pathlib import Path

import pytest

from harness.campaigns.mutate.generate import (PathError, SinceError, changed_lines, generate, mutants_of, sample,
                                               select_files)
from harness.campaigns.mutate.operators import OPERATORS, UnknownOperator, parse_operators

REPO = Path(__file__).resolve().parents[1]

DEVICE = b"""\
#include <cuda_runtime.h>
#define N 4
__constant__ float TABLE[2] = {1.0f, 2.0f};

int host_only(int a, int b) { return a + b * 3; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

extern "C" __global__ void __launch_bounds__(128) k(float* out, const float* x, int* count, int n) {
    __shared__ __align__(16) float stage[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    stage[threadIdx.x % 32] = x[i] * 0.5f;
    __syncthreads();
    __threadfence();
    float v = warp_sum(stage[(threadIdx.x + 1) % 32]);
    if (!(n > 2) && i != 0 || (i & 1) == 0) v = v - 1.0f;
    unsigned bits = (unsigned)i << 2 | ~0u;
    atomicAdd(count, 1);
    int old = atomicMax(count, i);
    out[i] = v + (float)(bits ^ old) + TABLE[i % 2];
}
"""


def lines_of(source: bytes) -> list[str]:
    return source.decode().split("\n")


def test_every_operator_makes_mutants_of_device_code():
    mutants, warnings = mutants_of("k.cu", DEVICE, tuple(OPERATORS))
    assert warnings == []
    made = {m.operator for m in mutants}
    assert made == set(OPERATORS), f"operators that made nothing: {set(OPERATORS) - made}"


def test_host_code_and_launch_configuration_are_never_mutated():
    mutants, _ = mutants_of("k.cu", DEVICE, tuple(OPERATORS))
    assert not [m for m in mutants if m.start_line == 5], "host_only is host code"
    assert not [m for m in mutants if m.start_line in (2, 3)], "defines and __constant__ initialisers are not bodies"
    assert not [m for m in mutants if "128" in m.original], "__launch_bounds__ is outside the body"
    assert {m.function for m in mutants} == {"warp_sum", "k"}


def test_locations_are_one_based_and_point_at_the_original_text():
    mutants, _ = mutants_of("k.cu", DEVICE, tuple(OPERATORS))
    lines = lines_of(DEVICE)
    for m in mutants:
        if m.start_line == m.end_line:
            assert lines[m.start_line - 1][m.start_col - 1 : m.end_col - 1] == m.original, m
        assert DEVICE[m.start_byte : m.end_byte].decode() == m.original
        assert m.start_line >= 1 and m.start_col >= 1


def test_specific_operator_results():
    mutants, _ = mutants_of("k.cu", DEVICE, tuple(OPERATORS))
    pairs = {(m.operator, m.original, m.replacement) for m in mutants}
    assert ("boundary", ">=", ">") in pairs
    assert ("relational", ">=", "<") in pairs
    assert ("guard-dropped", "i >= n", "false") in pairs
    assert ("barrier", "__syncthreads();", ";") in pairs
    assert ("barrier", "__threadfence();", ";") in pairs
    assert ("shuffle", "0xffffffffu", "0x7fffffffu") in pairs
    assert ("shuffle", "m", "(m + 1)") in pairs
    assert ("gpu-index", "blockIdx", "threadIdx") in pairs
    assert ("gpu-index", "blockDim.x", "(blockDim.x - 1)") in pairs
    assert ("shared-dropped", "__shared__", "") in pairs
    assert ("int-literal", "0xffffffffu", "0x100000000u") in pairs
    assert ("float-constant", "0.5f", "0.0f") in pairs
    assert ("logical", "&&", "||") in pairs
    assert ("bitwise", "<<", ">>") in pairs
    assert any(op == "atomic" and orig.startswith("atomicAdd") and "*(count) = old + (1)" in rep
               for op, orig, rep in pairs)
    assert any(op == "store-dropped" and orig.startswith("out[i] =") and rep == ";" for op, orig, rep in pairs)


def test_ids_are_stable_and_unique_and_the_same_edit_is_made_once():
    a, _ = mutants_of("k.cu", DEVICE, tuple(OPERATORS))
    b, _ = mutants_of("k.cu", DEVICE, tuple(OPERATORS))
    assert [m.id for m in a] == [m.id for m in b]
    assert len({m.id for m in a}) == len(a)
    edits = [(m.start_byte, m.end_byte, m.replacement) for m in a]
    assert len(set(edits)) == len(edits)
    other, _ = mutants_of("other.cu", DEVICE, tuple(OPERATORS))
    assert not {m.id for m in a} & {m.id for m in other}, "the file is part of the id"


def test_every_operator_has_a_one_line_reason():
    for op in OPERATORS.values():
        assert op.reason and "\n" not in op.reason and len(op.reason) < 120, op.name


def test_unknown_operator_lists_the_known_ones():
    with pytest.raises(UnknownOperator) as exc:
        parse_operators("arithmetic,bogus")
    assert "'bogus'" in str(exc.value)
    for name in OPERATORS:
        assert name in str(exc.value)
    assert parse_operators("barrier, atomic") == ("barrier", "atomic")
    assert parse_operators(None) == tuple(OPERATORS)


def test_a_sample_is_reproducible_for_a_seed():
    mutants, _ = mutants_of("k.cu", DEVICE, tuple(OPERATORS))
    one = sample(mutants, 1, 10)
    assert len(one) == 10
    assert [m.id for m in one] == [m.id for m in sample(mutants, 1, 10)]
    assert [m.id for m in one] != [m.id for m in sample(mutants, 2, 10)]
    assert sample(mutants, 1, None) == mutants


def test_a_function_that_does_not_parse_is_named_and_skipped(tmp_path):
    broken = DEVICE + b"\n__device__ int bad(int a) {\n    return a +* ) ;\n}\n"
    mutants, warnings = mutants_of("k.cu", broken, tuple(OPERATORS))
    line = lines_of(broken).index("    return a +* ) ;") + 1
    assert len(warnings) == 1 and warnings[0].startswith(f"k.cu:{line}:") and "bad" in warnings[0], warnings
    assert {m.function for m in mutants} == {"warp_sum", "k"}, "the rest of the file is still mutated"


def test_a_source_that_does_not_parse_at_all_is_named_and_skipped(tmp_path):
    (tmp_path / "good.cu").write_bytes(DEVICE)
    (tmp_path / "junk.cu").write_bytes(b"\x7fELF )))) {{{{ \n garbage <<<< >>>\n")
    mutants, warnings = generate(tmp_path, ["good.cu", "junk.cu"], tuple(OPERATORS))
    assert any(w.startswith("junk.cu:") and "skipped" in w for w in warnings), warnings
    assert mutants and {m.file for m in mutants} == {"good.cu"}


def test_every_kernel_of_this_repo_parses():
    files = select_files(REPO / "kernels_cu", [])
    mutants, warnings = generate(REPO / "kernels_cu", files, tuple(OPERATORS))
    assert warnings == []
    assert {m.file for m in mutants} == set(files)


def test_paths_are_checked(tmp_path):
    root = tmp_path / "kernels"
    (root / "sub").mkdir(parents=True)
    (root / "a.cu").write_bytes(DEVICE)
    (root / "sub" / "b.cuh").write_text("#pragma once\n")
    (root / "a.py").write_text("")
    (tmp_path / "outside.cu").write_text("")
    assert select_files(root, []) == ["a.cu", "sub/b.cuh"]
    assert select_files(root, ["sub"]) == ["sub/b.cuh"]
    assert select_files(root, [str(root / "a.cu")]) == ["a.cu"]
    with pytest.raises(PathError, match="outside the kernel root"):
        select_files(root, [str(tmp_path / "outside.cu")])
    with pytest.raises(PathError, match="not a .cu or .cuh"):
        select_files(root, [str(root / "a.py")])
    with pytest.raises(PathError, match="no such file"):
        select_files(root, ["nope.cu"])


def git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(cwd)})


def test_since_keeps_only_mutants_on_changed_lines(tmp_path):
    root = tmp_path / "kernels"
    root.mkdir()
    (root / "k.cu").write_bytes(DEVICE)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "base")
    changed = DEVICE.replace(b"x[i] * 0.5f", b"x[i] * 0.25f")
    (root / "k.cu").write_bytes(changed)
    lines = changed_lines(root, "HEAD")
    line = lines_of(changed).index(next(s for s in lines_of(changed) if "0.25f" in s)) + 1
    assert lines == {"k.cu": {line}}
    mutants, _ = generate(root, ["k.cu"], tuple(OPERATORS), since=lines)
    assert mutants and all(m.start_line == line for m in mutants)
    with pytest.raises(SinceError, match="no commit by that name"):
        changed_lines(root, "no-such-ref")


def test_literals_keep_their_sign_and_array_sizes_are_left_alone():
    src = b"__global__ void k(float* a, int* b) { int s[4] = {7}; b[0] = -1; a[0] = -2.0f; a[1] = 0.f; }"
    pairs = {(m.original, m.replacement) for m in mutants_of("k.cu", src, ("int-literal", "float-constant"))[0]}
    assert ("-1", "-2") in pairs and ("-1", "0") in pairs
    assert ("-2.0f", "2.0f") in pairs and ("-2.0f", "0.0f") in pairs
    assert ("0.f", "1.0f") in pairs
    assert not [p for p in pairs if p[0] == "4"], "the declared size of s is not an arithmetic constant"
    assert not [p for p in pairs if p[0].startswith("-") and p[1].startswith("(--")]
