"""Every `.cu` under the kernel root is a collected gate of kind `compile`.

`python -m pytest` compiles every kernel with no GPU: each `x.cu` is an item
`x.cu::compile` that compiles it with NVRTC, with the name expressions its launcher `x.py`
declares (`NAME_EXPRESSIONS`, the templates the gates instantiate), and fails naming the
file and line of NVRTC's first error. Its report carries each kernel's registers, spill
bytes and shared memory as user properties (JUnit `<properties>`) and as a report section
(`pytest -rA` prints it).

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
    from harness import _settings

    return _settings.current().kernel_root


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

    def runtest(self) -> None:
        from harness import kernelfile
        from harness.compile import compile_file
        from harness.modsettings import declared_settings

        root = _kernel_root()
        if not _under(self.path.parent, root):  # where the file is, not where a symlink leads
            pytest.fail(f"{self.path} is not under the kernel root {root}: the compile gates compile the kernel "
                        "root's .cu files; pass --kernel-root DIR (or set the ini key kernel_root) to its folder",
                        pytrace=False)
        mod = compile_file(self.path)  # the launcher's declared settings, as every tool reads them
        host_only = declared_settings(self.path).host_only
        problem = kernelfile.problem(mod, host_only, self.path.with_suffix(".py"))
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
        from harness.compile import CompileError, UnreadableSource
        from harness.modsettings import LauncherError

        exc = excinfo.value
        if isinstance(exc, UnreadableSource):
            return str(exc)
        if isinstance(exc, CompileError):
            path, line = exc.location
            head = f"{path}:{line}: does not compile" if line else f"{path}: does not compile"
            return f"{head}\n{exc}"
        if isinstance(exc, LauncherError):
            return str(exc)
        from harness.toolchain import IncludeDirError, NvccNotFound

        if isinstance(exc, (IncludeDirError, NvccNotFound)):
            return f"{self.path}: {exc}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::{KIND}"


def mod_set_aside(mod) -> str:
    """What the device view set aside, one line ("nothing" when the file is device code only);
    an item of a kernel-root header starts with the header's path."""
    from harness.deviceview import grouped

    return "; ".join(grouped(mod.set_aside)) if mod.set_aside else "nothing"


def set_aside_by_file(mod) -> str:
    """What the device view set aside, a block per file (the `.cu`, then each kernel-root
    header), one item a line."""
    from dataclasses import replace

    from harness.deviceview import grouped

    if not mod.set_aside:
        return "set aside: nothing"
    lines = []
    for file in dict.fromkeys(s.file for s in mod.set_aside):
        lines.append(f"set aside in {file or mod.source.name}:")
        lines += [f"  {g}" for g in grouped([replace(s, file="") for s in mod.set_aside if s.file == file])]
    return "\n".join(lines)


def collect_file(file_path: Path, parent):
    """A `.cu` under the kernel root that pytest's collection reaches, as a CuFile; and one named
    on the command line outside it, whose compile gate fails saying so (pytest would answer
    `not found`)."""
    if file_path.suffix == ".cu" and (_under(file_path, _kernel_root()) or parent.session.isinitpath(file_path)):
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
