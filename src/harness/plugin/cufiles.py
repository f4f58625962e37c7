"""Every `.cu` under the kernel root is a collected gate of kind `compile`.

`python -m pytest` compiles every kernel with no GPU: each `x.cu` is an item
`x.cu::compile` that compiles it with NVRTC, with the name expressions its launcher `x.py`
declares (`NAME_EXPRESSIONS`, the templates the gates instantiate), and fails naming the
file and line of NVRTC's first error. Its report carries each kernel's registers, spill
bytes and shared memory as user properties (JUnit `<properties>`) and as a report section
(`pytest -rA` prints it).

An item compiles its file as found under the kernel root in place when it runs: a pool worker
switched to another tree (a sandbox, a comparison's REF) compiles that tree's file at the same
path. A comparison's side run over another tree collects today's node ids (the kernel root named
in `HARNESS_LAUNCHERS_OF`, `harness.library.ref_launchers`) the same way.

Collected two ways, by the plugin's hooks once a project has opted in:
- `collect_file`: a `.cu` under the kernel root in a folder pytest visits
  (`pytest kernels_cu`, `pytest kernels_cu/x.cu`, or testpaths naming the kernel root);
- `add_unreached` on the session's collect report: when pytest runs with no path arguments
  (testpaths, or the rootdir), every `.cu` under the kernel root that the arguments did not
  reach is added, whatever testpaths says.
"""

from __future__ import annotations

from pathlib import Path

import pytest

KIND = "compile"


def _kernel_root() -> Path:
    from harness.core import settings as _settings

    return _settings.in_effect().kernel_root


def _named_roots() -> tuple[Path, ...]:
    """The kernel roots whose `.cu` files name compile items here: the kernel root, and in a
    comparison's side run the one today's node ids name."""
    import os

    from harness.core.child import LAUNCHERS_OF_CHANNEL

    today = os.environ.get(LAUNCHERS_OF_CHANNEL)
    return (_kernel_root(), *((Path(today),) if today else ()))


def kernel_file(path: Path) -> str | None:
    """`path` relative to the kernel root that names it (posix), or None when none does: where
    the file is, not where a symlink leads."""
    folder = Path(path).parent
    for root in _named_roots():
        if _under(folder, root.resolve()):
            return (folder.resolve().relative_to(root.resolve()) / Path(path).name).as_posix()
    return None


def _under(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder)
    except OSError:
        return False


class CuFile(pytest.File):
    """One `.cu` file under the kernel root; collects its one compile item."""

    def collect(self):
        yield CompileItem.from_parent(self, name=KIND)


class CompileItem(pytest.Item):
    """Compiles one `.cu` with NVRTC (no GPU) and records ptxas' resource usage."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_marker(KIND)
        self.kernel_file = kernel_file(self.path)  # its path in any kernel tree; None outside the root

    def runtest(self) -> None:
        from harness.compiling import kernelfile
        from harness.compiling.compile import compile_file
        from harness.compiling.modsettings import declared_settings

        if self.kernel_file is None:
            pytest.fail(f"{self.path} is not under the kernel root {_kernel_root()}: the compile gates compile the "
                        "kernel root's .cu files; pass --kernel-root DIR (or set the ini key kernel_root) to its folder",
                        pytrace=False)
        # The file in the kernel tree in place now (this one, or the one a worker was switched to),
        # with its launcher's declared settings, as every tool reads them.
        source = _kernel_root() / self.kernel_file
        mod = compile_file(source)
        problem = kernelfile.problem(mod, declared_settings(source).host_only, source.with_suffix(".py"))
        if problem:
            pytest.fail(problem, pytrace=False)
        lines = []
        for r in mod.resources:
            self.user_properties.append(
                (f"resources {r.kernel}",
                 f"registers={r.registers} spill_bytes={r.spill_bytes} shared_bytes={r.shared_bytes}"))
            lines.append(f"{r.kernel}: {r.registers} registers, {r.spill_bytes} spill bytes, "
                         f"{r.shared_bytes} shared bytes")
        self.user_properties.append(("arch", mod.arch))
        self.user_properties.append(("backend", f"{mod.compiler} ({mod.backend_reason})"))
        self.user_properties.append(("set aside", mod_set_aside(mod)))
        self.user_properties.append(("compile options", " ".join(mod.options)))
        self.add_report_section("call", "resources", "\n".join(lines) or (
            f"none: host-only (HOST_ONLY = True in {self.path.with_suffix('.py')})"))
        self.add_report_section("call", "device view", f"backend: {mod.compiler} ({mod.backend_reason})\n"
                                                       + set_aside_by_file(mod))

    def repr_failure(self, excinfo, style=None):
        from harness.compiling.compile import CompileError, UnreadableSource
        from harness.compiling.modsettings import LauncherError

        exc = excinfo.value
        if isinstance(exc, UnreadableSource):
            return str(exc)
        if isinstance(exc, CompileError):
            path, line = exc.location
            head = f"{path}:{line}: does not compile" if line else f"{path}: does not compile"
            return f"{head}\n{exc}"
        if isinstance(exc, LauncherError):
            return str(exc)
        from harness.compiling.toolchain import NvccNotFound
        from harness.core.settings import IncludeDirError

        if isinstance(exc, (IncludeDirError, NvccNotFound)):
            return f"{self.path}: {exc}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        # The domain heads the item's failure; it must not end the node id, or pytest's verbose
        # line turns its dots into "::" (`demo.cu::compile` read `demo::cu::compile`).
        return self.path, None, f"{KIND} {self.path.name}"


def mod_set_aside(mod) -> str:
    """What the device view set aside, one line ("nothing" when the file is device code only);
    an item of a kernel-root header starts with the header's path."""
    from harness.compiling.deviceview import grouped

    return "; ".join(grouped(mod.set_aside)) if mod.set_aside else "nothing"


def set_aside_by_file(mod) -> str:
    """What the device view set aside, a block per file (the `.cu`, then each kernel-root
    header), one item a line."""
    from dataclasses import replace

    from harness.compiling.deviceview import grouped

    if not mod.set_aside:
        return "set aside: nothing"
    lines = []
    for file in dict.fromkeys(s.file for s in mod.set_aside):
        lines.append(f"set aside in {file or mod.source.name}:")
        lines += [f"  {g}" for g in grouped([replace(s, file="") for s in mod.set_aside if s.file == file])]
    return "\n".join(lines)


def collect_file(file_path: Path, parent):
    """A `.cu` under the kernel root (or the root today's node ids name, `_named_roots`) that
    pytest's collection reaches, as a CuFile; and one named on the command line outside it, whose
    compile gate fails saying so (pytest would answer `not found`)."""
    if file_path.suffix == ".cu" and (kernel_file(file_path) is not None or parent.session.isinitpath(file_path)):
        return CuFile.from_parent(parent, path=file_path)
    return None


def add_unreached(collector, rep) -> None:
    """With no path arguments (testpaths, or the rootdir): every `.cu` under the kernel root
    that pytest's own collection does not reach joins the session's collection."""
    if not isinstance(collector, pytest.Session) or not rep.passed:
        return
    config = collector.config
    if config.args_source == pytest.Config.ArgsSource.ARGS or getattr(config.option, "harness_serve", False):
        return  # paths named on the command line (or a harness child run): only what they reach
    root = _kernel_root()
    if not root.is_dir():
        return
    reached = [Path(p).resolve() for p in getattr(collector, "_initialpaths", ())]
    for source in sorted(root.rglob("*.cu")):
        if source.is_file() and any(_under(source, r) for r in reached):
            continue  # pytest's own collection reaches it through collect_file; never a broken link or a folder
        if not (source.parent.resolve() / source.name).is_relative_to(config.rootpath):
            continue  # node ids are relative to the rootdir; a kernel root outside it is compiled by the command
        rep.result.append(CuFile.from_parent(collector, path=source.parent.resolve() / source.name))
