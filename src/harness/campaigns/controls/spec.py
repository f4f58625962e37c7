"""The control file format: one TOML file per control, validated before anything runs.

A control is a perturbation of the kernel sources (one or more exact-text edits) and the
gates it must turn red, each with the route it must go red by. `load_controls` reads a
folder of them and raises `ControlSpecError` listing every problem in every file at once,
each naming the file, the key and the fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

from harness.campaigns.controls.edits import Edit, EditError, apply
from harness.core.errors import UsageError
from harness.core.records import Route

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".hh", ".inl", ".inc")


# The routes a control may expect a gate to go red by (harness.core.records.Route holds them all).
EXPECTABLE = (Route.ASSERTION, Route.TRAP, Route.REFUSAL)


@dataclass(frozen=True)
class Expect:
    gate: str  # a pytest node id relative to the rootdir
    route: Route
    message: str | None = None  # a substring of the failure message

    @property
    def module(self) -> str:
        return self.gate.split("::", 1)[0]


@dataclass(frozen=True)
class Control:
    name: str  # the file's stem
    path: Path
    description: str
    why: str
    edits: tuple[Edit, ...]
    expects: tuple[Expect, ...]
    # how each edit's keys are named in messages: "" (top-level) or "edit[N]."
    edit_prefixes: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def edit_key(self, index: int, key: str) -> str:
        prefix = self.edit_prefixes[index] if index < len(self.edit_prefixes) else f"edit[{index + 1}]."
        return prefix + key

    @property
    def files(self) -> tuple[str, ...]:
        """The kernel-root-relative files this control edits, in first-edit order."""
        return tuple(dict.fromkeys(e.file for e in self.edits))

    @property
    def gates(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(x.gate for x in self.expects))

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(x.module for x in self.expects))


@dataclass(frozen=True)
class Problem:
    path: Path
    key: str | None
    message: str

    def __str__(self) -> str:
        where = _shown_path(self.path)
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ControlSpecError(UsageError):
    """Every problem found in a folder of controls; nothing runs until there are none."""

    def __init__(self, problems: list[Problem]):
        self.problems = tuple(problems)
        n = len(self.problems)
        lines = [f"{n} problem{'s' if n != 1 else ''} in the controls; nothing was run:"]
        lines += [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


TOP_KEYS = ("description", "file", "find", "replace", "occurrence", "regex", "why", "edit", "expect")
EDIT_KEYS = ("file", "find", "replace", "occurrence", "regex")
EXPECT_KEYS = ("gate", "route", "message")


# ---------------------------------------------------------------- parsing one file


def _unknown(path: Path, keys, valid, prefix: str) -> list[Problem]:
    out = []
    for key in keys:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        fix = f"did you mean {close[0]!r}?" if close else f"valid keys here are {', '.join(valid)}"
        out.append(Problem(path, f"{prefix}{key}", f"unknown key; {fix}"))
    return out


def _string(path, table, key, prefix, problems, *, required=True, empty_ok=False):
    if key not in table:
        if required:
            problems.append(Problem(path, f"{prefix}{key}", f"missing; add {key} = \"...\""))
        return None
    value = table[key]
    if not isinstance(value, str):
        problems.append(Problem(path, f"{prefix}{key}", f"must be a string, not {type(value).__name__}"))
        return None
    if not empty_ok and not value.strip():
        problems.append(Problem(path, f"{prefix}{key}", "is empty; write it out"))
        return None
    return value


def _edit(path: Path, table: dict, prefix: str, problems: list[Problem]) -> Edit | None:
    before = len(problems)
    file = _string(path, table, "file", prefix, problems)
    find = _string(path, table, "find", prefix, problems)
    replace = _string(path, table, "replace", prefix, problems, empty_ok=True)
    occurrence = table.get("occurrence")
    if occurrence is not None and (isinstance(occurrence, bool) or not isinstance(occurrence, int) or occurrence < 1):
        problems.append(Problem(path, f"{prefix}occurrence", f"must be an integer >= 1 (which match, counting from 1), not {occurrence!r}"))
    regex = table.get("regex", False)
    if not isinstance(regex, bool):
        problems.append(Problem(path, f"{prefix}regex", f"must be true or false, not {regex!r}"))
    if find is not None and replace is not None and not regex and find == replace:
        problems.append(Problem(path, f"{prefix}replace", "equals find: the control would perturb nothing"))
    if len(problems) > before:
        return None
    return Edit(file=file, find=find, replace=replace, occurrence=occurrence, regex=regex)


def _expect(path: Path, table: dict, prefix: str, problems: list[Problem]) -> Expect | None:
    before = len(problems)
    problems += _unknown(path, table, EXPECT_KEYS, prefix)
    gate = _string(path, table, "gate", prefix, problems)
    if gate is not None and "::" not in gate:
        problems.append(Problem(path, f"{prefix}gate", f"{gate!r} is not a pytest node id; write it as \"gates/test_x.py::test_claim\" (add [param] when parametrized)"))
    route_text = _string(path, table, "route", prefix, problems)
    route = None
    if route_text is not None:
        try:
            route = Route(route_text)
            if route not in EXPECTABLE:
                raise ValueError(route_text)
        except ValueError:
            valid = [r.value for r in EXPECTABLE]
            close = difflib.get_close_matches(route_text, valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(Problem(path, f"{prefix}route", f"{route_text!r} is not a route; use one of {', '.join(valid)}{hint}"))
    message = _string(path, table, "message", prefix, problems, required=False)
    if len(problems) > before:
        return None
    return Expect(gate=gate, route=route, message=message)


def parse_control(path: Path) -> tuple[Control | None, list[Problem]]:
    """Read one control file: its keys and types only (no kernel root, no gates).

    Returns the control (holding only the edits and expects that parsed when there are
    problems) and the problems; the control is None when the file is not TOML at all."""
    problems: list[Problem] = []
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return None, [Problem(path, None, f"cannot be read: {exc}")]
    except tomllib.TOMLDecodeError as exc:
        return None, [Problem(path, None, f"is not valid TOML: {exc}; fix the syntax (strings need quotes, tables are [[edit]] and [[expect]])")]

    problems += _unknown(path, data, TOP_KEYS, "")
    description = _string(path, data, "description", "", problems)
    why = _string(path, data, "why", "", problems)

    single = [k for k in ("file", "find", "replace", "occurrence", "regex") if k in data]
    edits: list[Edit] = []
    prefixes: list[str] = []
    if "edit" in data:
        if single:
            problems.append(Problem(path, single[0], "give either top-level file/find/replace or [[edit]] tables, not both; move it into an [[edit]] table"))
        tables = data["edit"]
        if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
            problems.append(Problem(path, "edit", "must be one or more [[edit]] tables with file, find and replace"))
        else:
            for i, table in enumerate(tables, 1):
                prefix = f"edit[{i}]."
                problems += _unknown(path, table, EDIT_KEYS, prefix)
                edit = _edit(path, table, prefix, problems)
                if edit is not None:
                    edits.append(edit)
                    prefixes.append(prefix)
    elif single:
        edit = _edit(path, data, "", problems)
        if edit is not None:
            edits.append(edit)
            prefixes.append("")
    else:
        problems.append(Problem(path, "find", "missing; add file, find and replace (or one [[edit]] table per edit)"))

    expects: list[Expect] = []
    tables = data.get("expect")
    if tables is None:
        problems.append(Problem(path, "expect", "missing; add an [[expect]] table with gate and route naming the gate that must go red"))
    elif not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        problems.append(Problem(path, "expect", "must be one or more [[expect]] tables with gate and route"))
    else:
        seen: set[str] = set()
        for i, table in enumerate(tables, 1):
            expect = _expect(path, table, f"expect[{i}].", problems)
            if expect is None:
                continue
            if expect.gate in seen:
                problems.append(Problem(path, f"expect[{i}].gate", f"{expect.gate} is expected twice; keep one [[expect]] per gate"))
                continue
            seen.add(expect.gate)
            expects.append(expect)

    # The parts that parsed, so the checks against the tree and the gates can report
    # their problems in the same pass.
    control = Control(path.stem, path, description or "", why or "", tuple(edits), tuple(expects), tuple(prefixes))
    return control, problems


# ---------------------------------------------------------------- checks against the tree


def check_edits(control: Control, kernel_root: Path) -> list[Problem]:
    """Each file inside the kernel root and a kernel source; each edit applies exactly once."""
    root = kernel_root.resolve()
    problems: list[Problem] = []
    texts: dict[str, str] = {}
    for i, edit in enumerate(control.edits):
        key = control.edit_key(i, "file")
        rel = Path(edit.file)
        target = (root / rel).resolve()
        if rel.is_absolute() or not target.is_relative_to(root):
            problems.append(Problem(control.path, key, f"{edit.file} is outside the kernel root {_shown_path(root)}; name the file by its path inside the kernel root"))
            continue
        if not target.is_file():
            near = difflib.get_close_matches(rel.as_posix(), [p.relative_to(root).as_posix() for p in _sources(root)], n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else "; name a file relative to the kernel root"
            problems.append(Problem(control.path, key, f"{edit.file} does not exist under the kernel root {_shown_path(root)}{hint}"))
            continue
        if target.suffix not in SOURCE_SUFFIXES:
            problems.append(Problem(control.path, key, f"{edit.file} is not a kernel source ({', '.join(SOURCE_SUFFIXES)}): gates import Python from the repo, not from the sandbox, so editing it there would change nothing; perturb the .cu or a header it includes"))
            continue
        texts.setdefault(edit.file, target.read_text(encoding="utf-8"))
    if problems:
        return problems
    try:
        apply(control.edits, texts)
    except EditError as exc:
        problems.append(Problem(control.path, control.edit_key(exc.index, exc.key), str(exc)))
    return problems


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)


def check_gates(controls: list[Control], known: set[str], rootdir: Path) -> list[Problem]:
    """Each expected gate is a node id pytest collects from the rootdir."""
    problems: list[Problem] = []
    for control in controls:
        for i, expect in enumerate(control.expects, 1):
            if expect.gate in known:
                continue
            key = f"expect[{i}].gate"
            if not (rootdir / expect.module).is_file():
                problems.append(Problem(control.path, key, f"{expect.module} does not exist (node ids are relative to the rootdir {_shown_path(rootdir)}); name the gate's file from there"))
                continue
            params = sorted(g for g in known if g.startswith(expect.gate + "["))
            siblings = sorted(g.split("::", 1)[1] for g in known if g.startswith(expect.module + "::"))
            name = expect.gate.split("::", 1)[1]
            near = difflib.get_close_matches(name, siblings, n=2, cutoff=0.75)
            if params:
                hint = f"it is parametrized; name one case, e.g. {params[0]!r}"
            elif near:
                hint = "did you mean " + " or ".join(repr(f"{expect.module}::{n}") for n in near) + "?"
            elif siblings and len(siblings) <= 12:
                hint = f"{expect.module} has: {', '.join(siblings)}"
            else:
                hint = f"run `python -m pytest --collect-only -q {expect.module}` to list its gates"
            problems.append(Problem(control.path, key, f"no gate {expect.gate} is collected; {hint}"))
    return problems


# ---------------------------------------------------------------- the folder


def control_files(controls_dir: Path) -> list[Path]:
    return sorted(p for p in controls_dir.glob("*.toml") if p.is_file())


def select(controls: list[Control], names: list[str] | tuple[str, ...], controls_dir: Path) -> list[Control]:
    if not names:
        return controls
    by_name = {c.name: c for c in controls}
    problems = []
    for name in names:
        stem = Path(name).stem if name.endswith(".toml") else name
        if stem not in by_name:
            near = difflib.get_close_matches(stem, list(by_name), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}?" if near else f"the controls are: {', '.join(sorted(by_name)) or '(none)'}"
            problems.append(Problem(controls_dir, None, f"no control named {name!r}; {hint}"))
    if problems:
        raise ControlSpecError(problems)
    wanted = {Path(n).stem if n.endswith(".toml") else n for n in names}
    return [c for c in controls if c.name in wanted]


def load_controls(
    controls_dir: Path,
    kernel_root: Path,
    *,
    names=(),
    collect=None,
    rootdir: Path | None = None,
) -> list[Control]:
    """Parse and validate every control in `controls_dir` (all of them, so a stale control
    fails even when it is not selected), then return the selected ones.

    `collect(modules) -> (node ids, error text or None)` lists the gates pytest collects;
    None skips the gate-existence check (only for callers that check gates themselves).
    """
    controls_dir = Path(controls_dir)
    rootdir = Path(rootdir) if rootdir is not None else Path.cwd()
    if not controls_dir.is_dir():
        raise ControlSpecError([Problem(controls_dir, None, "is not a folder; pass --controls-dir DIR (or the ini key controls_dir) naming the folder of control .toml files")])
    files = control_files(controls_dir)
    if not files:
        raise ControlSpecError([Problem(controls_dir, None, "holds no control (*.toml); write one TOML file per control (see docs/controls.md)")])
    problems: list[Problem] = [Problem(p, None, "is a folder, not a control file; move it out of the controls folder "
                                            "(each control is one .toml file)")
                               for p in sorted(controls_dir.glob("*.toml")) if p.is_dir()]
    controls: list[Control] = []
    for path in files:
        control, found = parse_control(path)
        problems += found
        if control is not None:
            problems += check_edits(control, kernel_root)
            controls.append(control)
    if collect is not None and controls:
        modules = sorted({m for c in controls for m in c.modules if (rootdir / m).is_file()})
        known, error = collect(modules) if modules else (set(), None)
        if error:
            problems.append(Problem(controls_dir, None, f"pytest could not collect the expected gates' modules:\n{error}"))
        else:
            problems += check_gates(controls, known, rootdir)
    if problems:
        raise ControlSpecError(problems)
    return select(controls, names, controls_dir)


def _shown_path(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
