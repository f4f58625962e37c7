"""The plugin's pool of GPU gate workers: started from the pytest configuration (`st`, the
plugin's HarnessState, holds it), told what its server collects and which spares to keep."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from harness import _settings, device

if TYPE_CHECKING:
    from harness.pool import controller


def server_args(st, config: pytest.Config, files: list[str]) -> list[str]:
    """What the pool's server passes to pytest.main: the files to collect and the settings
    that decide what they collect to, never what the run reports or where it writes."""
    args = list(files) + [f"--rootdir={config.rootpath}", "-q", "--color=no", "-p", "no:cacheprovider",
                          f"--kernel-root={st.kernel_root}", f"--harness-cache-dir={_settings.current().cache_dir}"]
    if config.inipath is not None:
        args.append(f"--config-file={config.inipath}")
    if st.arch:
        args.append(f"--arch={st.arch}")
    args += [f"--include-dir={d}" for d in _settings.current().include_dirs]
    if config.getoption("snapshot_update", False):
        args.append("--snapshot-update")  # the workers store the snapshots
    for plugin in getattr(config.option, "plugins", None) or []:
        if plugin not in ("no:cacheprovider",):
            args += ["-p", plugin]
    for override in getattr(config.option, "override_ini", None) or []:
        args += ["-o", override]
    if config.pluginmanager.hasplugin("xdist"):
        args += ["-p", "no:xdist"]
    return args


def new_pool(st, config: pytest.Config, fork: bool = False) -> controller.Pool:
    from harness.pool import controller

    prefix = config.workerinput.get("workerid", "") + "-" if st.is_worker else ""
    pool_config = controller.PoolConfig(rootdir=config.rootpath, invocation_dir=config.invocation_params.dir,
                                     pytest_args=[], sanitizer=st.sanitizer_cmd, sanitizer_tool=st.sanitize,
                                     name_prefix=prefix)
    try:
        pool = controller.Pool(pool_config)
    except controller.PoolError as exc:  # a temp dir too deep for the pool's socket: the fix is the user's
        raise pytest.UsageError(str(exc)) from None
    pool_config.sanitizer_log_dir = pool.tmp
    if st.sanitizer_cmd is None:
        try:
            pool.start_server(fork=fork)
        except BaseException:
            pool.close()  # its folder and any process it started go with it
            raise
    return pool


def start_pool(st, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the pool (started at configure where a driver exists) the files to collect."""

    files = sorted({str(it.path) for it in items}) or [str(config.rootpath)]
    if st.pool is None:
        st.pool = new_pool(st, config)
    args = server_args(st, config, files)
    st.pool.config.pytest_args = args + ["--harness-serve"]
    from harness.pool.traps import first_spares

    traps = sum(1 for it in items if it.get_closest_marker("trap"))
    st.pool.config.spares = first_spares(traps)  # every trap gate can start at the run's beginning
    early = not st.is_worker
    if st.is_worker:
        # N xdist workers share the machine and none knows its gates ahead: one spare each.
        # On a machine with one GPU (said without CUDA: CUDA_VISIBLE_DEVICES, else the
        # driver's /proc entries) it starts beside the probe; with several, after it, once the
        # probe says which GPU is this worker's (a wrong early guess would start a spare on a
        # GPU that is not there).
        st.pool.config.spares = 1
        early = device.device_count_hint() == 1
    if st.sanitizer_cmd is None:
        st.pool.collect(args)
        if early:
            # The device is known before the probe answers: the main worker starts beside the
            # probe, the trap gates' spares once it answered (pytest_collection_modifyitems).
            # The driver makes contexts one at a time, so made all at once, the first gate
            # would wait for every one of them.
            st.pool.warm_up(1 if traps and not st.is_worker else None)


def refuse_without_device(st, probe: dict) -> None:
    """The require-gpu policy: with --require-gpu (or --sanitize) and no usable device, one usage error."""
    if probe.get("error") is None and probe.get("count", 0) > 0:
        return
    why = probe.get("error") or "no CUDA device was found"
    if st.require_gpu:
        raise pytest.UsageError(f"harness: --require-gpu: {why}")
    if st.sanitize:
        raise pytest.UsageError(f"harness: --sanitize {st.sanitize} needs a CUDA device to run the gates on: {why}; "
                                "run it on a machine with a GPU, or drop --sanitize")
