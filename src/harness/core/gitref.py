"""The git facts a command needs of a revision the user names (`--since`, `--compare-to`):
the repository holding a folder, whether the revision names a commit there, whether the clone
is shallow. Each answers None or False where git cannot, and the caller says what to do."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None


def repo_of(folder: Path) -> Path | None:
    """The top of the git checkout holding `folder`, or None."""
    top = _git(folder, "rev-parse", "--show-toplevel")
    return Path(top.stdout.strip()) if top is not None and top.returncode == 0 else None


def names_a_commit(repo: Path, ref: str) -> bool:
    check = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    return check is not None and check.returncode == 0


def is_shallow(repo: Path) -> bool:
    check = _git(repo, "rev-parse", "--is-shallow-repository")
    return check is not None and check.stdout.strip() == "true"


def has_path(repo: Path, ref: str, path: str) -> bool:
    """Whether revision `ref` of `repo` holds `path` (relative to the repository's top; "" is the top)."""
    check = _git(repo, "cat-file", "-e", f"{ref}:{path}")
    return check is not None and check.returncode == 0
