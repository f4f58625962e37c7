"""The sandbox: a fresh temporary copy of the kernel root that a control or a mutant perturbs.

Only the kernel root is copied. Headers outside it (the CUDA headers, CCCL, the user's
include directories) are read where they are; a symlink in the root that leads outside it
(a CCCL checkout linked into the tree) is recreated as the same symlink, never copied, and
a write through it is refused like any write outside the sandbox.

The real kernel root is only ever read. Every write goes through `write`, which refuses
any path outside the sandbox, and the sandbox is removed on every way out of the `with`
block: success, a failed control, an exception, KeyboardInterrupt.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from harness.cubin_cache import SANDBOX_MARK

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
_live: set[Path] = set()  # the sandboxes open now; `write` writes nowhere else


class SandboxEscape(RuntimeError):
    """A write aimed outside the sandbox: a bug, never a control's fault."""


@contextmanager
def sandbox(kernel_root: Path, label: str = "control"):
    """Yield the path of a fresh copy of `kernel_root`; remove it afterwards."""
    kernel_root = Path(kernel_root).resolve()
    base = Path(tempfile.mkdtemp(prefix=f"harness-{_safe(label)}-"))
    try:
        copy = (base / kernel_root.name).resolve()
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
        _live.discard((base / kernel_root.name).resolve())
        shutil.rmtree(base, ignore_errors=True)


def write(copy: Path, rel: str, text: str) -> None:
    target = (copy / rel).resolve()
    if copy not in _live or not target.is_relative_to(copy):
        raise SandboxEscape(f"refusing to write {target}: it is not inside the sandbox {copy}")
    target.write_text(text, encoding="utf-8")


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label)[:40]
