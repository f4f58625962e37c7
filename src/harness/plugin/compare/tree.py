"""REF's kernel tree: checked before anything runs (`ref_problem`), materialised in a temporary
folder removed on every way out (`kernel_tree_at`), and its launchers tried once
(`check_launchers`)."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from harness.core.gitref import has_path, is_shallow, names_a_commit, repo_of
from harness.core.usage import UsageError


def ref_problem(ref: str, kernel_root: Path) -> str | None:
    """Why REF names no kernel tree to compare with (one line naming the fix), or None: a folder
    must hold a .cu file; a git revision must name a commit of the repository holding the kernel
    root, and that commit must hold the kernel root."""
    folder = Path(ref).expanduser()
    if folder.is_file():
        return f"--compare-to {ref} is a file: pass a folder holding the old kernel tree, or a git revision"
    if folder.is_dir():
        if not any(p.is_file() for p in folder.rglob("*.cu")):
            return f"--compare-to {ref}: the folder holds no .cu file; pass a kernel tree or a git revision"
        return None
    kernel_root = Path(kernel_root).resolve()
    repo = repo_of(kernel_root)
    if repo is None:
        return (f"--compare-to {ref}: not a folder, and the kernel root {kernel_root} is not in a git repository; "
                "pass a folder holding the old kernel tree")
    if not names_a_commit(repo, ref):
        hint = (" (this clone is shallow: fetch the history, e.g. git fetch --unshallow, or git fetch origin "
                f"{ref})" if is_shallow(repo) else "; name a branch, tag or commit of this repository")
        return f"--compare-to {ref}: no such revision in {repo}{hint}"
    rel = kernel_root.relative_to(repo).as_posix()
    if rel != "." and not has_path(repo, ref, rel):
        return f"--compare-to {ref}: {ref} has no {rel}/; compare with a revision that has the kernel root"
    return None


@contextlib.contextmanager
def kernel_tree_at(ref: str, kernel_root: Path):
    """Yield REF's kernel tree: the folder REF itself, or the kernel root as of git revision
    REF, written into a temporary folder removed on every way out. Raises UsageError."""
    problem = ref_problem(ref, kernel_root)
    if problem:
        raise UsageError(problem)
    folder = Path(ref).expanduser()
    if folder.is_dir():
        yield folder.resolve()
        return
    kernel_root = Path(kernel_root).resolve()
    repo = repo_of(kernel_root)
    rel = kernel_root.relative_to(repo).as_posix()
    tmp = Path(tempfile.mkdtemp(prefix="harness-compare-"))
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", ref, "--", rel],
                                 capture_output=True, timeout=300)
        if archive.returncode != 0:
            raise UsageError(f"--compare-to {ref}: {ref} has no {rel}/ (git archive: "
                             f"{archive.stderr.decode().strip()}); compare with a revision that has the kernel root")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        yield tmp / rel
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_launchers(ref: str, today: Path, ref_root: Path, rootdir: Path) -> None:
    """REF's launchers (those in its kernel root) import here, or one UsageError line: executed
    once in this process, today's put back at once, before any gate runs."""
    from harness.library import ref_launchers

    try:
        ref_launchers.swap(today, ref_root, rootdir)
    except ref_launchers.LauncherImportError as exc:
        raise UsageError(f"--compare-to {ref}: {exc}; fix the launcher at REF, or compare with a REF whose "
                         "launchers import") from None
    finally:
        ref_launchers.restore()
