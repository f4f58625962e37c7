"""The fork server's own process (`harness.runs.forkserver` starts it and says what it is for).
Its stdlib-only helpers serve the harness too (`nvidia_device_opened`: the pool's fork check).

Run as a script (`python -c "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')" THIS FD`)
in `/`, so it imports no module of the harness: pytest rewrites the asserts of every module of a
pytest plugin's distribution (the harness, xdist, pytest-timeout) as it imports them, and a
module imported here would reach each child unrewritten and be named in a warning. It imports
what a gate run imports first (pytest, rich, NumPy where that is safe), then waits for runs on
the control socket FD: each is a socket of its own, with one JSON request on it; the reply is
`{"pid": N}` and later `{"exit": CODE, "cpu": SECONDS}`, or `{"spawn": WHY}` where a fork would not be what a
spawned `python -m pytest` is. Stdlib only at import; nothing here runs a gate.
"""

from __future__ import annotations

import gc
import json
import os
import select
import selectors
import signal
import socket
import struct
import sys
import threading

# What a gate run imports before its first gate, none of it a plugin's distribution (above).
PREIMPORTS = (
    "pytest", "_pytest.pytester", "pluggy", "rich.console", "rich.table", "rich.markup", "execnet", "cuda.pathfinder",
    "tree_sitter", "tree_sitter_cuda", "pdb", "statistics", "tarfile", "queue", "ctypes", "json", "tomllib",
)
# Imported only where BLAS keeps to one thread: OpenBLAS otherwise starts its threads at import.
NUMPY_PREIMPORTS = ("numpy", "ml_dtypes")
PLUGIN_DISTRIBUTIONS_GROUP = "pytest11"


def send(sock: socket.socket, obj) -> None:
    """One frame of harness.pool.channel's wire (4-byte length, JSON)."""
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def recv(sock: socket.socket, timeout: float) -> dict | None:
    """One frame, or None at EOF or after `timeout` seconds."""
    buf = b""
    while True:
        if len(buf) >= 4:
            (n,) = struct.unpack("!I", buf[:4])
            if len(buf) >= 4 + n:
                return json.loads(buf[4:4 + n])
        if not select.select([sock], [], [], timeout)[0]:
            return None
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk


def nvidia_device_opened() -> bool | None:
    """Whether this process holds an NVIDIA device file open (cuInit opens /dev/nvidiactl):
    None where /proc cannot say."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


def blas_one_thread(env) -> bool:
    return env.get("OPENBLAS_NUM_THREADS") == "1" or (
        "OPENBLAS_NUM_THREADS" not in env and env.get("OMP_NUM_THREADS") == "1")


def _preimport() -> list[str]:
    import importlib

    names = list(PREIMPORTS)
    if blas_one_thread(os.environ):
        names += NUMPY_PREIMPORTS
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # a missing optional module: the child imports what it needs itself
            failed.append(f"{name}: {type(e).__name__}: {e}")
    import _pytest.config

    for name in _pytest.config.default_plugins:
        try:
            importlib.import_module(f"_pytest.{name}")
        except Exception:
            pass
    return failed


def _top_level_origins() -> dict[str, tuple[bool, tuple[str, ...]]]:
    """Where each imported top-level module came from, resolved: whether it is a namespace
    package, and its file, its package's folder, or a namespace package's folders."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if "." in name or mod is None:
            continue
        where = getattr(mod, "__file__", None)
        path = getattr(mod, "__path__", None)
        if where is not None:
            where = os.path.realpath(where)
            out[name] = (False, (os.path.dirname(where),) if path is not None else (where,))
        elif path is not None:
            out[name] = (True, tuple(os.path.realpath(p) for p in path))
    return out


def _tasks() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _shadowed(cwd: str, origins: dict[str, tuple[bool, tuple[str, ...]]]) -> str | None:
    """A module that the run's folder, first on a spawned pytest's sys.path, would give it in
    place of the one the server imported: `name.py`, `name.*.so`, a package `name/`, or any
    folder `name/` where the server's `name` is a namespace package."""
    try:
        entries = os.listdir(cwd)
    except OSError as e:
        return f"the run's folder cannot be listed ({e})"
    for entry in entries:
        stem, dot, rest = entry.partition(".")
        if stem not in origins:
            continue
        namespace, where = origins[stem]
        full = os.path.join(cwd, entry)
        if dot:
            importable = rest in ("py", "pyc") or rest.endswith((".so", ".pyd")) or rest in ("so", "pyd")
        else:
            importable = os.path.isdir(full) and (namespace or os.path.isfile(os.path.join(full, "__init__.py")))
        if importable and os.path.realpath(full) not in where:
            return f"{full} would stand in for the module {stem} the fork server imported"
    return None


def _why_not_fork(req: dict, origins: dict[str, tuple[bool, tuple[str, ...]]]) -> str | None:
    if threading.active_count() > 1 or _tasks() != 1:
        return f"the fork server runs {max(threading.active_count(), _tasks())} threads"
    if nvidia_device_opened() is not False:
        return "the fork server may hold an NVIDIA device file open"
    return _shadowed(req["cwd"], origins)


def _serve(control_fd: int) -> dict | None:
    """The server's loop. Returns None when the client is gone (the server then exits), or, in
    a forked child, the run it is to become."""
    failed = _preimport()
    origins = _top_level_origins()
    for line in failed:
        print(f"not imported ahead: {line}", flush=True)
    gc.collect()
    gc.freeze()  # what every child shares stays out of the collector's sight (no copy-on-write)
    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ, "control")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    children: dict[int, socket.socket | None] = {}
    said_hello = False
    while True:
        for key, _ in sel.select():
            if key.data == "control":
                try:
                    _, fds, _, _ = socket.recv_fds(control, 1, 1)
                except OSError:
                    fds = []
                if not fds:  # the client ended: so do its runs
                    for pid in children:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    return None
                conn = socket.socket(fileno=fds[0])
                if not said_hello:
                    send(conn, {"op": "hello", "not_imported": failed})
                    conn.close()
                    said_hello = True
                    continue
                sel.register(conn, selectors.EVENT_READ, "run")
            elif key.data == "wake":
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
                while children:
                    try:
                        pid, status, usage = os.wait4(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if not pid:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        cpu = usage.ru_utime + usage.ru_stime  # its own and its waited-for children's
                        try:
                            send(conn, {"exit": os.waitstatus_to_exitcode(status), "cpu": cpu})
                        except OSError:
                            pass
                        sel.unregister(conn)
                        conn.close()
            else:
                conn = key.fileobj
                if conn in children.values():  # the client closed its end: its child runs on alone
                    sel.unregister(conn)
                    conn.close()
                    for pid, c in children.items():
                        if c is conn:
                            children[pid] = None
                    continue
                try:
                    req = recv(conn, timeout=5.0)
                except (OSError, ValueError):
                    req = None
                why = None if req is None else _why_not_fork(req, origins)
                if req is None or why is not None:
                    if why is not None:
                        send(conn, {"spawn": why})
                    sel.unregister(conn)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for k in list(sel.get_map().values()):
                        if isinstance(k.fileobj, int):
                            os.close(k.fileobj)
                        else:
                            k.fileobj.close()
                    sel.close()
                    os.close(wake_w)
                    return req
                children[pid] = conn
                send(conn, {"pid": pid})


def _become_pytest(req: dict) -> None:
    """The forked child's first steps: the run's session, folder, environment and stdio, then
    `python -m pytest ARGS` as the interpreter runs it (its exit is the process's)."""
    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    sys.dont_write_bytecode = bool(req["env"].get("PYTHONDONTWRITEBYTECODE"))
    import tempfile

    tempfile.tempdir = None  # read again from TMPDIR
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = ["pytest", *req["args"]]
    import runpy

    runpy.run_module("pytest", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run = _serve(int(sys.argv[2]))
    if run is None:
        sys.exit(0)
    _become_pytest(run)
