"""One declaration of a module's compile settings, read by every tool that compiles it.

A `.cu` is compiled with the settings its launcher (the `x.py` beside `x.cu`) declares as
module-level constants; every tool that compiles the module (gates through
`harness.library.kernels.module`, the collected `x.cu::compile` items, `python -m harness compile`,
controls and campaigns) reads them here, so they all build the same cubin:

    NAME_EXPRESSIONS = ("topk<float, 4>",)  # C++ name expressions to instantiate and look up
    DEFINES = {"BLOCK": 256, "USE_FAST": None}  # -DBLOCK=256 -DUSE_FAST
    FAST_MATH = False      # --use_fast_math (implies FTZ, approximate division and sqrt)
    FTZ = False            # --ftz (default: FAST_MATH)
    FMAD = True            # --fmad
    EXTRA_FLAGS = ()       # more compiler flags (e.g. "--maxrregcount=64"; an upstream build's nvcc flags:
                           # harness.compiling.options.nvrtc_extra_flags)
    INCLUDE_DIRS = ()      # extra include folders, relative to the launcher's folder
    COMPILER = "auto"      # "auto", "nvrtc" or "nvcc" (harness.compiling.backends: the backend rule)
    DEVICE_VIEW = True     # compile the device-only view of the file (harness.compiling.deviceview)
    HOST_ONLY = False      # True: the file holds host code only, on purpose (harness.compiling.kernelfile)

A `.cu` with no launcher compiles with the defaults. A constant of the wrong type is a
`LauncherError` naming the launcher, the constant and an example.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.core.errors import HarnessError

CONSTANTS = ("NAME_EXPRESSIONS", "DEFINES", "FAST_MATH", "FTZ", "FMAD", "EXTRA_FLAGS", "INCLUDE_DIRS", "COMPILER",
             "DEVICE_VIEW", "HOST_ONLY")
COMPILERS = ("auto", "nvrtc", "nvcc")


class LauncherError(HarnessError):
    """The launcher beside a `.cu` could not be read for its compile settings. The message is
    one line: `where` (the launcher, or where a setting was given), what went wrong and what
    to do (`why`)."""

    def __init__(self, why: str, where: str | os.PathLike | None = None):
        self.why = why
        self.where = where
        super().__init__(f"{where}: {why}" if where is not None else why)


@dataclass(frozen=True)
class ModuleSettings:
    name_expressions: tuple[str, ...] = ()
    defines: tuple[tuple[str, str | None], ...] = ()  # sorted (name, value) pairs
    fast_math: bool = False
    ftz: bool | None = None  # None: as fast_math
    fmad: bool = True
    extra_flags: tuple[str, ...] = ()
    include_dirs: tuple[Path, ...] = ()  # absolute
    compiler: str = "auto"
    device_view: bool = True
    host_only: bool = False  # no compile option: what the compile gate expects of the cubin
    declared_in: str | None = field(default=None, compare=False)  # the launcher, for messages

    @property
    def ftz_effective(self) -> bool:
        return self.fast_math if self.ftz is None else self.ftz

    def with_overrides(self, *, name_expressions=None, defines=None, fmad=None) -> "ModuleSettings":
        """These settings with a caller's arguments (`module(..., defines=...)`). A value the
        launcher declares may only be repeated, never changed: one declaration per module."""
        changes = {}
        where = self.declared_in or "the launcher"
        if name_expressions is not None and tuple(name_expressions):
            ne = tuple(name_expressions)
            if self.name_expressions and set(ne) - set(self.name_expressions):
                raise LauncherError(
                    f"{where} declares NAME_EXPRESSIONS = {self.name_expressions!r} but the module is loaded with "
                    f"{ne!r}: add every name expression to NAME_EXPRESSIONS (one declaration, so the compile "
                    "command, the compile items and the controls build the same cubin)")
            if not self.name_expressions:
                changes["name_expressions"] = ne
        if defines:
            d = normalise_defines(defines, "module(defines=...)")
            if self.defines and d != self.defines:
                raise LauncherError(
                    f"{where} declares DEFINES {dict(self.defines)!r} but the module is loaded with defines="
                    f"{dict(d)!r}: declare them once, in DEFINES")
            changes["defines"] = d
        if fmad is not None and fmad != self.fmad:
            if self.declared_in and _declares(self.declared_in, "FMAD"):
                raise LauncherError(f"{where} declares FMAD = {self.fmad} but the module is loaded with fmad={fmad}: "
                                    "declare it once, in FMAD")
            changes["fmad"] = bool(fmad)
        return replace(self, **changes) if changes else self


def _declares(launcher: str, constant: str) -> bool:
    mod = sys.modules.get(_module_name(Path(launcher)))
    return mod is not None and hasattr(mod, constant)


def normalise_defines(defines, origin: str) -> tuple[tuple[str, str | None], ...]:
    if not isinstance(defines, dict):
        raise LauncherError(f"DEFINES must be a dict of macro name to value (or None), got {defines!r}; "
                            "write e.g. DEFINES = {\"BLOCK\": 256}", origin)
    out = []
    for k, v in defines.items():
        if not isinstance(k, str) or not k.isidentifier():
            raise LauncherError(f"DEFINES key {k!r} is not a macro name; write e.g. DEFINES = {{\"BLOCK\": 256}}",
                                origin)
        value = None if v is None else (str(v).lower() if isinstance(v, bool) else str(v))
        if value is not None and ("\n" in value or "\r" in value):
            raise LauncherError(f"DEFINES value of {k!r} is {value!r}, which spans lines: a macro's value is one "
                                "line on the command line; write e.g. DEFINES = {\"BLOCK\": 256}", origin)
        out.append((k, value))
    return tuple(sorted(out))


def _module_name(launcher: Path) -> str:
    return "_harness_launcher_" + hashlib.sha256(str(launcher.resolve()).encode()).hexdigest()[:16]


def _import_root(folder: Path) -> Path:
    """The folder a launcher's package imports resolve from: the first parent of `folder`
    that is not a package (holds no __init__.py). For kernels_cu/x.py: the project root, so
    `from kernels_cu.y import ...` and `from harness ...` inside the launcher work from any
    working folder."""
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        folder = folder.parent
    return folder


def _load_launcher(launcher: Path):
    name = _module_name(launcher)
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location(name, launcher)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses in the launcher look their module up here
    root = str(_import_root(launcher.resolve().parent))
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        spec.loader.exec_module(mod)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise
        where = ""
        tb = exc.__traceback__
        while tb is not None:  # the deepest frame inside the launcher: where it failed
            if Path(tb.tb_frame.f_code.co_filename).resolve() == launcher.resolve():
                where = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise LauncherError(
            f"importing the launcher to read NAME_EXPRESSIONS failed{where}: "
            f"{type(exc).__name__}{': ' + detail if detail else ''}; fix the launcher so that "
            f"`import` of it succeeds with no GPU", launcher
        ) from None
    finally:
        if added and root in sys.path:
            sys.path.remove(root)
    return mod


# EXTRA_FLAGS that another setting owns: a compiler takes the last of two with a warning in its
# log at most, so the module would be built otherwise than its recorded settings say, and a
# header found through an -I of its own would be missing from the cache key.
_OWNED_FLAGS = (
    (re.compile(r"^(-arch|--gpu-architecture|-gencode|--generate-code|-code|--gpu-code)(=|$)"),
     lambda v: "the arch is the run's (--arch, HARNESS_ARCH or the device's): drop it"),
    (re.compile(r"^-?-use_fast_math$"), lambda v: "write FAST_MATH = True instead"),
    (re.compile(r"^-?-fmad(?:=(\w+))?$"), lambda v: f"write FMAD = {(v or 'true').lower() == 'true'} instead"),
    (re.compile(r"^-?-ftz(?:=(\w+))?$"), lambda v: f"write FTZ = {(v or 'true').lower() == 'true'} instead"),
    (re.compile(r"^-?-prec-(?:div|sqrt)(?:=(\w+))?$"),
     lambda v: "write FAST_MATH = True instead (approximate division and square root)"),
    (re.compile(r"^(-I|--include-path(=|$)|-isystem)"),
     lambda v: 'write INCLUDE_DIRS = ("DIR",) instead, so that their headers are in the cache key'),
)


def _extra_flags(launcher: Path, flags: tuple[str, ...]) -> tuple[str, ...]:
    for flag in flags:
        for pattern, fix in _OWNED_FLAGS:
            m = pattern.match(flag)
            if m:
                value = m.group(1) if m.groups() and m.group(1) and not m.group(1).startswith("-") else None
                raise LauncherError(f"EXTRA_FLAGS sets {flag}: {fix(value)} (a second spelling of a setting the "
                                    "harness records would make the record wrong)", launcher)
    return flags


def _bool(launcher: Path, name: str, value, allow_none: bool = False):
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    raise LauncherError(f"{name} must be True or False, got {value!r}; write e.g. {name} = False", launcher)


def _strings(launcher: Path, name: str, value, example: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) \
            or not all(isinstance(n, str) for n in value):
        raise LauncherError(f"{name} must be a tuple of strings, got {value!r}; write e.g. {name} = ({example!r},) "
                            "(note the trailing comma)", launcher)
    return tuple(value)


def declared_settings(source: str | os.PathLike) -> ModuleSettings:
    """The settings the launcher beside `source` (`x.py` beside `x.cu`) declares; the
    defaults when there is no launcher. Raises `LauncherError` (one line)."""
    launcher = Path(source).with_suffix(".py")
    if not launcher.is_file():
        return ModuleSettings()
    mod = _load_launcher(launcher)
    g = lambda name, default: getattr(mod, name, default)  # noqa: E731
    names = g("NAME_EXPRESSIONS", ())
    if isinstance(names, (str, bytes)) or not isinstance(names, (tuple, list)) \
            or not all(isinstance(n, str) for n in names):
        raise LauncherError(
            f"NAME_EXPRESSIONS must be a tuple of C++ name expressions (strings), got "
            f"{names!r}; write e.g. NAME_EXPRESSIONS = (\"my_kernel<256>\",) (note the trailing comma)", launcher
        )
    if any(not n.strip() for n in names):
        raise LauncherError("NAME_EXPRESSIONS holds an empty string: each entry names a kernel; write "
                            "e.g. NAME_EXPRESSIONS = (\"my_kernel<256>\",)", launcher)
    compiler = g("COMPILER", "auto")
    if compiler not in COMPILERS:
        raise LauncherError(f"COMPILER must be one of {', '.join(map(repr, COMPILERS))}, got {compiler!r}", launcher)
    include = _strings(launcher, "INCLUDE_DIRS", g("INCLUDE_DIRS", ()), "third_party/include")
    from harness.core.settings import IncludeDirError, check_include_dirs

    try:
        include_dirs = check_include_dirs([launcher.parent / d for d in include], f"INCLUDE_DIRS in {launcher}")
    except IncludeDirError as exc:
        raise LauncherError(str(exc)) from None
    return ModuleSettings(
        name_expressions=tuple(names),
        defines=normalise_defines(g("DEFINES", {}), f"{launcher}"),
        fast_math=_bool(launcher, "FAST_MATH", g("FAST_MATH", False)),
        ftz=_bool(launcher, "FTZ", g("FTZ", None), allow_none=True),
        fmad=_bool(launcher, "FMAD", g("FMAD", True)),
        extra_flags=_extra_flags(launcher, _strings(launcher, "EXTRA_FLAGS", g("EXTRA_FLAGS", ()), "--maxrregcount=64")),
        include_dirs=include_dirs,
        compiler=compiler,
        device_view=_bool(launcher, "DEVICE_VIEW", g("DEVICE_VIEW", True)),
        host_only=_bool(launcher, "HOST_ONLY", g("HOST_ONLY", False)),
        declared_in=str(launcher),
    )
