"""The sandbox: a fresh temporary copy of the kernel root that a control or a mutant perturbs.

Only the kernel root is copied. Headers outside it (the CUDA headers, CCCL, the user's
include directories) are read where they are; a symlink in the root that leads outside it
(a CCCL checkout linked into the tree) is recreated as the same symlink, never copied, and
a write through it is refused like any write outside the sandbox.

The real kernel root is only ever read. Every write goes through `write`, which refuses
any path outside the sandbox, and the sandbox is removed on every way out of the `with`
block: success, a failed control, an exception, KeyboardInterrupt. An interrupt can land
where no `finally` runs (a `with` not yet entered, a cleanup not yet begun): every folder is
registered before it is made, and a campaign interrupted calls `sweep`.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from harness.compiling.cubin_cache import SANDBOX_MARK
from harness.core.errors import HarnessError

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
_live: set[Path] = set()  # the sandboxes open now; `write` writes nowhere else
_made: set[Path] = set()  # every folder `temp_folder` made (or is making) and has not removed


class SandboxEscape(HarnessError, RuntimeError):
    """A write aimed outside the sandbox: a bug, never a control's fault."""


@contextmanager
def temp_folder(label: str, parent: Path | None = None):
    """A fresh folder `harness-<label>-<random>` in `parent` (default: the temp folder),
    removed on every way out. It is registered before it is made and unregistered only once
    it is gone, so an interrupt wherever it lands (even where no `finally` of this can run:
    between the folder made and the `with` that owns it) leaves it to `sweep`."""
    base = _reserve(Path(parent or tempfile.gettempdir()), f"harness-{_safe(label)}-")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
        _made.discard(base)


def _reserve(parent: Path, prefix: str) -> Path:
    """A new folder `prefix<8 random hex digits>` in `parent` (as long a name as mkdtemp's:
    a child's socket path in it must stay short), registered before it is made."""
    while True:
        base = (parent / f"{prefix}{secrets.token_hex(4)}").resolve()
        _made.add(base)
        try:
            base.mkdir(mode=0o700)
            return base
        except FileExistsError:
            _made.discard(base)


@contextmanager
def sandbox(kernel_root: Path, label: str = "control", parent: Path | None = None):
    """Yield the path of a fresh copy of `kernel_root`, made in a `temp_folder` in `parent`;
    remove it afterwards."""
    kernel_root = Path(kernel_root).resolve()
    with temp_folder(label, parent) as base:
        copy = base / kernel_root.name
        try:
            outside: list[tuple[Path, Path]] = []

            def ignore(folder, names):
                skipped = set(_IGNORE(folder, names))
                for name in names:
                    entry = Path(folder) / name
                    if entry.is_symlink() and not entry.resolve().is_relative_to(kernel_root):
                        outside.append((entry.relative_to(kernel_root), entry.resolve()))
                        skipped.add(name)
                return skipped

            shutil.copytree(kernel_root, copy, symlinks=False, ignore=ignore)
            (base / SANDBOX_MARK).touch()  # its compiles go to the cache's sandbox part, evicted first
            for rel, target in outside:  # headers outside the root are linked, never copied
                (copy / rel).symlink_to(target, target_is_directory=target.is_dir())
            _live.add(copy)
            yield copy
        finally:
            _live.discard(copy)


# The folder the sandboxes of the screen's worker processes are made in: removed by this
# process once they are gone, so a sandbox a killed worker left goes with it, and one a
# worker would make after it is gone fails instead of staying behind.
sandbox_home = temp_folder


@contextmanager
def swept_on_interrupt():
    """Around a campaign: on KeyboardInterrupt, `sweep`, then raise it again."""
    try:
        yield
    except KeyboardInterrupt:
        sweep()
        raise


def sweep() -> None:
    """Remove every folder `temp_folder` made that is still there: what an interrupt left
    (a campaign calls it on its way out after Ctrl-C, once its threads and workers are gone;
    one interrupt is raised once, so this runs uninterrupted)."""
    for base in list(_made):
        shutil.rmtree(base, ignore_errors=True)
        _made.discard(base)


def write(copy: Path, rel: str, text: str) -> None:
    target = (copy / rel).resolve()
    if copy not in _live or not target.is_relative_to(copy):
        raise SandboxEscape(f"refusing to write {target}: it is not inside the sandbox {copy}")
    target.write_text(text, encoding="utf-8")


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label)[:40]
