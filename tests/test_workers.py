"""The warm pool and the watchdog through pytester, with a fake device (no GPU needed):
gates that block in C with every signal masked, workers that die, trap gates in fresh
workers, spares, deadlines from the CLI, the ini and a marker, bad input, and nothing
left running after the run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_plugin import FAKE_DEVICE_CONFTEST
from tests._machine import use_child_env


# A gate that blocks in a C call no Python signal handler can interrupt: every signal is
# masked in the thread, then libc's sleep() waits. Only SIGKILL ends it.
BLOCKED_IN_C = """
import ctypes, signal
def block_forever_in_c():
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    ctypes.CDLL(None).sleep(3600)
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    use_child_env(monkeypatch)
    # One lane: these tests are of the main worker, whatever the machine's cores (lanes: test_lanes.py).
    pytester.makeini("[pytest]\nkernel_root = .\nharness_lanes = 1\n")
    pytester.makeconftest(FAKE_DEVICE_CONFTEST + BLOCKED_IN_C)
    return pytester


def _gates(suite) -> dict:
    report = json.loads((suite.path / "rep" / "gates.json").read_text())
    return {g["nodeid"].split("::")[1]: g for g in report["gates"]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until_gone(pid: int, what: str) -> None:
    """Until `pid` is gone (an event, not a time: the bound only stops a hang)."""
    for _ in range(6000):
        if not _alive(pid):
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} (pid {pid}) is still running")


def test_a_gate_blocked_in_c_with_signals_masked_gets_timeout_and_the_rest_their_verdicts(suite):
    suite.makepyfile(test_w="""
        import os, pytest
        from conftest import block_forever_in_c
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_a_before():
            open("pids", "a").write(f"{os.getpid()}\\n")
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_b_hangs():
            open("pids", "a").write(f"{os.getpid()}\\n")
            block_forever_in_c()
        @pytest.mark.gpu
        @pytest.mark.link
        def test_c_green_after():
            open("pids", "a").write(f"{os.getpid()}\\n")
        @pytest.mark.gpu
        @pytest.mark.link
        def test_d_red_after():
            assert 1 == 2, "d's own assertion"
    """)
    # (the run ends at all only because the watchdog killed b's worker: nothing else ends a
    # sleep in C with every signal masked; the records below say so, whatever the run's wall time)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-deadline", "2", "--harness-report", "rep",
                                        "--junitxml", "junit.xml")
    result.assert_outcomes(passed=2, failed=2)
    gates = _gates(suite)
    b = gates["test_b_hangs"]
    assert (b["outcome"], b["route"]) == ("failed", "timeout")
    assert "timeout after 2 s (--harness-deadline)" in b["first_failure_line"]
    assert "killed and replaced" in b["failure_message"]
    assert gates["test_c_green_after"]["outcome"] == "passed"
    assert gates["test_c_green_after"]["worker"] != b["worker"]
    d = gates["test_d_red_after"]
    assert (d["outcome"], d["route"], d["first_failure_line"]) == ("failed", "assertion", "d's own assertion")
    assert (suite.path / "junit.xml").is_file()
    out = " ".join(result.stdout.str().split())
    assert "1 GPU gate(s) ran past their deadline" in out
    pids = [int(p) for p in (suite.path / "pids").read_text().split()]
    assert len(set(pids)) == 2  # a and b shared a worker; c ran in its replacement
    for pid in set(pids):  # each was SIGKILLed when the run closed its pool: gone, however loaded the machine
        _wait_until_gone(pid, "a worker of the run")


def test_the_watchdog_names_the_last_kernel_launched(suite):
    suite.makepyfile(test_k="""
        import pytest
        from harness.library.kernels import note_launch
        from conftest import block_forever_in_c
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_spins():
            note_launch("spin.cu:reduce_forever")
            block_forever_in_c()
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-deadline", "2", "--harness-report", "rep")
    result.assert_outcomes(failed=1)
    g = _gates(suite)["test_spins"]
    assert g["route"] == "timeout"
    assert g["first_failure_line"].endswith("last kernel launched: spin.cu:reduce_forever")
    assert "the last kernel launched was spin.cu:reduce_forever" in g["failure_message"]


def test_a_deadline_marker_beats_the_ini_and_the_ini_beats_the_default(suite):
    suite.makeini("[pytest]\nkernel_root = .\nharness_deadline = 2\nharness_lanes = 1\n")
    suite.makepyfile(test_m="""
        import pytest
        from conftest import block_forever_in_c
        @pytest.mark.gpu
        @pytest.mark.anchor
        @pytest.mark.deadline(1)
        def test_marker():
            block_forever_in_c()
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_ini():
            block_forever_in_c()
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep")
    result.assert_outcomes(failed=2)
    gates = _gates(suite)
    assert "timeout after 1 s (its deadline marker)" in gates["test_marker"]["first_failure_line"]
    assert "timeout after 2 s (ini harness_deadline)" in gates["test_ini"]["first_failure_line"]


def test_a_worker_that_dies_mid_gate_is_red_by_route_error_and_replaced(suite):
    suite.makepyfile(test_d="""
        import os, pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_a_dies():
            os._exit(3)
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_b_after():
            pass
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep")
    result.assert_outcomes(passed=1, failed=1)
    gates = _gates(suite)
    a = gates["test_a_dies"]
    assert (a["outcome"], a["route"]) == ("failed", "error")
    assert "ended without a verdict" in a["first_failure_line"]
    assert gates["test_b_after"]["outcome"] == "passed"


def test_gpu_gates_share_a_warm_worker_and_each_trap_gate_gets_a_fresh_one(suite):
    suite.makepyfile(test_s="""
        import os, pytest
        from conftest import fire_trap
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_1():
            open("pids", "a").write(f"g {os.getpid()}\\n")
        @pytest.mark.gpu
        @pytest.mark.trap
        def test_2_trap():
            open("pids", "a").write(f"t {os.getpid()}\\n")
            fire_trap()
        @pytest.mark.gpu
        @pytest.mark.trap
        def test_3_trap():
            open("pids", "a").write(f"t {os.getpid()}\\n")
            fire_trap()
        @pytest.mark.memory_safety
        @pytest.mark.names_faults
        @pytest.mark.gpu
        @pytest.mark.link
        def test_4():
            open("pids", "a").write(f"g {os.getpid()}\\n")
        @pytest.mark.refusal
        def test_5_host_only():
            open("pids", "a").write(f"h {os.getpid()}\\n")
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep", "-v")
    result.assert_outcomes(passed=5)
    # the pytest process's own gates first, then the GPU gates, the trap gates last, each group
    # in its own order (the trap gates run from the beginning, in their own lane)
    order = [line.split("::")[1].split()[0] for line in result.outlines if "::test_" in line and "PASSED" in line]
    assert order == ["test_5_host_only", "test_1", "test_4", "test_2_trap", "test_3_trap"], order
    rows = [line.split() for line in (suite.path / "pids").read_text().splitlines()]
    gpu = {int(p) for k, p in rows if k == "g"}
    traps = [int(p) for k, p in rows if k == "t"]
    host = {int(p) for k, p in rows if k == "h"}
    assert len(gpu) == 1
    assert len(set(traps)) == 2 and not gpu & set(traps)
    assert not host & (gpu | set(traps))  # host-only gates run in the pytest process
    gates = _gates(suite)
    assert gates["test_2_trap"]["isolated"] is True and gates["test_1"]["isolated"] is False
    # a trap gate is a memory-safety gate by definition; an ordinary one is not
    assert gates["test_2_trap"]["memory_safety"] is True and gates["test_1"]["memory_safety"] is False
    assert gates["test_4"]["memory_safety"] is True  # marked
    from harness.campaigns.mutate.select import Coverage

    assert Coverage.from_report(suite.path / "rep" / "gates.json").memory_safety_gates() == {
        "test_s.py::test_2_trap", "test_s.py::test_3_trap", "test_s.py::test_4"}
    # a gate marked names_faults is recorded so, for a campaign to run it first after a fault
    assert gates["test_4"]["names_faults"] is True and gates["test_1"]["names_faults"] is False
    assert Coverage.from_report(suite.path / "rep" / "gates.json").fault_naming_gates() == {"test_s.py::test_4"}


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_deadline_is_one_clear_usage_error(suite, value):
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess(f"--harness-deadline={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "--harness-deadline" in err and "Traceback" not in err
    assert "e.g. --harness-deadline 120" in err


def test_a_bad_ini_deadline_is_one_clear_usage_error(suite):
    suite.makeini("[pytest]\nkernel_root = .\nharness_deadline = -5\n")
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*harness: ini harness_deadline must be a positive, finite number of seconds (got -5);"
                                 " set e.g. harness_deadline = 120*"])


def test_an_unknown_sanitizer_tool_is_refused_naming_the_tools(suite):
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess("--sanitize", "leakcheck")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sanitize*invalid choice: 'leakcheck'*memcheck*racecheck*"])


def test_a_sanitizer_that_is_not_executable_is_one_clear_error(suite, monkeypatch, tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o644)
    monkeypatch.setenv("HARNESS_SANITIZER", str(fake))
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess("--sanitize", "memcheck")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*harness: --sanitize: {fake} *is not an executable file*chmod +x*"])
    assert "Traceback" not in result.stderr.str()


def test_a_missing_sanitizer_says_how_to_install_it(suite, monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_SANITIZER", str(tmp_path / "nowhere"))
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess("--sanitize", "racecheck")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*harness: --sanitize: HARNESS_SANITIZER=*nowhere does not exist*"])


def test_sanitize_without_a_device_is_one_clear_error(pytester, monkeypatch, tmp_path):
    use_child_env(monkeypatch)  # no device
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nexec \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HARNESS_SANITIZER", str(fake))
    # One lane: these tests are of the main worker, whatever the machine's cores (lanes: test_lanes.py).
    pytester.makeini("[pytest]\nkernel_root = .\nharness_lanes = 1\n")
    pytester.makeconftest("import sys\npytest_plugins = [] if 'harness.plugin' in sys.modules else ['harness.plugin']\n")
    pytester.makepyfile(test_x="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_x():
            pass
    """)
    result = pytester.runpytest_subprocess("--sanitize", "memcheck")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*harness: --sanitize memcheck needs a CUDA device*drop --sanitize*"])


def test_findings_in_a_sanitizer_log_are_parsed_into_blocks_with_one_actionable_line():
    from harness.pool.sanitizer import findings, first_line

    log = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at oob_write+0x70 in /k/oob.cu:7
=========     by thread (104,0,0) in block (3,0,0)
=========     Address 0x7f00000fa0 is out of bounds
=========     and is 0 bytes after the nearest allocation at 0x7f00000000 of size 4000 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f4d]
=========
========= ERROR SUMMARY: 1 error
"""
    blocks = findings(log)
    assert len(blocks) == 1
    line = first_line("memcheck", blocks[0])
    assert line.startswith("memcheck: Invalid __global__ write of size 4 bytes; at oob_write+0x70")
    assert "by thread (104,0,0) in block (3,0,0)" in line and "Address 0x7f00000fa0 is out of bounds" in line
    assert findings("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n") == []


def test_no_nvidia_driver_is_named_as_such_not_as_a_driver_version(monkeypatch):
    from harness.core import device

    monkeypatch.setattr(device, "_driver_present", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = device._probe.__wrapped__()
    assert not p.usable
    assert "this machine has no NVIDIA driver (libcuda.so.1 is not installed)" in p.error
    assert "version" not in p.error


def test_every_device_hidden_is_a_machine_with_no_driver_and_is_named_as_such(monkeypatch):
    # CUDA_VISIBLE_DEVICES="" on a machine with a driver: no pool forked at configure, no probe
    # process, no CuPy import, as where there is no driver; the probe names the variable
    import ctypes

    from harness.core import device

    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # the driver's library loads
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device._driver_present()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not device._driver_present()
    p = device._probe.__wrapped__()
    assert (p.count, p.error) == (0, "no CUDA device was found: CUDA_VISIBLE_DEVICES is empty, which hides every "
                                     "device; unset it, or name a device, to run the GPU gates")
    assert device.why_no_driver() == p.error
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert device._driver_present() and device.why_no_driver() == device.NO_DRIVER


def test_a_probe_process_that_does_not_answer_is_an_error_and_is_killed(tmp_path, monkeypatch):
    from harness.pool import controller

    (tmp_path / "slow_probe.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(controller, "SERVE_MODULE", "slow_probe")
    probe = controller.ProbeProcess(tmp_path, timeout=0.5)
    assert probe.result() == {"count": 0, "error": "the device probe did not answer in 0.5 s: check the GPU (nvidia-smi)"}
    assert probe.proc.poll() is not None
    unread = controller.ProbeProcess(tmp_path)  # a run that ended before it read its probe
    unread.close()
    assert unread.proc.poll() is not None


def test_a_machine_with_no_driver_is_told_so_without_importing_cupy():
    # Every process of a GPU-less machine that asks (a compile's arch, a gate run's probe) paid
    # CuPy's import before it learnt that no driver is there.
    code = ("import sys\nfrom harness.core import device\ndevice._driver_present = lambda: False\n"
            "p = device._probe()\nprint(p.usable, 'cupy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_the_removed_child_timeout_option_is_one_clear_usage_error(suite):
    suite.makepyfile(test_x="import pytest\n@pytest.mark.refusal\ndef test_x():\n    pass\n")
    result = suite.runpytest_subprocess("--harness-child-timeout", "-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*harness: --harness-child-timeout was removed*pass --harness-deadline S*"])
    assert "Traceback" not in result.stderr.str()


def test_the_device_count_hint_reads_cuda_visible_devices_without_cuda(monkeypatch):
    from harness.core import device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert device.device_count_hint() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert device.device_count_hint() is None  # no device visible: the probe will say so
    assert [device.ordinal_for_xdist_worker(w, 2) for w in ("gw0", "gw1", "gw2", "gw3")] == [0, 1, 0, 1]
    assert device.ordinal_for_xdist_worker("gw5", 1) == 0


class _FakeDriver:
    """The part of cuda.bindings.driver that set_gpu_wait and gpu_wait_mode call."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, log):
        self.log, self.flags = log, 0

    def cuInit(self, flags):
        self.log.append(("cuInit", flags))
        return (0,)

    def cuDeviceGet(self, ordinal):
        self.log.append(("cuDeviceGet", ordinal))
        return 0, f"dev{ordinal}"

    def cuDevicePrimaryCtxSetFlags(self, dev, flags):
        self.log.append(("cuDevicePrimaryCtxSetFlags", dev, flags))
        self.flags = flags
        return (0,)

    def cuDevicePrimaryCtxGetState(self, dev):
        return 0, self.flags, 1


@pytest.fixture
def fake_driver(monkeypatch):
    import types

    from harness.core import device

    log = []
    drv = _FakeDriver(log)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = drv
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)
    monkeypatch.setattr(device, "_driver_present", lambda: True)
    return log


def test_a_worker_sleeps_while_the_gpu_works_when_asked_before_its_context_exists(fake_driver, monkeypatch):
    import types

    from harness.pool import worker as pool_worker

    assert pool_worker.set_gpu_wait("block") is None
    assert fake_driver == [("cuInit", 0), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxSetFlags", "dev0", 0x04)]
    assert pool_worker.gpu_wait_mode() == "block"
    assert "is not one of auto, spin, yield, block" in pool_worker.set_gpu_wait("nap")
    assert pool_worker.set_gpu_wait(None) is None and pool_worker.set_gpu_wait("") is None
    # _prepare_device sets the mode before CuPy makes the context
    fake_driver.clear()
    calls = fake_driver
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(free=lambda p: calls.append(("cudaFree", p))))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv(pool_worker.GPU_WAIT_ENV, "block")
    pool_worker._prepare_device()
    assert calls[:4] == [("cuInit", 0), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxSetFlags", "dev0", 0x04),
                         ("cudaFree", 0)], calls


def test_the_campaigns_workers_are_told_to_sleep_while_the_gpu_works():
    from harness.pool import worker as pool_worker
    from harness.runs.warm import WORKER_ENV

    assert WORKER_ENV[pool_worker.GPU_WAIT_ENV] == "block"
    assert WORKER_ENV["OPENBLAS_NUM_THREADS"] == "1"


def test_without_a_driver_the_wait_mode_is_left_alone_quietly(monkeypatch):
    from harness.core import device
    from harness.pool import worker as pool_worker

    monkeypatch.setattr(device, "_driver_present", lambda: False)
    assert pool_worker.set_gpu_wait("block") is None


def test_the_harness_processes_start_without_a_second_copy_of_the_workers_module():
    # `python -m` of a pool module would run a second copy of a module the package has
    # imported, and runpy's RuntimeWarning about it would open every worker log
    import subprocess

    from harness.pool import channel

    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", channel.SERVE_MODULE, "probe"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" not in out.stderr and json.loads(out.stdout).keys() >= {"count"}, (out.stdout, out.stderr)


def _traced_run(suite, body: list[str], tmp_path, monkeypatch, passed: int):
    """Run `body` (test_s.py's lines) with the pool's trace on; the trace file."""
    suite.makepyfile(test_s="\n".join(body) + "\n")
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("HARNESS_POOL_TRACE", str(trace))
    monkeypatch.delenv("HARNESS_POOL_T0", raising=False)
    suite.runpytest_subprocess("--require-gpu", "-p", "no:randomly").assert_outcomes(passed=passed)
    return trace


def test_the_pool_makes_one_worker_per_trap_gate_and_one_spare_and_the_main_worker_first(suite, tmp_path, monkeypatch):
    """The driver makes contexts one at a time: the main worker is asked for beside the probe,
    the trap gates' spares once the probe answered, and once every trap gate has started no
    new worker is made (more contexts made while the traps are handled would hold them
    up). The timeline is the pool's own trace (HARNESS_POOL_TRACE),
    every process's lines on one clock."""
    body = ["import pytest", "from conftest import fire_trap"]
    for i in range(3):
        body += ["@pytest.mark.gpu", "@pytest.mark.anchor", f"def test_g{i}():", "    pass"]
    for i in range(3):
        body += ["@pytest.mark.gpu", "@pytest.mark.trap", f"def test_t{i}():", "    fire_trap()"]
    trace = _traced_run(suite, body, tmp_path, monkeypatch, passed=6)
    events = [line.split(None, 2) for line in trace.read_text().splitlines()]
    asked = [i for i, (_, _, what) in enumerate(events) if what.startswith("ask t")]
    forks = [what for _, _, what in events if what.startswith("server: fork")]
    probe = next(i for i, (_, _, what) in enumerate(events) if what == "probe answered")
    assert len(asked) == len(forks) == 1 + 3 + 1, trace.read_text()  # the main worker, a spare a trap gate, one kept
    assert asked[0] < probe < asked[1], trace.read_text()
    # every process wrote to the one timeline: the server, the probe and the workers
    whats = {what.split(":")[0] for _, _, what in events}
    assert {"server", "probe", "worker t1"} <= whats, sorted(whats)


# ------------------------------------------------------------------ the forked server

# A driver "present" from the conftest on: the pool then starts at configure, where the
# gate run forks its server from the pytest process (HARNESS_SERVER_START).
DRIVER_PRESENT = "\ndevice._driver_present = lambda: True\n"
SERVER_BODY = ["import os, pytest", "from conftest import fire_trap",
               "@pytest.mark.gpu", "@pytest.mark.anchor", "def test_a():", "    pass",
               "@pytest.mark.gpu", "@pytest.mark.anchor", "def test_b():", "    assert os.environ.get('NOPE') == 'x'",
               "@pytest.mark.gpu", "@pytest.mark.trap", "def test_t():", "    fire_trap()",
               "@pytest.mark.gpu", "@pytest.mark.trap", "def test_u():", "    pass",
               "@pytest.mark.refusal", "def test_r():", "    pass"]


def _server_run(suite, tmp_path, monkeypatch, mode: str | None, conftest_extra: str = "") -> tuple[dict, str]:
    # No plugin autoload: the harness is loaded only by the conftest, as from a checkout with
    # nothing installed (LOAD_PLUGIN's idiom, which loads it only when not yet imported).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    suite.makeconftest(FAKE_DEVICE_CONFTEST + DRIVER_PRESENT + conftest_extra)
    suite.makepyfile(test_s="\n".join(SERVER_BODY) + "\n")
    trace = tmp_path / f"trace-{mode}.txt"
    trace.unlink(missing_ok=True)
    monkeypatch.setenv("HARNESS_POOL_TRACE", str(trace))
    monkeypatch.delenv("HARNESS_POOL_T0", raising=False)
    if mode is None:
        monkeypatch.delenv("HARNESS_SERVER_START", raising=False)
    else:
        monkeypatch.setenv("HARNESS_SERVER_START", mode)
    result = suite.runpytest_subprocess("--require-gpu", "-p", "no:randomly", "--harness-report=rep")
    result.assert_outcomes(passed=3, failed=2)
    verdicts = {k: (g["outcome"], g.get("route"), g.get("first_failure_line")) for k, g in _gates(suite).items()}
    return verdicts, trace.read_text()


def test_the_gate_runs_server_is_a_fork_of_the_pytest_process_and_every_verdict_is_a_spawned_ones(
        suite, tmp_path, monkeypatch):
    """Forked at configure, the server has the pytest process's imports and conftests; it
    still runs a pytest session of its own, so each gate (passed, failed by assertion, a trap
    that fired, a trap that did not, a CPU gate) has the verdict it has under a spawned one."""
    forked, trace = _server_run(suite, tmp_path, monkeypatch, None)
    starts = [line.split(None, 2) for line in trace.splitlines() if "server start:" in line]
    assert len(starts) == 1 and starts[0][2].startswith("server start: fork"), trace
    pytest_pid = starts[0][1]
    server_pids = {pid for _, pid, what in (line.split(None, 2) for line in trace.splitlines())
                   if what.startswith("server: started")}
    assert len(server_pids) == 1 and server_pids != {pytest_pid}, trace
    spawned, trace = _server_run(suite, tmp_path, monkeypatch, "spawn")
    assert "server start: spawn (HARNESS_SERVER_START=spawn)" in trace, trace
    assert forked == spawned
    assert forked["test_b"][:2] == ("failed", "assertion") and forked["test_u"][:2] == ("failed", "assertion")
    assert forked["test_t"][0] == forked["test_a"][0] == forked["test_r"][0] == "passed"


def test_a_pytest_process_running_another_thread_spawns_its_server(suite, tmp_path, monkeypatch):
    # forking a process with other threads copies only the caller: a lock one of them held
    # stays held forever in the child; so the server is spawned, with the same verdicts
    thread = "\nimport threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    verdicts, trace = _server_run(suite, tmp_path, monkeypatch, None, conftest_extra=thread)
    assert "server start: spawn (this process runs 2 threads)" in trace, trace
    assert verdicts["test_t"][0] == "passed" and verdicts["test_b"][:2] == ("failed", "assertion")


def test_a_process_holding_an_nvidia_device_file_never_forks_its_server(monkeypatch):
    from harness.pool import fork

    monkeypatch.delenv("HARNESS_SERVER_START", raising=False)
    monkeypatch.setattr(fork.threading, "active_count", lambda: 1)  # (xdist's own threads run here)
    fds = {"0": "/dev/null", "1": "pipe:[7]"}
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: list(fds) if p == "/proc/self/fd" else real_listdir(p))
    monkeypatch.setattr(os, "readlink", lambda p: fds[p.rsplit("/", 1)[1]])
    assert fork.server_start_mode() == ("fork", "this process has no other thread and no CUDA context")
    fds["3"] = "/dev/nvidiactl"
    assert fork.server_start_mode() == ("spawn", "this process has initialised CUDA (an NVIDIA device file "
                                                    "is open)")
    monkeypatch.setenv("HARNESS_SERVER_START", "spawn")
    assert fork.server_start_mode() == ("spawn", "HARNESS_SERVER_START=spawn")


@pytest.mark.parametrize("value", ["forkserver", "1"])
def test_a_bad_server_start_mode_is_one_clear_usage_error(suite, monkeypatch, value):
    monkeypatch.setenv("HARNESS_SERVER_START", value)
    suite.makepyfile(test_x="def test_x():\n    pass\n")
    result = suite.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert f"HARNESS_SERVER_START='{value}' is not fork or spawn" in err and "Traceback" not in err


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_the_pools_temp_folder_goes_with_the_run(suite, monkeypatch, tmp_path, start):
    # A gate run's pool works in a folder of its own under the temp dir (its socket, the
    # server's log, sanitizer logs) and removes it, the server's log too, after the run:
    # otherwise a campaign of fresh pytests would leave one a mutant in /tmp.
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="hpt-", dir="/tmp"))  # short: the pool's socket lives under it
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HARNESS_SERVER_START", start)
    suite.makepyfile(test_t="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_green():
            pass
        @pytest.mark.gpu
        @pytest.mark.link
        def test_red():
            assert 1 == 2, "its own assertion"
    """)
    try:
        result = suite.runpytest_subprocess("--require-gpu", "--harness-deadline", "20")
        result.assert_outcomes(passed=1, failed=1)
        assert sorted(p.name for p in tmp.glob("harness-pool-*")) == [], "the pool's folder outlived the run"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_gate_run_killed_by_sigterm_leaves_no_server_worker_or_folder(suite, monkeypatch, tmp_path, start):
    # A plain pytest killed by SIGTERM (a cancelled CI job, `timeout`) runs no `finally`: its
    # pool is never closed. Its server and workers live in a session of their own, out of reach
    # of a signal to the pytest's group, where a worker deep in a gate would run on. So the
    # server, finding its owner gone, removes the pool's folder and ends every worker it
    # forked, and itself.
    import shutil
    import subprocess
    import tempfile

    private = Path(tempfile.mkdtemp(prefix="hst-", dir="/tmp"))  # short: the pool's socket lives under it
    who, release = tmp_path / "who", tmp_path / "release"
    suite.makepyfile(test_t="""
        import os, time, pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_waits():
            open(os.environ["WHO"] + ".part", "w").write(f"{os.getpid()} {os.getpgrp()}")
            os.rename(os.environ["WHO"] + ".part", os.environ["WHO"])
            while not os.path.exists(os.environ["RELEASE"]):  # in its gate until the test says
                time.sleep(0.05)
    """)
    env = dict(os.environ, TMPDIR=str(private), HARNESS_SERVER_START=start, WHO=str(who), RELEASE=str(release))
    owner = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--require-gpu",
                              "--harness-deadline", "600", f"--basetemp={tmp_path / 'basetemp'}", "test_t.py"],
                             cwd=suite.path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = server = None
    try:
        while not who.exists():  # the gate runs in its worker
            assert owner.poll() is None, "the gate run ended before its gate started"
            time.sleep(0.05)
        worker, server = map(int, who.read_text().split())  # the server leads its workers' group
        assert worker != server
        owner.send_signal(signal.SIGTERM)
        assert owner.wait() == -signal.SIGTERM
        _wait_until_gone(server, "the server")
        left = sorted(p.name for p in private.iterdir())
        assert left == [], f"the killed gate run's pool folder outlived it: {left}"
        _wait_until_gone(worker, "the worker in its gate")
    finally:
        release.write_text("")
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for pid in (worker, server):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(private, ignore_errors=True)


def test_a_temp_dir_too_deep_for_the_pools_socket_is_not_the_runs_end(suite, monkeypatch, tmp_path):
    # a Unix socket's path holds at most 107 bytes: under a deep TMPDIR (pytest's own tmp_path
    # under xdist is one) the pool must still start, not end the run on "AF_UNIX path too long"
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    suite.makepyfile(test_t="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_green():
            pass
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-deadline", "20")
    result.assert_outcomes(passed=1)
    assert list(deep.glob("harness-pool-*")) == []


def test_a_gate_run_killed_at_its_deadline_leaves_no_temp_folder(suite, monkeypatch):
    # a campaign's child pytest killed at its deadline cannot remove its pool's folder: the
    # runner gives each child a temp dir of its own and removes it once the child is gone
    import shutil
    import tempfile

    from harness.runs.fresh import run_gates

    (suite.path / "k.cu").write_text("__global__ void k() {}\n")
    # a GPU gate (so the run has a pool), then a host test that hangs in the pytest process
    # itself, where no gate watchdog reaches: only the runner's deadline ends the run
    suite.makepyfile(test_h="""
        import pytest
        from conftest import block_forever_in_c
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_a_green():
            pass
        @pytest.mark.structural
        def test_b_hangs():
            block_forever_in_c()
    """)
    private = Path(tempfile.mkdtemp(prefix="hrt-", dir="/tmp"))  # short: a pool's socket lives under it
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    try:
        run = run_gates(["test_h.py"], kernel_root=suite.path, rootdir=suite.path, report_dir=suite.path / "rep",
                        deadline=6, cache_dir=suite.path / "cache", require_gpu=True)
        left = sorted(p.name for p in private.iterdir())
    finally:
        shutil.rmtree(private, ignore_errors=True)
    assert run.timed_out
    assert left == [], f"the killed child's temp folders outlived it: {left}"


def test_a_skip_that_crossed_the_json_channel_has_pytests_tuple_longrepr():
    # A GPU gate skipped in the worker (a second GPU missing) came back with its longrepr as a
    # JSON list, and `pytest -rA` ended in an internal error in the skipped-summary fold
    # (seen on the H200 for tests/test_torch_gpu.py). The report is restored as pytest made it.
    from types import SimpleNamespace

    from _pytest.reports import TestReport

    from harness.plugin.verdicts import report_from_worker

    rep = TestReport("t.py::g", ("t.py", 3, "g"), {}, "skipped", ("t.py", 4, "Skipped: needs a second GPU"), "call")
    data = json.loads(json.dumps(rep._to_json()))
    assert isinstance(data["longrepr"], list)
    hook = SimpleNamespace(pytest_report_from_serializable=lambda config, data: TestReport._from_json(data))
    back = report_from_worker(SimpleNamespace(hook=hook), data)
    assert back.longrepr == ("t.py", 4, "Skipped: needs a second GPU") and isinstance(back.longrepr, tuple)
    assert back.skipped and back.nodeid == "t.py::g"
