"""The device-only view of a module's whole source: the `.cu` and every header it reaches in
the kernel root, each seen by the rules of `harness.compiling.deviceview`, as the compiler gets them.

A header in the kernel root is compiled as its device-only view, as the `.cu` is. When the
view of some header differs from the file, `ClosureView.write` lays the views out in a
folder shaped like the kernel root and the compiler searches that folder first (the
`$VIEW` labels in the recorded options). Every viewed file there starts with
`#line 1 "<its path in the kernel root>"`, so compiler messages and `__FILE__` name the
user's file with its own line numbers. A header the root reaches through a symlink that
leads outside it is linked there, not viewed; headers outside the kernel root (include
directories, the CUDA headers, CCCL, the shims) are compiled as they are.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from harness.compiling.deviceview import DeviceView, SetAside, Unit, device_views
from harness.compiling.includes import IncludePath, includes_of


@dataclass(frozen=True)
class Header:
    """A header reached from the `.cu` whose location (the path the compiler finds it by,
    symlinks not followed) is inside the kernel root."""

    location: Path
    label: str  # the location relative to the kernel root
    view: DeviceView | None  # None: a symlink leads outside the root; compiled as it is


@dataclass(frozen=True)
class ClosureView:
    source: Path
    root: Path
    view: DeviceView  # the `.cu`'s
    headers: tuple[Header, ...]  # the kernel root's, by label
    outside: tuple[str, ...]  # the text of every other header reached (compiled as it is)

    @property
    def set_aside(self) -> tuple[SetAside, ...]:
        """What was set aside: the `.cu`'s items, then each header's (`SetAside.file`)."""
        return self.view.set_aside + tuple(s for h in self.headers if h.view is not None for s in h.view.set_aside)

    @property
    def kept_host(self) -> tuple[SetAside, ...]:
        """Host items kept only because kept code names them, the `.cu`'s then each header's."""
        return self.view.kept_host + tuple(s for h in self.headers if h.view is not None for s in h.view.kept_host)

    @property
    def headers_changed(self) -> bool:
        """Whether some header's view differs from the file (the compiler then needs `write`)."""
        return any(h.view is not None and h.view.changed for h in self.headers)

    def includes_kept(self) -> tuple[list[str], list[str]]:
        """(the `.cu` view's includes, the includes of the kernel-root headers' views)."""
        return self.view.includes_kept(), [n for h in self.headers if h.view is not None for n in h.view.includes_kept()]

    def write(self, folder: Path, preamble: str = "") -> tuple[Path, str]:
        """Lay the views out under `folder` (which must not exist) as the kernel root is laid
        out; (the program's name, its text) for the compiler, `preamble` before the text."""
        folder.mkdir(mode=0o700)
        for h in self.headers:
            dest = folder / h.label
            dest.parent.mkdir(parents=True, exist_ok=True)
            if h.view is None:
                dest.symlink_to(h.location.resolve())
            else:
                dest.write_text(_line_one(h.location) + h.view.text, encoding="utf-8")
        inside = self.source.is_relative_to(self.root)
        program = folder / (self.source.relative_to(self.root) if inside else Path(".source") / self.source.name)
        program.parent.mkdir(parents=True, exist_ok=True)
        text = _line_one(self.source) + self.view.text
        program.write_text(text, encoding="utf-8")
        return program, preamble + text


def _line_one(path: Path) -> str:
    spelled = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{spelled}"\n'


def reached(source: Path, text: str, inc: IncludePath) -> dict[Path, str]:
    """{location: text} of `source` and every file it reaches by `#include`, searched as
    the compiler searches (the including file's folder for quoted names, then the include
    path), except the CUDA headers, CCCL and the shims. A location is the path the file is
    found by, symlinks not followed, so a view folder laid out by locations answers every
    search as the kernel root does."""
    system = tuple(d for d, _ in inc.system)
    folders = inc.searched()
    found = {source: text}
    queue = [source]
    while queue:
        here = queue.pop(0)
        for quote, name in includes_of(found[here]):
            for folder in ([here.parent] if quote == '"' else []) + folders:
                candidate = folder / name
                if candidate.is_file():
                    location = Path(os.path.normpath(candidate))
                    if location not in found and not any(location.resolve().is_relative_to(s) for s in system):
                        found[location] = location.read_text(encoding="utf-8", errors="replace")
                        queue.append(location)
                    break
    return found


_memo: dict[tuple, ClosureView] = {}


def closure_view(source: Path, text: str, inc: IncludePath, name_expressions: tuple[str, ...] = ()) -> ClosureView:
    """The views of `source` (its text `text`) and of every kernel-root header it reaches.
    Raises `DeviceViewError` naming the file (a header's path) and line of a construct the
    view cannot separate. Memoised on every reached file's location and content, so a
    launcher that compiles per launch pays for the syntax trees once per process."""
    files = reached(source, text, inc)
    key = (str(source), str(inc.root), name_expressions,
           tuple((str(p), hashlib.sha256(t.encode()).hexdigest()) for p, t in files.items()))
    hit = _memo.get(key)
    if hit is not None:
        return hit
    inside = sorted((p for p in files if p != source and p.is_relative_to(inc.root)), key=lambda p: p.as_posix())
    viewed = [p for p in inside if p.resolve().is_relative_to(inc.root)]
    outside = tuple(t for p, t in files.items() if p != source and p not in inside)
    units = [Unit(text, source, _resolver(inc, source))]
    units += [Unit(files[p], p, _resolver(inc, p), p.relative_to(inc.root).as_posix()) for p in viewed]
    context = (*outside, *(files[p] for p in inside if p not in viewed), "\n".join(name_expressions))
    views = dict(zip([source, *viewed], device_views(units, context)))
    headers = tuple(Header(p, p.relative_to(inc.root).as_posix(), views.get(p)) for p in inside)
    out = ClosureView(source, inc.root, views[source], headers, outside)
    _memo[key] = out
    return out


def _resolver(inc: IncludePath, origin: Path):
    return lambda name, quoted: inc.resolve(name, quoted, origin=origin)
