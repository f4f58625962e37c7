"""harness.library.source: structural lookups that comments and literals cannot fool."""

from __future__ import annotations

import pytest

from harness.library.source import (
                                    SourceError,
                                    calls_in,
                                    contains_call,
                                    declared_names,
                                    define_int,
                                    define_value,
                                    function,
                                    function_body,
                                    line_of,
                                    mentions,
                                    reachable_functions,
                                    strip_comments_and_literals,
                                    struct_fields,
                                    )

KERNEL = r"""
#include <cuda_bf16.h>
#define N_PER_BLOCK 4
#define N_PER_BLOCK_SW (8u)   // eight warps
// #define N_PER_BLOCK 5
/* #define N_PER_BLOCK_SW 16 */
#define MSG "#define N_PER_BLOCK 6"
#define SQUARE(x) ((x) * (x))
#define LONG_ONE \
    17

__constant__ float TABLE[16] = {0.f};

__device__ __forceinline__ float partial(const float* __restrict__ lut, int i)
{
    // TABLE[i] would serialise; __syncthreads() here is a comment
    const char* s = "}{ __syncthreads() TABLE[i]";
    const char c = '}';
    if (i > 1'000) { return lut[i]; }
    return lut[i & 15];
}

__global__ void kernel_sw(float* y, int n)
{
    __shared__ __align__(16) float s_lut[N_PER_BLOCK_SW][16];
    __syncwarp();
    y[0] = partial(s_lut[0], n) + partial(
        s_lut[1],
        SQUARE(n));
}

__global__ void kernel_base(float* y, int n)
{
    __syncthreads();
    y[0] = partial(TABLE, n);
}
"""


def test_stripping_keeps_length_lines_and_code_but_blanks_comments_and_literal_contents():
    clean = strip_comments_and_literals(KERNEL)
    assert len(clean) == len(KERNEL)
    assert clean.count("\n") == KERNEL.count("\n")
    assert "eight warps" not in clean and "would serialise" not in clean
    assert '"                           "' in clean  # the string's quotes stay, its contents go
    assert "' '" in clean  # so do the char literal's
    assert "1'000" in clean  # a digit separator is not a character literal
    assert "return lut[i & 15];" in clean
    assert strip_comments_and_literals(clean) == clean


def test_stripping_handles_raw_strings_escapes_and_unterminated_comments():
    src = 'a = R"x(})" )x"; b = "q\\"}"; c = \'\\\'\'; d /* open'
    clean = strip_comments_and_literals(src)
    assert len(clean) == len(src)
    assert "}" not in clean
    assert clean.startswith("a = R\"") and "b = \"" in clean and "c = '" in clean
    assert "open" not in clean


def test_define_value_reads_the_live_definition_not_comments_or_strings():
    assert define_value(KERNEL, "N_PER_BLOCK") == "4"
    assert define_value(KERNEL, "N_PER_BLOCK_SW") == "(8u)"
    assert define_int(KERNEL, "N_PER_BLOCK") == 4
    assert define_int(KERNEL, "N_PER_BLOCK_SW") == 8
    assert define_int(KERNEL, "LONG_ONE") == 17


def test_define_value_reads_a_path(tmp_path):
    path = tmp_path / "k.cu"
    path.write_text(KERNEL)
    assert define_int(path, "N_PER_BLOCK") == 4
    assert define_int(str(path), "N_PER_BLOCK_SW") == 8


def test_define_value_errors_say_what_was_wrong_and_what_to_do():
    with pytest.raises(SourceError, match=r"no `#define MISSING`; define it there"):
        define_value(KERNEL, "MISSING")
    with pytest.raises(SourceError, match=r"appears 2 times \(lines 2, 4\); keep one definition"):
        define_value("\n#define X 1\n#if 0\n#define X 2\n#endif\n", "X")
    with pytest.raises(SourceError, match="function-like macro"):
        define_value(KERNEL, "SQUARE")
    with pytest.raises(SourceError, match="not an integer literal"):
        define_int(KERNEL, "MSG")


def test_define_value_does_not_match_a_longer_name():
    assert define_value("#define N_PER_BLOCK_SW 8\n#define N_PER_BLOCK 4\n", "N_PER_BLOCK") == "4"


def test_function_body_is_brace_matched_and_ignores_braces_in_literals():
    body = function_body(KERNEL, "partial")
    assert body.startswith("{") and body.endswith("}")
    assert "return lut[i & 15];" in body
    assert "kernel_sw" not in body
    assert "TABLE" not in body  # only in a comment and a string, both blanked


def test_function_reports_params_and_the_line_of_the_name():
    f = function(KERNEL, "partial")
    assert "const float* __restrict__ lut" in f.params
    assert KERNEL.split("\n")[f.line - 1].startswith("__device__ __forceinline__ float partial(")
    assert line_of(KERNEL, f.body_offset) == f.body_line == f.line + 1
    sw = function(KERNEL, "kernel_sw")
    first_call = calls_in(sw.body, "partial")[0]
    assert "partial(s_lut[0], n)" in KERNEL.split("\n")[sw.body_line + first_call.line - 2]


def test_function_is_not_fooled_by_calls_or_declarations():
    src = "void g(int);\nvoid f() { g(1); if (g(2)) { } }\nvoid g(int a) { a++; }\n"
    assert function_body(src, "g") == "{ a++; }"


def test_function_errors_name_the_problem():
    with pytest.raises(SourceError, match="no definition of `absent"):
        function(KERNEL, "absent")
    with pytest.raises(SourceError, match=r"defined 2 times \(lines 1, 2\)"):
        function("void f(int) {}\nvoid f(float) {}\n", "f")
    with pytest.raises(SourceError, match="keyword"):
        function(KERNEL, "if")


def test_calls_in_splits_top_level_arguments_across_lines():
    calls = calls_in(function_body(KERNEL, "kernel_sw"), "partial")
    assert [c.args for c in calls] == [("s_lut[0]", "n"), ("s_lut[1]", "SQUARE(n)")]
    assert [c.line for c in calls] == [4, 4]  # lines within the body, whose `{` is line 1
    assert calls_in("f<8>(a, b<2>(c));", "f")[0].args == ("a", "b<2>(c)")
    assert calls_in("g();", "g")[0].args == ()


def test_calls_in_ignores_comments_strings_and_longer_names():
    body = function_body(KERNEL, "partial")
    assert not contains_call(body, "__syncthreads")
    assert contains_call(function_body(KERNEL, "kernel_base"), "__syncthreads")
    assert [c.args for c in calls_in("my_partial(1); partial(2);", "partial")] == [("2",)]


def test_mentions_is_token_exact_and_ignores_comments():
    assert mentions(function_body(KERNEL, "kernel_base"), "TABLE")
    assert not mentions(function_body(KERNEL, "partial"), "TABLE")
    assert not mentions("TABLE_2[i]", "TABLE")


def test_declared_names_finds_qualified_variables():
    assert declared_names(KERNEL, "__constant__") == ["TABLE"]
    assert declared_names(KERNEL, "__shared__") == ["s_lut"]


def test_reachable_functions_follow_calls_to_functions_defined_in_the_text():
    names = [f.name for f in reachable_functions(KERNEL, "kernel_sw")]
    assert names == ["kernel_sw", "partial"]  # __syncwarp, SQUARE and keywords have no definition here
    assert [f.name for f in reachable_functions(KERNEL, "partial")] == ["partial"]
    with pytest.raises(SourceError, match="no definition of `absent"):
        reachable_functions(KERNEL, "absent")


def test_read_source_returns_the_text_and_notes_it_for_the_running_gate(tmp_path):
    from harness.library import coverage
    from harness.library.source import read_source

    f = tmp_path / "k.cu"
    f.write_text("#define BLOCK 128\n")
    coverage.begin("gates/test_x.py::test_y")
    try:
        assert read_source(f) == "#define BLOCK 128\n"
        assert str(f) in coverage.current().sources or "k.cu" in coverage.current().sources
    finally:
        coverage.reset()


def test_struct_fields_lists_a_structs_data_members_in_order_with_pointer_types():
    text = ("// struct Params { int stale; };\n"
            "struct Params : public Base {\n    using index_t = uint32_t;\n    int batch, dim;  // two\n"
            "    bool silu;\n    index_t stride;\n    void *__restrict__ x_ptr;\n    const float *w, bias[4];\n"
            "    unsigned int n = 3;\n    static constexpr int kMax = 4;\n    int size() const { return batch; }\n};\n")
    assert struct_fields(text, "Params") == [
        ("batch", "int"), ("dim", "int"), ("silu", "bool"), ("stride", "index_t"), ("x_ptr", "void*"),
        ("w", "const float*"), ("bias", "const float"), ("n", "unsigned int")]


def test_struct_fields_of_a_struct_defined_twice_or_not_at_all_names_the_problem():
    with pytest.raises(SourceError, match=r"`struct P \{` is defined 0 times here"):
        struct_fields("struct Q { int a; };", "P")
    with pytest.raises(SourceError, match=r"is defined 2 times here"):
        struct_fields("struct P { int a; };\nstruct P { int b; };", "P")
