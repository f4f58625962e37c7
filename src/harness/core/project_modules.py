"""The project's own loaded modules: those whose file lies under the rootdir, neither an
installed package nor the harness itself. A warm worker clears their caches between mutants
(`harness.pool.worker.clear_project_caches`); a comparison rebinds the names they took from a
launcher (`harness.library.ref_launchers`)."""

from __future__ import annotations

import sys
from pathlib import Path


def module_file(mod) -> str | None:
    """A module's __file__, read without loading a lazily loaded module (importlib's
    LazyLoader loads on the first attribute read through the module)."""
    try:
        f = object.__getattribute__(mod, "__dict__").get("__file__")
    except (AttributeError, TypeError):
        return None
    return f if isinstance(f, str) else None


def project_modules(rootdir: Path) -> list[tuple[str, object]]:
    """(name, module) of every loaded module of the project under `rootdir`."""
    root = str(Path(rootdir).resolve())
    out = []
    for name, mod in list(sys.modules.items()):
        f = module_file(mod)
        if not f or not f.startswith(root) or "site-packages" in f:
            continue
        if name == "harness" or name.startswith("harness."):
            continue
        out.append((name, mod))
    return out
