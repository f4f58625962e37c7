"""A Ray cluster as the place a campaign's gates run: the connection, what is shipped to the
nodes, and the CPU work spread over them. The executor on it is `harness.runs.ray_executor`.

Nothing here assumes a shared file system. The project (the rootdir: gates, conftests,
launchers, the kernel root) travels once as Ray's `working_dir`, unpacked on each node and
the working folder of every task and actor there (`Shipped`); the cubins travel through
the object store (`cache_entries` on the head, `write_entries` on a node, into the node's
own cubin cache). Ray is imported only here and in the executor, and only under `--ray`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from harness.core.errors import SetupError

MIN_RAY = (2, 10)  # runtime_env excludes, ActorDiedError, get_node_id: what the backend uses
# never shipped: virtual environments, reports, caches, version control, carried wheels
EXCLUDES = [".git", ".venv*", "venv", "**/__pycache__", "*.pyc", ".pytest_cache", "harness-report",
            ".harness-cache", ".whl*", "*.egg-info", "build", "node_modules"]


class ClusterError(SetupError, RuntimeError):
    """Ray missing or too old, a cluster with no GPU, a tree that cannot be shipped: one line
    naming the fix."""


def import_ray():
    """Ray, or ClusterError when it is missing or older than MIN_RAY."""
    try:
        import ray
    except ImportError:
        raise ClusterError("--ray needs Ray, which is not installed here: pip install -e '.[ray]' "
                           f"(or pip install 'ray>={MIN_RAY[0]}.{MIN_RAY[1]}')") from None
    if version_of(ray.__version__) < MIN_RAY:
        raise ClusterError(f"Ray {ray.__version__} is too old for --ray (it needs {MIN_RAY[0]}.{MIN_RAY[1]} or "
                           f"newer): pip install -U 'ray>={MIN_RAY[0]}.{MIN_RAY[1]}' on the head and every node")
    return ray


def version_of(text: str) -> tuple[int, int]:
    numbers = [int(n) for n in re.findall(r"\d+", text)[:2]]
    return tuple(numbers + [0] * (2 - len(numbers)))  # type: ignore[return-value]


@dataclass(frozen=True)
class Shipped:
    """The project as a node sees it: the rootdir unpacked from Ray's working_dir, the
    working folder of every task and actor there; the cubin cache is the node's own."""

    kernel_root: str  # relative to the rootdir

    def root(self) -> Path:
        return Path.cwd()

    def kernel(self) -> Path:
        return Path.cwd() / self.kernel_root

    def cache(self) -> Path:
        """The node's cubin cache: HARNESS_CACHE_DIR there, else the harness default."""
        from harness.core import settings as _settings

        return _settings.in_effect().cache_dir


def shipped_tree(rootdir: Path, kernel_root: Path) -> Shipped:
    rootdir, kernel_root = Path(rootdir).resolve(), Path(kernel_root).resolve()
    if not kernel_root.is_relative_to(rootdir):
        raise ClusterError(f"the kernel root {kernel_root} is outside the rootdir {rootdir}, which is all --ray ships "
                           "to the nodes: move it under the rootdir, or pass --rootdir a folder holding both")
    return Shipped(kernel_root.relative_to(rootdir).as_posix())


def node_facts() -> dict:
    """Where this actor or task runs: the node's address, its Ray id (short) and the GPU(s) Ray gave it."""
    import ray

    context = ray.get_runtime_context()
    return {"node": ray.util.get_node_ip_address(), "node_id": context.get_node_id()[:8],
            "gpu": ",".join(str(g) for g in ray.get_gpu_ids())}


def where(facts: dict | None) -> str | None:
    """'node 10.0.0.3 (1a2b3c4d) GPU 0': a verdict's place, for the terminal."""
    if not facts:
        return None
    return f"node {facts.get('node')} ({facts.get('node_id')}) GPU {facts.get('gpu') or '?'}"


@dataclass
class Cluster:
    """A connection to a Ray cluster, with the project shipped as the job's working_dir."""

    address: str | None
    gpus: int
    shipped: Shipped

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()

    def cpu_map(self, fn: Callable, items: Iterable, on_done: Callable) -> None:
        """`on_done(fn(item, shipped))` for every item, each call a Ray task on some node's CPU,
        as they finish. A task on a node that dies is retried elsewhere (Ray's own retry)."""
        import ray

        task = ray.remote(num_cpus=1, max_retries=3)(_call)
        pending = [task.remote(fn, item, self.shipped) for item in items]
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                on_done(ray.get(ready[0]))
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise


def _call(fn, item, shipped):
    return fn(item, shipped)


def connect(address: str | None, rootdir: Path, kernel_root: Path, need_gpu: bool = True) -> Cluster:
    """Connect to the cluster at `address` (None: RAY_ADDRESS, else a running local one, else a
    new local one), shipping the rootdir; ClusterError when it has no GPU (and `need_gpu`)."""
    ray = import_ray()
    shipped = shipped_tree(rootdir, kernel_root)
    from harness.core.settings import SERVER_START_ENV

    runtime_env = {"working_dir": str(Path(rootdir).resolve()), "excludes": EXCLUDES,
                   # a Ray worker runs threads Python does not see: its pool's server never forks it
                   "env_vars": {"PYTHONDONTWRITEBYTECODE": "1", SERVER_START_ENV: "spawn"}}
    try:
        ray.init(address=address, runtime_env=runtime_env, logging_level="WARNING", log_to_driver=False,
                 configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(f"could not connect to the Ray cluster at {address or 'the default address'} ({first}): "
                           "start it with `ray start --head` and pass its address (ray://HOST:10001 or HOST:6379)") \
            from None
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < 1 and need_gpu:
        ray.shutdown()
        raise ClusterError(f"the Ray cluster at {address or 'the default address'} has no GPU: start each GPU node "
                           "with `ray start --address=HEAD:6379` on a machine whose driver shows its GPUs (or "
                           "--num-gpus=N)")
    return Cluster(address, gpus, shipped)


# ---------------------------------------------------------------- the cubin cache over the object store


def read_entries(cache_dir: Path, keys: Iterable[str]) -> dict[str, bytes]:
    """{path in the cache: bytes} of the entries (cubin and metadata) for these cache keys."""
    from harness.compiling.cubin_cache import entry_paths

    out = {}
    for key in keys:
        for sandbox in (False, True):  # a sandbox's compiles have a folder of their own
            for path in entry_paths(Path(cache_dir), key, sandbox):
                try:
                    out[path.relative_to(cache_dir).as_posix()] = path.read_bytes()
                except OSError:
                    pass  # a miss there: the node compiles it again (slower, never wrong)
    return out


def write_entries(cache_dir: Path, entries: dict[str, bytes]) -> None:
    """Write entries read by `read_entries` into this machine's cache (atomically; an entry
    already there is content-addressed, so it is the same and kept)."""
    import tempfile

    cache_dir = Path(cache_dir)
    for rel, data in entries.items():
        target = (cache_dir / rel).resolve()
        if not target.is_relative_to(cache_dir.resolve()) or ".." in Path(rel).parts:
            raise ValueError(f"refusing a cache entry outside the cache: {rel}")
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".shipped-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)


def cache_entries(kernel_root: Path, modules: Iterable[str], *, arch: str | None, cache_dir: Path,
                  names: dict) -> dict[str, bytes]:
    """The cache entries of these modules of a tree (the real kernel root, or a perturbed
    sandbox copy), compiled here when missing: what a node needs to load them uncompiled."""
    from harness.compiling.compile import CompileError, compile_file
    from harness.runs.compilecheck import run_dirs, settings_for

    keys = []
    for rel in modules:
        try:
            compiled = compile_file(rel, kernel_root=kernel_root, arch=arch, cache_dir=cache_dir,
                                    settings=settings_for(names, rel, kernel_root), include_dirs=run_dirs(names))
        except (CompileError, OSError):
            continue  # the node compiles it and reports the error as the gates see it
        keys.append(compiled.key)
    return read_entries(cache_dir, keys)


def changed_files(real_root: Path, copy: Path) -> dict[str, str]:
    """{relpath: text} of the files in a sandbox copy that differ from the real kernel root (a
    copy keeps each file's size and mtime: only those that differ are read)."""
    real_root, copy = Path(real_root), Path(copy)
    out = {}
    for dirpath, _, files in os.walk(copy):
        for name in files:
            path = Path(dirpath) / name
            if path.is_symlink():
                continue
            rel = path.relative_to(copy)
            original = real_root / rel
            try:
                a, b = path.stat(), original.stat()
                if (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns):
                    continue
                if path.read_bytes() == original.read_bytes():
                    continue
            except FileNotFoundError:
                pass
            out[rel.as_posix()] = path.read_text(encoding="utf-8")
    return out
