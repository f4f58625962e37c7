"""The run's settings: one value (`Settings`), resolved once (`resolve`) and passed down.

Every setting is resolved in one order, the option, else the environment variable, else the
ini key, else the default, paths relative to the rootdir (`resolve`), and the value goes down
explicitly: to the pool and to every child process (serialised once, `harness.core.child.ChildPytest.over`),
to the compile path (`harness.compiling.compile.compile_file(run=...)`).

A launcher in a kernel tree calls `harness.library.kernels.module("x.cu")` and cannot be handed the
settings: it reads the ones `in_effect`, which the owner of a run binds for as long as it runs
(the plugin for its session, a pool worker for a tree it was switched to, a command), with
`applied`; outside a run they are the project's found from the working folder.
"""

from __future__ import annotations

import configparser
import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

from harness.core.errors import UsageError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEFAULT_KERNEL_ROOT = "kernels_cu"
KERNEL_ROOT_ENV = "HARNESS_KERNEL_ROOT"
ARCH_ENV = "HARNESS_ARCH"
CACHE_ENV = "HARNESS_CACHE_DIR"
SERVER_START_ENV = "HARNESS_SERVER_START"  # fork (the default where safe) or spawn: how a gate run starts its server
SERVER_START_MODES = ("fork", "spawn")
TRACE_ENV = "HARNESS_POOL_TRACE"  # a file: the gate pool's timeline, every process's events, for measuring it
DEFAULT_ARCH_WITHOUT_DEVICE = "sm_90"
DEFAULT_DEADLINE = 120.0  # seconds a GPU gate may take before the watchdog kills its worker
SANITIZER_DEADLINE_FACTOR = 10  # a default deadline stretches under --sanitize (an explicit one does not)
DEADLINE_INI = "harness_deadline"


@dataclass(frozen=True)
class Settings:
    """What the compile path, the pool and every child read: the kernel root, the arch, the
    cubin cache, the extra include folders, the per-gate deadline and whether the device buffers
    carry redzones, each absolute or final."""

    kernel_root: Path
    arch: str | None  # None: the device's arch, or sm_90 with no device
    cache_dir: Path
    arch_source: str = ARCH_ENV  # where `arch` came from, for error messages: --arch or HARNESS_ARCH
    include_dirs: tuple[Path, ...] = ()  # --include-dir, then ini harness_include_dirs (absolute)
    deadline: float = DEFAULT_DEADLINE  # seconds, a float everywhere
    deadline_source: str = "the default"
    trap_shadow: bool = False  # modules built with their guards counted (a campaign's trap gate, in a warm worker)
    generated_sources: bool = False  # the tree is a campaign's mutant: its source analyses are not kept on disk
    sweep_budget: int | None = None  # --sweep-budget: shapes a sweep draws after its presets and boundaries
    sweep_replay: str | None = None  # --sweep-replay: the one shape a sweep checks (N=64,K=1024)
    redzones: bool = False  # guard regions around the harness's device buffers, checked after each launch (--redzones)

    def with_kernel_root(self, kernel_root: str | os.PathLike) -> "Settings":
        """These settings over another kernel tree (a sandbox, a comparison's REF)."""
        return replace(self, kernel_root=Path(kernel_root).resolve())


def _default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "harness" / "cubin"


# ------------------------------------------------------------------ the settings in effect

_in_effect: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("harness_settings", default=None)


def in_effect() -> Settings:
    """The settings of the run in progress, as its owner bound them (`applied`, `bind`); outside
    a run, the project's found from the working folder (`resolve`)."""
    bound = _in_effect.get()
    if bound is not None:
        return bound
    return _outside_a_run(os.getcwd(), *(os.environ.get(v) for v in (KERNEL_ROOT_ENV, ARCH_ENV, CACHE_ENV,
                                                                     "XDG_CACHE_HOME")))


@functools.lru_cache(maxsize=8)
def _outside_a_run(cwd: str, *environment) -> Settings:
    """`resolve`'s settings for a launcher used outside any run (a script, a notebook), kept
    per working folder and environment: a launcher asks at every launch."""
    return resolve(rootdir=find_rootdir(cwd)).settings


def bind(settings: Settings) -> contextvars.Token:
    """Make `settings` the ones in effect until `unbind(token)`: for an owner whose run spans
    hooks (the plugin, from configure to unconfigure)."""
    return _in_effect.set(settings)


def unbind(token: contextvars.Token) -> None:
    _in_effect.reset(token)


@contextlib.contextmanager
def applied(settings: Settings):
    """`settings` in effect inside the block (a worker switched to another tree, a command)."""
    token = bind(settings)
    try:
        yield settings
    finally:
        unbind(token)


# ------------------------------------------------------------------ the project's pytest configuration
# The commands (`python -m harness compile`, `python -m harness controls`) read the same
# settings as a pytest run: they find the rootdir as pytest does (the first folder, from
# the working folder up, whose pytest.ini / pyproject.toml / tox.ini / setup.cfg holds a
# pytest section) and read its ini keys, so they work from any folder inside the project.

_INI_CANDIDATES = (("pytest.ini", "pytest"), (".pytest.ini", "pytest"), ("pyproject.toml", None),
                   ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest"))


def _pytest_table(path: Path, section: str | None) -> dict | None:
    """The pytest section of one configuration file, or None when it has none."""
    if section is None:
        try:
            tool = tomllib.loads(path.read_text()).get("tool", {})
        except (OSError, ValueError):
            return None
        table = tool.get("pytest") if isinstance(tool, dict) else None
        if not isinstance(table, dict):
            return None
        inner = table.get("ini_options", table)
        return inner if isinstance(inner, dict) else None
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except (configparser.Error, UnicodeDecodeError):
        return None
    if path.name in ("pytest.ini", ".pytest.ini") and not parser.has_section(section):
        return {}  # pytest.ini counts even when empty
    return dict(parser.items(section)) if parser.has_section(section) else None


def _ini_table(rootdir: Path) -> dict | None:
    """The rootdir's pytest configuration table (the first file pytest would use), or None."""
    for name, section in _INI_CANDIDATES:
        path = Path(rootdir) / name
        if not path.is_file():
            continue
        table = _pytest_table(path, section)
        if table is not None:
            return table
    return None


def ini_value(rootdir: Path, key: str) -> str | None:
    """`key` from the rootdir's pytest configuration (the first file pytest would use)."""
    value = (_ini_table(rootdir) or {}).get(key)
    return str(value) if value is not None else None


def ini_lines(rootdir: Path, key: str) -> list[str]:
    """`key` as a list: a TOML array's items, or an ini value's non-empty lines."""
    return _as_lines(_ini_reader(rootdir)(key))


def find_rootdir(start: str | os.PathLike | None = None) -> Path:
    """The first folder from `start` (default: the working folder) up that holds a pytest
    configuration; `start` itself when there is none."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        for name, section in _INI_CANDIDATES:
            path = folder / name
            if path.is_file() and _pytest_table(path, section) is not None:
                return folder
    return here


INCLUDE_DIRS_INI = "harness_include_dirs"


class IncludeDirError(UsageError):
    """An include directory that does not exist, or a header two of them hold."""


def check_include_dirs(dirs, origin: str) -> tuple[Path, ...]:
    """The include directories as absolute paths; a missing one is an `IncludeDirError`
    naming where it was given (`origin`: --include-dir, ini harness_include_dirs, a
    launcher's INCLUDE_DIRS) and what to do."""
    out = []
    for d in dirs:
        p = Path(d).expanduser().resolve()
        if not p.is_dir():
            raise IncludeDirError(
                f"include directory {d} ({origin}) does not exist or is not a folder (resolved to {p}): "
                "fix the path, or remove it")
        if p not in out:
            out.append(p)
    return tuple(out)


def include_dirs(options=(), ini_lines: str | list | None = None, rootdir: Path | None = None) -> tuple[Path, ...]:
    """The extra include directories: `--include-dir` (relative to the working folder) in
    the order given, then ini `harness_include_dirs` (one per line, relative to the
    rootdir). A missing folder is an `IncludeDirError` naming where it was
    given and what to do."""
    out = list(check_include_dirs(options or (), "--include-dir"))
    if isinstance(ini_lines, str):
        ini_lines = ini_lines.splitlines()
    lines = [ln.strip() for ln in (ini_lines or []) if ln.strip()]
    base = Path(rootdir) if rootdir is not None else Path.cwd()
    for d in check_include_dirs([base / ln for ln in lines], f"ini {INCLUDE_DIRS_INI} in {base}"):
        if d not in out:
            out.append(d)
    return tuple(out)


DEFAULT_CONTROLS_DIR = "controls"
REPORT_DIR = "harness-report"  # every command's reports, in the rootdir unless an option names a folder


GATES_INI = "harness_gates"
DEFAULT_GATES = "gates"


def report_root(rootdir: str | os.PathLike | None = None) -> Path:
    """`harness-report/` in the project's rootdir (found from the working folder up by default)."""
    return (Path(rootdir).resolve() if rootdir is not None else find_rootdir()) / REPORT_DIR


@dataclass(frozen=True)
class Project:
    """A project's settings as every entry point reads them, with where each came from."""

    rootdir: Path
    settings: Settings
    kernel_root_source: str  # "--kernel-root", "HARNESS_KERNEL_ROOT", "ini kernel_root" or "the default"
    cache_source: str  # the cache option's name, "HARNESS_CACHE_DIR", "ini harness_cache_dir" or "the default"
    controls_dir: Path
    gate_paths: tuple[Path, ...]  # ini harness_gates, absolute; empty when the ini names none

    @property
    def kernel_root_explicit(self) -> bool:
        return self.kernel_root_source != "the default"


def _ini_reader(rootdir: Path):
    table = _ini_table(rootdir) or {}

    def read(key: str):
        value = table.get(key)
        if value is None:
            return None
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value)
    return read


def _as_lines(value) -> list[str]:
    if not value:
        return []
    if isinstance(value, str):
        value = value.splitlines()
    return [str(v).strip() for v in value if str(v).strip()]


def resolve(*, kernel_root=None, cache_dir=None, arch=None, include_dir=(), controls_dir=None,
            deadline: float | None = None, sanitize: bool = False, sweep_budget: int | None = None,
            sweep_replay: str | None = None, redzones: bool = False,
            rootdir: str | os.PathLike | None = None, ini=None, cache_option: str = "--cache-dir") -> Project:
    """The settings of the project at `rootdir` (default: found from the working folder up,
    as pytest finds it), in one order for every setting:

        the command-line option, else the environment variable, else the ini key, else the default.

    - kernel root: --kernel-root, HARNESS_KERNEL_ROOT, ini `kernel_root`, `kernels_cu`;
    - cubin cache: --harness-cache-dir / --cache-dir, HARNESS_CACHE_DIR, ini `harness_cache_dir`,
      $XDG_CACHE_HOME/harness/cubin (~/.cache/harness/cubin);
    - arch: --arch, HARNESS_ARCH, the device's, sm_90;
    - controls folder: --controls-dir, ini `controls_dir`, `controls`;
    - include directories: --include-dir, then ini `harness_include_dirs`;
    - per-gate deadline: --harness-deadline (`deadline`, a float its option parsed), ini
      `harness_deadline`, 120 s (x10 under --sanitize, `sanitize`);
    - redzones around the device buffers: off unless --redzones (`redzones=True`); --no-redzones wins.

    Options and environment variables are relative to the working folder, ini keys to the
    rootdir. `ini(key)` reads the project's ini (pytest's getini inside a run; the files
    pytest would read otherwise); an empty value counts as unset. `cache_option` names the
    cache option in `cache_source` (the plugin's is --harness-cache-dir)."""
    root = Path(rootdir).resolve() if rootdir is not None else find_rootdir()
    read = ini or _ini_reader(root)

    def first(option, option_name: str, env: str, key: str, default: Path) -> tuple[Path, str]:
        """(path, where it came from): the option, else the variable, else the ini key, else the default."""
        for value, source, base in ((option, option_name, None), (os.environ.get(env), env, None),
                                    (read(key), f"ini {key}", root)):
            if value:
                return (Path(base, value) if base is not None else Path(value)).resolve(), source
        return default, "the default"

    kr, kr_source = first(kernel_root, "--kernel-root", KERNEL_ROOT_ENV, "kernel_root",
                          (root / DEFAULT_KERNEL_ROOT).resolve())
    cache, cache_source = first(cache_dir, cache_option, CACHE_ENV, "harness_cache_dir", _default_cache_dir())
    ini_controls = read("controls_dir")
    controls = (Path(controls_dir).resolve() if controls_dir
                else (root / (ini_controls or DEFAULT_CONTROLS_DIR)).resolve())
    gates = tuple((root / g).resolve() for g in _as_lines(read(GATES_INI)))
    explicit = arch or None
    seconds, seconds_source = _deadline(deadline, read(DEADLINE_INI), sanitize)
    settings = Settings(kernel_root=kr, arch=explicit or os.environ.get(ARCH_ENV) or None, cache_dir=cache,
                        arch_source="--arch" if explicit else ARCH_ENV,
                        include_dirs=include_dirs(include_dir, _as_lines(read(INCLUDE_DIRS_INI)), root),
                        deadline=seconds, deadline_source=seconds_source, sweep_budget=sweep_budget,
                        sweep_replay=sweep_replay or None, redzones=bool(redzones))
    return Project(rootdir=root, settings=settings, kernel_root_source=kr_source, cache_source=cache_source,
                   controls_dir=controls, gate_paths=gates)


def _deadline(option: float | None, ini_text, sanitize: bool) -> tuple[float, str]:
    """The per-gate deadline and where it came from. Raises UsageError for an
    ini value that is not a positive number of seconds (the option's type checked its own)."""
    if option is not None:
        return float(option), "--harness-deadline"
    text = str(ini_text or "").strip()
    if text:
        from harness.core.values import positive_seconds

        return positive_seconds(text, f"ini {DEADLINE_INI}", "", fix=f"set e.g. {DEADLINE_INI} = 120"), \
            f"ini {DEADLINE_INI}"
    if sanitize:
        return DEFAULT_DEADLINE * SANITIZER_DEADLINE_FACTOR, "the default under --sanitize"
    return DEFAULT_DEADLINE, "the default"


def project_settings(*, kernel_root=None, cache_dir=None, arch=None, include_dir=(),
                     rootdir: str | os.PathLike | None = None) -> tuple[Path, Settings]:
    """(rootdir, settings) for a command: `resolve`'s, without the sources."""
    project = resolve(kernel_root=kernel_root, cache_dir=cache_dir, arch=arch, include_dir=include_dir,
                      rootdir=rootdir)
    return project.rootdir, project.settings
