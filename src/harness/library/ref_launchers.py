"""A comparison's REF side runs REF's launchers, not only REF's `.cu`.

Launchers that live in the kernel root (Python modules loaded from files under it, such as
`kernels_cu/fp8_gemv.py`) belong to the kernel tree: an optimisation may change a grid, a
block size or an argument in the launcher together with the kernel. When a comparison
(`harness.plugin.compare`) runs a side over another kernel root, every such module is executed again
from the file at the same relative path in that root, in the same module object (so a gate that
did `from kernels_cu import fp8_gemv` calls REF's launcher), and every name another project
module bound from it (`from kernels_cu.fp8_gemv import run_fp8_gemv`) is bound to REF's object
of that name; going back to today's root puts today's namespaces and bindings back.

Only a run started by a comparison does this: it names today's kernel root in
`HARNESS_LAUNCHERS_OF`. A launcher that exists today and not in REF stays today's; values a
module computed at import time from a launcher's constants stay today's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.core.child import LAUNCHERS_OF_CHANNEL
from harness.core.errors import HarnessError
from harness.core.project_modules import module_file, project_modules


class LauncherImportError(HarnessError, RuntimeError):
    """A launcher of the other kernel tree raised when executed."""


_today: dict[str, dict] = {}  # module name -> today's namespace, while another root's is in place
_rebound: list[tuple[dict, str, object]] = []  # (namespace, name, today's object) rebound to the other's
_active: Path | None = None  # the other root in place, None when today's is


def launcher_modules(today_root: Path) -> dict[str, tuple[object, str]]:
    """{module name: (module, its file relative to the kernel root)} for every loaded module
    whose file lies under today's kernel root."""
    root = Path(today_root).resolve()
    out = {}
    for name, mod in list(sys.modules.items()):
        f = module_file(mod)
        if not f or not f.endswith(".py"):
            continue
        path = Path(f).resolve()
        if path.is_relative_to(root):
            out[name] = (mod, path.relative_to(root).as_posix())
    return dict(sorted(out.items()))


_DUNDERS = ("__name__", "__package__", "__spec__", "__loader__", "__path__", "__builtins__")


def _submodule(package: str, attr: str, value) -> bool:
    """A package's attribute that is its own submodule (set by the import system, not its code)."""
    return getattr(value, "__name__", None) == f"{package}.{attr}" and type(value).__name__ == "module"


def use(kernel_root: Path, rootdir: Path) -> None:
    """Put the launchers of `kernel_root` in place: today's when it is today's kernel root (or
    no comparison asked for this), else the other tree's. Raises LauncherImportError (after
    putting today's back) when one of the other tree's launchers raises."""
    today = os.environ.get(LAUNCHERS_OF_CHANNEL)
    if not today:
        return
    root = Path(kernel_root).resolve()
    if _active == root:
        return
    restore()
    if root == Path(today).resolve():
        return
    swap(Path(today), root, rootdir)


def swap(today_root: Path, other_root: Path, rootdir: Path) -> list[str]:
    """Execute each launcher of today's kernel root again from `other_root`; the relative paths
    of those replaced. Raises LauncherImportError (today's put back) when one raises."""
    global _active
    replaced, objects = [], {}  # id(today's object) -> (module name, attribute name)
    try:
        for name, (mod, rel) in launcher_modules(today_root).items():
            source = Path(other_root) / rel
            if not source.is_file():
                continue
            space = mod.__dict__
            _today[name] = dict(space)
            objects.update({id(v): (name, k) for k, v in space.items()
                            if callable(v) and getattr(v, "__module__", None) == name})
            keep = {k: v for k, v in space.items() if k in _DUNDERS or _submodule(name, k, v)}
            space.clear()
            space.update(keep)
            space["__file__"] = str(source)
            _active = Path(other_root).resolve()
            try:
                exec(compile(source.read_text(), str(source), "exec"), space)
            except BaseException as exc:  # noqa: BLE001 - whatever REF's launcher raised
                raise LauncherImportError(f"the launcher {rel} of {other_root} does not import: "
                                          f"{type(exc).__name__}: {exc}") from exc
            replaced.append(rel)
        _rebind(objects, rootdir)
    except BaseException:
        restore()
        raise
    return replaced


def _rebind(objects: dict[int, tuple[str, str]], rootdir: Path) -> None:
    """Bind every name a project module (a launcher among them) took from a swapped launcher to
    the other tree's object of that name (or leave it, when the other tree has none)."""
    for _, mod in project_modules(rootdir):
        space = mod.__dict__
        for k, v in list(space.items()):
            origin = objects.get(id(v))
            if origin is None:
                continue
            new = sys.modules[origin[0]].__dict__.get(origin[1])
            if new is not None and new is not v:
                _rebound.append((space, k, v))
                space[k] = new


def restore() -> None:
    """Put today's launchers and bindings back (nothing when they are in place)."""
    global _active
    for space, k, v in reversed(_rebound):
        space[k] = v
    _rebound.clear()
    for name, space in _today.items():
        mod = sys.modules.get(name)
        if mod is not None:
            mod.__dict__.clear()
            mod.__dict__.update(space)
    _today.clear()
    _active = None
