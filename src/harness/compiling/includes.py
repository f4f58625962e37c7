"""Where a module's `#include`s are found, and what they reach: the include search path with
the label each folder is recorded under, and the source closure (the `.cu` and every header it
includes from the kernel root or a user include directory) that the cubin cache key hashes."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from harness.compiling import toolchain
from harness.core.settings import IncludeDirError

_INCLUDE_Q = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.MULTILINE)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def includes_of(text: str) -> list[tuple[str, str]]:
    """(quote, name) of each `#include` in `text` outside comments; quote is `<` or `"`."""
    return _INCLUDE_Q.findall(_strip_comments(text))


@dataclass(frozen=True)
class IncludePath:
    """The folders a module's includes are searched in, in order, each with the label the
    recorded options use for it: `$ROOT` and `$ROOT/sub` inside the kernel root (a sandbox
    copy records the same), `@include<N>` for a user include directory outside the root
    (its content hash is added per module), `@cuda-headers`, `@cccl`, `@harness-shims`
    (versions). `view`: the folder of the device views of the kernel root's headers
    (`harness.compiling.closureview`), searched first and recorded as `$VIEW`; None when the
    compiler reads the kernel root as it is."""

    source_dir: Path
    root: Path
    user: tuple[Path, ...]  # the launcher's INCLUDE_DIRS, then --include-dir / ini harness_include_dirs
    system: tuple[tuple[Path, str], ...]  # (dir, label) for CUDA headers, CCCL, shims
    view: Path | None = None

    def folders(self, quoted: bool) -> list[Path]:
        first = [self.source_dir] if quoted else []
        out = []
        for d in [*first, self.root, *self.user, *(d for d, _ in self.system)]:
            if d not in out:
                out.append(d)
        return out

    def label(self, folder: Path) -> str:
        folder = Path(folder)
        if self.view is not None and folder.is_relative_to(self.view):
            rel = folder.relative_to(self.view).as_posix()
            return "$VIEW" if rel == "." else f"$VIEW/{rel}"
        if folder.is_relative_to(self.root):
            rel = folder.relative_to(self.root).as_posix()
            return "$ROOT" if rel == "." else f"$ROOT/{rel}"
        for i, d in enumerate(self.user):
            if folder == d:
                return f"@include{i}"
        for d, label in self.system:
            if folder == d:
                return label
        return str(folder)

    def searched(self) -> list[Path]:
        """The folders handed to the compiler, in order: with a view, the view of the
        source's folder and of the root first; then the source's folder and the rest."""
        first = []
        if self.view is not None:
            if self.source_dir.is_relative_to(self.root):
                first.append(self.view / self.source_dir.relative_to(self.root))
            first.append(self.view)
        return list(dict.fromkeys([*first, *self.folders(quoted=True)]))

    def resolve(self, name: str, quoted: bool, origin: Path | None = None) -> Path | None:
        """Where `#include name` is found: the including file's folder first for quoted
        includes, then the search path. A header that two user include directories (or one
        and the kernel root) hold is an `IncludeDirError` saying which wins."""
        candidates = ([origin.parent] if quoted and origin is not None else []) + self.folders(quoted)
        hits = []
        for d in candidates:
            p = d / name
            if p.is_file():
                hits.append(p.resolve())
        if not hits:
            return None
        user_hits = [h for h in dict.fromkeys(hits)
                     if any(h.is_relative_to(d) for d in (self.root, *self.user))
                     and not (origin is not None and h.parent == origin.parent.resolve())]
        distinct = {h.read_bytes() for h in user_hits} if len(user_hits) > 1 else set()
        if len(distinct) > 1:
            spelled = f'"{name}"' if quoted else f"<{name}>"
            raise IncludeDirError(
                f"#include {spelled} is found in two include "
                f"directories: {user_hits[0]} (wins: it comes first in the search order) and {user_hits[1]}: "
                "rename or remove one copy, or drop one of the folders from INCLUDE_DIRS / --include-dir / "
                "ini harness_include_dirs")
        return hits[0]


def include_path(source: Path, kernel_root: Path, module_dirs=(), backend: str = "nvrtc",
                 run_dirs=()) -> IncludePath:
    """Where `source`'s includes are searched: its folder, the kernel root, its launcher's
    INCLUDE_DIRS (`module_dirs`), then the run's extra folders (`run_dirs`, the settings'
    --include-dir and ini harness_include_dirs), then the toolkit's (NVRTC only)."""
    root = Path(kernel_root).resolve()
    user = []
    for d in (*module_dirs, *run_dirs):
        d = Path(d).resolve()
        if d not in user and d != root:
            user.append(d)
    system = []
    if backend == "nvrtc":  # nvcc brings its own toolkit's headers and CCCL (its version is in the key)
        system = [(toolchain.cuda_include_dir().resolve(), f"@cuda-headers({toolchain.cuda_headers_version()})")]
        system += [(d, f"@cccl({toolchain.cccl_version()})") for d in toolchain.cccl_dirs()[0]]
        system.append((toolchain.SHIMS, f"@harness-shims({toolchain.shims_version()[:8]})"))
    # the device view's stand-in for a set-aside host header, last: it shadows nothing
    system.append((toolchain.STANDIN, f"@harness-standin({toolchain.shims_version(toolchain.STANDIN)[:8]})"))
    return IncludePath(Path(source).resolve().parent, root, tuple(user), tuple(system))


def closure_of(source: Path, inc: IncludePath) -> list[tuple[str, str]]:
    """(label, sha256) of the `.cu` and every header it includes, transitively, except the
    CUDA headers, CCCL and the shims (covered by their versions in the key): the kernel
    root's (a root-relative path), a user include directory's (`@include<N>/path`), and any
    a symlink in the root leads to (`@external/abs/path`)."""
    return closure_with_files(source, inc)[0]


def closure_with_files(source: Path, inc: IncludePath) -> tuple[list[tuple[str, str]], tuple[tuple[Path, str], ...]]:
    """`closure_of`, and (absolute path, sha256) of each file it read: what a compiled
    module's memo in `harness.library.kernels` checks for changes."""
    seen: dict[Path, str] = {}
    stack = [source.resolve()]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        data = path.read_bytes()
        seen[path] = hashlib.sha256(data).hexdigest()
        for quote, name in includes_of(data.decode("utf-8", errors="replace")):
            found = inc.resolve(name, quote == '"', origin=path)
            if found is not None and not any(found.is_relative_to(d) for d, _ in inc.system):
                stack.append(found)  # the kernel root's, a user include dir's, or one a symlink leads to

    def rel(p: Path) -> str:
        if p.is_relative_to(inc.root):
            return p.relative_to(inc.root).as_posix()
        for i, d in enumerate(inc.user):
            if p.is_relative_to(d):
                return f"@include{i}/{p.relative_to(d).as_posix()}"
        return f"@external{p.as_posix()}"  # reached through a symlink: the same path from a sandbox

    return sorted((rel(p), digest) for p, digest in seen.items()), tuple(seen.items())


def source_closure(source: Path, kernel_root: Path, include_dirs=()) -> list[tuple[str, str]]:
    """(path relative to the kernel root, sha256) of the `.cu` and every header it
    includes, transitively, that lies inside the kernel root or a user include directory
    (`@include<N>/...`). Headers of CUDA and CCCL are covered by their versions."""
    return closure_of(Path(source), include_path(source, kernel_root, include_dirs))
