"""The wire between the pytest process, the server and the workers: length-prefixed JSON
frames over the pool's Unix socket; the pool's timeline; and which end this process is."""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time

from harness.core.child import POOL_T0_CHANNEL
from harness.core.settings import TRACE_ENV

SERVE_MODULE = "harness.pool.serve"  # python -m SERVE_MODULE {serve|worker|probe}
POOL_FOLDER_PREFIX = "harness-pool-"  # the pool's folder under the temp dir: its socket, the server's log
# why a worker ends after a gate that left its CUDA context with a sticky error (both ends say it)
POISONED = "a gate left the CUDA context unusable"


def trace(event: str) -> None:
    """One line of the pool's timeline: seconds since the pytest process started, pid, event.
    CLOCK_MONOTONIC is one clock for every process on the machine, so the server's, the
    probe's and the workers' lines interleave with the pytest process's."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    t0 = os.environ.get(POOL_T0_CHANNEL)
    if t0 is None:
        os.environ[POOL_T0_CHANNEL] = t0 = repr(time.monotonic())
    try:
        with open(path, "a") as f:
            f.write(f"{time.monotonic() - float(t0):8.3f} {os.getpid()} {event}\n")
    except (OSError, ValueError):
        pass


class Timeout(Exception):
    pass


class ChannelClosed(EOFError):
    pass


class Channel:
    """Length-prefixed JSON frames over a stream socket; `recv` takes a timeout."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()

    def send(self, obj) -> None:
        data = json.dumps(obj).encode()
        self.sock.sendall(struct.pack("!I", len(data)) + data)

    def recv(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            n = self._whole_frame()
            if n is not None:
                data = bytes(self._buf[4:4 + n])
                del self._buf[:4 + n]
                return json.loads(data)
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise Timeout()
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                raise Timeout()
            self._read_some()

    def ready(self) -> bool:
        """Whether `recv` would return at once: a whole frame has arrived, or the other end
        closed (then `recv` raises ChannelClosed). Reads what has arrived; never waits."""
        while self._whole_frame() is None:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            try:
                self._read_some()
            except ChannelClosed:
                return True
        return True

    def _whole_frame(self) -> int | None:
        """The length of the first frame in the buffer, once all of it has arrived."""
        if len(self._buf) >= 4:
            (n,) = struct.unpack("!I", self._buf[:4])
            if len(self._buf) >= 4 + n:
                return n
        return None

    def _read_some(self) -> None:
        """Add what the (readable) socket holds to the buffer; ChannelClosed when it closed."""
        try:
            chunk = self.sock.recv(1 << 16)
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        if not chunk:
            raise ChannelClosed("the other end closed the connection")
        self._buf += chunk

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(path: str) -> Channel:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return Channel(s)



class Role:
    """This process's end of the pool: set in the server (its channel to the pool) and in a
    worker (its channel and token); the pytest process sets neither."""

    connect_path: str | None = None  # the pool's socket
    server: Channel | None = None  # the server's channel (in the server process)
    worker: Channel | None = None  # a worker's channel
    token: int | None = None  # a worker's token


ROLE = Role()


def is_server() -> bool:
    return ROLE.server is not None and ROLE.worker is None


def is_worker() -> bool:
    return ROLE.token is not None
