"""The plugin through pytester: the require-gpu policy, the skip banner, --no-fail-fast,
trap gates, sticky-error isolation and the reports. Runs with or without a GPU: every child
sees no device (tests/_machine.py), runs that need one fake the probe in a conftest."""

import json

import pytest

from tests._machine import use_child_env

# A conftest that makes the harness believe a device exists, for policy tests that need
# no real kernel. Child processes load it too (it sits in their rootdir).
LOAD_PLUGIN = """
import sys
pytest_plugins = [] if "harness.plugin" in sys.modules else ["harness.plugin"]
"""

FAKE_DEVICE_CONFTEST = LOAD_PLUGIN + """
import harness.core.device as device
from harness.core.device import DeviceProbe

_fake = DeviceProbe(count=1, name="Fake GPU", arch="sm_90")
device.probe = lambda: _fake
device.context_is_poisoned = lambda: False


class CUDARuntimeError(RuntimeError):
    pass


def fire_trap():
    raise CUDARuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
"""




@pytest.fixture
def suite(pytester, monkeypatch):
    """A pytester folder whose child pytest processes load the harness plugin, on a machine
    with no GPU."""
    use_child_env(monkeypatch)
    # One lane: these tests are of the main worker, whatever the machine's cores (lanes: test_lanes.py).
    pytester.makeini("[pytest]\nkernel_root = .\nharness_lanes = 1\n")
    pytester.makeconftest(LOAD_PLUGIN)
    return pytester


def test_require_gpu_with_no_device_fails_at_once_with_one_line(suite):
    suite.makepyfile(test_g="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_kernel():
            pass
    """)
    result = suite.runpytest_subprocess("--require-gpu")
    assert result.ret != 0
    lines = [line for line in result.stderr.lines if "harness: --require-gpu" in line]
    assert len(lines) == 1, result.stderr.lines
    assert "no CUDA device was found" in lines[0]
    assert "passed" not in result.stdout.str()


ONE_GPU_GATE = """
import pytest
@pytest.mark.gpu
@pytest.mark.anchor
def test_kernel():
    pass
"""


def test_under_xdist_no_driver_is_one_line_before_any_worker_starts(suite, monkeypatch):
    # no driver, whatever this machine has: the controller (the only process here) is told so
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    suite.makeconftest(LOAD_PLUGIN + "import harness.core.device\nharness.core.device._driver_present = lambda: False\n")
    suite.makepyfile(test_g=ONE_GPU_GATE)
    result = suite.runpytest_subprocess("-n", "2", "-p", "xdist", "--require-gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if "harness: --require-gpu" in line]
    assert len(lines) == 1 and "this machine has no NVIDIA driver" in lines[0], result.stderr.lines
    assert "created:" not in result.stdout.str()  # xdist started no worker


def test_under_xdist_the_device_probe_runs_while_the_workers_start_and_still_refuses_in_one_line(suite):
    # the driver made present: the controller's probe (a fresh process, no conftest) sees
    # every device hidden, and says so after xdist has started its workers, which it then
    # takes down
    suite.makepyfile(test_g=ONE_GPU_GATE)
    suite.makeconftest(LOAD_PLUGIN + "import harness.core.device\nharness.core.device._driver_present = lambda: True\n")
    result = suite.runpytest_subprocess("-n", "2", "-p", "xdist", "--require-gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if "harness: --require-gpu" in line]
    assert len(lines) == 1 and "CUDA_VISIBLE_DEVICES is empty, which hides every device" in lines[0], result.stderr.lines
    out = result.stdout.str()
    assert "created: 2/2 workers" in out and "passed" not in out and "failed" not in out


def test_require_gpu_from_the_environment_variable(suite, monkeypatch):
    monkeypatch.setenv("HARNESS_REQUIRE_GPU", "1")
    suite.makepyfile(test_g="import pytest\n@pytest.mark.refusal\ndef test_x():\n    pass\n")
    result = suite.runpytest_subprocess()
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*harness: --require-gpu: no CUDA device was found*"])


def test_without_require_gpu_gpu_gates_skip_naming_the_flag_and_a_banner_says_so(suite):
    suite.makepyfile(test_g="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_kernel():
            pass
        @pytest.mark.gpu
        @pytest.mark.link
        def test_other():
            pass
        @pytest.mark.structural
        def test_source_text():
            pass
    """)
    result = suite.runpytest_subprocess("-rs")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*pass --require-gpu to make this a failure*"])
    out = " ".join(result.stdout.str().split())
    assert "2 GPU gates were SKIPPED" in out
    assert "this run proves nothing about the kernels" in out
    result.assert_outcomes(passed=1, skipped=2)


def test_no_fail_fast_beats_exitfirst_from_addopts(suite):
    suite.makeini("[pytest]\naddopts = -x --maxfail=1\nkernel_root = .\nharness_lanes = 1\n")
    suite.makepyfile(test_f="""
        import pytest
        @pytest.mark.structural
        def test_one():
            assert False
        @pytest.mark.structural
        def test_two():
            assert False
        @pytest.mark.structural
        def test_three():
            pass
    """)
    stopped = suite.runpytest_subprocess()
    stopped.assert_outcomes(failed=1)
    everything = suite.runpytest_subprocess("--no-fail-fast")
    everything.assert_outcomes(failed=2, passed=1)


def test_a_missing_kernel_root_is_one_clear_error(suite):
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess("--kernel-root", "does/not/exist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*harness: kernel root *does/not/exist does not exist or is not a folder: pass --kernel-root DIR*"])


def test_an_unknown_arch_is_one_clear_error(suite):
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess("--arch", "sm_999")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*harness: unknown --arch 'sm_999': NVRTC * targets *sm_90*; pass one of them*"])


def test_require_gpu_fails_a_run_that_executed_no_gpu_gate(suite):
    suite.makeconftest(FAKE_DEVICE_CONFTEST)
    suite.makepyfile(test_x="""
        import pytest
        @pytest.mark.refusal
        def test_host_only():
            pass
    """)
    result = suite.runpytest_subprocess("--require-gpu")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*--require-gpu: no GPU gate was executed*"])


def test_trap_gates_pass_in_a_child_when_the_guard_fires_and_fail_by_assertion_when_it_does_not(suite):
    suite.makeconftest(FAKE_DEVICE_CONFTEST)
    suite.makepyfile(test_t="""
        import pytest
        from conftest import fire_trap
        @pytest.mark.gpu
        @pytest.mark.trap
        def test_guard_fires():
            fire_trap()
        @pytest.mark.gpu
        @pytest.mark.trap
        def test_guard_silent():
            pass
        @pytest.mark.gpu
        @pytest.mark.link
        def test_after():
            pass
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*the device guard did not fire*"])
    gates = {g["nodeid"].split("::")[1]: g for g in json.loads((suite.path / "rep" / "gates.json").read_text())["gates"]}
    assert gates["test_guard_fires"]["outcome"] == "passed"
    assert gates["test_guard_fires"]["isolated"] is True
    assert gates["test_guard_fires"]["kind"] == "trap"
    assert gates["test_guard_silent"]["route"] == "assertion"
    assert gates["test_after"]["isolated"] is False


def test_a_gate_that_poisons_the_context_is_named_once_and_changes_no_other_verdict(suite):
    suite.makeconftest(FAKE_DEVICE_CONFTEST)
    suite.makepyfile(test_p="""
        import pytest
        from conftest import fire_trap
        @pytest.mark.gpu
        @pytest.mark.link
        def test_a_culprit():
            fire_trap()
        @pytest.mark.gpu
        @pytest.mark.link
        def test_b_green():
            pass
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_c_red_by_its_own_assertion():
            assert 1 == 2, "c's own assertion"
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep")
    result.assert_outcomes(passed=1, failed=2)
    out = " ".join(result.stdout.str().split())
    assert out.count("poisoned the CUDA context") == 1
    report = json.loads((suite.path / "rep" / "gates.json").read_text())
    gates = {g["nodeid"].split("::")[1]: g for g in report["gates"]}
    assert report["poisoned_by"].endswith("test_a_culprit")
    assert gates["test_a_culprit"]["route"] == "trap"
    # The culprit's worker is gone: the later gates ran in a fresh one, with their own verdicts.
    culprit_worker = gates["test_a_culprit"]["worker"]
    assert culprit_worker
    assert gates["test_b_green"]["outcome"] == "passed"
    assert gates["test_b_green"]["worker"] not in (None, culprit_worker)
    c = gates["test_c_red_by_its_own_assertion"]
    assert (c["outcome"], c["route"]) == ("failed", "assertion")
    assert c["worker"] == gates["test_b_green"]["worker"]
    assert "c's own assertion" in c["first_failure_line"]


def test_reports_carry_kind_route_device_and_options(suite):
    suite.makeconftest(FAKE_DEVICE_CONFTEST)
    suite.makepyfile(test_r="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_anchor_red():
            from harness import assert_bits_eq
            import numpy as np
            assert_bits_eq("out", np.zeros(3, np.float32), np.asarray([0, 1, 0], np.float32))
        @pytest.mark.refusal
        def test_refusal_red():
            from harness.library.launch import Refusal
            raise Refusal("head_dim must be 256 or 512")
        @pytest.mark.gpu
        @pytest.mark.link
        def test_link_green():
            pass
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep", "--junitxml", "junit.xml")
    result.assert_outcomes(passed=1, failed=2)
    report = json.loads((suite.path / "rep" / "gates.json").read_text())
    assert report["version"] == 1
    assert report["device"] == "Fake GPU"
    assert report["compile_options"][0] == "-arch=sm_90"  # the list NVRTC receives (cuda.core spelling)
    assert report["summary"] == {"passed": 1, "failed": 2, "skipped": 0, "error": 0,
                                 "gpu_executed": 2, "gpu_skipped": 0}
    gates = {g["nodeid"].split("::")[1]: g for g in report["gates"]}
    a = gates["test_anchor_red"]
    assert (a["kind"], a["outcome"], a["route"], a["gpu"]) == ("anchor", "failed", "assertion", True)
    assert a["first_failure_line"] == "out: 1 of 3 elements differ bitwise (float32)"
    assert a["device"] == "Fake GPU" and a["compile_options"]
    assert "first difference at flat index 1, index [1]:" in a["failure_message"]
    r = gates["test_refusal_red"]
    assert (r["kind"], r["route"], r["gpu"], r["device"]) == ("refusal", "refusal", False, None)
    assert r["first_failure_line"] == "Refusal: head_dim must be 256 or 512"
    assert set(gates["test_link_green"]) >= {"nodeid", "module", "kind", "gpu", "outcome", "route", "duration",
                                             "first_failure_line", "device", "compile_options"}
    summary = (suite.path / "rep" / "summary.md").read_text()
    assert "**1 passed, 2 failed, 0 errors, 0 skipped**" in summary
    assert "| `test_r.py::test_anchor_red` | anchor | assertion | out: 1 of 3 elements differ bitwise (float32) |" in summary
    junit = (suite.path / "junit.xml").read_text()
    assert '<property name="kind" value="anchor" />' in junit
    assert '<property name="module" value="test_r.py" />' in junit


def test_markers_are_registered_with_help(suite):
    result = suite.runpytest_subprocess("--markers")
    for name in ("gpu", "anchor", "link", "refusal", "trap", "structural"):
        result.stdout.fnmatch_lines([f"@pytest.mark.{name}: *"])


def test_a_trap_gate_that_ends_its_module_leaves_the_next_module_a_clean_setup(suite):
    suite.makeconftest(FAKE_DEVICE_CONFTEST)
    suite.makepyfile(
        test_a="""
            import pytest
            from conftest import fire_trap
            torn_down = []
            @pytest.fixture(scope="module")
            def shared():
                yield 1
                torn_down.append(1)
            @pytest.mark.gpu
            @pytest.mark.link
            def test_uses_module_fixture(shared):
                assert shared == 1
            @pytest.mark.gpu
            @pytest.mark.trap
            def test_trap_last_in_module():
                fire_trap()
        """,
        test_b="""
            import pytest
            @pytest.mark.gpu
            @pytest.mark.anchor
            def test_first_of_next_module():
                import test_a
                assert test_a.torn_down == [1]
        """,
    )
    result = suite.runpytest_subprocess("--require-gpu", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
