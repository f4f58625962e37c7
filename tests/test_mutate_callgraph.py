"""--trap-gates reached: the call graph of the kernel root, and the trap gates it lets a
mutant skip (harness.campaigns.mutate.callgraph, Coverage.unreached_trap_gates, gate_stage)."""

from pathlib import Path

from harness.campaigns.mutate.callgraph import kernel_base_name, kernels_reaching
from harness.campaigns.mutate.select import Coverage, GateInfo

REPO = Path(__file__).resolve().parents[1]

SOURCE = """
#define CALL_H3(x) h3(x)
struct Row { __device__ float load(int i) const { return h4(i); } };
__device__ float h4(int i) { return (float)i; }
__device__ float h3(float x) { return x * 2.f; }
__device__ float h2(float x) { return x + 1.f; }
template <int N> __device__ float h1(float x) { return h2(x) * N; }
__device__ float orphan(float x) { return x; }
extern "C" __global__ void kern_a(float* y) { y[threadIdx.x] = h1<4>(y[threadIdx.x]); }
extern "C" __global__ void kern_b(float* y) { Row r; y[threadIdx.x] = CALL_H3(r.load(threadIdx.x)); }
"""


def test_the_graph_follows_template_calls_macros_and_methods(tmp_path):
    (tmp_path / "k.cu").write_text(SOURCE)
    reach = kernels_reaching(tmp_path)
    assert reach["h1"] == reach["h2"] == {"kern_a"}, "a template call, then a plain one"
    assert reach["h3"] == {"kern_b"}, "through the macro's replacement text"
    assert reach["load"] == reach["h4"] == {"kern_b"}, "a method call by its field name"
    assert reach["kern_a"] == {"kern_a"} and reach["kern_b"] == {"kern_b"}, "a kernel runs its own code"
    assert "orphan" not in reach, "no kernel reaches it: nothing may be skipped for its mutants"


def test_launched_names_reduce_to_the_function():
    assert kernel_base_name("qk_rope.cu:qk_rope_paged<256>") == "qk_rope_paged"
    assert kernel_base_name("a.cu:ns::kern") == "kern"
    assert kernel_base_name("kern") == "kern"


def test_todays_kernels_every_mutated_function_is_reached():
    from harness.campaigns.mutate.generate import generate, select_files
    from harness.campaigns.mutate.operators import OPERATORS

    root = REPO / "kernels_cu"
    reach = kernels_reaching(root)
    mutants, _ = generate(root, select_files(root, []), tuple(OPERATORS))
    assert {m.function for m in mutants} <= set(reach), "a mutated function no kernel reaches"
    assert {"nvfp4_gemv", "nvfp4_gemv_sw", "moe_glu", "moe_down"} <= reach["nvfp4_partial"]
    assert reach["first_visible"] == {"paged_decode", "paged_prefill"}
    assert reach["moe_topk_softmax"] == {"moe_router"}


def _gate(nodeid, kernels, isolated=True):
    return GateInfo(nodeid, nodeid.split("::")[0], "trap" if isolated else "anchor", 0.1, frozenset({"k.cu"}),
                    frozenset(), isolated, isolated, None if kernels is None else frozenset(kernels))


def test_only_isolated_trap_gates_whose_kernels_cannot_run_the_function_are_skipped():
    cov = Coverage([
        _gate("g.py::trap_a", ["k.cu:kern_a"]),
        _gate("g.py::trap_a_template", ["k.cu:kern_a<4>"]),
        _gate("g.py::trap_b", ["k.cu:kern_b"]),
        _gate("g.py::trap_unrecorded", None),
        _gate("g.py::trap_launched_nothing", []),
        _gate("g.py::anchor_b", ["k.cu:kern_b"], isolated=False),  # shares a process: never skipped
    ])
    skipped = cov.unreached_trap_gates(list(cov.gates), frozenset({"kern_a"}))
    assert skipped == {"g.py::trap_b"}


def test_a_mutant_skips_the_trap_gates_its_function_cannot_reach(tmp_path):
    from harness.campaigns.mutate.campaign import MutateConfig, gate_stage
    from harness.runs.result import Executor, GateOutcome, GateRuns
    from harness.campaigns.mutate.generate import generate
    from harness.campaigns.mutate.verdicts import MutantResult, Verdict

    root = tmp_path / "kernels"
    root.mkdir()
    (root / "k.cu").write_text(SOURCE)
    mutant = next(m for m in generate(root, ["k.cu"], ("arithmetic",))[0] if m.function == "h2")
    cov = Coverage([_gate("g.py::trap_a", ["k.cu:kern_a"]), _gate("g.py::trap_b", ["k.cu:kern_b"]),
                    _gate("g.py::anchor_b", ["k.cu:kern_b"], isolated=False)])

    class Recording(Executor):
        gates: list = []

        def run(self, sandbox, gates, deadline):
            self.gates += list(gates)
            return GateRuns(tuple(GateOutcome(g, "passed") for g in gates))

    for mode, ran in (("all", ["g.py::anchor_b", "g.py::trap_a", "g.py::trap_b"]),
                      ("reached", ["g.py::anchor_b", "g.py::trap_a"])):
        ex = Recording()
        ex.gates = []
        config = MutateConfig(rootdir=tmp_path, kernel_root=root, report_dir=tmp_path / "r", deadline=30.0,
                              require_gpu=False, trap_gates=mode)
        r = gate_stage(MutantResult(mutant, Verdict.PENDING), root, cov, {"k.cu": ("k.cu",)}, ex, config)
        assert sorted(ex.gates) == sorted(ran), (mode, ex.gates)
        assert r.verdict is Verdict.SURVIVED
        assert ("1 trap gate(s) not run" in r.reason) == (mode == "reached"), r.reason
