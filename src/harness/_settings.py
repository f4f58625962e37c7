"""Process-wide settings the plugin sets once and launchers read.

Launchers in a kernel tree call `harness.kernels.module("x.cu")`; they cannot see pytest's
`config`, so the plugin hands the kernel root, the arch and the cache folder over here in
`pytest_configure`. Outside pytest the environment variables below apply.
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass, replace
from pathlib import Path

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


@dataclass(frozen=True)
class Settings:
    kernel_root: Path
    arch: str | None  # None: the device's arch, or sm_90 with no device
    cache_dir: Path
    arch_source: str = "--arch"  # where `arch` came from, for error messages: --arch or HARNESS_ARCH
    include_dirs: tuple[Path, ...] = ()  # --include-dir, then ini harness_include_dirs (absolute)


def _default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "harness" / "cubin"


def _from_environment() -> Settings:
    return Settings(
        kernel_root=Path(os.environ.get(KERNEL_ROOT_ENV, DEFAULT_KERNEL_ROOT)).resolve(),
        arch=os.environ.get(ARCH_ENV) or None,
        cache_dir=_default_cache_dir(),
        arch_source=ARCH_ENV,
    )


_current: Settings | None = None


def current() -> Settings:
    global _current
    if _current is None:
        _current = _from_environment()
    return _current


def configure(**changes) -> Settings:
    """Replace some settings (kernel_root, arch, cache_dir); returns the new settings.
    `arch=None` means no explicit arch: HARNESS_ARCH applies when set, else the device's."""
    global _current
    if "kernel_root" in changes and changes["kernel_root"] is not None:
        changes["kernel_root"] = Path(changes["kernel_root"]).resolve()
    if "cache_dir" in changes and changes["cache_dir"] is not None:
        changes["cache_dir"] = Path(changes["cache_dir"])
    if "include_dirs" in changes and changes["include_dirs"] is not None:
        changes["include_dirs"] = tuple(Path(d).resolve() for d in changes["include_dirs"])
    if "arch" in changes:
        explicit = changes["arch"]
        changes["arch"] = explicit or os.environ.get(ARCH_ENV) or None
        changes["arch_source"] = "--arch" if explicit else ARCH_ENV
    changes = {k: v for k, v in changes.items() if v is not None or k == "arch"}
    _current = replace(current(), **changes)
    return _current


def reset() -> None:
    global _current
    _current = None


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


def include_dirs(options=(), ini_lines: str | list | None = None, rootdir: Path | None = None) -> tuple[Path, ...]:
    """The extra include directories: `--include-dir` (relative to the working folder) in
    the order given, then ini `harness_include_dirs` (one per line, relative to the
    rootdir). A missing folder is a `harness.toolchain.IncludeDirError` naming where it was
    given and what to do."""
    from harness.toolchain import check_include_dirs

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
            rootdir: str | os.PathLike | None = None, ini=None, cache_option: str = "--cache-dir") -> Project:
    """The settings of the project at `rootdir` (default: found from the working folder up,
    as pytest finds it), in one order for every setting:

        the command-line option, else the environment variable, else the ini key, else the default.

    - kernel root: --kernel-root, HARNESS_KERNEL_ROOT, ini `kernel_root`, `kernels_cu`;
    - cubin cache: --harness-cache-dir / --cache-dir, HARNESS_CACHE_DIR, ini `harness_cache_dir`,
      $XDG_CACHE_HOME/harness/cubin (~/.cache/harness/cubin);
    - arch: --arch, HARNESS_ARCH, the device's, sm_90;
    - controls folder: --controls-dir, ini `controls_dir`, `controls`;
    - include directories: --include-dir, then ini `harness_include_dirs`.

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
    settings = Settings(kernel_root=kr, arch=explicit or os.environ.get(ARCH_ENV) or None, cache_dir=cache,
                        arch_source="--arch" if explicit else ARCH_ENV,
                        include_dirs=include_dirs(include_dir, _as_lines(read(INCLUDE_DIRS_INI)), root))
    return Project(rootdir=root, settings=settings, kernel_root_source=kr_source, cache_source=cache_source,
                   controls_dir=controls, gate_paths=gates)


def project_settings(*, kernel_root=None, cache_dir=None, arch=None, include_dir=(),
                     rootdir: str | os.PathLike | None = None) -> tuple[Path, Settings]:
    """(rootdir, settings) for a command: `resolve`'s, without the sources."""
    project = resolve(kernel_root=kernel_root, cache_dir=cache_dir, arch=arch, include_dir=include_dir,
                      rootdir=rootdir)
    return project.rootdir, project.settings
