"""What every campaign is told: where pytest runs, the kernel root it perturbs, where its report
goes, the arch, the cubin cache and whether GPU gates are required. The controls' and the
mutants' configurations add their own fields to it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.core import settings as _settings


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    rootdir: Path  # where pytest runs; node ids are relative to it
    kernel_root: Path
    report_dir: Path
    arch: str | None = None
    cache_dir: Path | None = None  # default: the project's (HARNESS_CACHE_DIR, ini, the harness' own)
    require_gpu: bool = True  # False: --no-require-gpu (GPU gates skip) and the harness's own tests

    def path(self, p) -> Path:
        """`p` resolved against the rootdir."""
        p = Path(p)
        return (p if p.is_absolute() else self.rootdir / p).resolve()

    def cache(self) -> Path:
        """The cubin cache folder the campaign compiles into and its gate runs read."""
        return self.path(self.cache_dir) if self.cache_dir else _settings.in_effect().cache_dir
