"""CPU screening: the cubin fingerprint sees what runs and ignores what does not; compile
errors, equivalents and duplicates; the source-read rule; a process pool over a fake suite
that never writes the kernel root."""

import hashlib
import os
import shutil
import signal
import tempfile
from pathlib import Path


from harness.compiling.compile import compile_file
from harness.campaigns.mutate.campaign import dependents_of
from harness.campaigns.mutate.elf import fingerprint
from harness.campaigns.mutate.generate import Mutant, mutants_of
from harness.campaigns.mutate.operators import OPERATORS
from harness.campaigns.mutate.screen import Compiled, ScreenContext, classify, compile_all, original_fingerprints
from harness.campaigns.mutate.verdicts import Verdict

SUITE = Path(__file__).parent / "fixtures" / "mutate_suite"

TABLE = """\
namespace q { constexpr int kMask = 3; }  // internal linkage: NVRTC names it after a hash of the file
__constant__ float T[4] = {1.0f, 2.0f, 3.0f, 4.0f};
extern "C" __global__ void k(float* out, int n) {
    int i = threadIdx.x & (q::kMask * 85);  // comment
    if (i < n) out[i] = T[i & 3] * 2.0f;
}
"""


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def cubin(tmp_path: Path, name: str, text: str, folder: str = "a") -> bytes:
    root = tmp_path / folder
    root.mkdir(exist_ok=True)
    (root / name).write_text(text)
    return compile_file(name, kernel_root=root, arch="sm_90", use_cache=False).cubin


def test_fingerprint_ignores_paths_and_comments(tmp_path):
    a = fingerprint(cubin(tmp_path, "k.cu", TABLE, "a"))
    b = fingerprint(cubin(tmp_path, "k.cu", TABLE.replace("// comment", "// another comment"), "elsewhere"))
    assert a == b


def test_fingerprint_sees_code_constants_and_shared_sizes(tmp_path):
    base = fingerprint(cubin(tmp_path, "k.cu", TABLE))
    code = fingerprint(cubin(tmp_path, "k.cu", TABLE.replace("* 2.0f", "* 3.0f")))
    table = fingerprint(cubin(tmp_path, "k.cu", TABLE.replace("3.0f, 4.0f", "3.0f, 5.0f")))
    assert len({base, code, table}) == 3
    shared = TABLE.replace("    if (i < n) out[i] = T[i & 3] * 2.0f;",
                           "    __shared__ float s[SIZE];\n    s[i & 7] = T[i & 3];\n    __syncthreads();\n"
                           "    if (i < n) out[i] = s[(i + 1) & 7];")
    eight = fingerprint(cubin(tmp_path, "k.cu", shared.replace("SIZE", "8")))
    sixteen = fingerprint(cubin(tmp_path, "k.cu", shared.replace("SIZE", "16")))
    assert eight != sixteen, "only the shared-memory size differs"


def mutant(mid, file="k.cu"):
    return Mutant(mid, file, "arithmetic", 1, 1, 1, 2, 0, 1, "+", "-", "arithmetic: + -> -", "k")


def test_classify_compile_error_equivalent_duplicate():
    ms = [mutant("m1"), mutant("m2"), mutant("m3"), mutant("m4"), mutant("m5")]
    compiled = {
        "m1": Compiled("m1", False, (), "k.cu(3): error: expected an expression", 0.1),
        "m2": Compiled("m2", True, (("k.cu", "ORIG"),), None, 0.1),
        "m3": Compiled("m3", True, (("k.cu", "X"),), None, 0.1),
        "m4": Compiled("m4", True, (("k.cu", "X"),), None, 0.1),
        "m5": Compiled("m5", True, (("k.cu", "Y"),), None, 0.1),
    }
    out = classify(ms, compiled, {"k.cu": "ORIG"}, source_read=set())
    assert [out[m.id].verdict for m in ms] == [Verdict.COMPILE_ERROR, Verdict.EQUIVALENT, Verdict.PENDING,
                                               Verdict.DUPLICATE, Verdict.PENDING]
    assert out["m1"].reason.startswith("k.cu(3): error")
    assert out["m4"].duplicate_of == "m3" and out["m4"].reason == "duplicate of m3"
    # a file a gate reads is never screened out by its cubin alone
    read = classify(ms, compiled, {"k.cu": "ORIG"}, source_read={"k.cu"})
    assert [read[m.id].verdict for m in ms] == [Verdict.COMPILE_ERROR] + [Verdict.PENDING] * 4
    assert read["m2"].cubin_identical and not read["m3"].cubin_identical
    # m4's cubin is m3's: only its source readers will run, then it is m3's duplicate
    assert read["m4"].duplicate_of == "m3" and read["m3"].duplicate_of is None
    # unknown readers: nothing screened out by its cubin
    unknown = classify(ms, compiled, {"k.cu": "ORIG"}, source_read=None)
    assert unknown["m2"].verdict is Verdict.PENDING and unknown["m4"].verdict is Verdict.PENDING


def test_a_group_of_identical_mutants_no_gate_reads_takes_its_lowest_id_as_the_twin():
    """The feed's twin is the first whose compile finished; the campaign's end makes it the
    lowest id, so two campaigns that compiled in another order report each mutant alike."""
    from harness.campaigns.mutate.campaign import resolve_duplicates
    from harness.campaigns.mutate.verdicts import MutantResult

    def results(first: str, others: list[str], gates_run=()):
        out = {first: MutantResult(mutant(first), Verdict.KILLED, "killed by g", killed_by=["g.py::t"],
                                   gates_run=["g.py::t"], seconds=2.0)}
        for o in others:
            out[o] = MutantResult(mutant(o), Verdict.DUPLICATE, f"duplicate of {first}", duplicate_of=first,
                                  gates_run=list(gates_run), seconds=0.5)
        return out

    a, b = results("m3", ["m1", "m2"]), results("m1", ["m2", "m3"])  # the same group, compiled in two orders
    resolve_duplicates(a), resolve_duplicates(b)
    for out in (a, b):
        assert (out["m1"].verdict, out["m1"].killed_by, out["m1"].duplicate_of) == (Verdict.KILLED, ["g.py::t"], None)
        assert [(out[m].verdict, out[m].duplicate_of, out[m].effective) for m in ("m2", "m3")] == \
            [(Verdict.DUPLICATE, "m1", Verdict.KILLED)] * 2
        assert out["m3"].reason == "duplicate of m1" and out["m1"].mutant.id == "m1"
    # a duplicate that ran the gates reading its own source keeps the twin whose run saw its source
    read = results("m3", ["m1"], gates_run=["g.py::reads"])
    resolve_duplicates(read)
    assert read["m1"].duplicate_of == "m3" and read["m3"].verdict is Verdict.KILLED
    # and mutants of two files (one of them may be read) keep theirs
    other = results("m3", [])
    other["m1"] = MutantResult(mutant("m1", file="h.cuh"), Verdict.DUPLICATE, "duplicate of m3", duplicate_of="m3")
    resolve_duplicates(other)
    assert other["m1"].duplicate_of == "m3"


def test_the_pool_screens_a_suite_without_writing_its_kernel_root(tmp_path):
    root = tmp_path / "kernels"
    shutil.copytree(SUITE / "kernels", root)
    before = tree_hash(root)
    ms = []
    for f in ("sum.cu", "other.cu"):
        ms += mutants_of(f, (root / f).read_bytes(), tuple(OPERATORS))[0]
    broken = Mutant("broken", "sum.cu", "arithmetic", 1, 1, 1, 1, 0, 0, "", "not C++ at all", "a compile error", "-")
    ms.append(broken)
    ctx = ScreenContext(root.resolve(), "sm_90", tmp_path / "cache", {}, dependents_of(root.resolve(), {"sum.cu", "other.cu"}))
    done = []
    compiled = compile_all(ms, ctx, jobs=2, on_done=done.append)
    assert len(done) == len(ms) and set(compiled) == {m.id for m in ms}
    out = classify(ms, compiled, original_fingerprints(ctx), source_read={"sum.cu"})
    assert tree_hash(root) == before
    # NVRTC's "file(line): error: ..." or, when not even the device view can be derived,
    # the view's "file:line: ..." line
    assert out["broken"].verdict is Verdict.COMPILE_ERROR
    assert "error" in out["broken"].reason or out["broken"].reason.startswith("sum.cu:1: ")
    other = {out[m.id].verdict for m in ms if m.file == "other.cu"}
    assert Verdict.EQUIVALENT in other, "the dead `unused = 7 * 3` mutants compile to the original's code"
    assert Verdict.DUPLICATE in other, "`+ 1 - 1`: 1 -> 0 on the first and 1 -> 2 on the second give the same code"
    sums = {out[m.id].verdict for m in ms if m.file == "sum.cu" and m.id != "broken"}
    assert Verdict.EQUIVALENT not in sums and Verdict.DUPLICATE not in sums, "a gate reads sum.cu"
    assert list(tmp_path.glob("harness-mutant-*")) == []


def spawned_workers() -> list[int]:
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :].split()[1] == me and b"spawn_main" in cmd:  # not the resource tracker
            found.append(int(entry))
    return found


def test_a_killed_worker_costs_nothing_but_time(tmp_path, monkeypatch):
    root = tmp_path / "kernels"
    shutil.copytree(SUITE / "kernels", root)
    before = tree_hash(root)
    ms = mutants_of("sum.cu", (root / "sum.cu").read_bytes(), tuple(OPERATORS))[0]
    ctx = ScreenContext(root.resolve(), "sm_90", tmp_path / "cache", {}, dependents_of(root.resolve(), {"sum.cu"}))
    killed = []

    def kill_one(c):
        if not killed:
            workers = spawned_workers()
            assert workers, "the pool has workers"
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])

    from harness.campaigns.mutate import screen

    rounds = []
    real_round = screen._pool_round
    monkeypatch.setattr(screen, "_pool_round", lambda todo, *a: (rounds.append(len(todo)), real_round(todo, *a)))
    compiled = compile_all(ms, ctx, jobs=2, on_done=kill_one)
    assert killed and set(compiled) == {m.id for m in ms}
    assert len(rounds) == 2 and rounds[1] < rounds[0], "a fresh pool took the mutants not done yet"
    assert all(c.ok for c in compiled.values())
    assert tree_hash(root) == before
    # the screen's home, and every sandbox in it (the killed worker's too), went with the screen
    assert list(Path(tempfile.gettempdir()).glob(f"harness-screen-{ctx.owner}-*")) == []


def test_a_screening_workers_sandbox_is_made_in_its_screens_home(tmp_path, monkeypatch):
    """So a sandbox a killed worker left goes with the home, and another campaign's, in a home
    of its own, is never touched (tests/test_sandbox_interrupt.py removes a home with one in)."""
    import dataclasses

    import harness.compiling.compile
    from harness.campaigns.mutate.screen import compile_mutant

    home = tmp_path / "home"
    home.mkdir()
    ms = mutants_of("sum.cu", (SUITE / "kernels" / "sum.cu").read_bytes(), tuple(OPERATORS))[0]
    ctx = ScreenContext(SUITE / "kernels", "sm_90", tmp_path / "cache", {}, dependents_of(SUITE / "kernels", {"sum.cu"}))
    roots = []
    real = harness.compiling.compile.compile_file
    monkeypatch.setattr(harness.compiling.compile, "compile_file", lambda rel, **kw: (roots.append(kw["kernel_root"]),
                                                                             real(rel, **kw))[1])
    assert compile_mutant(ms[0], dataclasses.replace(ctx, home=home)).ok
    assert roots and all(Path(r).is_relative_to(home.resolve()) for r in roots), roots
    assert list(home.iterdir()) == []  # and removed once compiled
