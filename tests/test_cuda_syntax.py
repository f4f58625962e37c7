"""harness.compiling.cuda_syntax: the one CUDA parser, the preparation that makes a source parseable,
walks, function names, device functions and the first parse error."""

import subprocess
import sys

from harness.compiling import cuda_syntax
from harness.compiling.cuda_syntax import (device_functions, first_error, function_name, is_device_function, is_kernel,
                                           parse, parser, prepare, walk)
from tests._machine import child_env

SOURCE = b"""\
#include <cuda_runtime.h>
int host_only(int a) { return a + 1; }

namespace ns {
__device__ __forceinline__ float twice(float v) {
#pragma unroll
    for (int i = 0; i < 2; ++i) v += v;
    return v;
}
}

template <int N>
__global__ void __launch_bounds__(128) kern(float* y) {
    __shared__ __align__(16) float stage[32];
    y[threadIdx.x] = ns::twice(stage[threadIdx.x % 32]) * N;
}
"""


def _definitions(tree) -> dict:
    return {function_name(n): n for n in walk(tree.root_node) if n.type == "function_definition"}


def test_device_functions_are_found_with_their_names_and_a_host_function_is_not():
    tree = parse(SOURCE)
    assert [function_name(fn) for fn in device_functions(tree)] == ["twice", "kern"]
    defs = _definitions(tree)
    assert set(defs) == {"host_only", "twice", "kern"}
    assert not is_device_function(defs["host_only"]) and not is_kernel(defs["host_only"])
    assert is_device_function(defs["twice"]) and not is_kernel(defs["twice"])
    assert is_device_function(defs["kern"]) and is_kernel(defs["kern"])


def test_a_node_with_no_function_declarator_is_named_by_a_question_mark():
    tree = parse(b"__device__ int x = 1;\n")
    assert function_name(tree.root_node.children[0]) == "?"


def test_prepare_blanks_pragmas_and_align_keeping_every_offset_and_line():
    prepared = prepare(SOURCE)
    assert len(prepared) == len(SOURCE) and prepared.count(b"\n") == SOURCE.count(b"\n")
    assert b"pragma" not in prepared and b"__align__" not in prepared
    assert [i for i, c in enumerate(SOURCE) if c == 0x0A] == [i for i, c in enumerate(prepared) if c == 0x0A]
    assert prepared.replace(b" ", b"") == (SOURCE.replace(b"#pragma unroll", b"")
                                           .replace(b"__align__(16)", b"").replace(b" ", b""))
    assert prepare(b"int x;\n") == b"int x;\n"


def test_parse_prepares_unless_told_not_to_and_reads_str_as_utf8():
    assert not parse(SOURCE).root_node.has_error
    assert parse(SOURCE.decode()).root_node.text == prepare(SOURCE)
    assert parse(SOURCE, prepared=False).root_node.text == SOURCE
    assert parser() is parser(), "one parser, built once"


def test_walk_is_in_source_order_and_skips_below_the_named_types():
    tree = parse(b"__device__ int f() { return g(1); }\nint h() { return g(2); }\n")
    numbers = [n.text for n in walk(tree.root_node) if n.type == "number_literal"]
    assert numbers == [b"1", b"2"]
    skipped = [n.type for n in walk(tree.root_node, skip=("function_definition",))]
    assert skipped.count("function_definition") == 2 and "number_literal" not in skipped
    fn = tree.root_node.children[0]
    assert "number_literal" in [n.type for n in walk(fn, skip=("function_definition",))], "the start is walked"


def test_the_first_parse_error_is_located():
    tree = parse(b"__device__ int f() {\n  return 1;\n}\n__device__ int g() {\n  int x = (1 + ;\n}\n")
    bad = first_error(tree.root_node)
    assert bad is not None and bad.start_point[0] + 1 == 5
    fns = device_functions(tree)
    assert [function_name(f) for f in fns] == ["f", "g"]
    assert first_error(fns[0]) is None and first_error(fns[1]) is not None
    assert first_error(parse(SOURCE).root_node) is None


def test_importing_the_module_does_not_import_tree_sitter():
    code = ("import sys, harness.compiling.cuda_syntax, harness.compiling.deviceview, harness.campaigns.mutate.generate, "
            "harness.campaigns.mutate.callgraph\n"
            "assert not [m for m in sys.modules if m.startswith('tree_sitter')], sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())


def test_available_says_whether_the_parser_can_be_built(monkeypatch):
    assert cuda_syntax.available()
    monkeypatch.setattr(cuda_syntax, "_parser", None)
    monkeypatch.setitem(sys.modules, "tree_sitter_cuda", None)  # an import of it raises ImportError
    assert not cuda_syntax.available()
