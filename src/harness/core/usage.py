"""The commands' shared layer: their exit status, their project options, and bad input found
before any work starts, as one line naming what was wrong and what to do.

The pytest plugin's `check_configuration` and the commands call the single checks (the
compile path's own, `arch_problem` and `cache_max_problem`, live beside what they check). Each check returns the message, or None when the input is fine.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from harness.core.errors import UsageError  # noqa: F401  (the commands' and the plugin's, raised here)
from harness.core.values import positive_int, positive_seconds  # noqa: F401  (re-exported)


class ExitStatus(enum.IntEnum):
    """Every command's exit status."""

    OK = 0
    FINDINGS = 1  # what the command looks for was found: a control not as expected, a surviving mutant
    CONTROLS_DIFFER = 1
    SURVIVORS = 1
    USAGE = 2  # bad arguments or invalid inputs: nothing ran
    BASELINE_RED = 3  # the unperturbed gates are red: nothing over them would prove anything
    DEVICE_LOST = 4  # the device stopped answering mid-run: no verdict after that is one
    INTERRUPTED = 130


def add_project_options(parser, *, rootdir: bool = True,
                        arch_help: str = "default: HARNESS_ARCH, else the device's arch, else sm_90") -> None:
    """The options every command reads its project by, each resolved as the pytest run does
    (`harness.core.settings.resolve`: the option, else the variable, else the ini key, else the default)."""
    if rootdir:
        parser.add_argument("--rootdir", default=None, metavar="DIR",
                            help="where pytest runs and gate node ids start (default: the project's rootdir, found "
                                 "as pytest finds it: the first folder from the working folder up with a pytest "
                                 "configuration)")
    parser.add_argument("--kernel-root", default=None, metavar="DIR",
                        help="folder of the .cu files (default: HARNESS_KERNEL_ROOT, else ini kernel_root, else "
                             "kernels_cu)")
    parser.add_argument("--arch", default=None, metavar="sm_XX", help=arch_help)
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="the cubin cache, shared with the gate runs (default: HARNESS_CACHE_DIR, else ini "
                             "harness_cache_dir, else ~/.cache/harness/cubin)")


def say_baseline_red(console, baseline) -> None:
    """A red baseline (`harness.runs.result.Baseline`) on a rich console: why nothing ran over it."""
    from rich.markup import escape

    head, *rest = baseline.lines()
    console.print(f"[bold red]baseline red[/]: {escape(head)}")
    for line in rest:
        console.print(line, markup=False)


def _blocking_file(path: Path) -> Path | None:
    """The first of `path` and its parents that exists and is not a folder."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def folder_problem(path: str | os.PathLike, option: str, holds: str) -> str | None:
    """`path` must be a folder or creatable as one (it, or a parent, is not a file)."""
    path = Path(path)
    blocker = _blocking_file(path.resolve())
    if blocker is None:
        return None
    if blocker == path.resolve():
        return (f"{option} {path} is a file, not a folder: {option} names the folder that holds {holds}; "
                "pass a folder (it is created when missing)")
    return (f"{option} {path} cannot be a folder: {blocker} is a file; pass a folder path "
            f"for {holds} (it is created when missing)")


def writable_problem(path: str | os.PathLike) -> str | None:
    """Why no folder can be made or written at `path`, or None: tried by making (and removing) a
    folder in its nearest existing parent, which a read-only place or a missing permission refuses
    (permission bits alone do not say it: root passes them, a read-only mount does not)."""
    import tempfile

    target = Path(path).resolve()
    parent = next((p for p in (target, *target.parents) if p.exists()), None)
    if parent is None or not parent.is_dir():
        return None  # a file in the way: folder_problem's to say
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".harness-probe-", dir=parent))
    except OSError as exc:
        return f"{parent} takes no new folder ({exc.strerror or exc})"
    return None


def kernel_root_problem(root: str | os.PathLike, option: str, needs_cu: bool = True) -> str | None:
    """An explicitly named kernel root (by `option`: an option, a variable or "ini kernel_root")
    must be a folder, holding at least one .cu file unless `needs_cu` is false."""
    root = Path(root)
    if option.startswith("-"):
        fix = f"pass {option} DIR (or the ini key kernel_root) naming the folder that holds your .cu files"
    elif option.startswith("ini "):
        fix = ("set the ini key kernel_root (relative to the rootdir) to the folder that holds your .cu files, "
               "or pass --kernel-root DIR")
    else:
        fix = f"set {option} (or the ini key kernel_root) to the folder that holds your .cu files"
    if not root.is_dir():
        return f"kernel root {root} does not exist or is not a folder: {fix}"
    if needs_cu and not any(p.is_file() for p in root.rglob("*.cu")):
        return f"kernel root {root} holds no .cu file: {fix}"
    return None


def output_folder_problem(path: str | os.PathLike, option: str, holds: str) -> str | None:
    """A folder the command writes `holds` into: `folder_problem`'s, and it must be writable, or
    makeable (the first missing folder on its path is made and removed to find out), so a
    command finds out before it runs, not after."""
    problem = folder_problem(path, option, holds)
    if problem:
        return problem
    target = Path(path).resolve()
    missing, existing = None, target
    while not existing.exists():
        missing, existing = existing, existing.parent
    if missing is None:
        if os.access(target, os.W_OK | os.X_OK):
            return None
        return f"{option} {path} cannot be written: pass a folder you can write for {holds}"
    try:
        missing.mkdir()
        missing.rmdir()
    except OSError as exc:
        return f"{option} {path} cannot be made ({exc.strerror or exc}): pass a folder you can write for {holds}"
    return None


def add_bench_output(parser, name: str) -> None:
    """A benchmark's `--out DIR` and `--name STEM` (its JSON and Markdown), on `parser` (or an
    argument group)."""
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the JSON and Markdown go (default: harness-report/bench in the rootdir)")
    parser.add_argument("--name", default=name, help="file name stem for the JSON and Markdown")


def bench_out_folder(arg: str | None) -> Path:
    """Where a benchmark writes its figures (--out, else harness-report/bench in the rootdir),
    checked before it runs. Raises UsageError when no folder can be made there."""
    from harness.core.settings import report_root

    out = Path(arg) if arg else report_root() / "bench"
    problem = output_folder_problem(out, "--out" if arg else "the default --out", "the benchmark's JSON and Markdown")
    if problem:
        raise UsageError(problem)
    return out


def rootdir_problem(rootdir: str | os.PathLike | None) -> str | None:
    """--rootdir, when given, must be a folder."""
    if rootdir is None or Path(rootdir).is_dir():
        return None
    return (f"--rootdir {rootdir} is not a folder: pass the folder of the project's pytest configuration "
            "(pytest.ini, pyproject.toml, tox.ini or setup.cfg), or leave it out to find it from the working folder up")


def kernel_root_option(source: str) -> str:
    """What `kernel_root_problem` names for a kernel root that came from `source`
    (`harness.core.settings.Project.kernel_root_source`): the default is fixed by --kernel-root."""
    return "--kernel-root" if source == "the default" else source


def server_start_problem(value: str | None) -> str | None:
    """HARNESS_SERVER_START (`harness.core.settings.SERVER_START_ENV`): unset, or one of
    `harness.core.settings.SERVER_START_MODES`."""
    from harness.core.settings import SERVER_START_ENV, SERVER_START_MODES

    if value is None or value.strip().lower() in ("", *SERVER_START_MODES):
        return None
    return (f"{SERVER_START_ENV}={value!r} is not {' or '.join(SERVER_START_MODES)}: unset it (the gate run forks "
            "its server where that is safe) or set spawn to start the server as a fresh interpreter")
