"""No sandbox outlives an interrupt, wherever it lands: Ctrl-C is raised at every point the
interpreter could raise it while a sandbox is made or removed (each profile event, one run a
point), then swept as an interrupted campaign sweeps; and in the screen's parent while its
workers make theirs. No GPU needed."""

import sys
import tempfile
from pathlib import Path

import pytest

from harness.runs.sandbox import sandbox, sweep
from tests._machine import use_child_env

SUITE = Path(__file__).parent / "fixtures" / "mutate_suite"


# Where an interrupt is raised: at every event (a call, a return, a C call or its return) of
# the harness's code that makes and removes sandboxes and of contextlib's, and at the entry of
# every function of shutil and pathlib those call. Not inside the standard library's own
# bodies, where an exception raised between an `os.open` and its `try`, or after an
# `os.close`, is that library's weakness, not the sandbox's.
OURS = ("/harness/runs/sandbox.py", "/contextlib.py")
CALLED = ("/shutil.py", "/pathlib.py")


def interrupt_at(k: int):
    """A profile function raising KeyboardInterrupt at the k-th of those points, as a signal
    handled there would; then it is gone (one Ctrl-C, one KeyboardInterrupt)."""
    seen = 0

    def profile(frame, event, arg):
        nonlocal seen
        name = frame.f_code.co_filename
        if name.endswith(OURS) or (event == "call" and name.endswith(CALLED)):
            seen += 1
            if seen == k:
                sys.setprofile(None)
                raise KeyboardInterrupt(f"at event {k}")
    return profile


@pytest.fixture
def temp(tmp_path, monkeypatch):
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "kernels"
    (root / "sub").mkdir(parents=True)
    (root / "a.cu").write_text("// a\n")
    (root / "sub" / "b.cuh").write_text("// b\n")
    return root


@pytest.mark.parametrize("phase", ["making", "removing"])
def test_an_interrupt_at_any_point_of_making_or_removing_a_sandbox_leaves_nothing(temp, root, phase):
    k = 0
    while True:
        k += 1
        interrupted = False
        try:
            made = sandbox(root, "x")
            if phase == "making":
                sys.setprofile(interrupt_at(k))
            with made as copy:
                sys.setprofile(None)
                assert (copy / "sub" / "b.cuh").is_file()
                if phase == "removing":
                    sys.setprofile(interrupt_at(k))
            sys.setprofile(None)
        except KeyboardInterrupt:
            interrupted = True
            sweep()  # what an interrupted campaign does on its way out
        finally:
            sys.setprofile(None)
        assert list(temp.iterdir()) == [], f"an interrupt at event {k} of {phase} the sandbox left it behind"
        if not interrupted:
            break
    assert k > 20  # the loop reached every point of the phase, then ran it through uninterrupted


def screen_context():
    from harness.campaigns.mutate.campaign import dependents_of
    from harness.campaigns.mutate.screen import ScreenContext
    from harness.runs.compilecheck import declared_names

    root = SUITE / "kernels"
    return ScreenContext(root, "sm_90", None, declared_names(root), dependents_of(root, {"sum.cu", "other.cu"}))


def some_mutants(n: int):
    from harness.campaigns.mutate.generate import generate, select_files
    from harness.campaigns.mutate.operators import OPERATORS

    root = SUITE / "kernels"
    return generate(root, select_files(root, []), tuple(OPERATORS))[0][:n]


@pytest.mark.parametrize("jobs", [1, 2])
def test_an_interrupt_in_the_screen_leaves_no_sandbox_of_its_workers(temp, tmp_path, jobs):
    """Ctrl-C in the screen's parent as a result comes in: whatever the workers were making
    (the sandbox a killed worker left is played by one made beside theirs), nothing stays."""
    import dataclasses

    from harness.campaigns.mutate import screen

    ctx = dataclasses.replace(screen_context(), cache_dir=tmp_path / "cache")
    homes = []

    def on_done(compiled):
        (home,) = [p for p in temp.iterdir() if p.name.startswith("harness-screen-")]
        homes.append(home)
        (home / "harness-mutant-left-by-a-killed-worker").mkdir()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        screen.compile_all(some_mutants(4), ctx, jobs, on_done=on_done)
    assert homes and list(temp.iterdir()) == []


def interrupt_once_made(frame, event, arg):
    """A profile function raising KeyboardInterrupt where a sandbox folder has been made and no
    `with` owns it yet (`temp_folder` yielding it; not a child pytest's temp folder, made the
    same way): no `finally` of its own can remove it."""
    if event == "return" and frame.f_code.co_name == "temp_folder" and frame.f_code.co_filename.endswith(
            "/harness/runs/sandbox.py") and frame.f_locals.get("label") != "child":
        sys.setprofile(None)
        raise KeyboardInterrupt("a sandbox made, its with not entered")


@pytest.mark.parametrize("engine", ["controls", "mutate"])
def test_a_campaign_interrupted_between_a_sandbox_made_and_owned_sweeps_it(engine, temp, tmp_path, monkeypatch):
    import shutil

    use_child_env(monkeypatch)
    suite = tmp_path / "suite"
    shutil.copytree(Path(__file__).parent / "fixtures" / f"{engine}_suite", suite)
    if engine == "controls":
        from harness.campaigns.controls import CampaignConfig, run_campaign

        config = CampaignConfig(rootdir=suite, kernel_root=Path("kernels"), report_dir=Path("report"),
                                controls_dir=Path("controls"), names=("value_changed",), static=True,
                                require_gpu=False, cache_dir=suite / "cache")
    else:
        from harness.campaigns.mutate.campaign import MutateConfig, run_campaign

        config = MutateConfig(rootdir=suite, kernel_root=Path("kernels"), report_dir=Path("report"), static=True,
                              jobs=1, arch="sm_90", require_gpu=False, cache_dir=suite / "cache")
    sys.setprofile(interrupt_once_made)
    try:
        with pytest.raises(KeyboardInterrupt, match="a sandbox made, its with not entered"):
            run_campaign(config)
    finally:
        sys.setprofile(None)
    assert list(temp.iterdir()) == []
